# Sourced by the benchmark scripts (compare.sh, shared.sh, traces.sh,
# cluster.sh): their common options, the release build, where its binaries
# are, a work directory, and the clean-up of what they started.
#
#   . benches/lib.sh
#   bench_options 5s 3 "$@"     # --duration, --repeats (defaults given);
#                               # other options are left in bench_rest
#   bench_build [CARGO_ARGS]    # release build (of the workspace, or of
#                               # what CARGO_ARGS name); sets bin, bench,
#                               # work, pids
#   sidecar_pid=...; pids+=("$sidecar_pid")   # stopped at exit
#   bench_on_exit() { ...; }    # optional: more to stop at exit
#   wait_port PORT              # until something answers on 127.0.0.1:PORT

# bench_options DEFAULT_DURATION DEFAULT_REPEATS ARGS...: sets duration and
# repeats; whatever else was given is in bench_rest, for the script.
bench_options() {
  duration=$1 repeats=$2
  shift 2
  bench_rest=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --duration) duration=$2; shift 2 ;;
      --repeats) repeats=$2; shift 2 ;;
      *) bench_rest+=("$1"); shift ;;
    esac
  done
}

# bench_unknown OPTION: the one line and exit code for an option no one took.
bench_unknown() {
  echo "unknown option $1" >&2
  exit 64
}

# bench_build: the release build of the workspace (dedupd and dedupd-bench),
# a fresh work directory, and the exit trap that stops every process in
# pids (and bench_on_exit's, if the script defines it) and removes it.
bench_build() {
  cargo build --release --locked --quiet "${@:---workspace}"
  bin=target/release/dedupd
  bench=target/release/dedupd-bench
  work=$(mktemp -d)
  pids=()
  trap bench_cleanup EXIT
}

bench_cleanup() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if declare -F bench_on_exit >/dev/null; then bench_on_exit || true; fi
  rm -rf "$work" 2>/dev/null || true
}

# wait_port PORT: returns once something answers on 127.0.0.1:PORT (10 s at
# most, then the script exits).
wait_port() { # port
  for _ in $(seq 1 200); do
    if bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; then return 0; fi
    sleep 0.05
  done
  echo "nothing answers on port $1" >&2; exit 1
}
