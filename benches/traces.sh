#!/usr/bin/env bash
# What trace export costs a call, and what a collector that is down costs:
# dedupd with traces off, exporting to a collector that is up, to one that
# refuses connections, and to one that takes them and never answers, back
# to back; prints a Markdown section for BENCHMARKS.md.
#
#   benches/traces.sh [--duration 5s] [--repeats 3]
#
# Starts four sidecars (ports 51021-51024, /metrics on 51031-51034; sled
# with --sync none, so no disk wait hides the CPU a span costs), the OTLP
# sink (dedupd-bench otlp-sink, 51025) and a silent listener (51027); every
# server one tokio worker, the load generator one worker; stops them all on
# exit. Every call is a root span, sampled (the default parentbased_always_on).
set -euo pipefail
cd "$(dirname "$0")/.."

. benches/lib.sh
bench_options 5s 3 "$@"
[ ${#bench_rest[@]} -eq 0 ] || bench_unknown "${bench_rest[0]}"
bench_build

"$bench" otlp-sink --listen 127.0.0.1:51025 --worker-threads 1 2>"$work/sink.log" & pids+=($!)
# Accepts connections (the kernel's backlog) and never reads or answers.
python3 -c 'import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 51027)); s.listen(4096); time.sleep(1e9)' & pids+=($!)
sidecar() { # port metrics-port name [extra flags...]
  local port=$1 metrics=$2 name=$3; shift 3
  "$bin" --listen "127.0.0.1:$port" --metrics-listen "127.0.0.1:$metrics" --data-dir "$work/$name" \
    --sync none --worker-threads 1 --log warn "$@" 2>"$work/$name.log" & pids+=($!)
  until "$bin" health --addr "127.0.0.1:$port" >/dev/null 2>&1; do sleep 0.05; done
}
sidecar 51021 51031 off
sidecar 51022 51032 up --otlp-endpoint http://127.0.0.1:51025 --otlp-protocol grpc
sidecar 51023 51033 refused --otlp-endpoint http://127.0.0.1:51026 --otlp-protocol grpc
sidecar 51024 51034 silent --otlp-endpoint http://127.0.0.1:51027 --otlp-protocol grpc

load() { # port concurrency -> JSON
  "$bench" load --target "dedupd://127.0.0.1:$1" --workload claim --concurrency "$2" \
    --duration "$duration" --worker-threads 1 --json
}
field() { python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(eval(sys.argv[2], {}, {"r": r}))' "$@"; }

declare -A p50 p99 rate
for _ in $(seq 1 "$repeats"); do
  for port in 51021 51022 51023 51024; do
    json=$(load "$port" 1)
    p50[$port]+=" $(field "$json" 'r["latency_us"]["p50"]')"
    p99[$port]+=" $(field "$json" 'r["latency_us"]["p99"]')"
    json=$(load "$port" 64)
    rate[$port]+=" $(field "$json" 'int(r["ops_per_sec"])')"
  done
done
spans() { # metrics-port -> "exported dropped"
  curl -s "http://127.0.0.1:$1/metrics" -H 'Accept: text/plain' | python3 -c '
import sys
exported = dropped = 0.0
for line in sys.stdin:
    if line.startswith("dedupd_trace_spans_exported_total "): exported = float(line.split()[-1])
    if line.startswith("dedupd_trace_spans_dropped_total{"): dropped += float(line.split()[-1])
print(int(exported), int(dropped))'
}

python3 - "$duration" "$repeats" "$(nproc)" \
  "${p50[51021]}" "${p99[51021]}" "${rate[51021]}" "$(spans 51031)" \
  "${p50[51022]}" "${p99[51022]}" "${rate[51022]}" "$(spans 51032)" \
  "${p50[51023]}" "${p99[51023]}" "${rate[51023]}" "$(spans 51033)" \
  "${p50[51024]}" "${p99[51024]}" "${rate[51024]}" "$(spans 51034)" <<'PY'
import statistics, sys
duration, repeats, cpus = sys.argv[1:4]
med = lambda text: statistics.median(float(x) for x in text.split())
rows = []
names = ["traces off", "exporting, collector up", "exporting, collector refuses connections",
         "exporting, collector silent (accepts, never answers)"]
for i, name in enumerate(names):
    p50, p99, rate, spans = sys.argv[4 + 4 * i: 8 + 4 * i]
    exported, dropped = spans.split()
    rows.append((name, med(p50), med(p99), med(rate), int(exported), int(dropped)))
base50, base_rate = rows[0][1], rows[0][3]
print(f"""## Trace export (benches/traces.sh, {duration} × {repeats} interleaved, medians)

dedupd on sled with `--sync none` (no disk wait to hide a span's CPU cost),
one tokio worker per server, the load generator one worker, {cpus} CPUs.
Each Claim is a sampled root span with two children (store round trip,
durability wait), exported over OTLP/gRPC through the bounded queue.

| Claim | p50 µs, c=1 | p99 µs, c=1 | p50 ÷ off | Claims/s, c=64 | ÷ off | spans exported | spans dropped |
|---|---:|---:|---:|---:|---:|---:|---:|""")
for name, p50, p99, rate, exported, dropped in rows:
    print(f"| {name} | {p50:,.0f} | {p99:,.0f} | {p50 / base50:.2f}× | {rate:,.0f} | {rate / base_rate:.2f}× | {exported:,} | {dropped:,} |")
print("""
A collector that is down costs spans (counted in
`dedupd_trace_spans_dropped_total`), not answers: the queue is never waited
on, and the export runs on its own task.""")
PY
