"""Tests of the Python helper against the real dedupd binary.

Run from the repository root after `cargo build`:
    python -m pytest examples/python
DEDUPD_BIN overrides the binary (default: target/debug/dedupd).
"""

import time

import pytest

import dedupd_client as dc


def test_process_runs_the_handler_once_and_replays_the_result(sidecar):
    calls = []
    with dc.Dedup(sidecar, namespace="payments", owner="pytest") as dedup:
        def handle(claim):
            calls.append(claim)
            return f"transfer for {claim.correlation_id}"

        first = dedup.process("pay-1", handle, event_type="PaymentReceived")
        again = dedup.process("pay-1", handle, event_type="PaymentReceived")
    assert first == again == b"transfer for pay-1"
    assert len(calls) == 1
    assert calls[0].attempt == 1 and not calls[0].recovered


def test_a_failing_handler_releases_so_the_redelivery_retries(sidecar):
    with dc.Dedup(sidecar, namespace="payments") as dedup:
        def fail(claim):
            raise RuntimeError("downstream unavailable")

        with pytest.raises(RuntimeError):
            dedup.process("pay-2", fail)
        seen = []
        result = dedup.process("pay-2", lambda claim: seen.append(claim) or b"ok")
    assert result == b"ok"
    assert seen[0].attempt == 2, "the release kept the attempt count"
    assert not seen[0].recovered, "a release is not a crash"


def test_the_lease_is_renewed_while_a_long_handler_runs(sidecar):
    with dc.Dedup(sidecar, lease_seconds=1.0) as dedup, dc.Dedup(sidecar, lease_seconds=1.0) as other:
        refused = []

        def slow(claim):
            # Three lease lengths: without renewals another consumer would get it.
            for _ in range(6):
                time.sleep(0.5)
                with pytest.raises(dc.InProgress) as busy:
                    other.process("long-1", lambda c: b"stolen")
                refused.append(busy.value.retry_after_seconds)
            return b"finished"

        assert dedup.process("long-1", slow) == b"finished"
    assert len(refused) == 6


def test_stale_and_fingerprint_mismatch_are_raised(sidecar):
    with dc.Dedup(sidecar, namespace="statuses") as dedup:
        dedup.process("status-failed", lambda c: b"failed", ordering_key="link-9", sequence=2)
        with pytest.raises(dc.Stale) as stale:
            dedup.process("status-degraded", lambda c: b"degraded", ordering_key="link-9", sequence=1)
        assert stale.value.highest_committed_sequence == 2

        dedup.process("order-7", lambda c: b"v1", payload_fingerprint="sha256:aaa")
        with pytest.raises(dc.FingerprintMismatch):
            dedup.process("order-7", lambda c: b"v2", payload_fingerprint="sha256:bbb")


def test_a_commit_after_losing_the_lease_raises_lease_lost(sidecar):
    with dc.Dedup(sidecar, lease_seconds=0.2) as dedup, dc.Dedup(sidecar, lease_seconds=5) as other:
        response = dedup.claim_raw("zombie-1")
        claim = dc.Claim("default", "zombie-1", response.lease_token, response.fencing_token,
                         response.attempt, response.recovered)
        time.sleep(0.3)  # the lease ends without a heartbeat
        taken = other.claim_raw("zombie-1")
        assert taken.outcome == dc.pb.CLAIM_OUTCOME_CLAIMED and taken.recovered
        with pytest.raises(dc.LeaseLost):
            dedup.commit(claim, b"too late")
