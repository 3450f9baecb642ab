"""A Kafka-shaped consumer loop with dedupd: each poll returns a batch of
records; the whole batch is claimed in one call (one disk sync), the new
ones are processed, the batch is committed in one call, then the offsets.

Works with any client whose poll returns records with a key and a value
(confluent-kafka, aiokafka, kafka-python, Redpanda, Event Hubs' Kafka face):
`process_batch` only needs the correlation ID and the payload of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import dedupd


@dataclass
class Record:
    correlation_id: str  # the producer's ID, e.g. a header or the key
    value: bytes


@dataclass
class BatchOutcome:
    processed: list[str]
    duplicates: list[str]
    #: Held by another consumer, or lost while processing: do not commit the
    #: offset past the first of these (seek back and poll them again).
    retry: list[str]


def process_batch(
    client: dedupd.Client,
    records: Sequence[Record],
    handle: Callable[[dedupd.Claim, Record], bytes],
) -> BatchOutcome:
    outcome = BatchOutcome([], [], [])
    claims = client.claim_many([record.correlation_id for record in records])
    done: list[tuple[dedupd.Claim, bytes]] = []
    failed: list[dedupd.Claim] = []
    for record, claimed in zip(records, claims):
        if isinstance(claimed, (dedupd.Stale, dedupd.FingerprintMismatch)):
            outcome.duplicates.append(record.correlation_id)  # skip, like a duplicate
        elif isinstance(claimed, dedupd.InProgress):
            outcome.retry.append(record.correlation_id)
        elif claimed.duplicate:
            outcome.duplicates.append(record.correlation_id)
        else:
            try:
                done.append((claimed, handle(claimed, record)))
            except Exception:
                failed.append(claimed)
                outcome.retry.append(record.correlation_id)
    if failed:
        client.release_many(failed)
    for (claim, _), result in zip(done, client.commit_many(done)):
        if isinstance(result, dedupd.LeaseLost):
            outcome.retry.append(claim.correlation_id)
        else:
            outcome.processed.append(claim.correlation_id)
    return outcome
