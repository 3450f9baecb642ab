"""The article's failure sequence against real brokers and a real database.

A consumer (consumer.py, a separate Python process) takes a payment event
from RabbitMQ or NATS JetStream, claims its correlation ID in dedupd, writes
a credit_transfers row in PostgreSQL, and is killed with SIGKILL before it
commits and acks. The broker redelivers to a NEW consumer process. Whatever
the crash point, the database ends with exactly one row per event.
"""

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import uuid

import psycopg
import pytest

HERE = pathlib.Path(__file__).resolve().parent
PG = os.environ.get("DEDUPD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="module", autouse=True)
def tables():
    with psycopg.connect(PG, autocommit=True) as db:
        # No unique constraint on purpose: a duplicate must be visible.
        db.execute("CREATE TABLE IF NOT EXISTS credit_transfers ("
                   " id BIGSERIAL PRIMARY KEY, correlation_id TEXT NOT NULL,"
                   " account TEXT NOT NULL, amount NUMERIC NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS link_status (link TEXT PRIMARY KEY, status TEXT NOT NULL)")


def rows(correlation_id):
    with psycopg.connect(PG) as db:
        return db.execute("SELECT count(*) FROM credit_transfers WHERE correlation_id = %s",
                          (correlation_id,)).fetchone()[0]


class Rabbit:
    def __init__(self):
        import pika

        self.queue = f"payments-{uuid.uuid4().hex[:8]}"
        self.connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", 5672))
        self.channel = self.connection.channel()
        self.channel.queue_declare(queue=self.queue, durable=True)
        self.args = ["--broker", "rabbitmq", "--queue", self.queue]

    def publish(self, event):
        import pika

        self.channel.basic_publish("", self.queue, json.dumps(event).encode(),
                                   pika.BasicProperties(message_id=uuid.uuid4().hex))

    def close(self):
        self.channel.queue_delete(self.queue)
        self.connection.close()


class Nats:
    def __init__(self):
        self.subject = f"payments.{uuid.uuid4().hex[:8]}"
        self.stream = "PAY_" + self.subject.split(".")[1]
        self.args = ["--broker", "nats", "--queue", self.subject, "--durable", "payments", "--ack-wait", "2"]
        asyncio.run(self._run(lambda js: js.add_stream(name=self.stream, subjects=[self.subject])))

    async def _run(self, action):
        import nats

        nc = await nats.connect("nats://127.0.0.1:4222")
        try:
            return await action(nc.jetstream())
        finally:
            await nc.close()

    def publish(self, event):
        # A fresh broker message ID each time, as a DLQ replay would get.
        headers = {"Nats-Msg-Id": uuid.uuid4().hex}
        asyncio.run(self._run(lambda js: js.publish(self.subject, json.dumps(event).encode(), headers=headers)))

    def close(self):
        asyncio.run(self._run(lambda js: js.delete_stream(self.stream)))


@pytest.fixture(params=["rabbitmq", "nats"])
def broker(request):
    broker = Rabbit() if request.param == "rabbitmq" else Nats()
    yield broker
    broker.close()


def consume(sidecar, broker, crash="none", max_messages=1):
    """Runs one consumer process; returns (exit code, its log events)."""
    command = [sys.executable, str(HERE / "consumer.py"), *broker.args, "--dedupd", sidecar,
               "--pg", PG, "--crash", crash, "--max-messages", str(max_messages), "--timeout", "45"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, events, done.stderr


def payment(correlation_id):
    return {"correlation_id": correlation_id, "type": "PaymentReceived", "account": "DE02-1234", "amount": "125.00"}


def test_killed_after_commit_before_ack_redelivery_is_duplicate(sidecar, broker):
    correlation_id = f"pay-{uuid.uuid4().hex}"
    broker.publish(payment(correlation_id))
    code, events, _ = consume(sidecar, broker, crash="after-commit")
    assert code == -9, events
    assert rows(correlation_id) == 1

    code, events, stderr = consume(sidecar, broker)
    assert code == 0, stderr
    kinds = [e["event"] for e in events]
    assert "duplicate" in kinds and "written" not in kinds, events
    assert rows(correlation_id) == 1


def test_killed_after_write_before_commit_next_claim_is_recovered(sidecar, broker):
    correlation_id = f"pay-{uuid.uuid4().hex}"
    broker.publish(payment(correlation_id))
    code, events, _ = consume(sidecar, broker, crash="after-write")
    assert code == -9, events
    assert rows(correlation_id) == 1

    code, events, stderr = consume(sidecar, broker)
    assert code == 0, stderr
    claimed = [e for e in events if e["event"] == "claimed"]
    assert claimed and claimed[-1]["recovered"] is True, events
    assert claimed[-1]["attempt"] == 2
    assert any(e["event"] == "already_written" for e in events), events
    assert rows(correlation_id) == 1, "the consumer checked its own table before redoing"


def test_dlq_replay_with_a_new_message_id_is_duplicate(sidecar, broker):
    correlation_id = f"pay-{uuid.uuid4().hex}"
    broker.publish(payment(correlation_id))
    assert consume(sidecar, broker)[0] == 0
    broker.publish(payment(correlation_id))  # same event, new broker message ID
    code, events, stderr = consume(sidecar, broker)
    assert code == 0, stderr
    assert [e["event"] for e in events if e["event"] in ("duplicate", "written")] == ["duplicate"]
    assert rows(correlation_id) == 1


def test_late_lower_sequence_is_stale_and_status_stays_failed(sidecar, broker):
    link = f"link-{uuid.uuid4().hex[:8]}"
    broker.publish({"correlation_id": f"{link}-s2", "type": "StatusUpdated", "link": link,
                    "status": "failed", "sequence": 2})
    broker.publish({"correlation_id": f"{link}-s1", "type": "StatusUpdated", "link": link,
                    "status": "degraded", "sequence": 1})
    code, events, stderr = consume(sidecar, broker, max_messages=2)
    assert code == 0, stderr
    assert [e["event"] for e in events if e["event"] in ("committed", "stale")] == ["committed", "stale"]
    with psycopg.connect(PG) as db:
        status = db.execute("SELECT status FROM link_status WHERE link = %s", (link,)).fetchone()[0]
    assert status == "failed"
