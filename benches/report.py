#!/usr/bin/env python3
"""Turns benches/compare.sh results into BENCHMARKS.md and its plots.

argv: results.jsonl out.md [plots-dir]; stdin: one JSON object of resource
figures. With plots-dir (default: docs/benchmarks beside out.md), renders
PNG plots with matplotlib: throughput and p99 against concurrency for every
target, and dedupd's ratio to each peer; BENCHMARKS.md shows them beside the
tables. compare.sh keeps its inputs in benches/results/, so
`benches/report.py benches/results/compare.jsonl BENCHMARKS.md <
benches/results/compare-extra.json` renders the same page again.
"""
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from collections import defaultdict

results_path, out_path = sys.argv[1], sys.argv[2]
plots_dir = sys.argv[3] if len(sys.argv) > 3 else os.path.join(os.path.dirname(os.path.abspath(out_path)), "docs", "benchmarks")
extra = json.load(sys.stdin)
runs = [json.loads(line) for line in open(results_path) if line.strip()]

ALWAYS, NONE, NOOP = "dedupd sync=always", "dedupd sync=none", "no-op"
ON_PG = "dedupd on PostgreSQL"
PEERS = [
    "Redis appendfsync=always",
    "Redis appendfsync=everysec",
    "PostgreSQL synchronous_commit=on",
    "PostgreSQL synchronous_commit=off",
]
ORDER = [NOOP, ALWAYS, NONE, ON_PG] + PEERS

by_key = defaultdict(list)
for run in runs:
    by_key[(run["workload"], run["concurrency"], run["name"])].append(run)


def median(workload, concurrency, name, field="ops_per_sec"):
    values = []
    for run in by_key.get((workload, concurrency, name), []):
        value = run
        for part in field.split("."):
            value = value[part]
        values.append(value)
    return statistics.median(values) if values else None


def fmt_ops(value):
    return "—" if value is None else f"{value:,.0f}"


def fmt_ratio(a, b):
    return "—" if a is None or not b else f"{a / b:.2f}×"


def concurrencies(workload):
    return sorted({c for (w, c, _) in by_key if w == workload})


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def mem_total():
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal"):
            return f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    return "?"


def rustc():
    try:
        return subprocess.run(["rustc", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "rustc ?"


def plot(workload, title, unit):
    """Three PNGs for `workload`; returns their paths relative to out.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plots_dir, exist_ok=True)
    cs = concurrencies(workload)
    relative = os.path.relpath(plots_dir, os.path.dirname(os.path.abspath(out_path)))
    made = []

    def save(figure, name):
        figure.tight_layout()
        figure.savefig(os.path.join(plots_dir, name), dpi=110)
        plt.close(figure)
        made.append(f"{relative}/{name}")

    for field, label, name in [
        ("ops_per_sec", unit, f"{workload}-throughput.png"),
        ("latency_us.p99", "p99 latency, µs", f"{workload}-p99.png"),
    ]:
        figure, axes = plt.subplots(figsize=(7.5, 4.2))
        for target in ORDER:
            points = [(c, median(workload, c, target, field)) for c in cs]
            points = [(c, v) for c, v in points if v is not None]
            if points:
                style = "-" if target.startswith("dedupd") else "--"
                axes.plot(*zip(*points), style, marker="o", label=target)
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xticks(cs, [str(c) for c in cs])
        axes.set_xlabel("concurrency (calls in flight)")
        axes.set_ylabel(label)
        axes.set_title(f"{title}: {label}")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7, loc="best")
        save(figure, name)

    figure, axes = plt.subplots(figsize=(7.5, 4.2))
    for mine in [ALWAYS, NONE]:
        for peer in [NOOP] + PEERS:
            points = [(c, median(workload, c, mine), median(workload, c, peer)) for c in cs]
            points = [(c, a / b) for c, a, b in points if a and b]
            if points:
                style = "-" if mine == ALWAYS else ":"
                axes.plot(*zip(*points), style, marker="o", label=f"{mine} ÷ {peer}")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(cs, [str(c) for c in cs])
    axes.set_xlabel("concurrency (calls in flight)")
    axes.set_ylabel("throughput ratio (above 1: dedupd faster)")
    axes.set_title(f"{title}: dedupd ÷ each peer")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=6, loc="best", ncol=2)
    save(figure, f"{workload}-ratios.png")
    return made


lines = []
out = lines.append
now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
out("# Benchmarks")
out("")
out(f"Produced by `benches/compare.sh` in one run on {now}. Reproduce with")
out("`benches/compare.sh` (about 15 minutes; `--repeats 1 --duration 2s` for a quick look).")
out("")
out("## Machine and method")
out("")
out(f"- {cpu_model()}, {os.cpu_count()} CPUs, {mem_total()} RAM, Linux {platform.release()}, {rustc()}")
out(f"- Disk: `dd bs=4k oflag=dsync` → {extra['dsync']}")
out(f"- Each figure is the median of {extra['repeats']} runs of {extra['duration']}; the runs of all targets")
out("  are interleaved so that a noisy moment hits every target alike.")
out("- CPU split, the same for every target: the load generator (`dedupd-bench load`) has 1 tokio worker;")
out("  dedupd and the no-op server have 1 tokio worker each (dedupd also runs its committer thread);")
out("  Redis is single-threaded; PostgreSQL uses one backend per connection.")
out("- 4 connections per target; concurrency = tasks issuing calls at once. All on loopback.")
out("- Operations: dedupd `Claim` (fresh IDs) / `Claim`+`Commit`; the no-op server answers the same")
out("  proto without a store; Redis `SET key v NX PX 30000` then `SET key committed PX 604800000`;")
out("  PostgreSQL `INSERT … ON CONFLICT DO NOTHING` into a `processed_events`-shaped table, then `UPDATE`.")
out("  The peers do less than dedupd (no lease tokens, fencing, attempts, expiry index, or check of")
out("  who commits); they are what a team would write by hand.")
out("- Every run checks its own results (fresh IDs must all be CLAIMED, never DUPLICATE); all passed.")
out("")

for workload, title, unit in [
    ("claim", "Claim (fresh IDs)", "claims/s"),
    ("claim-commit", "Claim + Commit pairs", "pairs/s"),
]:
    out(f"## {title}: throughput ({unit})")
    out("")
    throughput_plot, p99_plot, ratio_plot = plot(workload, title, unit)
    out(f"![{title}: throughput against concurrency]({throughput_plot})")
    out("")
    cs = concurrencies(workload)
    out("| target | " + " | ".join(f"c={c}" for c in cs) + " |")
    out("|---|" + "---:|" * len(cs))
    for name in ORDER:
        out(f"| {name} | " + " | ".join(fmt_ops(median(workload, c, name)) for c in cs) + " |")
    out("")
    out(f"### Ratios (dedupd ÷ peer, {title.lower()})")
    out("")
    out(f"![{title}: dedupd's throughput ÷ each peer's]({ratio_plot})")
    out("")
    out("| dedupd | vs | " + " | ".join(f"c={c}" for c in cs) + " |")
    out("|---|---|" + "---:|" * len(cs))
    for mine in [ALWAYS, NONE]:
        for peer in [NOOP] + PEERS:
            out(
                f"| {mine} | {peer} | "
                + " | ".join(fmt_ratio(median(workload, c, mine), median(workload, c, peer)) for c in cs)
                + " |"
            )
    out("")
    out(f"### Latency ({title.lower()}), µs: p50 / p99 / p99.9")
    out("")
    out(f"![{title}: p99 latency against concurrency]({p99_plot})")
    out("")
    out("| target | " + " | ".join(f"c={c}" for c in cs) + " |")
    out("|---|" + "---:|" * len(cs))
    for name in ORDER:
        cells = []
        for c in cs:
            p50 = median(workload, c, name, "latency_us.p50")
            p99 = median(workload, c, name, "latency_us.p99")
            p999 = median(workload, c, name, "latency_us.p999")
            cells.append("—" if p50 is None else f"{p50:,.0f} / {p99:,.0f} / {p999:,.0f}")
        out(f"| {name} | " + " | ".join(cells) + " |")
    out("")

out("## Batches of 500 claims (ClaimBatch; Redis: one pipeline; PostgreSQL: one INSERT … SELECT unnest)")
out("")
cs = concurrencies("batch")
out("| target | " + " | ".join(f"c={c} claims/s" for c in cs) + " |")
out("|---|" + "---:|" * len(cs))
for name in ORDER:
    out(f"| {name} | " + " | ".join(fmt_ops(median("batch", c, name)) for c in cs) + " |")
out("")

records = extra["records"]
out(f"## Resources with {records:,} live records")
out("")
out(f"Loaded as {records:,} claims + commits through `ClaimBatch`/`CommitBatch` of 1,000 into a fresh")
out(f"sidecar (sync=always): {extra['load']['ops_per_sec']:,.0f} claim+commit pairs/s,")
out(f"{extra['load_seconds']:.1f} s in all.")
out("")
out("| figure | value |")
out("|---|---:|")
out(f"| peak RSS of the sidecar while loading | {extra['peak_rss_kb'] / 1024:.1f} MiB |")
out(f"| RSS after restart and 2 s of claims | {extra['rss_after_restart_kb'] / 1024:.1f} MiB |")
out(f"| disk use after a clean stop | {extra['disk_bytes'] / 1024 / 1024:.1f} MiB |")
out(f"| disk bytes per live record | {extra['disk_bytes'] / records:,.0f} |")
out(f"| write-ahead log left at the `kill -9` (replayed at start) | {extra.get('log_bytes', 0) / 1024 / 1024:.1f} MiB |")
out(f"| start-up time after `kill -9` (exec to first answered Lookup, log replay included) | {extra['startup_seconds'] * 1000:,.0f} ms |")
out("")

out("## Targets of issue 12")
out("")


def verdict(ok):
    return "met" if ok else "**not met**"


def ratio(pair):
    return pair[0] / pair[1] if pair[0] and pair[1] else 0


claim64 = ratio((median("claim", 64, ALWAYS), median("claim", 64, NOOP)))
pairs64_redis = ratio((median("claim-commit", 64, ALWAYS), median("claim-commit", 64, "Redis appendfsync=always")))
batch4_redis = ratio((median("batch", 4, ALWAYS), median("batch", 4, "Redis appendfsync=always")))
batch4_pg = ratio((median("batch", 4, ALWAYS), median("batch", 4, "PostgreSQL synchronous_commit=on")))
p99_c16 = median("claim", 16, ALWAYS, "latency_us.p99")
rss_max = max(extra["peak_rss_kb"], extra["rss_after_restart_kb"]) / 1024
per_record = extra["disk_bytes"] / records
startup_ms = extra["startup_seconds"] * 1000
out("| target | measured | verdict |")
out("|---|---:|---|")
out(f"| durable Claim at c=64 ≥ 0.5 × no-op | {claim64:.2f}× | {verdict(claim64 >= 0.5)} |")
out(f"| Claim+Commit at c=64 ≥ 0.75 × Redis appendfsync=always | {pairs64_redis:.2f}× | {verdict(pairs64_redis >= 0.75)} |")
out(f"| ClaimBatch of 500 at c=4 ≥ 0.7 × Redis pipeline, appendfsync=always | {batch4_redis:.2f}× | {verdict(batch4_redis >= 0.7)} |")
out(f"| ClaimBatch of 500 at c=4 ≥ 1.5 × PostgreSQL INSERT … SELECT unnest (synchronous_commit=on) | {batch4_pg:.2f}× | {verdict(batch4_pg >= 1.5)} |")
out(f"| p99 Claim ≤ 2 ms at c=16 | {(p99_c16 or 0) / 1000:.2f} ms | {verdict(p99_c16 is not None and p99_c16 <= 2000)} |")
out(f"| peak RSS ≤ 128 MiB with {records:,} live records | {rss_max:.1f} MiB | {verdict(rss_max <= 128)} |")
out(f"| ≤ 300 disk bytes per live record | {per_record:,.0f} | {verdict(per_record <= 300)} |")
out(f"| start-up ≤ 1 s with {records:,} records | {startup_ms:,.0f} ms | {verdict(startup_ms <= 1000)} |")
out("")

out("## Targets of issue 26 (the write-ahead log)")
out("")
claim1_p50 = median("claim", 1, ALWAYS, "latency_us.p50")
redis1_p50 = median("claim", 1, "Redis appendfsync=always", "latency_us.p50")
p50_ratio = ratio((claim1_p50, redis1_p50))
pairs64_noop = ratio((median("claim-commit", 64, ALWAYS), median("claim-commit", 64, NOOP)))
out("| target | measured | verdict |")
out("|---|---:|---|")
out(f"| Claim c=1 p50 ≤ 1.3 × Redis appendfsync=always | {claim1_p50 or 0:,.0f} µs vs {redis1_p50 or 0:,.0f} µs = {p50_ratio:.2f}× | {verdict(p50_ratio and p50_ratio <= 1.3)} |")
out(f"| durable Claim at c=64 ≥ 0.55 × no-op | {claim64:.2f}× | {verdict(claim64 >= 0.55)} |")
out(f"| Claim+Commit at c=64 ≥ 0.55 × no-op pairs | {pairs64_noop:.2f}× | {verdict(pairs64_noop >= 0.55)} |")
out(f"| ClaimBatch of 500 at c=4 ≥ 0.9 × Redis pipeline, appendfsync=always | {batch4_redis:.2f}× | {verdict(batch4_redis >= 0.9)} |")
out(f"| peak RSS with {records:,} live records (reported; must not grow) | {rss_max:.1f} MiB | reported |")
out(f"| start-up ≤ 1 s with {records:,} records and the log left by a `kill -9` | {startup_ms:,.0f} ms | {verdict(startup_ms <= 1000)} |")
out("")

out("## Targets of issue 39 (the CPU of a claim)")
out("")
noop1_p50 = median("claim", 1, NOOP, "latency_us.p50")
sync_p50 = median("sync-floor", 1, "append+fdatasync", "latency_us.p50")
sync_runs = by_key.get(("sync-floor", 1, "append+fdatasync"), [])
floor = noop1_p50 + sync_p50 if noop1_p50 and sync_p50 else None
floor_ratio = ratio((claim1_p50, floor))
batch_ratios = {
    c: ratio((median("batch", c, ALWAYS), median("batch", c, "Redis appendfsync=always")))
    for c in concurrencies("batch")
}
if floor:
    out("The floor under a durable answer, measured in this run: the no-op server's Claim c=1 p50")
    out(f"({noop1_p50:,.0f} µs: gRPC on loopback) + a {sync_runs[0]['bytes']}-byte append to a preallocated file and its")
    out(f"`fdatasync` in the sidecars' directory, p50 of {sync_runs[0]['count']:,} (`dedupd-bench sync-floor`: {sync_p50:,.0f} µs)")
    out(f"= **{floor:,.0f} µs**.")
    floor_cell = f"{claim1_p50 or 0:,.0f} µs vs {floor:,.0f} µs = {floor_ratio:.2f}×"
else:
    out("This run has no `sync-floor` figures (a run from before `benches/compare.sh` took them).")
    floor_cell = "—"
out("")
out("| target | measured | verdict |")
out("|---|---:|---|")
out(f"| Claim c=1 p50 ≤ 1.2 × the floor | {floor_cell} | {verdict(floor_ratio and floor_ratio <= 1.2) if floor else '—'} |")
out(f"| durable Claim at c=64 ≥ 0.5 × no-op | {claim64:.2f}× | {verdict(claim64 >= 0.5)} |")
out(f"| Claim+Commit at c=64 ≥ 0.5 × no-op pairs | {pairs64_noop:.2f}× | {verdict(pairs64_noop >= 0.5)} |")
batch_cells = ", ".join(f"c={c} {r:.2f}×" for c, r in batch_ratios.items())
out(f"| ClaimBatch of 500 at c=4 ≥ 0.9 × Redis pipeline, appendfsync=always | {batch_cells} | {verdict(batch4_redis >= 0.9)} |")
out(f"| ≤ 300 disk bytes per record at {records:,} records | {per_record:,.0f} | {verdict(per_record <= 300)} |")
out(f"| start-up ≤ 1 s with {records:,} records | {startup_ms:,.0f} ms | {verdict(startup_ms <= 1000)} |")
out("")

generated = "\n".join(lines) + "\n"
# Keep the hand-written analysis that follows the generated part.
marker = "<!-- analysis: kept by benches/report.py -->"
analysis = ""
if os.path.exists(out_path):
    previous = open(out_path).read()
    if marker in previous:
        analysis = previous[previous.index(marker):]
open(out_path, "w").write(generated + ("\n" + analysis if analysis else ""))
