#!/usr/bin/env bash
# What sealing stored answers costs (issue 43): the same sidecar build with
# and without --encryption-key-file, side by side in one run, alternating.
#
#   benches/sealing.sh [--duration 5s] [--repeats 3] [--concurrency 8]
#                      [--out benches/results/sealing.jsonl]
#
# For answers of 1 KiB and 64 KiB, each repeat runs, plaintext then sealed:
#   commit   gRPC Claim+Commit of fresh IDs, the answer stored (dedupd-bench
#            load --workload claim-commit --response-bytes N)
#   replay   gRPC Claims of committed IDs: every one DUPLICATE with its answer
#            (--workload duplicate-heavy --duplicate-share 1)
#   proxy    the HTTP proxy replaying one key's answer (wrk, a fixed key,
#            the upstream's /orders?bytes=N answer)
# every sidecar and proxy on --sync none (the disk would hide the cipher)
# and one worker thread, with its CPU per operation from /proc. Needs wrk.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/lib.sh
bench_options 5s 3 "$@"
concurrency=8 out=benches/results/sealing.jsonl
set -- "${bench_rest[@]+"${bench_rest[@]}"}"
while [ $# -gt 0 ]; do
  case "$1" in
    --concurrency) concurrency=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) bench_unknown "$1" ;;
  esac
done
command -v wrk >/dev/null || { echo "wrk is not on PATH (apt-get install wrk)" >&2; exit 1; }
bench_build

key="$work/answers.key"
head -c 32 /dev/urandom | base64 > "$key"
start() { # name port [flags...]: a sidecar (gRPC, or the proxy with http-proxy ...)
  local name=$1 port=$2; shift 2
  "$@" --data-dir "$work/data-$name" --sync none --metrics-listen off --worker-threads 1 \
    --log warn --ready-file "$work/ready-$name.json" 2>"$work/$name.log" & pids+=($!)
  for _ in $(seq 1 200); do [ -f "$work/ready-$name.json" ] && return 0; sleep 0.05; done
  cat "$work/$name.log" >&2; exit 1
}
"$bench" http-upstream --listen 127.0.0.1:51033 --worker-threads 1 2>"$work/upstream.log" & pids+=($!)
wait_port 51033
declare -A pid port
port[grpc-plaintext]=51031 port[grpc-sealed]=51032 port[proxy-plaintext]=51034 port[proxy-sealed]=51035
start grpc-plaintext 51031 "$bin" --listen 127.0.0.1:51031;                 pid[grpc-plaintext]=$!
start grpc-sealed 51032 "$bin" --listen 127.0.0.1:51032 --encryption-key-file "$key"; pid[grpc-sealed]=$!
start proxy-plaintext 51034 "$bin" http-proxy --listen 127.0.0.1:51034 --upstream http://127.0.0.1:51033
pid[proxy-plaintext]=$!
start proxy-sealed 51035 "$bin" http-proxy --listen 127.0.0.1:51035 --upstream http://127.0.0.1:51033 \
  --encryption-key-file "$key"
pid[proxy-sealed]=$!

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
mkdir -p "$(dirname "$out")"
: > "$out"
# record SCENARIO MODE BYTES REPEAT OPS OPS_PER_S P50_US TICKS
record() {
  python3 -c 'import json,sys,os
s,m,b,r,ops,rate,p50,ticks=sys.argv[1:]
hz=os.sysconf("SC_CLK_TCK")
print(json.dumps({"scenario":s,"mode":m,"bytes":int(b),"repeat":int(r),"ops_per_s":float(rate),
  "p50_us":float(p50),"cpu_us_per_op":int(ticks)/hz*1e6/max(int(ops),1)}))' "$@" | tee -a "$out"
}
grpc() { # workload mode bytes repeat
  local workload=$1 mode=$2 bytes=$3 repeat=$4 target=grpc-$2 before json
  local extra=()
  [ "$workload" = duplicate-heavy ] && extra=(--duplicate-share 1)
  before=$(cpu_ticks "${pid[$target]}")
  json=$("$bench" load --target "dedupd://127.0.0.1:${port[$target]}" --workload "$workload" \
    --response-bytes "$bytes" --concurrency "$concurrency" --duration "$duration" --json "${extra[@]}")
  python3 -c 'import json,sys; r=json.loads(sys.argv[1]); assert r["checks_passed"] and r["errors"]==0, r' "$json"
  record "$( [ "$workload" = claim-commit ] && echo commit || echo replay )" "$mode" "$bytes" "$repeat" \
    $(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(r["ops"], r["ops_per_sec"], r["latency_us"]["p50"])' "$json") \
    "$(( $(cpu_ticks "${pid[$target]}") - before ))"
}
proxy() { # mode bytes repeat
  local mode=$1 bytes=$2 repeat=$3 target=proxy-$1 before run_id
  run_id="s$$-$bytes-$repeat"
  curl -s -o /dev/null -X POST "http://127.0.0.1:${port[$target]}/orders?bytes=$bytes" \
    -H "Idempotency-Key: \"$run_id-fixed\"" -H 'Content-Type: application/json' \
    -H 'Authorization: Bearer bench' -d '{"sku":"A1","qty":2,"note":"benchmark order"}'
  before=$(cpu_ticks "${pid[$target]}")
  KEY_MODE=fixed KEY_RUN=$run_id KEY_PATH="/orders?bytes=$bytes" \
    wrk -t1 -c"$concurrency" -d"$duration" --latency -s benches/wrk/post.lua \
    "http://127.0.0.1:${port[$target]}" > "$work/wrk.txt"
  record proxy "$mode" "$bytes" "$repeat" \
    $(python3 - "$work/wrk.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
assert "Non-2xx" not in text, text
unit = {"us": 1, "ms": 1000, "s": 1e6}
p50 = re.search(r"^\s+50%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
print(re.search(r"(\d+) requests in", text).group(1),
      re.search(r"Requests/sec:\s+([\d.]+)", text).group(1),
      float(p50.group(1)) * unit[p50.group(2)])
PY
) "$(( $(cpu_ticks "${pid[$target]}") - before ))"
}
for repeat in $(seq 1 "$repeats"); do
  for bytes in 1024 65536; do
    for mode in plaintext sealed; do
      grpc claim-commit "$mode" "$bytes" "$repeat"
      grpc duplicate-heavy "$mode" "$bytes" "$repeat"
      proxy "$mode" "$bytes" "$repeat"
    done
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
def med(s, m, b, k):
    return statistics.median(r[k] for r in rows if (r["scenario"], r["mode"], r["bytes"]) == (s, m, b))
print("| scenario | answer | plaintext ops/s | sealed ops/s | sealed ÷ plaintext | p50 µs plaintext / sealed | sidecar CPU µs/op plaintext / sealed |")
print("|---|---:|---:|---:|---:|---:|---:|")
for s in ["commit", "replay", "proxy"]:
    for b in [1024, 65536]:
        p, q = med(s, "plaintext", b, "ops_per_s"), med(s, "sealed", b, "ops_per_s")
        print(f"| {s} | {b >> 10} KiB | {p:,.0f} | {q:,.0f} | {q / p:.2f}× | "
              f"{med(s, 'plaintext', b, 'p50_us'):,.0f} / {med(s, 'sealed', b, 'p50_us'):,.0f} | "
              f"{med(s, 'plaintext', b, 'cpu_us_per_op'):.1f} / {med(s, 'sealed', b, 'cpu_us_per_op'):.1f} |")
PY
