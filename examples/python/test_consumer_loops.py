"""The consumer-loop examples against the real sidecar (and, for RabbitMQ,
the machine's broker on 127.0.0.1:5672)."""

from __future__ import annotations

import uuid

import dedupd
import pika

from kafka_batches import Record, process_batch
from rabbitmq_consumer import consume


def test_rabbitmq_redeliveries_are_handled_once(sidecar):
    queue = f"dedupd-example-{uuid.uuid4().hex[:8]}"
    connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", 5672))
    channel = connection.channel()
    channel.queue_declare(queue=queue, auto_delete=True)
    # Five deliveries of three events: the producer retried two of them.
    for correlation_id in ["order-1", "order-2", "order-1", "order-3", "order-2"]:
        channel.basic_publish("", queue, f"body of {correlation_id}".encode(),
                              pika.BasicProperties(correlation_id=correlation_id, type="OrderPlaced"))
    handled = []
    with dedupd.Client(sidecar, namespace="orders") as client:
        acknowledged = consume(channel, queue, client,
                               lambda claim, body: handled.append(body) or b"ok", max_messages=5)
    connection.close()
    assert acknowledged == 5, "duplicates are acknowledged too"
    assert sorted(handled) == [b"body of order-1", b"body of order-2", b"body of order-3"]


def test_kafka_batches_process_each_record_once(sidecar):
    handled = []

    def handle(claim, record):
        if record.value == b"poison":
            raise ValueError("cannot handle this one yet")
        handled.append(record.correlation_id)
        return b"ok"

    with dedupd.Client(sidecar, namespace="kafka") as client:
        first = process_batch(client, [Record("k-1", b"a"), Record("k-2", b"poison"), Record("k-3", b"c")], handle)
        assert first.processed == ["k-1", "k-3"] and first.retry == ["k-2"]
        # The next poll overlaps the first (the offset was committed only up to k-1).
        second = process_batch(client, [Record("k-2", b"b"), Record("k-3", b"c"), Record("k-4", b"d")], handle)
        assert second.processed == ["k-2", "k-4"] and second.duplicates == ["k-3"] and second.retry == []
    assert handled == ["k-1", "k-3", "k-2", "k-4"]
