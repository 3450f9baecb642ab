"""The synchronous client against the real sidecar."""

from __future__ import annotations

import hashlib
import pathlib
import threading
import time

import grpc
import pytest

import dedupd
from conftest import TOKEN, Certificates, Sidecar, free_port, start


def test_process_runs_the_handler_once_and_replays_its_result(sidecar: Sidecar) -> None:
    calls: list[dedupd.Claim] = []

    def handle(claim: dedupd.Claim) -> str:
        calls.append(claim)
        return f"transfer for {claim.correlation_id}"

    with dedupd.Client(sidecar.address, namespace="payments", owner="pytest") as client:
        first = client.process("pay-1", handle, event_type="PaymentReceived")
        again = client.process("pay-1", handle, event_type="PaymentReceived")
        record = client.lookup("pay-1")
    assert first == again == b"transfer for pay-1"
    assert len(calls) == 1
    assert calls[0].attempt == 1 and not calls[0].recovered
    assert calls[0].namespace == "payments"
    assert record is not None and record.owner == "pytest" and record.event_type == "PaymentReceived"


def test_the_namespace_is_the_servers_default_when_left_empty(sidecar: Sidecar) -> None:
    with dedupd.Client(sidecar.address) as client:
        with client.claim("no-namespace") as claim:
            assert claim.namespace == "default", "read from the server's answer, not assumed"
            client.commit(claim, b"ok")
        assert client.lookup("no-namespace") is not None


def test_a_failing_handler_releases_so_the_redelivery_runs_it_again(sidecar: Sidecar) -> None:
    def fail(claim: dedupd.Claim) -> bytes:
        raise RuntimeError("downstream unavailable")

    with dedupd.Client(sidecar.address) as client:
        with pytest.raises(RuntimeError, match="downstream unavailable"):
            client.process("pay-2", fail)
        seen: list[dedupd.Claim] = []

        def succeed(claim: dedupd.Claim) -> bytes:
            seen.append(claim)
            return b"ok"

        assert client.process("pay-2", succeed) == b"ok"
    assert seen[0].attempt == 2, "the release kept the attempt count"
    assert not seen[0].recovered, "a release is not a crash"


def test_a_block_that_ends_without_commit_releases(sidecar: Sidecar) -> None:
    with dedupd.Client(sidecar.address) as client:
        with client.claim("forgot-to-commit"):
            pass
        record = client.lookup("forgot-to-commit")
        assert record is not None and record.state == 3  # RECORD_STATE_RELEASED


def test_the_handlers_error_is_not_masked_by_a_failing_release(sidecar: Sidecar) -> None:
    client = dedupd.Client(sidecar.address, retry=dedupd.Retry(attempts=2, first_delay=0.01))

    def crash_the_sidecar_then_fail(claim: dedupd.Claim) -> bytes:
        sidecar.stop()
        raise ValueError("the business write failed")

    with pytest.raises(ValueError, match="the business write failed") as failure:
        client.process("pay-3", crash_the_sidecar_then_fail)
    notes = getattr(failure.value, "__notes__", [])
    assert any("releasing 'pay-3' failed too" in note for note in notes), notes
    client.close()


def test_the_lease_is_renewed_while_a_long_handler_runs(sidecar: Sidecar) -> None:
    with dedupd.Client(sidecar.address, lease=1.0) as client, dedupd.Client(sidecar.address) as other:
        refused: list[float] = []

        def slow(claim: dedupd.Claim) -> bytes:
            # Three lease lengths: without renewals the other client would get it.
            for _ in range(6):
                time.sleep(0.5)
                with pytest.raises(dedupd.InProgress) as busy:
                    other.process("long-1", lambda c: b"stolen")
                refused.append(busy.value.retry_after)
            return b"finished"

        assert client.process("long-1", slow) == b"finished"
    assert len(refused) == 6 and all(0 < wait <= 1.0 for wait in refused)


def test_one_renewal_thread_keeps_many_long_handlers_leases(sidecar: Sidecar) -> None:
    """Eight handlers at once, each outliving its lease four times, on one
    client: every lease is renewed (the other client is refused throughout),
    by one thread, not one per claim, while quick handlers run beside them."""
    with dedupd.Client(sidecar.address, lease=0.6) as client, dedupd.Client(sidecar.address) as other:
        refused: list[str] = []
        failures: list[BaseException] = []

        def slow(claim: dedupd.Claim) -> bytes:
            for _ in range(6):
                time.sleep(0.4)
                with pytest.raises(dedupd.InProgress):
                    other.process(claim.correlation_id, lambda c: b"stolen")
                refused.append(claim.correlation_id)
            return b"finished"

        def run(key: str) -> None:
            try:
                assert client.process(key, slow) == b"finished"
            except BaseException as error:  # noqa: BLE001 - asserted below
                failures.append(error)

        before = {thread.name for thread in threading.enumerate()}
        workers = [threading.Thread(target=run, args=(f"long-{n}",)) for n in range(8)]
        for worker in workers:
            worker.start()
        for n in range(50):
            assert client.process(f"quick-{n}", lambda c: b"q") == b"q"
        time.sleep(0.5)
        renewal_threads = [t for t in threading.enumerate() if t.name.startswith("dedupd-renew") and t.name not in before]
        for worker in workers:
            worker.join()
    assert not failures, failures
    assert len(refused) == 8 * 6
    assert len(renewal_threads) == 1, [t.name for t in renewal_threads]


def test_an_idle_client_holds_no_renewal_thread(sidecar: Sidecar) -> None:
    """The renewal thread leaves once nothing is left to renew (so a client
    dropped without close() holds no thread), and the next long handler
    starts it again and is renewed."""

    def renewal_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "dedupd-renewal"]

    with dedupd.Client(sidecar.address, lease=0.3) as client, dedupd.Client(sidecar.address) as other:
        for n in range(20):
            assert client.process(f"idle-{n}", lambda c: b"quick") == b"quick"
        deadline = time.monotonic() + 5
        while renewal_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not renewal_threads(), "the thread left within a few beats"

        def slow(claim: dedupd.Claim) -> bytes:
            for _ in range(4):
                time.sleep(0.2)
                with pytest.raises(dedupd.InProgress):
                    other.process(claim.correlation_id, lambda c: b"stolen")
            return b"finished"

        assert client.process("idle-long", slow) == b"finished"


def test_a_lost_lease_refuses_the_commit(sidecar: Sidecar) -> None:
    with dedupd.Client(sidecar.address, lease=0.2) as client, dedupd.Client(sidecar.address) as other:
        # claim_once does not renew: a process that stalls past its lease.
        stalled = client.claim_once("zombie")
        time.sleep(0.4)
        taken = other.claim_once("zombie")
        assert taken.recovered and taken.fencing_token > stalled.fencing_token
        with pytest.raises(dedupd.LeaseLost):
            client.commit(stalled, b"late")
        other.commit(taken, b"done")
        assert other.process("zombie", lambda c: b"never") == b"done"


def test_stale_and_fingerprint_mismatch_are_raised(sidecar: Sidecar) -> None:
    with dedupd.Client(sidecar.address, namespace="orders") as client:
        client.process("evt-7", lambda c: b"", ordering_key="account-1", sequence=7)
        with pytest.raises(dedupd.Stale) as stale:
            client.process("evt-5", lambda c: b"", ordering_key="account-1", sequence=5)
        assert stale.value.highest_committed_sequence == 7
        client.process("evt-9", lambda c: b"", payload_fingerprint="sha256:aaa")
        with pytest.raises(dedupd.FingerprintMismatch):
            client.process("evt-9", lambda c: b"", payload_fingerprint="sha256:bbb")


def test_batches_claim_and_commit_a_poll_in_one_call_each(sidecar: Sidecar) -> None:
    with dedupd.Client(sidecar.address, namespace="kafka") as client:
        client.process("m-2", lambda c: b"earlier")
        results = client.claim_many(["m-1", "m-2", "m-3"])
        claims = [r for r in results if isinstance(r, dedupd.Claim)]
        assert [c.duplicate for c in claims] == [False, True, False]
        assert claims[1].cached_response == b"earlier"
        fresh = [c for c in claims if not c.duplicate]
        records = client.commit_many([(c, f"done {c.correlation_id}") for c in fresh])
        assert [getattr(r, "response", None) for r in records] == [b"done m-1", b"done m-3"]
        again = client.claim_many(["m-1", "m-3", "m-4"])
        assert [isinstance(r, dedupd.Claim) and r.duplicate for r in again] == [True, True, False]
        fourth = again[2]
        assert isinstance(fourth, dedupd.Claim)
        client.release_many([fourth])
        assert client.process("m-4", lambda c: b"now") == b"now"


def test_fencing_tokens_are_whole_python_ints(sidecar: Sidecar) -> None:
    with dedupd.Client(sidecar.address) as client:
        tokens = [client.claim_once(f"f-{i}").fencing_token for i in range(3)]
    assert all(isinstance(t, int) for t in tokens) and tokens == sorted(tokens)


def test_a_unix_socket_address(unix_sidecar: Sidecar) -> None:
    assert unix_sidecar.address.startswith("unix://")
    with dedupd.Client(unix_sidecar.address) as client:
        assert client.process("over-a-socket", lambda c: b"ok") == b"ok"


def test_dedupd_addr_is_honoured(sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEDUPD_ADDR", f"http://{sidecar.address}")
    with dedupd.Client() as client:
        assert client.process("from-env", lambda c: b"ok") == b"ok"


def test_tls_with_a_client_certificate_and_a_token(secured_sidecar: Sidecar, certificates: Certificates) -> None:
    tls = dedupd.TLS(ca=certificates.ca, cert=certificates.client_cert, key=certificates.client_key)
    with dedupd.Client(secured_sidecar.address, tls=tls, token=TOKEN) as client:
        assert client.process("secure-1", lambda c: b"ok") == b"ok"
    with dedupd.Client(secured_sidecar.address, tls=tls, token="not-the-token-at-all-0123456789") as client:
        with pytest.raises(dedupd.DedupError) as refused:
            client.claim_once("secure-2")
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    # No TLS at all: the server does not answer plaintext.
    with dedupd.Client(secured_sidecar.address, token=TOKEN, retry=dedupd.Retry(attempts=1), timeout=2) as client:
        with pytest.raises(dedupd.Unavailable):
            client.claim_once("secure-3")


def test_tls_settings_from_the_environment(
    secured_sidecar: Sidecar, certificates: Certificates, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEDUPD_ADDR", f"https://{secured_sidecar.address}")
    monkeypatch.setenv("DEDUPD_TLS_CA", certificates.ca)
    monkeypatch.setenv("DEDUPD_TLS_CLIENT_CERT", certificates.client_cert)
    monkeypatch.setenv("DEDUPD_TLS_CLIENT_KEY", certificates.client_key)
    monkeypatch.setenv("DEDUPD_TOKEN", TOKEN)
    with dedupd.Client() as client:
        assert client.process("secure-env", lambda c: b"ok") == b"ok"


def test_unavailable_after_the_retries_says_when_to_come_back() -> None:
    nothing_there = f"127.0.0.1:{free_port()}"
    retry = dedupd.Retry(attempts=3, first_delay=0.01, max_delay=0.5)
    started = time.monotonic()
    with dedupd.Client(nothing_there, retry=retry, timeout=2) as client:
        with pytest.raises(dedupd.Unavailable) as failure:
            client.claim_once("nobody-home")
    assert failure.value.code == grpc.StatusCode.UNAVAILABLE
    assert failure.value.retry_after == 0.5
    assert time.monotonic() - started < 10


def test_each_retry_waits_at_least_half_its_delay() -> None:
    """Equal jitter: the retries of a policy ride out at least half the
    sum of its delays, whatever the draws (full jitter could wait nothing)."""
    retry = dedupd.Retry(attempts=8, first_delay=0.1, max_delay=1.0)
    for attempt in range(7):
        delay = min(1.0, 0.1 * 2**attempt)
        waits = [retry.delay(attempt) for _ in range(1000)]
        assert min(waits) >= delay / 2, (attempt, min(waits))
        assert max(waits) <= delay, (attempt, max(waits))


def test_a_call_rides_out_a_sidecar_restart(workdir: pathlib.Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    first = start(workdir, listen)
    # Nine waits adding up to at least 3.25 s (equal jitter) for a restart
    # 0.5 s away plus a debug build's start-up on a loaded machine and the
    # channel's own reconnect backoff.
    with dedupd.Client(listen, retry=dedupd.Retry(attempts=10, first_delay=0.1, max_delay=1.0)) as client:
        assert client.process("before", lambda c: b"1") == b"1"
        first.stop()
        restarted: list[Sidecar] = []
        threading.Timer(0.5, lambda: restarted.append(start(workdir, listen))).start()
        # Sent while nothing listens: retried until the sidecar is back.
        assert client.process("before", lambda c: b"again") == b"1", "the record survived"
        assert client.process("after", lambda c: b"2") == b"2"
    deadline = time.monotonic() + 20
    while not restarted and time.monotonic() < deadline:
        time.sleep(0.05)
    restarted[0].stop()


def key_id(key: bytes) -> str:
    """A sealing key's ID as the sidecar derives and logs it."""
    return hashlib.sha256(b"dedupd sealing key id v1\0" + key).digest()[:8].hex()


def test_an_answer_whose_sealing_key_was_destroyed_is_a_duplicate_marked_erased(
    workdir: pathlib.Path,
) -> None:
    keys = {name: workdir / f"{name}.key" for name in ("a", "b")}
    keys["a"].write_text("aa" * 32)
    keys["b"].write_text("bb" * 32)
    first = start(workdir, "127.0.0.1:0", "--encryption-key-file", str(keys["a"]))
    try:
        with dedupd.Client(first.address) as client:
            assert client.process("erased-1", lambda claim: b"card 4242") == b"card 4242"
    finally:
        first.stop()
    # Key a removed but not declared destroyed: the sidecar refuses to
    # start (exit 64, naming it; tests/binary.rs), never empty answers.
    # Key a destroyed, and declared so.
    erased_flags = ("--encryption-key-file", str(keys["b"]), "--erased-key-id", key_id(b"\xaa" * 32))
    second = start(workdir, "127.0.0.1:0", *erased_flags)
    try:
        with dedupd.Client(second.address) as client:
            with client.claim("erased-1") as claim:
                assert claim.duplicate, "processed once, never again"
                assert claim.response_erased
                assert claim.cached_response == b""
            called = []
            with pytest.raises(dedupd.ResponseErased) as erased:
                client.process("erased-1", lambda claim: called.append(1))
            assert erased.value.correlation_id == "erased-1"
            assert not called
    finally:
        second.stop()
