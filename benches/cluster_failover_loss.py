#!/usr/bin/env python3
"""A report, not a test: what a Redis Cluster failover loses WITHOUT
`--store-replicas`.

Without it a primary answers a Commit before any replica has it, so a
failover right after may lose it, and the redelivery is then processed
again. A burst of commits through one sidecar, the primary of the last one
SIGKILLed at once and its replica promoted: the lost ones are counted and
printed. Whether any is lost depends on how far replication lagged at the
kill (often none on an idle loopback), which is why this is a report and
not a test. What it does check: only the failed-over primary's records can
be gone, and every record kept is intact. (With `--store-replicas 1` the
across-pods test in examples/python/failure_sequence loses none, asserted.)

    DEDUPD_BIN=target/debug/dedupd python3 benches/cluster_failover_loss.py [--commits 300]

Needs redis-server and redis-cli on PATH, and the Python client
(pip install ./clients/python).
"""

import argparse
import pathlib
import sys
import tempfile
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples/python/failure_sequence"))

from test_across_pods import OwnRedisCluster, Pod  # noqa: E402


def crc16(data):
    """CRC-16/XMODEM, as Redis Cluster hashes keys to slots."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def key_slot(key):
    """The slot of `key`, hash tags included (CLUSTER KEYSLOT, without a
    redis-cli per key)."""
    raw = key.encode()
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1:end]
    return crc16(raw) % 16384


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=300)
    args = parser.parse_args()
    import dedupd

    with tempfile.TemporaryDirectory() as workdir:
        cluster = OwnRedisCluster(workdir)
        try:
            schema = f"dedupd_loss_{uuid.uuid4().hex[:12]}"
            pod = Pod("pod", "redis", cluster.url, schema, workdir)
            ids = [f"pay-{uuid.uuid4().hex}" for _ in range(args.commits)]
            client = dedupd.Client(pod.address, namespace="payments")
            for correlation_id in ids:
                with client.claim(correlation_id) as claim:
                    assert not claim.duplicate
                    client.commit(claim, b"done")

            def key_of(correlation_id):
                return f"{schema}:r:payments/{correlation_id}"

            killed = cluster.primary_of(key_of(ids[-1]))
            slots = cluster.slots_of(killed)
            on_killed = [i for i in ids if key_slot(key_of(i)) in slots]
            cluster.fail_over(key_of(ids[-1]))
            pod.until_serving()
            lost = []
            for correlation_id in ids:
                record = pod.lookup(correlation_id)
                if record["found"]:
                    assert record["record"]["state"] == "COMMITTED", record
                else:
                    lost.append(correlation_id)
            assert set(lost) <= set(on_killed), "records lost from a primary that never failed"
            print(f"without --store-replicas: {len(lost)} of {len(on_killed)} acknowledged commits "
                  f"on the failed-over primary lost ({len(ids)} in all)")
            pod.stop()
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
