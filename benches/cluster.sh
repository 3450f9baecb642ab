#!/usr/bin/env bash
# Claim+Commit at c=64 from 1, 2 and 3 load generators, each with a sidecar
# of its own, against one Redis primary and against a Redis Cluster of three
# primaries (and a replica each), with the hand-written Redis peer beside
# each; the CPU each process took is measured, since on a 2-core machine
# the processes share two CPUs. Prints a Markdown section for BENCHMARKS.md.
#
#   benches/cluster.sh [--duration 5s] [--repeats 2]
#
# Needs redis-server and redis-cli on PATH. Starts a private Redis primary
# (appendfsync always) and a cluster (.ci/redis-cluster: the same settings)
# and three dedupd sidecars on each (one tokio worker each); every load
# generator one worker. Stops them all on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

. benches/lib.sh
bench_options 5s 2 "$@"
[ ${#bench_rest[@]} -eq 0 ] || bench_unknown "${bench_rest[0]}"
command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
  || { echo "redis-server and redis-cli must be on PATH" >&2; exit 1; }

bench_build
bench_on_exit() {
  .ci/redis-cluster stop "$work/cluster" 2>/dev/null || true
  [ -e "$work/primary.pid" ] && kill "$(cat "$work/primary.pid")" 2>/dev/null || true
  pkill -f "dedupd --listen 127.0.0.1:5202" 2>/dev/null || true
  sleep 0.5
}

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --daemonize yes --port "$port" --bind 127.0.0.1 --dir "$work" --save "" \
  --appendonly yes --appendfsync always --logfile "$work/primary.log" --pidfile "$work/primary.pid" >/dev/null
until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.05; done
cluster=$(.ci/redis-cluster start "$work/cluster")

python3 - "$work" "$duration" "$repeats" "redis://127.0.0.1:$port" "$cluster" <<'PY'
import json, os, statistics, subprocess, sys, time

work, duration, repeats, primary, cluster = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
binary, bench = "target/release/dedupd", "target/release/dedupd-bench"
tick = os.sysconf("SC_CLK_TCK")

def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick

def redis_pids(url):
    pids = []
    for hostport in url.split("://", 1)[1].split(","):
        info = subprocess.run(["redis-cli", "-p", hostport.rsplit(":", 1)[1], "info", "server"],
                              capture_output=True, text=True).stdout
        pids += [int(line.split(":")[1]) for line in info.splitlines() if line.startswith("process_id:")]
    return pids

def start_sidecars(url, base):
    sidecars = []
    for i in range(3):
        address = f"127.0.0.1:{base + i}"
        log = open(f"{work}/sidecar-{base + i}.log", "w")
        process = subprocess.Popen([binary, "--listen", address, "--metrics-listen", "off", "--store", "redis",
                                    "--store-url", url, "--data-dir", f"{work}/data-{base + i}",
                                    "--worker-threads", "1", "--log", "warn"], stderr=log)
        deadline = time.monotonic() + 30
        while subprocess.run([binary, "health", "--addr", address], capture_output=True).returncode != 0:
            assert process.poll() is None and time.monotonic() < deadline, f"sidecar {address} did not serve"
            time.sleep(0.05)
        sidecars.append((address, process))
    return sidecars

def run(targets, watched):
    """One load generator per target, at once; their summed pairs/s and the
    CPU seconds per second each kind of process took."""
    before = {pid: cpu_seconds(pid) for pid in watched}
    started = time.monotonic()
    loads = [subprocess.Popen([bench, "load", "--target", target, "--workload", "claim-commit",
                               "--concurrency", "64", "--duration", duration, "--worker-threads", "1",
                               "--json"], stdout=subprocess.PIPE, text=True) for target in targets]
    results = []
    for load in loads:
        out, _ = load.communicate()
        assert load.returncode == 0, out
        results.append(json.loads(out))
    elapsed = time.monotonic() - started
    after = {pid: cpu_seconds(pid) for pid in watched}
    return sum(r["ops_per_sec"] for r in results), {pid: (after[pid] - before[pid]) / elapsed for pid in watched}

def children_cpu():
    usage = os.times()
    return usage.children_user + usage.children_system

rows = []
for name, url, base in (("one primary", primary, 52021), ("cluster, 3 primaries", cluster, 52024)):
    sidecars = start_sidecars(url, base)
    servers = redis_pids(url)
    for generators in (1, 2, 3):
        measured = {"dedupd": [], "peer": []}
        split = {"dedupd": [], "peer": []}
        for _ in range(repeats):
            for kind in ("dedupd", "peer"):
                targets = ([f"dedupd://{address}" for address, _ in sidecars[:generators]] if kind == "dedupd"
                           else [url] * generators)
                sidecar_pids = [process.pid for _, process in sidecars[:generators]] if kind == "dedupd" else []
                load_before = children_cpu()
                started = time.monotonic()
                pairs, cpu = run(targets, servers + sidecar_pids)
                load_cpu = (children_cpu() - load_before) / (time.monotonic() - started)
                measured[kind].append(pairs)
                split[kind].append((sum(cpu[p] for p in servers), sum(cpu[p] for p in sidecar_pids), load_cpu))
        med = lambda xs: statistics.median(xs)
        cpu_of = lambda kind, i: med([s[i] for s in split[kind]])
        rows.append((name, generators, med(measured["dedupd"]), med(measured["peer"]),
                     cpu_of("dedupd", 0), cpu_of("dedupd", 1), cpu_of("dedupd", 2),
                     cpu_of("peer", 0), cpu_of("peer", 2)))
    for _, process in sidecars:
        process.terminate()
        process.wait()

print(f"""## dedupd on a Redis Cluster (benches/cluster.sh, {duration} × {repeats}, medians)

Claim + Commit pairs at c=64 per load generator, each generator with a
sidecar of its own (one tokio worker) on the same store; the hand-written
Redis peer (SET NX + SET, redis-rs's cluster client on the cluster) with as
many generators. One primary: a private Redis 7, `appendonly yes`,
`appendfsync always`. Cluster: three primaries and a replica each
(`.ci/redis-cluster`), the same settings. CPU: CPU-seconds per second
(1.0 = one core) taken by the Redis servers (all six nodes on the cluster,
replication included), the sidecars and the load generators; this machine
has 2 cores, so past 2.0 in all, more generators only share the same CPUs.

| store | generators | dedupd pairs/s | peer pairs/s | dedupd ÷ peer | CPU with dedupd: Redis / sidecars / generators | CPU with the peer: Redis / generators |
|---|---:|---:|---:|---:|---|---|""")
for name, generators, dedupd, peer, redis_cpu, sidecar_cpu, load_cpu, peer_redis_cpu, peer_load_cpu in rows:
    print(f"| {name} | {generators} | {dedupd:,.0f} | {peer:,.0f} | {dedupd / peer:.2f}× | "
          f"{redis_cpu:.2f} / {sidecar_cpu:.2f} / {load_cpu:.2f} | {peer_redis_cpu:.2f} / {peer_load_cpu:.2f} |")
PY
