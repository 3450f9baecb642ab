"""A small, idiomatic Python client for the dedupd sidecar.

The stubs are generated from proto/dedup/v1/dedup.proto at import time into
a `_generated/` folder next to this file (grpcio-tools, no system protoc).

    dedup = Dedup("127.0.0.1:50051", namespace="payments", owner="pod-a")
    result = dedup.process(event.correlation_id, handle, event_type="PaymentReceived")

`process` claims the correlation ID, runs `handle(claim)` while renewing the
lease in the background, commits with the handler's result (bytes or str)
and returns it; on a duplicate it returns the cached result without calling
the handler; if the handler raises, it releases the claim and re-raises.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import grpc

_HERE = pathlib.Path(__file__).resolve().parent
_PROTO_ROOT = _HERE.parent.parent / "proto"
_GENERATED = _HERE / "_generated"


def _generate_stubs() -> None:
    from grpc_tools import protoc  # type: ignore

    proto = _PROTO_ROOT / "dedup" / "v1" / "dedup.proto"
    target = _GENERATED / "dedup" / "v1" / "dedup_pb2.py"
    if target.exists() and target.stat().st_mtime >= proto.stat().st_mtime:
        return
    _GENERATED.mkdir(exist_ok=True)
    import grpc_tools

    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{_PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={_GENERATED}",
            f"--grpc_python_out={_GENERATED}",
            str(proto),
        ]
    )
    if code != 0:
        raise RuntimeError(f"generating stubs from {proto} failed ({code})")


_generate_stubs()
sys.path.insert(0, str(_GENERATED))
from dedup.v1 import dedup_pb2 as pb  # noqa: E402
from dedup.v1 import dedup_pb2_grpc as pb_grpc  # noqa: E402
from google.protobuf import duration_pb2  # noqa: E402

Result = Union[bytes, str, None]


class DedupError(Exception):
    """Base class of the outcomes `process` cannot turn into a result."""


class InProgress(DedupError):
    """Another consumer holds a live lease: redeliver or retry later."""

    def __init__(self, retry_after_seconds: float):
        super().__init__(f"in progress elsewhere; retry after {retry_after_seconds:.3f}s")
        self.retry_after_seconds = retry_after_seconds


class Stale(DedupError):
    """A higher sequence of the ordering key was already committed: skip."""

    def __init__(self, highest_committed_sequence: int):
        super().__init__(f"stale: sequence {highest_committed_sequence} already committed")
        self.highest_committed_sequence = highest_committed_sequence


class FingerprintMismatch(DedupError):
    """The producer reused the correlation ID for other content."""


class LeaseLost(DedupError):
    """Our lease expired and someone else claimed (or we released)."""


@dataclass
class Claim:
    """A claim held by this consumer."""

    namespace: str
    correlation_id: str
    lease_token: str
    fencing_token: int
    attempt: int
    recovered: bool
    #: True when the event was already processed: nothing to do.
    duplicate: bool = False
    #: For a duplicate: the response the first commit cached.
    cached_response: bytes = b""


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


class Dedup:
    """A connection to one dedupd sidecar."""

    def __init__(
        self,
        address: Optional[str] = None,
        namespace: str = "",
        owner: str = "",
        consumer_version: str = "",
        lease_seconds: float = 30.0,
        token: Optional[str] = None,
    ):
        address = address or os.environ.get("DEDUPD_ADDR", "127.0.0.1:50051")
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.ClaimAndCommitStub(self._channel)
        self._metadata = [("authorization", f"Bearer {token}")] if token else None
        self.namespace = namespace
        self.owner = owner
        self.consumer_version = consumer_version
        self.lease_seconds = lease_seconds

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Dedup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # The raw calls, one per RPC that `process` needs.

    def claim_raw(self, correlation_id: str, **fields) -> pb.ClaimResponse:
        request = pb.ClaimRequest(
            namespace=self.namespace,
            correlation_id=correlation_id,
            owner=self.owner,
            consumer_version=self.consumer_version,
            lease_ttl=_duration(self.lease_seconds),
            **fields,
        )
        return self._stub.Claim(request, metadata=self._metadata)

    def commit(self, claim: Claim, response: Result = None) -> pb.CommitResponse:
        if isinstance(response, str):
            response = response.encode()
        request = pb.CommitRequest(
            namespace=claim.namespace,
            correlation_id=claim.correlation_id,
            lease_token=claim.lease_token,
            response=response or b"",
        )
        try:
            return self._stub.Commit(request, metadata=self._metadata)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LeaseLost(error.details()) from None
            raise

    def release(self, claim: Claim) -> None:
        request = pb.ReleaseRequest(
            namespace=claim.namespace,
            correlation_id=claim.correlation_id,
            lease_token=claim.lease_token,
        )
        try:
            self._stub.Release(request, metadata=self._metadata)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise

    def renew(self, claim: Claim) -> None:
        request = pb.RenewRequest(
            namespace=claim.namespace,
            correlation_id=claim.correlation_id,
            lease_token=claim.lease_token,
            lease_ttl=_duration(self.lease_seconds),
        )
        self._stub.Renew(request, metadata=self._metadata)

    def lookup(self, correlation_id: str) -> Optional[pb.Record]:
        answer = self._stub.Lookup(
            pb.LookupRequest(namespace=self.namespace, correlation_id=correlation_id),
            metadata=self._metadata,
        )
        return answer.record if answer.found else None

    @contextlib.contextmanager
    def _heartbeat(self, claim: Claim) -> Iterator[None]:
        """Renews the lease every third of its length while the body runs."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.lease_seconds / 3):
                try:
                    self.renew(claim)
                except grpc.RpcError:
                    return  # lost: the commit will say so

        thread = threading.Thread(target=beat, name="dedupd-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    @contextlib.contextmanager
    def claim(self, correlation_id: str, **fields) -> Iterator[Claim]:
        """`with dedup.claim(id) as claim:` — `claim.duplicate` for a duplicate.

        On normal exit the caller must have called `dedup.commit(claim, ...)`;
        if the body raises, the claim is released and the error re-raised.
        """
        response = self.claim_raw(correlation_id, **fields)
        outcome = response.outcome
        if outcome == pb.CLAIM_OUTCOME_DUPLICATE:
            yield Claim(
                namespace=response.record.namespace,
                correlation_id=correlation_id,
                lease_token="",
                fencing_token=response.fencing_token,
                attempt=response.record.attempt,
                recovered=False,
                duplicate=True,
                cached_response=response.record.response,
            )
            return
        if outcome == pb.CLAIM_OUTCOME_IN_PROGRESS:
            raise InProgress(response.retry_after.ToNanoseconds() / 1e9)
        if outcome == pb.CLAIM_OUTCOME_STALE:
            raise Stale(response.highest_committed_sequence)
        if outcome == pb.CLAIM_OUTCOME_FINGERPRINT_MISMATCH:
            raise FingerprintMismatch(correlation_id)
        claim = Claim(
            namespace=self.namespace or "default",
            correlation_id=correlation_id,
            lease_token=response.lease_token,
            fencing_token=response.fencing_token,
            attempt=response.attempt,
            recovered=response.recovered,
        )
        try:
            with self._heartbeat(claim):
                yield claim
        except BaseException:
            self.release(claim)
            raise

    def process(self, correlation_id: str, handler: Callable[[Claim], Result], **fields) -> bytes:
        """Runs `handler` at most once per correlation ID; returns its result.

        A duplicate returns the result cached by the first commit without
        calling `handler`. InProgress, Stale and FingerprintMismatch are
        raised for the caller's transport logic (nack, ack-and-skip, alert).
        """
        with self.claim(correlation_id, **fields) as claim:
            if claim.duplicate:
                return claim.cached_response
            committed = self.commit(claim, handler(claim))
        return committed.record.response
