"""The synchronous client: `Client(...).process(id, handler)` and
`with client.claim(id) as claim:`; the lease is renewed by the client's one
background thread while the work runs (see `_renewal`)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import grpc

from dedupd import _protocol as protocol
from dedupd._connection import TLS, Retry, call_metadata, channel_options, metadata, target
from dedupd._proto.dedup.v1 import dedup_pb2 as pb
from dedupd._proto.dedup.v1 import dedup_pb2_grpc as pb_grpc
from dedupd._renewal import Renewer
from dedupd._protocol import (
    Claim,
    ClaimFields,
    DedupError,
    FingerprintMismatch,
    InProgress,
    Result,
    Settings,
    Stale,
)

Answer = TypeVar("Answer")


class Client:
    """A connection to one dedupd sidecar.

    `address`: `host:port`, `http://…`, `https://…` (TLS) or
    `unix:///path.sock`; unset, `DEDUPD_ADDR`, then `127.0.0.1:50051`.
    `token`: the bearer token (unset: `DEDUPD_TOKEN`). `tls`: a `TLS` (unset:
    from `DEDUPD_TLS_CA` / `DEDUPD_TLS_CLIENT_CERT` / `DEDUPD_TLS_CLIENT_KEY`).
    `namespace`, `owner`, `consumer_version` and `lease` (seconds) go into
    every claim; `timeout` bounds each call; `retry` is the policy for
    UNAVAILABLE.
    """

    def __init__(
        self,
        address: Optional[str] = None,
        *,
        namespace: str = "",
        owner: str = "",
        consumer_version: str = "",
        lease: float = 30.0,
        token: Optional[str] = None,
        tls: Optional[TLS] = None,
        timeout: float = 10.0,
        retry: Retry = Retry(),
    ) -> None:
        grpc_target, tls = target(address, tls if tls is not None else TLS.from_env())
        options = channel_options(grpc_target, tls)
        self._channel = (
            grpc.secure_channel(grpc_target, tls.credentials(), options=options)
            if tls is not None
            else grpc.insecure_channel(grpc_target, options=options)
        )
        # The generated stub is untyped; every call goes through _call.
        self._stub: Any = pb_grpc.ClaimAndCommitStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = metadata(token)
        self._timeout = timeout
        self._retry = retry
        self.settings = Settings(namespace, owner, consumer_version, lease)
        self._renewer = Renewer(self._send_renewal, lambda: self.settings.lease / 3, _is_lease_lost)

    def close(self) -> None:
        self._renewer.close()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, method: str, request: Any) -> Any:
        rpc = getattr(self._stub, method)
        for attempt in range(self._retry.attempts):
            try:
                return rpc(request, metadata=call_metadata(self._metadata), timeout=self._timeout)
            except grpc.RpcError as error:
                code = error.code() if isinstance(error, grpc.Call) else None
                if code == grpc.StatusCode.UNAVAILABLE and attempt + 1 < self._retry.attempts:
                    time.sleep(self._retry.delay(attempt))
                    continue
                raise protocol.translate(error, method, self._retry.max_delay) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    # One method per RPC.

    def claim_once(self, correlation_id: str, fields: ClaimFields = ClaimFields()) -> Claim:
        """Claims the key: a `Claim` (check `.duplicate`), or raises
        `InProgress`, `Stale` or `FingerprintMismatch`."""
        response = self._call("Claim", protocol.claim_request(self.settings, correlation_id, fields))
        result = protocol.claim_result(correlation_id, response)
        if isinstance(result, Claim):
            return result
        raise result

    def commit(self, claim: Claim, response: Result = None, *, retention: Optional[float] = None) -> pb.Record:
        """Commits after the business write; `response` is returned to
        duplicates. Raises `LeaseLost` if the lease no longer holds the key."""
        protocol.check_claimable(claim, "commit")
        answer = self._call("Commit", protocol.commit_request(claim, response, retention))
        claim.settled = True
        record: pb.Record = answer.record
        return record

    def release(self, claim: Claim) -> None:
        """Releases after a failure: a redelivery may claim at once. Releasing
        a claim that expired or was already released is not an error."""
        protocol.check_claimable(claim, "release")
        try:
            self._call("Release", protocol.release_request(claim))
        except protocol.LeaseLost:
            pass  # Someone else holds it now, or it was committed: nothing to give back.
        claim.settled = True

    def renew(self, claim: Claim) -> None:
        """Extends the lease by the client's `lease` from now."""
        protocol.check_claimable(claim, "renew")
        self._call("Renew", protocol.renew_request(claim, self.settings))

    def lookup(self, correlation_id: str) -> Optional[pb.Record]:
        """The key's record, or None."""
        answer = self._call(
            "Lookup", pb.LookupRequest(namespace=self.settings.namespace, correlation_id=correlation_id)
        )
        return answer.record if answer.found else None

    # The shapes a consumer wants.

    @contextlib.contextmanager
    def claim(
        self,
        correlation_id: str,
        *,
        event_type: str = "",
        payload_fingerprint: str = "",
        ordering_key: str = "",
        sequence: Optional[int] = None,
        retention: Optional[float] = None,
    ) -> Iterator[Claim]:
        """`with client.claim(id) as claim:` — for a duplicate,
        `claim.duplicate` is True and there is nothing to do. Otherwise the
        lease is renewed while the block runs; call `client.commit(claim,
        result)` after the business write. If the block raises, or ends
        without a commit, the claim is released; the block's own exception
        is never replaced by a failing release."""
        fields = ClaimFields(event_type, payload_fingerprint, ordering_key, sequence, retention)
        claim = self.claim_once(correlation_id, fields)
        if claim.duplicate:
            yield claim
            return
        watch = self._renewer.watch(claim)
        try:
            yield claim
        except BaseException as error:
            self._renewer.end(watch)
            self._release_quietly(claim, error)
            raise
        self._renewer.end(watch)
        if not claim.settled:
            self.release(claim)

    def process(
        self,
        correlation_id: str,
        handler: Callable[[Claim], Result],
        *,
        event_type: str = "",
        payload_fingerprint: str = "",
        ordering_key: str = "",
        sequence: Optional[int] = None,
        retention: Optional[float] = None,
    ) -> bytes:
        """Runs `handler(claim)` at most once per correlation ID and returns
        its result (as stored); a duplicate returns the first result without
        calling it. `InProgress`, `Stale` and `FingerprintMismatch` are for
        the caller's transport logic (nack, ack and skip, alert)."""
        # `with self.claim(...)` unrolled: this is the hot path, and a
        # generator-based context manager costs more than the rest of it.
        fields = ClaimFields(event_type, payload_fingerprint, ordering_key, sequence, retention)
        claim = self.claim_once(correlation_id, fields)
        if claim.duplicate:
            return protocol.replayed(claim)
        watch = self._renewer.watch(claim)
        try:
            record = self.commit(claim, handler(claim))
        except BaseException as error:
            self._renewer.end(watch)
            self._release_quietly(claim, error)
            raise
        self._renewer.end(watch)
        response: bytes = record.response
        return response

    def claim_many(
        self, correlation_ids: Sequence[str], fields: ClaimFields = ClaimFields()
    ) -> List[Union[Claim, InProgress, Stale, FingerprintMismatch]]:
        """Claims a batch (a Kafka poll, say) in one call and one disk sync:
        one result per ID, in order — a `Claim` (check `.duplicate`) or the
        exception its outcome stands for, returned, not raised. The leases
        are not renewed: process the batch within `lease`, or `renew`."""
        request = protocol.claim_batch_request(self.settings, correlation_ids, fields)
        return protocol.claim_batch_results(correlation_ids, self._call("ClaimBatch", request))

    def commit_many(self, commits: Sequence[Tuple[Claim, Result]]) -> List[Union[pb.Record, protocol.LeaseLost]]:
        """Commits a batch: per item the committed record, or `LeaseLost`."""
        answer = self._call("CommitBatch", protocol.commit_batch_request(commits))
        return protocol.commit_batch_results(commits, answer)

    def release_many(self, claims: Sequence[Claim]) -> None:
        """Releases a batch (those no longer held are skipped)."""
        self._call("ReleaseBatch", protocol.release_batch_request(claims))
        for claim in claims:
            claim.settled = True

    # Internals.

    def _release_quietly(self, claim: Claim, cause: BaseException) -> None:
        try:
            self.release(claim)
        except DedupError as failure:
            # The handler's error is what the caller needs; the lease will
            # expire by itself. Say so on the handler's error.
            note = f"dedupd: releasing {claim.correlation_id!r} failed too ({failure}); its lease will expire"
            add_note = getattr(cause, "add_note", None)
            if callable(add_note):
                add_note(note)

    def _send_renewal(self, claim: Claim, deadline: float) -> Any:
        """One Renew, not waited for and not retried (the renewer tries
        again soon), within `deadline` seconds (at most a beat)."""
        return self._stub.Renew.future(
            protocol.renew_request(claim, self.settings),
            metadata=call_metadata(self._metadata),
            timeout=min(self._timeout, deadline),
        )


def _is_lease_lost(error: Any) -> bool:
    """Whether a failed Renew means the lease is gone: the same reading of
    a status as every other call's (`protocol.translate`)."""
    return isinstance(error, grpc.RpcError) and isinstance(protocol.translate(error, "Renew", 0.0), protocol.LeaseLost)
