"""Turns benches/clients/run.sh's figures into the table and the plot of
BENCHMARKS.md's client section (issue 42).

    python report.py benches/results/clients.jsonl [docs/benchmarks/clients.png]

Prints the Markdown table (medians over rounds; the ratio is dedupd's
`process()` ÷ Powertools, events/s; "beyond" is process()'s p50 less the raw
stub's Claim+Commit p50, within each round, then the median). With a second
argument, also draws events/s per peer (matplotlib)."""

from __future__ import annotations

import collections
import json
import statistics
import sys
from typing import Dict, List, Tuple

PEERS = ("powertools", "dedupd", "raw")
LABELS = {"powertools": "Powertools + Redis", "dedupd": "dedupd process()", "raw": "raw stub Claim+Commit"}
SETTINGS = {
    "durable": "durable (dedupd --sync always; Redis appendfsync always)",
    "fast": "fast (dedupd --sync none; Redis appendfsync everysec)",
}

Case = Tuple[str, str, int]


def load(path: str) -> Dict[Case, Dict[str, List[dict]]]:
    cases: Dict[Case, Dict[str, List[dict]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    with open(path) as lines:
        for line in lines:
            if line.startswith("{"):
                row = json.loads(line)
                cases[(row["client"], row["setting"], row["concurrency"])][row["peer"]].append(row)
    return cases


def median(rows: List[dict], field: str) -> float:
    return statistics.median(row[field] for row in rows)


def table(cases: Dict[Case, Dict[str, List[dict]]]) -> str:
    out = [
        "| client | setting | concurrent | Powertools + Redis: events/s (p50 µs) | dedupd `process()` | raw stub Claim+Commit | `process()` ÷ Powertools | `process()` beyond its two calls: p50, CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (client, setting, concurrency), peers in sorted(cases.items()):
        cells = []
        for peer in PEERS:
            rows = peers.get(peer, [])
            cells.append(f"{median(rows, 'events_per_s'):,.0f} ({median(rows, 'p50_us'):,.0f})" if rows else "–")
        ratio = (
            f"{median(peers['dedupd'], 'events_per_s') / median(peers['powertools'], 'events_per_s'):.2f}×"
            if peers.get("dedupd") and peers.get("powertools")
            else "–"
        )
        beyond = "–"
        if peers.get("beyond"):
            row = peers["beyond"][0]
            beyond = f"{row['p50_us']:+.0f} µs, {row['cpu_us']:+.0f} µs"
        out.append(f"| {client} | {setting} | {concurrency} | {' | '.join(cells)} | {ratio} | {beyond} |")
    return "\n".join(out)


def plot(cases: Dict[Case, Dict[str, List[dict]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(cases)
    figure, axes = plt.subplots(figsize=(11, 4.5))
    width = 0.27
    for index, peer in enumerate(PEERS):
        values = [median(cases[key][peer], "events_per_s") if cases[key].get(peer) else 0 for key in keys]
        axes.bar([k + (index - 1) * width for k in range(len(keys))], values, width, label=LABELS[peer])
    axes.set_xticks(range(len(keys)))
    axes.set_xticklabels([f"{client}\n{setting}\n×{concurrency}" for client, setting, concurrency in keys], fontsize=8)
    axes.set_ylabel("events/s (median of rounds)")
    axes.set_title("The consumer loop: dedupd's clients against Powertools' idempotency on Redis")
    axes.legend()
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    cases = load(sys.argv[1])
    print(table(cases))
    if len(sys.argv) > 2:
        plot(cases, sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
