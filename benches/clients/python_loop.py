"""The consumer loop a Python team times before adopting dedupd: the same
trivial handler, fresh IDs, run through

- `powertools`: AWS Powertools' `idempotent_function` on its Redis
  persistence layer (what the team would otherwise use);
- `dedupd`: `dedupd.Client.process()`;
- `raw`: grpcio's generated stub making the same Claim and Commit by hand,
  nothing else: the floor `process()` adds its own cost to.

Peers alternate within each round, so they share the machine's state.
Every event is checked: its answer came back.
Prints one JSON line per peer and round (events/s, p50 and p99 of one
event), then a table of medians. Run by benches/clients/run.sh, which
starts the servers.

    python python_loop.py --dedupd 127.0.0.1:PORT --redis-port PORT \
        --events 2000 --threads 1 --rounds 3 --setting durable
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
import warnings
from typing import Callable, Dict, List

import grpc

import dedupd
from dedupd._proto.dedup.v1 import dedup_pb2 as pb
from dedupd._proto.dedup.v1 import dedup_pb2_grpc as pb_grpc

Loop = Callable[[str], bytes]


class _LambdaContext:
    @staticmethod
    def get_remaining_time_in_millis() -> int:
        return 300_000


def powertools_loop(redis_port: int) -> Loop:
    import redis
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import CachePersistenceLayer

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    # Its cache layer with a plain redis-py client, as its docs show (the
    # older RedisCachePersistenceLayer is deprecated and defaults to TLS).
    persistence = CachePersistenceLayer(client=redis.Redis(host="127.0.0.1", port=redis_port))
    config = IdempotencyConfig(event_key_jmespath="id")
    # What Lambda would hand it (outside Lambda it warns on every call that
    # it cannot tell the time left, and a warning per event is not measured).
    config.register_lambda_context(_LambdaContext())

    @idempotent_function(data_keyword_argument="event", persistence_store=persistence, config=config)
    def handle(event: Dict[str, str]) -> Dict[str, str]:
        return {"done": event["id"]}

    def one(event_id: str) -> bytes:
        return handle(event={"id": event_id})["done"].encode()

    return one


def dedupd_loop(address: str) -> Loop:
    client = dedupd.Client(address, namespace="bench")

    def one(event_id: str) -> bytes:
        return client.process(event_id, lambda claim: event_id)

    return one


def raw_loop(address: str) -> Loop:
    """Claim and Commit through the generated stub, with the same fields
    the client sends (a lease, a request ID): no renewal, no retry."""
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.ClaimAndCommitStub(channel)  # type: ignore[no-untyped-call]

    def one(event_id: str) -> bytes:
        request = pb.ClaimRequest(namespace="bench", correlation_id=event_id, request_id=uuid.uuid4().hex)
        request.lease_ttl.seconds = 30
        claimed = stub.Claim(request, timeout=10)
        if claimed.outcome != pb.CLAIM_OUTCOME_CLAIMED:
            raise AssertionError(f"{event_id}: {claimed.outcome}")
        committed = stub.Commit(
            pb.CommitRequest(
                namespace=claimed.record.namespace,
                correlation_id=event_id,
                lease_token=claimed.lease_token,
                response=event_id.encode(),
            ),
            timeout=10,
        )
        return bytes(committed.record.response)

    return one


def run(loop: Loop, events: int, threads: int) -> Dict[str, float]:
    """`events` fresh IDs over `threads` threads, each its share in turn;
    events/s over the wall time, and the latency of one event."""
    prefix = uuid.uuid4().hex[:12]
    share = events // threads
    latencies: List[List[float]] = [[] for _ in range(threads)]
    failures: List[BaseException] = []
    start_line = threading.Barrier(threads + 1)

    def worker(index: int) -> None:
        mine = latencies[index]
        ids = [f"{prefix}-{index}-{n}" for n in range(share)]
        start_line.wait()
        try:
            for event_id in ids:
                began = time.perf_counter()
                answer = loop(event_id)
                mine.append(time.perf_counter() - began)
                if answer != event_id.encode():
                    raise AssertionError(f"{event_id}: answered {answer!r}")
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    start_line.wait()
    began = time.perf_counter()
    cpu_began = time.process_time()
    for thread in workers:
        thread.join()
    elapsed = time.perf_counter() - began
    cpu = time.process_time() - cpu_began
    if failures:
        raise failures[0]
    every = sorted(latency for mine in latencies for latency in mine)
    return {
        "events": len(every),
        "events_per_s": len(every) / elapsed,
        "p50_us": every[len(every) // 2] * 1e6,
        "p99_us": every[int(len(every) * 0.99)] * 1e6,
        # This process's CPU per event, gRPC's own threads included.
        "cpu_us": cpu / len(every) * 1e6,
    }


def beyond(ours: Loop, raw: Loop, events: int) -> Dict[str, float]:
    """What `process()` costs beyond its two calls, measured pairwise: the
    two loops alternate event by event on one thread, so both see the same
    moments of the machine; the difference of their p50 latencies, and of
    their mean CPU on this thread per event (gRPC's own threads do the same
    work for both)."""
    prefix = uuid.uuid4().hex[:12]
    latency: Dict[str, List[float]] = {"ours": [], "raw": []}
    cpu: Dict[str, List[float]] = {"ours": [], "raw": []}
    for n in range(events):
        for name, loop in (("ours", ours), ("raw", raw)) if n % 2 else (("raw", raw), ("ours", ours)):
            event_id = f"{prefix}-{name}-{n}"
            began, cpu_began = time.perf_counter(), time.thread_time()
            loop(event_id)
            cpu[name].append(time.thread_time() - cpu_began)
            latency[name].append(time.perf_counter() - began)
    return {
        "p50_us": (statistics.median(latency["ours"]) - statistics.median(latency["raw"])) * 1e6,
        "cpu_us": (statistics.fmean(cpu["ours"]) - statistics.fmean(cpu["raw"])) * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dedupd", required=True)
    parser.add_argument("--redis-port", type=int, required=True)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setting", default="durable", help="a label: durable or fast")
    parser.add_argument("--peers", default="powertools,dedupd,raw")
    args = parser.parse_args()

    makers = {
        "powertools": lambda: powertools_loop(args.redis_port),
        "dedupd": lambda: dedupd_loop(args.dedupd),
        "raw": lambda: raw_loop(args.dedupd),
    }
    peers = {name: makers[name]() for name in args.peers.split(",")}
    # Warm each peer (connections, imports) before anything is timed.
    for loop in peers.values():
        run(loop, min(args.events, 200 * args.threads), args.threads)
    figures: Dict[str, List[Dict[str, float]]] = {name: [] for name in peers}
    for round_ in range(args.rounds):
        for name, loop in peers.items():
            result = run(loop, args.events, args.threads)
            figures[name].append(result)
            line = {"client": "python", "peer": name, "setting": args.setting, "concurrency": args.threads}
            print(json.dumps({**line, "round": round_, **{k: round(v, 1) for k, v in result.items()}}))
    print(f"# python, {args.setting}, {args.threads} thread(s), {args.events} events, median of {args.rounds}:", file=sys.stderr)
    for name, results in figures.items():
        rate = statistics.median(r["events_per_s"] for r in results)
        p50 = statistics.median(r["p50_us"] for r in results)
        print(f"#   {name:<11} {rate:8.0f} events/s   p50 {p50:7.0f} us", file=sys.stderr)
    if "dedupd" in peers and "raw" in peers and args.threads == 1:
        extra = beyond(peers["dedupd"], peers["raw"], args.events)
        line = {"client": "python", "peer": "beyond", "setting": args.setting, "concurrency": 1}
        print(json.dumps({**line, **{k: round(v, 1) for k, v in extra.items()}}))
        print(
            f"#   process() beyond its two calls (interleaved): {extra['p50_us']:+.0f} us p50, "
            f"{extra['cpu_us']:+.0f} us CPU",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
