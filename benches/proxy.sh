#!/usr/bin/env bash
# The HTTP idempotency proxy against the service behind it, with wrk:
# direct vs through `dedupd http-proxy`, in one run, on this machine.
#
#   benches/proxy.sh [--duration 10s] [--connections 64] [--repeats 3]
#                    [--upstream-work 0us] [--out FILE] [--dedupd BIN]
#
# --dedupd runs another build of the proxy (say, the last release's, copied
# aside) against the same upstream: run the script once per build,
# alternating, to compare them in one sitting.
#
# Starts `dedupd-bench http-upstream` (one tokio worker; each request costs
# it --upstream-work of CPU on top of HTTP) and `dedupd http-proxy` in front
# of it twice (one worker each, sled, --sync always and --sync none), then for
# each scenario runs wrk (one thread) at --connections for throughput and
# at 1 connection for the latency a lone request sees:
#   direct       POST /orders to the service
#   pass-through POST /orders through the proxy, no Idempotency-Key
#   keyed-first  through the proxy, a new key per request (claim, forward,
#                commit with the stored answer: two durable writes)
#   keyed-first-sync-none  the same through the proxy with --sync none
#                (what the disk costs)
#   replay       through the proxy, one key (answered from the store; the
#                service's call count shows it was not called)
# and last, the peak resident memory of a fresh proxy while one keyed POST
# gets a 96 MiB answer (streamed: only --max-response-bytes is gathered).
# Prints a table with the ratios issue 14 asks for and writes it to --out.
# Needs wrk (apt-get install wrk).
set -euo pipefail
caller_dir=$PWD
cd "$(dirname "$0")/.."

duration=10s connections=64 repeats=3 work=0us out="" dedupd=target/release/dedupd
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) duration=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --upstream-work) work=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --dedupd) case $2 in /*) dedupd=$2 ;; *) dedupd=$caller_dir/$2 ;; esac; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 64 ;;
  esac
done
command -v wrk >/dev/null || { echo "wrk is not on PATH (apt-get install wrk)" >&2; exit 1; }

cargo build --release --locked --quiet --workspace
tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

upstream_port=51011 proxy_port=51012 unsynced_port=51013
target/release/dedupd-bench http-upstream --listen 127.0.0.1:$upstream_port --worker-threads 1 \
  --work "$work" 2>"$tmp/upstream.log" & pids+=($!)
upstream_pid=$!
start_proxy() { # port sync [name]
  local name=${3:-$2}
  "$dedupd" http-proxy --listen 127.0.0.1:$1 --upstream http://127.0.0.1:$upstream_port \
    --data-dir "$tmp/data-$name" --sync "$2" --metrics-listen off --worker-threads 1 --log warn \
    --ready-file "$tmp/ready-$name.json" 2>"$tmp/proxy-$name.log" & pids+=($!)
  for _ in $(seq 1 200); do [ -f "$tmp/ready-$name.json" ] && return 0; sleep 0.05; done
  cat "$tmp/proxy-$name.log" >&2; exit 1
}
start_proxy $proxy_port always
proxy_pid=$!
start_proxy $unsynced_port none
unsynced_pid=$!

calls() { curl -s http://127.0.0.1:$upstream_port/calls | python3 -c 'import json,sys; print(json.load(sys.stdin)["calls"])'; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

results="$tmp/results.jsonl"
: > "$results"
# run NAME PORT PROXY_PID KEY_MODE CONNECTIONS REPEAT
run() {
  local name=$1 port=$2 proxy=$3 mode=$4 conns=$5 repeat=$6
  local before_calls before_up before_proxy
  before_calls=$(calls)
  before_up=$(cpu_ticks $upstream_pid)
  before_proxy=$(cpu_ticks "$proxy")
  KEY_MODE=$mode KEY_RUN="r$$-$name-$conns-$repeat" \
    wrk -t1 -c"$conns" -d"$duration" --latency -s benches/wrk/post.lua "http://127.0.0.1:$port" > "$tmp/wrk.txt"
  python3 - "$tmp/wrk.txt" "$name" "$conns" "$(( $(calls) - before_calls ))" \
    "$(( $(cpu_ticks $upstream_pid) - before_up ))" "$(( $(cpu_ticks "$proxy") - before_proxy ))" \
    "$(getconf CLK_TCK)" >> "$results" <<'PY'
import json, re, sys
wrk_output, name, conns, upstream_calls, up_ticks, proxy_ticks, hz = sys.argv[1:]
text = open(wrk_output).read()
def ms(value, unit):
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
percentiles = {p: ms(v, u) for p, v, u in re.findall(r"^\s+(50|90|99)%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)}
requests = int(re.search(r"(\d+) requests in", text).group(1))
print(json.dumps({
    "name": name, "connections": int(conns),
    "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),
    "p50_ms": percentiles["50"], "p99_ms": percentiles["99"],
    "requests": requests,
    "non2xx": int(re.search(r"NON2XX (\d+)", text).group(1)),
    "upstream_calls": int(upstream_calls),
    "upstream_cpu_us_per_request": int(up_ticks) / int(hz) * 1e6 / max(requests, 1),
    "proxy_cpu_us_per_request": int(proxy_ticks) / int(hz) * 1e6 / max(requests, 1),
}))
PY
}

# One request so the replay scenario's key is committed before it is timed.
for repeat in $(seq 1 "$repeats"); do
  curl -s -o /dev/null -X POST http://127.0.0.1:$proxy_port/orders \
    -H "Idempotency-Key: \"r$$-replay-$connections-$repeat-fixed\"" -H 'Content-Type: application/json' \
    -H 'Authorization: Bearer bench' -d '{"sku":"A1","qty":2,"note":"benchmark order"}'
  curl -s -o /dev/null -X POST http://127.0.0.1:$proxy_port/orders \
    -H "Idempotency-Key: \"r$$-replay-1-$repeat-fixed\"" -H 'Content-Type: application/json' \
    -H 'Authorization: Bearer bench' -d '{"sku":"A1","qty":2,"note":"benchmark order"}'
  for conns in "$connections" 1; do
    run direct $upstream_port $proxy_pid none "$conns" "$repeat"
    run pass-through $proxy_port $proxy_pid none "$conns" "$repeat"
    run keyed-first $proxy_port $proxy_pid unique "$conns" "$repeat"
    run keyed-first-sync-none $unsynced_port $unsynced_pid unique "$conns" "$repeat"
    run replay $proxy_port $proxy_pid fixed "$conns" "$repeat"
  done
done

# A fresh proxy (its peak memory not raised by the runs above): peak RSS
# before and after one keyed POST whose answer is 96 MiB.
large_port=51014
start_proxy $large_port always large
large_pid=$!
peak_kib() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status"; }
large_before=$(peak_kib $large_pid)
large_bytes=$(curl -s -X POST "http://127.0.0.1:$large_port/orders?bytes=$((96 << 20))" \
  -H 'Idempotency-Key: large-answer' -H 'Authorization: Bearer bench' -H 'Content-Type: application/json' -d '{}' -o /dev/null -w '%{size_download}')
large_after=$(peak_kib $large_pid)

python3 - "$results" "$duration" "$connections" "$repeats" "$(nproc)" "$work" \
  "$large_before" "$large_after" "$large_bytes" "$dedupd" <<'PY' | tee "${out:-/dev/null}"
import json, statistics, sys
path, duration, connections, repeats, cpus, work, large_before, large_after, large_bytes, dedupd = sys.argv[1:]
rows = [json.loads(line) for line in open(path)]
def median(name, conns, field):
    return statistics.median(r[field] for r in rows if r["name"] == name and r["connections"] == int(conns))
def total(name, conns, field):
    return sum(r[field] for r in rows if r["name"] == name and r["connections"] == int(conns))
names = ["direct", "pass-through", "keyed-first", "keyed-first-sync-none", "replay"]
print(f"wrk -t1, {duration} per run, median of {repeats}; service work {work} per request; {cpus} CPUs shared by wrk, the service and the proxy; proxy binary {dedupd}")
print()
print(f"| scenario | req/s c={connections} | x direct | p50 c={connections} | p99 c={connections} | req/s c=1 | p50 c=1 | p99 c=1 | service calls / requests | proxy CPU µs/req | service CPU µs/req | non-2xx |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
direct = median("direct", connections, "rps")
for name in names:
    rps = median(name, connections, "rps")
    calls = total(name, connections, "upstream_calls") + total(name, 1, "upstream_calls")
    requests = total(name, connections, "requests") + total(name, 1, "requests")
    print(f"| {name} | {rps:,.0f} | {rps / direct:.2f} | {median(name, connections, 'p50_ms'):.2f} ms | {median(name, connections, 'p99_ms'):.2f} ms "
          f"| {median(name, 1, 'rps'):,.0f} | {median(name, 1, 'p50_ms'):.3f} ms | {median(name, 1, 'p99_ms'):.3f} ms "
          f"| {calls:,} / {requests:,} | {median(name, connections, 'proxy_cpu_us_per_request'):.1f} | {median(name, connections, 'upstream_cpu_us_per_request'):.1f} "
          f"| {total(name, connections, 'non2xx') + total(name, 1, 'non2xx')} |")
print()
added = median("pass-through", 1, "p50_ms") - median("direct", 1, "p50_ms")
targets = [
    ("pass-through >= 0.8x direct", median("pass-through", connections, "rps") / direct, 0.8),
    ("keyed first >= 0.5x direct", median("keyed-first", connections, "rps") / direct, 0.5),
    ("replays >= 1x direct", median("replay", connections, "rps") / direct, 1.0),
]
for label, value, target in targets:
    print(f"- {label}: {value:.2f}x — {'met' if value >= target else 'not met'}")
print(f"- p50 added to a pass-through request (c=1) <= 0.3 ms: {added:.3f} ms — {'met' if added <= 0.3 else 'not met'}")
peak = int(large_after) / 1024
print(f"- a {int(large_bytes) / 2**20:.0f} MiB keyed answer streamed: peak RSS {int(large_before) / 1024:.1f} MiB before, {peak:.1f} MiB after (< 64 MiB: {'met' if peak < 64 and int(large_bytes) == 96 << 20 else 'not met'})")
PY
