"""The asyncio client (`grpc.aio`), the same shape as `dedupd.Client`:
`await client.process(id, handler)` and `async with client.claim(id) as
claim:`; the lease is renewed by a task while the work runs."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import Any, AsyncIterator, Awaitable, Callable, List, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from dedupd import _protocol as protocol
from dedupd._connection import TLS, Retry, call_metadata, channel_options, metadata, target
from dedupd._proto.dedup.v1 import dedup_pb2 as pb
from dedupd._proto.dedup.v1 import dedup_pb2_grpc as pb_grpc
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

#: A handler: a plain function or a coroutine function.
Handler = Callable[[Claim], Union[Result, Awaitable[Result]]]


class Client:
    """A connection to one dedupd sidecar, for asyncio; arguments as
    `dedupd.Client`. Create it inside the running event loop."""

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
            grpc.aio.secure_channel(grpc_target, tls.credentials(), options=options)
            if tls is not None
            else grpc.aio.insecure_channel(grpc_target, options=options)
        )
        # The generated stub is untyped; every call goes through _call.
        self._stub: Any = pb_grpc.ClaimAndCommitStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = metadata(token)
        self._timeout = timeout
        self._retry = retry
        self.settings = Settings(namespace, owner, consumer_version, lease)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any) -> Any:
        rpc = getattr(self._stub, method)
        for attempt in range(self._retry.attempts):
            try:
                return await rpc(request, metadata=call_metadata(self._metadata), timeout=self._timeout)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE and attempt + 1 < self._retry.attempts:
                    await asyncio.sleep(self._retry.delay(attempt))
                    continue
                raise protocol.translate(error, method, self._retry.max_delay) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def claim_once(self, correlation_id: str, fields: ClaimFields = ClaimFields()) -> Claim:
        """As `dedupd.Client.claim_once`."""
        response = await self._call("Claim", protocol.claim_request(self.settings, correlation_id, fields))
        result = protocol.claim_result(correlation_id, response)
        if isinstance(result, Claim):
            return result
        raise result

    async def commit(self, claim: Claim, response: Result = None, *, retention: Optional[float] = None) -> pb.Record:
        """As `dedupd.Client.commit`."""
        protocol.check_claimable(claim, "commit")
        answer = await self._call("Commit", protocol.commit_request(claim, response, retention))
        claim.settled = True
        record: pb.Record = answer.record
        return record

    async def release(self, claim: Claim) -> None:
        """As `dedupd.Client.release`."""
        protocol.check_claimable(claim, "release")
        try:
            await self._call("Release", protocol.release_request(claim))
        except protocol.LeaseLost:
            pass  # Someone else holds it now, or it was committed: nothing to give back.
        claim.settled = True

    async def renew(self, claim: Claim) -> None:
        """As `dedupd.Client.renew`."""
        protocol.check_claimable(claim, "renew")
        await self._call("Renew", protocol.renew_request(claim, self.settings))

    async def lookup(self, correlation_id: str) -> Optional[pb.Record]:
        """As `dedupd.Client.lookup`."""
        answer = await self._call(
            "Lookup", pb.LookupRequest(namespace=self.settings.namespace, correlation_id=correlation_id)
        )
        return answer.record if answer.found else None

    @contextlib.asynccontextmanager
    async def claim(
        self,
        correlation_id: str,
        *,
        event_type: str = "",
        payload_fingerprint: str = "",
        ordering_key: str = "",
        sequence: Optional[int] = None,
        retention: Optional[float] = None,
    ) -> AsyncIterator[Claim]:
        """As `dedupd.Client.claim`, with `async with`."""
        fields = ClaimFields(event_type, payload_fingerprint, ordering_key, sequence, retention)
        claim = await self.claim_once(correlation_id, fields)
        if claim.duplicate:
            yield claim
            return
        renewal = _Renewal(self, claim)
        try:
            yield claim
        except BaseException as error:
            renewal.end()
            await self._release_quietly(claim, error)
            raise
        renewal.end()
        if not claim.settled:
            await self.release(claim)

    async def process(
        self,
        correlation_id: str,
        handler: Handler,
        *,
        event_type: str = "",
        payload_fingerprint: str = "",
        ordering_key: str = "",
        sequence: Optional[int] = None,
        retention: Optional[float] = None,
    ) -> bytes:
        """As `dedupd.Client.process`; `handler` may be a coroutine function."""
        # `async with self.claim(...)` unrolled: this is the hot path.
        fields = ClaimFields(event_type, payload_fingerprint, ordering_key, sequence, retention)
        claim = await self.claim_once(correlation_id, fields)
        if claim.duplicate:
            return protocol.replayed(claim)
        renewal = _Renewal(self, claim)
        try:
            result = handler(claim)
            if inspect.isawaitable(result):
                result = await result
            record = await self.commit(claim, result)
        except BaseException as error:
            renewal.end()
            await self._release_quietly(claim, error)
            raise
        renewal.end()
        response: bytes = record.response
        return response

    async def claim_many(
        self, correlation_ids: Sequence[str], fields: ClaimFields = ClaimFields()
    ) -> List[Union[Claim, InProgress, Stale, FingerprintMismatch]]:
        """As `dedupd.Client.claim_many`."""
        request = protocol.claim_batch_request(self.settings, correlation_ids, fields)
        return protocol.claim_batch_results(correlation_ids, await self._call("ClaimBatch", request))

    async def commit_many(
        self, commits: Sequence[Tuple[Claim, Result]]
    ) -> List[Union[pb.Record, protocol.LeaseLost]]:
        """As `dedupd.Client.commit_many`."""
        answer = await self._call("CommitBatch", protocol.commit_batch_request(commits))
        return protocol.commit_batch_results(commits, answer)

    async def release_many(self, claims: Sequence[Claim]) -> None:
        """As `dedupd.Client.release_many`."""
        await self._call("ReleaseBatch", protocol.release_batch_request(claims))
        for claim in claims:
            claim.settled = True

    async def _release_quietly(self, claim: Claim, cause: BaseException) -> None:
        try:
            await self.release(claim)
        except DedupError as failure:
            note = f"dedupd: releasing {claim.correlation_id!r} failed too ({failure}); its lease will expire"
            add_note = getattr(cause, "add_note", None)
            if callable(add_note):
                add_note(note)


class _Renewal:
    """Renews one claim's lease a beat (a third of the lease) after it was
    claimed, and every beat after, while its work runs: a timer on the event
    loop until a renewal is due, so a handler that finishes within a beat
    costs one timer, not a task. A refused renewal marks the claim
    `lease_lost`; any other failure is tried again a beat later."""

    __slots__ = ("_client", "_claim", "_timer", "_renewing")

    def __init__(self, client: Client, claim: Claim) -> None:
        self._client = client
        self._claim = claim
        self._renewing: Optional["asyncio.Task[None]"] = None
        self._timer = self._arm()

    def _arm(self) -> asyncio.TimerHandle:
        """The next renewal, a beat from now."""
        return asyncio.get_running_loop().call_later(self._client.settings.lease / 3, self._due)

    def _due(self) -> None:
        self._renewing = asyncio.ensure_future(self._renew())

    async def _renew(self) -> None:
        try:
            await self._client.renew(self._claim)
        except protocol.LeaseLost:
            self._claim.lease_lost = True
            return  # The commit will be refused and say so.
        except Exception:  # noqa: BLE001 - a DedupError, or the channel closing under it
            pass  # Try again at the next beat; the lease has two left.
        self._timer = self._arm()

    def end(self) -> None:
        """The work is over: no more renewals (one under way is cancelled)."""
        self._timer.cancel()
        if self._renewing is not None:
            self._renewing.cancel()
