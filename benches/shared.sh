#!/usr/bin/env bash
# dedupd on a shared store against the hand-written peer on the same server,
# and the local tier's DUPLICATE against the shared store's, back to back;
# prints a Markdown section for BENCHMARKS.md.
#
#   benches/shared.sh [--duration 5s] [--repeats 3]
#
# Needs redis-server on PATH. Starts a private Redis (appendfsync always,
# port 51014) and three dedupd sidecars on it (ports 51011-51013: local tier
# on, local tier off), each server with one tokio worker / one process and
# the load generator one worker; stops them all on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

. benches/lib.sh
bench_options 5s 3 "$@"
[ ${#bench_rest[@]} -eq 0 ] || bench_unknown "${bench_rest[0]}"
bench_build
command -v redis-server >/dev/null || { echo "redis-server is not on PATH" >&2; exit 1; }

redis-server --port 51014 --bind 127.0.0.1 --dir "$work" --save "" \
  --appendonly yes --appendfsync always --logfile "$work/redis.log" & pids+=($!)
until redis-cli -p 51014 ping >/dev/null 2>&1; do sleep 0.05; done
sidecar() { # port data-dir [extra flags...]
  local port=$1 dir=$2; shift 2
  "$bin" --listen "127.0.0.1:$port" --metrics-listen off --store redis \
    --store-url redis://127.0.0.1:51014 --data-dir "$work/$dir" --worker-threads 1 --log warn \
    "$@" 2>"$work/$dir.log" & pids+=($!)
  until "$bin" health --addr "127.0.0.1:$port" >/dev/null 2>&1; do sleep 0.05; done
}
sidecar 51011 tier-on
sidecar 51012 tier-off --local-tier-mb 0
# The ceiling of the gRPC hop and the engine: dedupd with no store I/O to wait for.
"$bin" --listen 127.0.0.1:51013 --metrics-listen off --data-dir "$work/sled" --sync none \
  --worker-threads 1 --log warn 2>"$work/sled.log" & pids+=($!)
until "$bin" health --addr 127.0.0.1:51013 >/dev/null 2>&1; do sleep 0.05; done

load() { # target workload concurrency [extra...] -> JSON
  local target=$1 workload=$2 concurrency=$3; shift 3
  "$bench" load --target "$target" --workload "$workload" --concurrency "$concurrency" \
    --duration "$duration" --worker-threads 1 --json "$@"
}
field() { python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(eval(sys.argv[2], {}, {"r": r}))' "$@"; }

pairs_dedupd=() pairs_redis=() pairs_sled=() p50_on=() p50_off=() p99_on=() p99_off=()
for _ in $(seq 1 "$repeats"); do
  json=$(load dedupd://127.0.0.1:51011 claim-commit 64)
  pairs_dedupd+=("$(field "$json" 'int(r["ops_per_sec"])')")
  json=$(load redis://127.0.0.1:51014 claim-commit 64)
  pairs_redis+=("$(field "$json" 'int(r["ops_per_sec"])')")
  json=$(load dedupd://127.0.0.1:51013 claim-commit 64)
  pairs_sled+=("$(field "$json" 'int(r["ops_per_sec"])')")
  json=$(load dedupd://127.0.0.1:51011 duplicate-heavy 1 --duplicate-share 1)
  p50_on+=("$(field "$json" 'r["latency_us"]["p50"]')"); p99_on+=("$(field "$json" 'r["latency_us"]["p99"]')")
  json=$(load dedupd://127.0.0.1:51012 duplicate-heavy 1 --duplicate-share 1)
  p50_off+=("$(field "$json" 'r["latency_us"]["p50"]')"); p99_off+=("$(field "$json" 'r["latency_us"]["p99"]')")
done
engine=$("$bench" tier --redis redis://127.0.0.1:51014 --requests 20000 | tail -2)

python3 - "$duration" "$repeats" "$engine" <<PY
import statistics, sys
duration, repeats, engine = sys.argv[1], sys.argv[2], sys.argv[3]
med = lambda xs: statistics.median(float(x) for x in xs)
dedupd, redis = med("${pairs_dedupd[*]}".split()), med("${pairs_redis[*]}".split())
sled = med("${pairs_sled[*]}".split())
on50, off50 = med("${p50_on[*]}".split()), med("${p50_off[*]}".split())
on99, off99 = med("${p99_on[*]}".split()), med("${p99_off[*]}".split())
print(f"""## dedupd on Redis (benches/shared.sh, {duration} × {repeats} interleaved, medians)

Private Redis 7 with \`appendonly yes\`, \`appendfsync always\`; every server
one tokio worker / one process, the load generator one worker.

| Claim + Commit pairs, c=64 | pairs/s |
|---|---:|
| dedupd on Redis | {dedupd:,.0f} |
| hand-written Redis peer (SET NX + SET, no gRPC hop) | {redis:,.0f} |
| dedupd on sled, sync=none (no store I/O: the gRPC + engine ceiling) | {sled:,.0f} |
| **ratio dedupd on Redis ÷ peer** (target ≥ 0.6×) | **{dedupd / redis:.2f}×** |
| ceiling ÷ peer | {sled / redis:.2f}× |

| DUPLICATE of a committed ID through gRPC, c=1 | p50 µs | p99 µs |
|---|---:|---:|
| local tier on (answered by this sidecar's sled) | {on50:,.0f} | {on99:,.0f} |
| local tier off (asks Redis) | {off50:,.0f} | {off99:,.0f} |
| **p50 speed-up** (target ≥ 5×) | **{off50 / on50:.2f}×** | |

The same DUPLICATE through the engine alone (\`dedupd-bench tier\`, no gRPC
hop, one call at a time):

\`\`\`
{engine}
\`\`\`
""")
PY
