"""What the sync and asyncio clients share: the exceptions, the `Claim`, the
requests they build and how an answer becomes a result or an exception.
Transport (channels, retries, threads or tasks) lives in the clients."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import grpc
from google.protobuf import duration_pb2

from dedupd._proto.dedup.v1 import dedup_pb2 as pb

#: What a handler may return: cached by Commit and handed to duplicates.
Result = Union[bytes, str, None]


class DedupError(Exception):
    """Base of every error this package raises. `code` is the gRPC status
    code when the server answered with one."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        self.code = code


class InProgress(DedupError):
    """Another consumer holds a live lease: do not process; redeliver (nack)
    or retry after `retry_after` seconds."""

    def __init__(self, correlation_id: str, retry_after: float) -> None:
        super().__init__(f"{correlation_id!r} is in progress elsewhere; retry after {retry_after:.3f}s")
        self.correlation_id = correlation_id
        self.retry_after = retry_after


class Stale(DedupError):
    """An event of the same ordering key with a sequence at least as high was
    already committed: acknowledge this one and skip it."""

    def __init__(self, correlation_id: str, highest_committed_sequence: int) -> None:
        super().__init__(
            f"{correlation_id!r} is stale: sequence {highest_committed_sequence} was already committed"
        )
        self.correlation_id = correlation_id
        self.highest_committed_sequence = highest_committed_sequence


class FingerprintMismatch(DedupError):
    """The correlation ID was seen with another payload: the producer reused
    an ID for other content. Do not process; alert."""

    def __init__(self, correlation_id: str, existing_fingerprint: str) -> None:
        super().__init__(
            f"{correlation_id!r} was claimed before with another payload fingerprint ({existing_fingerprint!r})"
        )
        self.correlation_id = correlation_id
        self.existing_fingerprint = existing_fingerprint


class LeaseLost(DedupError):
    """This claim's lease no longer holds the key (it expired and someone
    else claimed, or it was released): the work must not be committed."""


class ResponseErased(DedupError):
    """The event was processed before, but its stored answer was erased (the
    key that sealed it was destroyed): acknowledge the message and do not
    process it again; the answer itself cannot be had."""

    def __init__(self, correlation_id: str) -> None:
        super().__init__(f"{correlation_id!r} was processed, but its stored answer was erased")
        self.correlation_id = correlation_id


class Unavailable(DedupError):
    """The sidecar (or its store) could not answer, after the retries: the
    call is safe to make again; wait `retry_after` seconds first. Leave the
    message unacknowledged so the broker redelivers it."""

    def __init__(self, message: str, code: grpc.StatusCode, retry_after: float) -> None:
        super().__init__(message, code)
        self.retry_after = retry_after


def replayed(claim: "Claim") -> bytes:
    """A duplicate's stored answer, for `process`; `ResponseErased` when it
    was erased, rather than an empty answer the caller would take for the
    real one."""
    if claim.response_erased:
        raise ResponseErased(claim.correlation_id)
    return claim.cached_response


@dataclass
class Claim:
    """A claim: `duplicate` says the event was already processed (then
    `cached_response` holds what the first commit stored); otherwise this
    consumer holds the key until it commits or releases."""

    namespace: str
    correlation_id: str
    lease_token: str
    #: Pass it to the business write so a zombie holder's write is refused.
    fencing_token: int
    attempt: int
    #: A previous holder died without committing: its business write may or
    #: may not have happened, so check before redoing it.
    recovered: bool
    duplicate: bool = False
    cached_response: bytes = b""
    #: A duplicate whose stored response was sealed with an encryption key
    #: since destroyed (declared erased): `cached_response` is empty.
    response_erased: bool = False
    #: Set once Commit succeeded (or the claim was released).
    settled: bool = field(default=False, repr=False)
    #: Set by the background renewal when the server refused to renew.
    lease_lost: bool = field(default=False, repr=False)


@dataclass(frozen=True)
class ClaimFields:
    """Optional fields of a Claim (see dedup.proto's ClaimRequest)."""

    event_type: str = ""
    payload_fingerprint: str = ""
    ordering_key: str = ""
    sequence: Optional[int] = None
    retention: Optional[float] = None


def duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(round(seconds * 1e9)))
    return value


def as_bytes(result: Result) -> bytes:
    if result is None:
        return b""
    if isinstance(result, str):
        return result.encode()
    if isinstance(result, (bytes, bytearray, memoryview)):
        return bytes(result)
    raise TypeError(f"a handler's result must be bytes, str or None, not {type(result).__name__}")


@dataclass(frozen=True)
class Settings:
    """A client's defaults for every claim."""

    namespace: str = ""
    owner: str = ""
    consumer_version: str = ""
    lease: float = 30.0


def claim_request(settings: Settings, correlation_id: str, fields: ClaimFields) -> pb.ClaimRequest:
    request = pb.ClaimRequest(
        namespace=settings.namespace,
        correlation_id=correlation_id,
        owner=settings.owner,
        consumer_version=settings.consumer_version,
        lease_ttl=duration(settings.lease),
        event_type=fields.event_type,
        payload_fingerprint=fields.payload_fingerprint,
        ordering_key=fields.ordering_key,
        # One per delivery: a retried Claim whose answer was lost gets the
        # same claim back instead of IN_PROGRESS.
        request_id=uuid.uuid4().hex,
    )
    if fields.sequence is not None:
        request.sequence = fields.sequence
    if fields.retention is not None:
        request.retention.CopyFrom(duration(fields.retention))
    return request


def claim_result(
    correlation_id: str, response: pb.ClaimResponse
) -> Union[Claim, InProgress, Stale, FingerprintMismatch]:
    """The claim an answer grants (or shows as a duplicate), or the exception
    to raise for the other outcomes."""
    outcome = response.outcome
    record = response.record
    if outcome in (pb.CLAIM_OUTCOME_CLAIMED, pb.CLAIM_OUTCOME_DUPLICATE):
        duplicate = outcome == pb.CLAIM_OUTCOME_DUPLICATE
        return Claim(
            # The record names the namespace the server used (its default
            # when ours is empty).
            namespace=record.namespace,
            correlation_id=correlation_id,
            lease_token=response.lease_token,
            fencing_token=response.fencing_token,
            attempt=response.attempt if not duplicate else record.attempt,
            recovered=response.recovered,
            duplicate=duplicate,
            cached_response=record.response if duplicate else b"",
            response_erased=duplicate and record.response_erased,
            settled=duplicate,
        )
    if outcome == pb.CLAIM_OUTCOME_IN_PROGRESS:
        return InProgress(correlation_id, response.retry_after.ToNanoseconds() / 1e9)
    if outcome == pb.CLAIM_OUTCOME_STALE:
        return Stale(correlation_id, response.highest_committed_sequence)
    if outcome == pb.CLAIM_OUTCOME_FINGERPRINT_MISMATCH:
        return FingerprintMismatch(correlation_id, record.payload_fingerprint)
    raise DedupError(f"unknown claim outcome {outcome} for {correlation_id!r}: is the client older than the server?")


def commit_request(claim: Claim, response: Result, retention: Optional[float] = None) -> pb.CommitRequest:
    request = pb.CommitRequest(
        namespace=claim.namespace,
        correlation_id=claim.correlation_id,
        lease_token=claim.lease_token,
        response=as_bytes(response),
    )
    if retention is not None:
        request.retention.CopyFrom(duration(retention))
    return request


def release_request(claim: Claim) -> pb.ReleaseRequest:
    return pb.ReleaseRequest(
        namespace=claim.namespace, correlation_id=claim.correlation_id, lease_token=claim.lease_token
    )


def renew_request(claim: Claim, settings: Settings) -> pb.RenewRequest:
    return pb.RenewRequest(
        namespace=claim.namespace,
        correlation_id=claim.correlation_id,
        lease_token=claim.lease_token,
        lease_ttl=duration(settings.lease),
    )


def check_claimable(claim: Claim, action: str) -> None:
    if claim.duplicate:
        raise DedupError(f"{claim.correlation_id!r} is a duplicate: there is nothing to {action}")


def lease_lost(claim: Claim, detail: str) -> LeaseLost:
    return LeaseLost(
        f"the lease on {claim.correlation_id!r} no longer holds the key: {detail}",
        grpc.StatusCode.FAILED_PRECONDITION,
    )


#: Codes after which the same call may simply be made again later.
RETRY_LATER = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


def translate(error: grpc.RpcError, method: str, retry_after: float) -> DedupError:
    """The exception for a failed call (the server's message kept)."""
    # grpc.Call and grpc.aio.AioRpcError both have code() and details().
    code_of = getattr(error, "code", None)
    details_of = getattr(error, "details", None)
    code = code_of() if callable(code_of) else grpc.StatusCode.UNKNOWN
    details = (details_of() if callable(details_of) else None) or str(error)
    message = f"{method}: {code.name}: {details}"
    if code in RETRY_LATER:
        return Unavailable(message, code, retry_after)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return LeaseLost(message, code)
    return DedupError(message, code)


def claim_batch_request(settings: Settings, correlation_ids: "Sequence[str]", fields: ClaimFields) -> pb.ClaimBatchRequest:
    return pb.ClaimBatchRequest(items=[claim_request(settings, id_, fields) for id_ in correlation_ids])


def claim_batch_results(
    correlation_ids: "Sequence[str]", response: pb.ClaimBatchResponse
) -> "List[Union[Claim, InProgress, Stale, FingerprintMismatch]]":
    return [claim_result(id_, result) for id_, result in zip(correlation_ids, response.results)]


def commit_batch_request(commits: "Sequence[Tuple[Claim, Result]]") -> pb.CommitBatchRequest:
    for claim, _ in commits:
        check_claimable(claim, "commit")
    return pb.CommitBatchRequest(items=[commit_request(claim, result) for claim, result in commits])


def commit_batch_results(
    commits: "Sequence[Tuple[Claim, Result]]", response: pb.CommitBatchResponse
) -> "List[Union[pb.Record, LeaseLost]]":
    """Per item the committed record (the claim marked settled), or LeaseLost."""
    results: "List[Union[pb.Record, LeaseLost]]" = []
    for (claim, _), result in zip(commits, response.results):
        if result.outcome == pb.COMMIT_OUTCOME_LEASE_LOST:
            results.append(lease_lost(claim, "expired before the batch commit"))
        else:
            claim.settled = True
            results.append(result.record)
    return results


def release_batch_request(claims: "Sequence[Claim]") -> pb.ReleaseBatchRequest:
    return pb.ReleaseBatchRequest(items=[release_request(claim) for claim in claims if not claim.duplicate])
