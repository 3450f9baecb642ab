"""A payment consumer behind RabbitMQ or NATS JetStream, deduplicated by
dedupd, writing credit transfers to PostgreSQL: the article's failure
sequence, for real.

    python consumer.py --broker rabbitmq --queue Q --crash before-commit ...

It takes one message at a time, claims the event's *producer* correlation
ID (from the message body, never the broker's message ID), writes the
business row, commits, then acknowledges. `--crash` kills the process with
SIGKILL at a chosen point, like a node taken offline mid-flight:
  after-write   after the business write, before Commit and the ack
  after-commit  after Commit, before the ack
It exits 0 after --max-messages messages were acknowledged.
"""

import argparse
import asyncio
import json
import os
import signal
import time

import dedupd
import psycopg


def log(what, **fields):
    print(json.dumps({"pid": os.getpid(), "event": what, **fields}), flush=True)


def crash(point, wanted):
    if point == wanted:
        log("crashing", at=point)
        os.kill(os.getpid(), signal.SIGKILL)


class Handler:
    """What to do with one event; returns True when the message may be acked,
    or a delay in seconds after which it should be redelivered."""

    def __init__(self, args):
        self.args = args
        self.dedup = dedupd.Client(args.dedupd, namespace="payments", owner=f"consumer-{os.getpid()}",
                                   lease=args.lease_seconds)
        self.db = psycopg.connect(args.pg, autocommit=True)

    def handle(self, body: bytes):
        event = json.loads(body)
        correlation_id = event["correlation_id"]
        fields = {"event_type": event["type"]}
        if "sequence" in event:
            fields.update(ordering_key=event["link"], sequence=event["sequence"])
        try:
            with self.dedup.claim(correlation_id, **fields) as claim:
                if claim.duplicate:
                    log("duplicate", correlation_id=correlation_id)
                    return True
                log("claimed", correlation_id=correlation_id, attempt=claim.attempt, recovered=claim.recovered)
                self.write(event, claim)
                crash(self.args.crash, "after-write")
                self.dedup.commit(claim, b"done")
                log("committed", correlation_id=correlation_id)
                crash(self.args.crash, "after-commit")
                return True
        except dedupd.InProgress as busy:
            log("in_progress", correlation_id=correlation_id, retry_after=busy.retry_after)
            return max(busy.retry_after, 0.2)
        except dedupd.Stale as stale:
            log("stale", correlation_id=correlation_id, highest=stale.highest_committed_sequence)
            return True
        except dedupd.Unavailable as away:
            # The sidecar or its store is away for longer than the client's
            # retries (a PostgreSQL restart, a sidecar restart): redeliver
            # later, never process blind.
            log("unavailable", correlation_id=correlation_id, detail=str(away))
            return max(away.retry_after, 0.5)

    def write(self, event, claim):
        if event["type"] == "StatusUpdated":
            self.db.execute(
                "INSERT INTO link_status (link, status) VALUES (%s, %s) "
                "ON CONFLICT (link) DO UPDATE SET status = EXCLUDED.status",
                (event["link"], event["status"]),
            )
            return
        # A recovered claim: the previous holder may have written already.
        if claim.recovered:
            exists = self.db.execute(
                "SELECT 1 FROM credit_transfers WHERE correlation_id = %s", (event["correlation_id"],)
            ).fetchone()
            if exists:
                log("already_written", correlation_id=event["correlation_id"])
                return
        self.db.execute(
            "INSERT INTO credit_transfers (correlation_id, account, amount) VALUES (%s, %s, %s)",
            (event["correlation_id"], event["account"], event["amount"]),
        )
        log("written", correlation_id=event["correlation_id"])


def run_rabbitmq(args, handler):
    import pika

    connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", 5672))
    channel = connection.channel()
    channel.queue_declare(queue=args.queue, durable=True)
    channel.basic_qos(prefetch_count=1)
    acked = 0
    deadline = time.monotonic() + args.timeout
    for method, _props, body in channel.consume(args.queue, inactivity_timeout=1):
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        if method is None:
            continue
        verdict = handler.handle(body)
        if verdict is True:
            channel.basic_ack(method.delivery_tag)
            acked += 1
            if acked >= args.max_messages:
                break
        else:
            time.sleep(verdict)
            channel.basic_nack(method.delivery_tag, requeue=True)
    channel.cancel()
    connection.close()


async def run_nats(args, handler):
    import nats
    from nats.js.api import ConsumerConfig

    nc = await nats.connect("nats://127.0.0.1:4222")
    js = nc.jetstream()
    subscription = await js.pull_subscribe(
        args.queue, durable=args.durable, config=ConsumerConfig(ack_wait=args.ack_wait)
    )
    acked = 0
    deadline = time.monotonic() + args.timeout
    while acked < args.max_messages:
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        try:
            messages = await subscription.fetch(1, timeout=1)
        except nats.errors.TimeoutError:
            continue
        for message in messages:
            verdict = handler.handle(message.data)
            if verdict is True:
                await message.ack()
                acked += 1
            else:
                await message.nak(delay=verdict)
    await nc.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", choices=["rabbitmq", "nats"], required=True)
    parser.add_argument("--queue", required=True, help="RabbitMQ queue or NATS subject")
    parser.add_argument("--durable", default="payments", help="NATS durable consumer name")
    parser.add_argument("--ack-wait", type=float, default=2.0, help="NATS AckWait, seconds")
    parser.add_argument("--dedupd", required=True)
    parser.add_argument("--pg", required=True)
    parser.add_argument("--crash", choices=["none", "after-write", "after-commit"], default="none")
    parser.add_argument("--lease-seconds", type=float, default=2.0)
    parser.add_argument("--max-messages", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args()
    handler = Handler(args)
    if args.broker == "rabbitmq":
        run_rabbitmq(args, handler)
    else:
        asyncio.run(run_nats(args, handler))
    log("done")


if __name__ == "__main__":
    main()
