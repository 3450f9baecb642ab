#!/usr/bin/env bash
# The consumer loop at the peer's pace (issue 42): dedupd's Python and Node
# clients against AWS Powertools' idempotency on Redis, side by side in one
# run, durable against durable and fast against fast.
#
#   benches/clients/run.sh [--events 2000] [--rounds 5] [--concurrency "1 8"]
#                          [--clients "python node"] [--out benches/results/clients.jsonl]
#                          [--plot docs/benchmarks/clients.png]
#
# durable: dedupd --sync always (embedded store) vs Redis appendfsync always
# fast:    dedupd --sync none                    vs Redis appendfsync everysec
# Starts its own sidecars and Redis servers on ports 51011-51014 (data in a
# temp dir) and stops them on exit. Needs redis-server, python3 and node on
# PATH; the peers' packages are installed in ~/.cache/dedupd-bench. Every
# event's answer is checked, so a run is also a test of both loops.
set -euo pipefail
cd "$(dirname "$0")/../.."

. benches/lib.sh
events=2000 rounds=5 concurrency="1 8" clients="python node" out=benches/results/clients.jsonl
plot=docs/benchmarks/clients.png
while [ $# -gt 0 ]; do
  case "$1" in
    --events) events=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --plot) plot=$2; shift 2 ;;
    *) bench_unknown "$1" ;;
  esac
done
command -v redis-server >/dev/null || { echo "redis-server is not on PATH" >&2; exit 1; }

cache="${XDG_CACHE_HOME:-$HOME/.cache}/dedupd-bench"
python_env() { # sets py
  local venv="$cache/clients-python"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import aws_lambda_powertools.utilities.idempotency, redis' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet -r benches/clients/requirements.txt
  fi
  # The client from this tree, afresh every run (it is what is measured).
  "$venv/bin/pip" install --quiet ./clients/python
  "$venv/bin/pip" install --quiet --no-deps --force-reinstall ./clients/python
  py="$venv/bin/python"
}
node_env() {
  (cd clients/node && npm ci --silent >&2 && npm run --silent build >&2)
  (cd benches/clients/node && npm ci --silent >&2)
}

# DEDUPD_BIN: a binary to run instead of the release build (CI's smoke run
# uses the debug build; figures come from the release build only).
if [ -n "${DEDUPD_BIN:-}" ]; then
  bin=$DEDUPD_BIN work=$(mktemp -d) pids=()
  trap bench_cleanup EXIT
else
  bench_build --bin dedupd
fi
port_free() { # port: nothing may answer there yet (an orphan of an earlier run would be measured)
  if bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; then
    echo "port $1 is taken: stop what listens there first" >&2; exit 1
  fi
}
start_redis() { # port appendfsync
  port_free "$1"
  mkdir -p "$work/redis-$1"
  redis-server --port "$1" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync "$2" \
    --dir "$work/redis-$1" --daemonize no --logfile "$work/redis-$1.log" & pids+=($!)
  wait_port "$1"
  kill -0 "$!"
}
start_dedupd() { # port sync
  port_free "$1"
  "$bin" --listen "127.0.0.1:$1" --metrics-listen off --data-dir "$work/dedupd-$1" --sync "$2" \
    --log warn 2>"$work/dedupd-$1.log" & pids+=($!)
  wait_port "$1"
  kill -0 "$!"
}
start_dedupd 51011 always
start_redis 51012 always
start_dedupd 51013 none
start_redis 51014 everysec

mkdir -p "$(dirname "$out")"
: > "$out"
for client in $clients; do
  case "$client" in
    python) python_env ;;
    node) node_env ;;
    *) bench_unknown "$client" ;;
  esac
  for setting in durable fast; do
    if [ "$setting" = durable ]; then ports=(51011 51012); else ports=(51013 51014); fi
    for c in $concurrency; do
      case "$client" in
        python) "$py" benches/clients/python_loop.py --dedupd "127.0.0.1:${ports[0]}" \
                  --redis-port "${ports[1]}" --events "$events" --threads "$c" --rounds "$rounds" \
                  --setting "$setting" | tee -a "$out" ;;
        node) node benches/clients/node/loop.mjs --dedupd "127.0.0.1:${ports[0]}" \
                --redis-port "${ports[1]}" --events "$events" --concurrency "$c" --rounds "$rounds" \
                --setting "$setting" | tee -a "$out" ;;
      esac
    done
  done
done
# The table for BENCHMARKS.md, and the plot (matplotlib, in the virtualenv
# benches/compare.sh uses).
plots="${XDG_CACHE_HOME:-$HOME/.cache}/dedupd-bench/plots"
if [ ! -x "$plots/bin/python" ] || ! "$plots/bin/python" -c 'import matplotlib' 2>/dev/null; then
  python3 -m venv "$plots" >&2 && "$plots/bin/pip" install --quiet -r benches/requirements.txt >&2
fi
"$plots/bin/python" benches/clients/report.py "$out" "$plot"
echo "figures in $out, plot in $plot" >&2
