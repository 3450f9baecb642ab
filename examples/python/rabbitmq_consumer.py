"""A RabbitMQ consumer loop with dedupd (pika): at-least-once delivery in,
effectively-once processing out.

    python rabbitmq_consumer.py QUEUE            # DEDUPD_ADDR names the sidecar

Each message carries the producer's correlation ID in its `correlation_id`
property (never the broker's delivery tag: a redelivery gets a new one).
"""

from __future__ import annotations

import sys
from typing import Callable

import dedupd
import pika
from pika.adapters.blocking_connection import BlockingChannel


def consume(
    channel: BlockingChannel,
    queue: str,
    client: dedupd.Client,
    handle: Callable[[dedupd.Claim, bytes], bytes],
    max_messages: int | None = None,
    idle_timeout: float = 1.0,
) -> int:
    """Consumes until `max_messages` were acknowledged (or the queue stays
    idle for `idle_timeout`); returns how many were."""
    channel.basic_qos(prefetch_count=16)
    acknowledged = 0
    for method, properties, body in channel.consume(queue, inactivity_timeout=idle_timeout):
        if method is None:
            break  # Idle: a real service would keep waiting.
        correlation_id = properties.correlation_id
        if not correlation_id:
            # Nothing to deduplicate on: park it for a human (dead-letter).
            channel.basic_reject(method.delivery_tag, requeue=False)
            continue
        try:
            client.process(correlation_id, lambda claim: handle(claim, body), event_type=properties.type or "")
        except (dedupd.InProgress, dedupd.Unavailable):
            # Another consumer is on it, or the sidecar is away: back to the queue.
            channel.basic_nack(method.delivery_tag, requeue=True)
            continue
        except (dedupd.Stale, dedupd.FingerprintMismatch):
            # Older than what was applied, or an ID reused for other content:
            # acknowledge without processing (alert on the second).
            channel.basic_ack(method.delivery_tag)
            continue
        # Processed now, or a duplicate of one processed before: both done.
        channel.basic_ack(method.delivery_tag)
        acknowledged += 1
        if max_messages is not None and acknowledged >= max_messages:
            break
    channel.cancel()
    return acknowledged


if __name__ == "__main__":
    connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", 5672))
    with dedupd.Client(namespace="orders") as dedup:
        count = consume(connection.channel(), sys.argv[1], dedup, lambda claim, body: print(body.decode()) or b"")
    print(f"{count} messages handled")
