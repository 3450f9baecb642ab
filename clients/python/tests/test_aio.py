"""The asyncio client against the real sidecar: the same shape as the sync one."""

from __future__ import annotations

import asyncio
import hashlib
import pathlib

import grpc
import pytest

import dedupd
import dedupd.aio
from conftest import TOKEN, Certificates, Sidecar, free_port, start


async def test_process_runs_a_coroutine_handler_once(sidecar: Sidecar) -> None:
    calls: list[dedupd.Claim] = []

    async def handle(claim: dedupd.Claim) -> bytes:
        calls.append(claim)
        await asyncio.sleep(0.01)
        return b"handled"

    async with dedupd.aio.Client(sidecar.address, namespace="payments") as client:
        assert await client.process("a-1", handle) == b"handled"
        assert await client.process("a-1", handle) == b"handled"
        # A plain function works too.
        assert await client.process("a-2", lambda claim: "plain") == b"plain"
    assert len(calls) == 1


async def test_concurrent_duplicates_run_the_handler_once(sidecar: Sidecar) -> None:
    runs: list[int] = []

    async def handle(claim: dedupd.Claim) -> bytes:
        runs.append(claim.attempt)
        await asyncio.sleep(0.2)
        return b"once"

    async with dedupd.aio.Client(sidecar.address) as client:
        results = await asyncio.gather(
            *(client.process("contended", handle) for _ in range(10)), return_exceptions=True
        )
    assert len(runs) == 1
    assert results.count(b"once") == 1
    assert all(isinstance(r, dedupd.InProgress) for r in results if r != b"once")


async def test_a_failing_handler_releases_and_its_error_propagates(sidecar: Sidecar) -> None:
    async def fail(claim: dedupd.Claim) -> bytes:
        raise KeyError("no such account")

    async with dedupd.aio.Client(sidecar.address) as client:
        with pytest.raises(KeyError):
            await client.process("a-3", fail)
        async with client.claim("a-3") as claim:
            assert claim.attempt == 2 and not claim.duplicate
            await client.commit(claim, b"second time")
        assert await client.process("a-3", fail) == b"second time"


async def test_the_lease_is_renewed_while_the_work_runs(sidecar: Sidecar) -> None:
    async with dedupd.aio.Client(sidecar.address, lease=0.6) as client, dedupd.aio.Client(
        sidecar.address
    ) as other:
        async with client.claim("a-long") as claim:
            for _ in range(4):
                await asyncio.sleep(0.4)
                with pytest.raises(dedupd.InProgress):
                    await other.claim_once("a-long")
            await client.commit(claim, b"done")
        assert not claim.lease_lost

        # Through process(), several at once, each outliving its lease.
        async def slow(claim: dedupd.Claim) -> bytes:
            for _ in range(4):
                await asyncio.sleep(0.4)
                with pytest.raises(dedupd.InProgress):
                    await other.claim_once(claim.correlation_id)
            return b"finished"

        answers = await asyncio.gather(*(client.process(f"a-long-{n}", slow) for n in range(4)))
        assert answers == [b"finished"] * 4


async def test_a_quick_handler_starts_no_renewal_task(sidecar: Sidecar) -> None:
    """A handler done within a beat costs a timer, not a task (one task per
    event was most of process()'s cost beyond its two calls)."""
    async with dedupd.aio.Client(sidecar.address) as client:
        before = len(asyncio.all_tasks())
        during: list[int] = []

        def handle(claim: dedupd.Claim) -> bytes:
            during.append(len(asyncio.all_tasks()))
            return b"quick"

        assert await client.process("a-quick", handle) == b"quick"
        assert during == [before]


async def test_a_lost_lease_refuses_the_commit(sidecar: Sidecar) -> None:
    async with dedupd.aio.Client(sidecar.address, lease=0.2) as client:
        stalled = await client.claim_once("a-zombie")
        await asyncio.sleep(0.4)
        taken = await client.claim_once("a-zombie")
        assert taken.recovered
        with pytest.raises(dedupd.LeaseLost):
            await client.commit(stalled, b"late")


async def test_batches(sidecar: Sidecar) -> None:
    async with dedupd.aio.Client(sidecar.address, namespace="kafka") as client:
        results = await client.claim_many(["b-1", "b-2"])
        claims = [r for r in results if isinstance(r, dedupd.Claim)]
        assert len(claims) == 2
        records = await client.commit_many([(claims[0], b"one"), (claims[1], b"two")])
        assert [getattr(r, "response", None) for r in records] == [b"one", b"two"]
        again = await client.claim_many(["b-1", "b-2", "b-3"])
        assert [isinstance(r, dedupd.Claim) and r.duplicate for r in again] == [True, True, False]


async def test_unix_socket(unix_sidecar: Sidecar) -> None:
    async with dedupd.aio.Client(unix_sidecar.address) as client:
        assert await client.process("a-unix", lambda c: b"ok") == b"ok"


async def test_tls_and_token(secured_sidecar: Sidecar, certificates: Certificates) -> None:
    tls = dedupd.TLS(ca=certificates.ca, cert=certificates.client_cert, key=certificates.client_key)
    async with dedupd.aio.Client(secured_sidecar.address, tls=tls, token=TOKEN) as client:
        assert await client.process("a-tls", lambda c: b"ok") == b"ok"
    async with dedupd.aio.Client(secured_sidecar.address, tls=tls) as anonymous:
        with pytest.raises(dedupd.DedupError) as refused:
            await anonymous.claim_once("a-tls-2")
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


async def test_unavailable_after_the_retries() -> None:
    retry = dedupd.Retry(attempts=2, first_delay=0.01, max_delay=0.3)
    async with dedupd.aio.Client(f"127.0.0.1:{free_port()}", retry=retry, timeout=2) as client:
        with pytest.raises(dedupd.Unavailable) as failure:
            await client.lookup("nobody-home")
    assert failure.value.retry_after == 0.3


async def test_process_raises_response_erased_for_an_erased_answer(workdir: pathlib.Path) -> None:
    key = workdir / "a.key"
    key.write_text("aa" * 32)
    first = start(workdir, "127.0.0.1:0", "--encryption-key-file", str(key))
    try:
        async with dedupd.aio.Client(first.address) as client:
            assert await client.process("aio-erased", lambda claim: b"token") == b"token"
    finally:
        first.stop()
    # Sealing turned off, the key destroyed and declared so.
    key_id = hashlib.sha256(b"dedupd sealing key id v1\0" + b"\xaa" * 32).digest()[:8].hex()
    second = start(workdir, "127.0.0.1:0", "--erased-key-id", key_id)
    try:
        async with dedupd.aio.Client(second.address) as client:
            with pytest.raises(dedupd.ResponseErased):
                await client.process("aio-erased", lambda claim: b"again")
    finally:
        second.stop()
