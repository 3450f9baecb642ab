"""The article's failure sequence across pods: three consumer processes,
each with its OWN dedupd sidecar (own port, own data directory), all on
`--store postgres`, fed by RabbitMQ. Consumers are SIGKILLed between the
business write and Commit and between Commit and the ack, one sidecar is
SIGKILLed and restarted mid-run, and PostgreSQL itself is restarted once.
Every redelivery that crosses pods is answered DUPLICATE or `recovered`,
each event has exactly one credit_transfers row, and no acknowledged commit
is lost.
"""

import json
import os
import pathlib
import subprocess
import tempfile
import time
import uuid

import pytest

from test_failure_sequence import PG, Rabbit, consume, payment, rows, tables  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[3]
BINARY = os.environ.get("DEDUPD_BIN", str(ROOT / "target" / "debug" / "dedupd"))
STORE_URL = os.environ.get("DEDUPD_TEST_STORE_URL", "postgres://postgres@127.0.0.1:5432/test")


class Pod:
    """One dedupd sidecar on the shared PostgreSQL store."""

    def __init__(self, name, schema, workdir):
        self.name, self.schema, self.workdir = name, schema, pathlib.Path(workdir)
        self.process = None
        self.start()

    def start(self):
        ready = self.workdir / f"{self.name}.ready"
        ready.unlink(missing_ok=True)  # a killed sidecar leaves its old one
        self.process = subprocess.Popen(
            [BINARY, "--store", "postgres", "--store-url", STORE_URL, "--store-schema", self.schema,
             "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--log-format", "json",
             "--data-dir", str(self.workdir / self.name), "--ready-file", str(ready)],
            stderr=open(self.workdir / f"{self.name}.log", "ab"),
        )
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert self.process.poll() is None, f"{self.name} exited with {self.process.returncode}"
            assert time.monotonic() < deadline, f"{self.name} was not ready within 20 s"
            time.sleep(0.01)
        self.address = json.loads(ready.read_text())["grpc"][0]
        self.until_serving()

    def until_serving(self, seconds=30):
        deadline = time.monotonic() + seconds
        while subprocess.run([BINARY, "health", "--addr", self.address], capture_output=True,
                             timeout=10).returncode != 0:
            assert time.monotonic() < deadline, f"{self.name} not SERVING within {seconds} s"
            time.sleep(0.1)

    def kill_9(self):
        self.process.kill()
        self.process.wait()

    def stop(self):
        self.process.terminate()
        assert self.process.wait(timeout=30) == 0, f"{self.name} exits 0 on SIGTERM"

    def lookup(self, correlation_id):
        done = subprocess.run([BINARY, "lookup", correlation_id, "-n", "payments", "--addr", self.address,
                               "--json"], capture_output=True, text=True, timeout=30)
        return json.loads(done.stdout)


@pytest.fixture()
def pods():
    schema = f"dedupd_pods_{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory() as workdir:
        started = [Pod(f"pod-{i}", schema, workdir) for i in range(3)]
        yield started
        for pod in started:
            pod.stop()
    import psycopg

    with psycopg.connect(PG, autocommit=True) as db:
        db.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def restart_postgres():
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
                   check=True, timeout=120)


def events_of(events, kind):
    return [e for e in events if e["event"] == kind]


def test_redeliveries_across_pods_never_double_process(pods):
    broker = Rabbit()
    try:
        ids = [f"pay-{uuid.uuid4().hex}" for _ in range(6)]
        for correlation_id in ids:
            broker.publish(payment(correlation_id))

        # Pod 0's consumer writes the first event and dies before Commit.
        code, events, _ = consume(pods[0].address, broker, crash="after-write")
        assert code == -9, events
        first = ids[0]
        assert rows(first) == 1

        # The broker redelivers it to pod 1's consumer: IN_PROGRESS until the
        # dead holder's lease ends, then CLAIMED recovered (attempt 2) on
        # another pod; the consumer finds its row, commits, and dies before
        # the ack.
        code, events, _ = consume(pods[1].address, broker, crash="after-commit")
        assert code == -9, events
        claimed = events_of(events, "claimed")
        assert claimed and claimed[-1]["correlation_id"] == first, events
        assert claimed[-1]["recovered"] is True and claimed[-1]["attempt"] == 2, events
        assert events_of(events, "already_written"), events
        assert rows(first) == 1

        # Pod 2's sidecar is killed and started again; PostgreSQL restarts.
        pods[2].kill_9()
        pods[2].start()
        restart_postgres()
        for pod in pods:
            pod.until_serving()

        # The rest drains through pods 2 and 0: the first event (committed on
        # pod 1, never acked) is DUPLICATE on pod 2; the others are written once.
        code, events, stderr = consume(pods[2].address, broker, max_messages=3)
        assert code == 0, stderr
        assert events_of(events, "duplicate")[0]["correlation_id"] == first, events
        code, events, stderr = consume(pods[0].address, broker, max_messages=3)
        assert code == 0, stderr

        for correlation_id in ids:
            assert rows(correlation_id) == 1, correlation_id
            # No acknowledged commit lost, whichever pod is asked.
            for pod in pods:
                record = pod.lookup(correlation_id)
                assert record["found"] is True and record["record"]["state"] == "COMMITTED", record
    finally:
        broker.close()
