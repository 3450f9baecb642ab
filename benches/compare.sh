#!/usr/bin/env bash
# Runs dedupd against the no-op gRPC server, Redis and PostgreSQL, back to
# back on this machine, and writes BENCHMARKS.md (ratios, latencies, memory,
# disk and start-up figures).
#
#   benches/compare.sh [--duration 3s] [--repeats 3] [--records 1000000] [--out BENCHMARKS.md]
#
# Needs: PostgreSQL on 127.0.0.1:5432 (db test, trust), redis-server on PATH.
# Starts its own no-op server, two dedupd sidecars (sync always and none) and
# two private Redis servers (appendfsync always and everysec) on ports
# 51001-51005 with data in a temp dir, and stops them all on exit.
# Every server gets one tokio worker / one process and the load generator
# one worker, so the two CPUs are split the same way for every target.
set -euo pipefail
cd "$(dirname "$0")/.."

. benches/lib.sh
bench_options 3s 3 "$@"
records=1000000 out=BENCHMARKS.md
set -- "${bench_rest[@]}"
while [ $# -gt 0 ]; do
  case "$1" in
    --records) records=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) bench_unknown "$1" ;;
  esac
done

# matplotlib for the plots, in a virtualenv of its own outside the tree.
plotting_python() {
  local venv="${XDG_CACHE_HOME:-$HOME/.cache}/dedupd-bench/plots"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import matplotlib' 2>/dev/null; then
    python3 -m venv "$venv" >&2 && "$venv/bin/pip" install --quiet -r benches/requirements.txt >&2
  fi
  echo "$venv/bin/python"
}
plotting_python >/dev/null

bench_build
bench_on_exit() {
  psql "$pg_url" -qc "DROP SCHEMA IF EXISTS ${pg_schema:-none} CASCADE" >/dev/null 2>&1 || true
}

pg_url="postgres://postgres@127.0.0.1:5432/test"
if ! bash -c "exec 3<>/dev/tcp/127.0.0.1/5432" 2>/dev/null; then
  echo "PostgreSQL does not answer on 127.0.0.1:5432" >&2; exit 1
fi
command -v redis-server >/dev/null || { echo "redis-server is not on PATH" >&2; exit 1; }

"$bench" noop-server --listen 127.0.0.1:51001 --worker-threads 1 2>"$work/noop.log" & pids+=($!)
"$bin" --listen 127.0.0.1:51002 --metrics-listen off --data-dir "$work/always" --sync always --worker-threads 1 --log warn 2>"$work/always.log" & pids+=($!)
always_pid=$!
"$bin" --listen 127.0.0.1:51003 --metrics-listen off --data-dir "$work/none" --sync none --worker-threads 1 --log warn 2>"$work/none.log" & pids+=($!)
pg_schema="dedupd_bench_$$"
"$bin" --listen 127.0.0.1:51006 --metrics-listen off --store postgres --store-url "$pg_url" --store-schema "$pg_schema" \
  --worker-threads 1 --log warn 2>"$work/pg.log" & pids+=($!)
for mode in always everysec; do
  port=$([ $mode = always ] && echo 51004 || echo 51005)
  mkdir -p "$work/redis-$mode"
  redis-server --port $port --bind 127.0.0.1 --dir "$work/redis-$mode" --save "" \
    --appendonly yes --appendfsync $mode --logfile "$work/redis-$mode.log" & pids+=($!)
done
for port in 51001 51002 51003 51004 51005 51006; do wait_port $port; done
until "$bin" health --addr 127.0.0.1:51006 >/dev/null 2>&1; do sleep 0.05; done

targets=(
  "no-op|noop://127.0.0.1:51001"
  "dedupd sync=always|dedupd://127.0.0.1:51002"
  "dedupd sync=none|dedupd://127.0.0.1:51003"
  "dedupd on PostgreSQL|dedupd://127.0.0.1:51006"
  "Redis appendfsync=always|redis://127.0.0.1:51004"
  "Redis appendfsync=everysec|redis://127.0.0.1:51005"
  "PostgreSQL synchronous_commit=on|$pg_url?options=-c%20synchronous_commit%3Don"
  "PostgreSQL synchronous_commit=off|$pg_url?options=-c%20synchronous_commit%3Doff"
)
results="$work/results.jsonl"
: > "$results"
run() { # name url workload concurrency [extra args...]
  local name=$1 url=$2 workload=$3 concurrency=$4; shift 4
  local json
  json=$("$bench" load --target "$url" --workload "$workload" --concurrency "$concurrency" \
    --duration "$duration" --worker-threads 1 --json "$@") || {
      echo "bench failed: $name $workload c=$concurrency: $json" >&2; exit 1; }
  python3 -c 'import json,sys; r=json.loads(sys.argv[2]); r["name"]=sys.argv[1]; print(json.dumps(r))' \
    "$name" "$json" >> "$results"
  printf '%-34s %-13s c=%-4s %10s ops/s  p99 %s µs\n' "$name" "$workload" "$concurrency" \
    "$(python3 -c 'import json,sys; print(int(json.loads(sys.argv[1])["ops_per_sec"]))' "$json")" \
    "$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["latency_us"]["p99"])' "$json")"
}

# The device's share of the floor under a durable answer (issue 39): a
# small append to a preallocated file in the sidecars' directory and its
# fdatasync; with the no-op server's c=1 p50 it is the floor Claim c=1 is
# measured against. Taken with every repeat of the Claim c=1 runs.
sync_floor() {
  local json
  json=$("$bench" sync-floor --dir "$work" --count 2000) || {
    echo "bench failed: sync-floor: $json" >&2; exit 1; }
  python3 -c 'import json,sys; r=json.loads(sys.argv[1]); r.update(name="append+fdatasync", workload="sync-floor", concurrency=1); print(json.dumps(r))' \
    "$json" >> "$results"
  printf '%-34s %-13s c=%-4s %10s        p50 %s µs\n' "append+fdatasync" sync-floor 1 "" \
    "$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["latency_us"]["p50"])' "$json")"
}

# Repeats are interleaved (every target once, then again) so that a noisy
# moment on the machine hits all targets alike; the report takes medians.
for workload in claim claim-commit; do
  for concurrency in 1 16 64 256; do
    for _ in $(seq 1 "$repeats"); do
      if [ "$workload" = claim ] && [ "$concurrency" = 1 ]; then sync_floor; fi
      for target in "${targets[@]}"; do
        run "${target%%|*}" "${target#*|}" "$workload" "$concurrency"
      done
    done
  done
done
for concurrency in 1 4 16; do
  for _ in $(seq 1 "$repeats"); do
    for target in "${targets[@]}"; do
      run "${target%%|*}" "${target#*|}" batch "$concurrency" --batch-size 500
    done
  done
done

# Memory, disk and start-up with many live records, on a fresh sidecar.
kill "$always_pid"; wait "$always_pid" 2>/dev/null || true
rm -rf "$work/big"
"$bin" --listen 127.0.0.1:51002 --metrics-listen off --data-dir "$work/big" --sync always --worker-threads 1 --log warn 2>"$work/big.log" &
big_pid=$!; pids+=($big_pid)
wait_port 51002
echo "loading $records claims+commits ..."
load_started=$(date +%s.%N)
"$bench" load --target dedupd://127.0.0.1:51002 --workload batch-commit --batch-size 1000 \
  --concurrency 4 --requests "$records" --worker-threads 1 --json > "$work/load.json"
load_seconds=$(python3 -c "print($(date +%s.%N) - $load_started)")
peak_rss_kb=$(awk '/VmHWM/ {print $2}' /proc/$big_pid/status)
# kill -9, not SIGTERM: the restart below replays the write-ahead log left
# since the last checkpoint, as after a crash.
kill -KILL $big_pid; wait $big_pid 2>/dev/null || true
# Bytes of groups in the log (segments are preallocated: their size says
# little). A segment: "dedupWAL", its group magic (u32), then groups of a
# 20-byte header [magic u32][number u64][length u32][crc u32] and frames.
log_bytes=$(python3 - "$work/big/wal" <<'PY'
import os, struct, sys
total = 0
d = sys.argv[1]
for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
    data = open(os.path.join(d, name), "rb").read()
    if data[:8] != b"dedupWAL":
        continue
    (magic,) = struct.unpack_from("<I", data, 8)
    at = 12
    while at + 20 <= len(data):
        group_magic, _number, length, _crc = struct.unpack_from("<IQII", data, at)
        if group_magic != magic or length == 0 or at + 20 + length > len(data):
            break
        at += 20 + length
    total += at - 12
print(total)
PY
)
restart_started=$(date +%s.%N)
"$bin" --listen 127.0.0.1:51002 --metrics-listen off --data-dir "$work/big" --sync always --worker-threads 1 --log warn 2>>"$work/big.log" &
big_pid=$!; pids+=($big_pid)
until "$bin" lookup --addr 127.0.0.1:51002 -n bench probe >/dev/null 2>&1; do sleep 0.01; done
startup_seconds=$(python3 -c "print($(date +%s.%N) - $restart_started)")
# Touch a sample of the records so the cache is warm, then read RSS again.
"$bench" load --target dedupd://127.0.0.1:51002 --workload claim --concurrency 16 --duration 2s \
  --worker-threads 1 --json > /dev/null
rss_after_restart_kb=$(awk '/VmRSS/ {print $2}' /proc/$big_pid/status)
kill -TERM $big_pid; wait $big_pid 2>/dev/null || true
disk_bytes=$(du -sb "$work/big" | cut -f1)

fsync_line=$(dd if=/dev/zero of="$work/dsync.test" bs=4k count=500 oflag=dsync 2>&1 | tail -1)
# The run's figures are kept, so the page and its plots can be rendered
# again (benches/report.py's docstring).
mkdir -p benches/results
cp "$results" benches/results/compare.jsonl
cat > benches/results/compare-extra.json <<JSON
{"records": $records, "load_seconds": $load_seconds, "peak_rss_kb": $peak_rss_kb,
 "disk_bytes": $disk_bytes, "startup_seconds": $startup_seconds,
 "rss_after_restart_kb": $rss_after_restart_kb, "log_bytes": $log_bytes, "load": $(cat "$work/load.json"),
 "duration": "$duration", "repeats": $repeats, "dsync": "$fsync_line"}
JSON
"$(plotting_python)" benches/report.py benches/results/compare.jsonl "$out" < benches/results/compare-extra.json
echo "wrote $out and its plots in docs/benchmarks/"
