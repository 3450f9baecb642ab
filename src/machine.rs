//! The state machine of protocol §2 (docs/protocol.md), as pure functions
//! of (record, request, now).
//!
//! "Now" is an interval ([`Now`]: on a shared store, the store's clock as
//! this pod can vouch for it). A lease or retention holds until the
//! interval's `earliest` is past its end; new ends are set from its
//! `latest`. A pod's own clock for its own store is a point.
//!
//! Every store runs these same functions inside its atomic read-modify-write
//! of one key, so no rule exists twice. A function answers with the
//! [`Change`] to apply and the outcome to report; it never does I/O. The one
//! thing it cannot invent, a fresh fencing token, it asks the store for
//! through `issue_fencing`, and only when it grants a claim.

use crate::{
    clock::{Now, UnixMillis},
    domain::{
        ClaimOutcome, ClaimRequest, CommitOutcome, CommitRequest, FencingToken, LeaseLost,
        LeaseToken, Record, RecordState, ReleaseOutcome, ReleaseRequest, RenewRequest,
    },
};

/// What a transition does to the stored record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(
    clippy::large_enum_variant,
    reason = "a Change lives for one read-modify-write; boxing would only add an allocation"
)]
pub enum Change {
    /// Leave the record as it is.
    Keep,
    /// Store this record in place of the current one.
    Put(Record),
    /// Remove the record.
    Delete,
}

/// The highest committed sequence of an ordering scope, kept as long as the
/// longest-retained commit that raised it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceMark {
    /// The highest committed sequence.
    pub highest: u64,
    /// After this moment the mark reads as absent.
    pub retain_until: UnixMillis,
}

/// Expiry never depends on the reaper: a record past `retain_until` is absent.
pub fn live(current: Option<&Record>, now: impl Into<Now>) -> Option<&Record> {
    let now = now.into();
    current.filter(|record| now.before(record.retain_until))
}

/// Same rule for ordering marks.
pub fn live_mark(mark: Option<SequenceMark>, now: impl Into<Now>) -> Option<SequenceMark> {
    let now = now.into();
    mark.filter(|mark| now.before(mark.retain_until))
}

/// Claim: see the table in protocol §2. `highest_committed_sequence` is the live
/// mark of the request's ordering scope, if it has one.
pub fn claim<E>(
    current: Option<&Record>,
    request: &ClaimRequest,
    now: impl Into<Now>,
    lease_token: LeaseToken,
    highest_committed_sequence: Option<u64>,
    issue_fencing: impl FnOnce() -> Result<FencingToken, E>,
) -> Result<(Change, ClaimOutcome), E> {
    let now = now.into();
    let current = live(current, now);
    if let Some(record) = current {
        if !request.payload_fingerprint.is_empty()
            && !record.payload_fingerprint.is_empty()
            && request.payload_fingerprint != record.payload_fingerprint
        {
            let record = record.clone();
            return Ok((Change::Keep, ClaimOutcome::FingerprintMismatch { record }));
        }
        match record.state {
            RecordState::Committed => {
                let record = record.clone();
                return Ok((Change::Keep, ClaimOutcome::Duplicate { record }));
            }
            RecordState::Claimed
                if now.before(record.lease_expires_at)
                    && !request.request_id.is_empty()
                    && request.request_id == record.request_id =>
            {
                // The same Claim retried (its answer was lost on the way):
                // the same claim again, never a second holder.
                let recovered = record.recovered;
                let record = record.clone();
                return Ok((Change::Keep, ClaimOutcome::Claimed { record, recovered }));
            }
            RecordState::Claimed if now.before(record.lease_expires_at) => {
                let retry_after = now.until(record.lease_expires_at);
                let record = record.clone();
                return Ok((
                    Change::Keep,
                    ClaimOutcome::InProgress {
                        record,
                        retry_after,
                    },
                ));
            }
            RecordState::Claimed | RecordState::Released => {}
        }
    }
    if let (Some(position), Some(highest)) = (&request.ordering, highest_committed_sequence) {
        if position.sequence <= highest {
            return Ok((
                Change::Keep,
                ClaimOutcome::Stale {
                    highest_committed_sequence: highest,
                },
            ));
        }
    }

    // A live CLAIMED record here has an expired lease: its holder died.
    let recovered = current.is_some_and(|record| record.state == RecordState::Claimed);
    let lease_expires_at = now.plus(request.lease_ttl);
    let payload_fingerprint = match (request.payload_fingerprint.is_empty(), current) {
        // Keep the first fingerprint seen, so a later different one is caught.
        (true, Some(record)) => record.payload_fingerprint.clone(),
        _ => request.payload_fingerprint.clone(),
    };
    let record = Record {
        state: RecordState::Claimed,
        lease_token,
        fencing_token: issue_fencing()?,
        lease_expires_at,
        attempt: current.map_or(0, |record| record.attempt).saturating_add(1),
        event_type: request.event_type.clone(),
        consumer_version: request.consumer_version.clone(),
        owner: request.owner.clone(),
        payload_fingerprint,
        claimed_at: now.latest,
        committed_at: None,
        retain_until: lease_expires_at.saturating_add(request.retention),
        retention: request.retention,
        response: Vec::new(),
        ordering: request.ordering.clone(),
        request_id: request.request_id.clone(),
        recovered,
        response_erased: false,
    };
    Ok((
        Change::Put(record.clone()),
        ClaimOutcome::Claimed { record, recovered },
    ))
}

/// Commit: allowed to the lease token of the latest claim, even after its
/// lease expired, as long as nobody claimed the key since. Idempotent.
pub fn commit(
    current: Option<&Record>,
    request: &CommitRequest,
    now: impl Into<Now>,
) -> (Change, Result<CommitOutcome, LeaseLost>) {
    let now = now.into();
    let Some(record) = held_by(live(current, now), request.lease_token) else {
        return (Change::Keep, Err(LeaseLost));
    };
    match record.state {
        RecordState::Claimed => {
            let retention = request.retention.unwrap_or(record.retention);
            let committed = Record {
                state: RecordState::Committed,
                committed_at: Some(now.latest),
                retain_until: now.plus(retention),
                retention,
                response: request.response.clone(),
                ..record.clone()
            };
            (
                Change::Put(committed.clone()),
                Ok(CommitOutcome::Committed(committed)),
            )
        }
        RecordState::Committed => (
            Change::Keep,
            Ok(CommitOutcome::AlreadyCommitted(record.clone())),
        ),
        RecordState::Released => (Change::Keep, Err(LeaseLost)),
    }
}

/// Release: the key becomes claimable at once; the record stays (released)
/// so the attempt count is kept. Releasing again with the same token, or
/// releasing an absent key, is fine; releasing someone else's claim, a
/// commit, or a release made with another token is not.
pub fn release(
    current: Option<&Record>,
    request: &ReleaseRequest,
    now: impl Into<Now>,
) -> (Change, Result<ReleaseOutcome, LeaseLost>) {
    let now = now.into();
    let Some(record) = live(current, now) else {
        return (Change::Keep, Ok(ReleaseOutcome::NotFound));
    };
    match record.state {
        RecordState::Released if record.lease_token == request.lease_token => {
            (Change::Keep, Ok(ReleaseOutcome::AlreadyReleased))
        }
        RecordState::Claimed if record.lease_token == request.lease_token => {
            let released = Record {
                state: RecordState::Released,
                lease_expires_at: now.latest,
                retain_until: now.plus(record.retention),
                ..record.clone()
            };
            (Change::Put(released), Ok(ReleaseOutcome::Released))
        }
        // Someone else's claim, a commit, or a release made with another
        // token: this token does not hold the key.
        RecordState::Claimed | RecordState::Committed | RecordState::Released => {
            (Change::Keep, Err(LeaseLost))
        }
    }
}

/// Renew: extends the lease of the latest claim (expired or not, as long as
/// nobody claimed the key since) to `now + lease_ttl`.
pub fn renew(
    current: Option<&Record>,
    request: &RenewRequest,
    now: impl Into<Now>,
) -> (Change, Result<UnixMillis, LeaseLost>) {
    let now = now.into();
    match held_by(live(current, now), request.lease_token) {
        Some(record) if record.state == RecordState::Claimed => {
            let lease_expires_at = now.plus(request.lease_ttl);
            let renewed = Record {
                lease_expires_at,
                retain_until: lease_expires_at.saturating_add(record.retention),
                ..record.clone()
            };
            (Change::Put(renewed), Ok(lease_expires_at))
        }
        _ => (Change::Keep, Err(LeaseLost)),
    }
}

/// Forget (admin): removes the record; reports whether a live one existed.
pub fn forget(current: Option<&Record>, now: impl Into<Now>) -> (Change, bool) {
    let existed = live(current, now).is_some();
    let change = if current.is_some() {
        Change::Delete
    } else {
        Change::Keep
    };
    (change, existed)
}

/// Rekey (admin): `read`'s answer, sealed anew, in place of its old
/// sealing — only while the record is still the live committed one that
/// was read (same claim, same stored answer), so a record claimed,
/// committed, forgotten, expired or re-sealed meanwhile is left as it is.
/// Reports whether it was replaced.
pub fn reseal(
    current: Option<&Record>,
    read: &Record,
    resealed: &[u8],
    now: impl Into<Now>,
) -> (Change, bool) {
    match live(current, now) {
        Some(current)
            if current.state == RecordState::Committed
                && current.lease_token == read.lease_token
                && current.response == read.response =>
        {
            let replaced = Record {
                response: resealed.to_vec(),
                ..current.clone()
            };
            (Change::Put(replaced), true)
        }
        _ => (Change::Keep, false),
    }
}

/// The ordering mark after `record` was committed: a commit raises the
/// highest committed sequence of its ordering scope (never lowers it) and
/// keeps the mark at least as long as the record. `None` means no change.
pub fn raise_mark(
    current: Option<SequenceMark>,
    committed: &Record,
    now: impl Into<Now>,
) -> Option<SequenceMark> {
    let position = committed.ordering.as_ref()?;
    let candidate = SequenceMark {
        highest: position.sequence,
        retain_until: committed.retain_until,
    };
    let Some(mark) = live_mark(current, now) else {
        return Some(candidate);
    };
    let raised = SequenceMark {
        highest: mark.highest.max(candidate.highest),
        retain_until: mark.retain_until.max(candidate.retain_until),
    };
    (raised != mark).then_some(raised)
}

fn held_by(record: Option<&Record>, lease_token: LeaseToken) -> Option<&Record> {
    record.filter(|record| record.lease_token == lease_token)
}

#[cfg(test)]
mod tests {
    //! One test per row of the protocol §2 table (docs/protocol.md), in table order.

    use std::{convert::Infallible, time::Duration};

    use super::*;
    use crate::domain::{Key, OrderingPosition};

    const LEASE: Duration = Duration::from_secs(30);
    const RETENTION: Duration = Duration::from_secs(3600);
    const T0: UnixMillis = UnixMillis(1_000_000);

    fn key() -> Key {
        Key::new_unchecked("orders".into(), "evt-1".into())
    }

    fn claim_request() -> ClaimRequest {
        ClaimRequest {
            key: key(),
            lease_ttl: LEASE,
            retention: RETENTION,
            event_type: "PaymentReceived".into(),
            consumer_version: "1.0.0".into(),
            owner: "pod-a".into(),
            payload_fingerprint: String::new(),
            ordering: None,
            request_id: String::new(),
        }
    }

    fn at(offset: Duration) -> UnixMillis {
        T0.saturating_add(offset)
    }

    /// Claims with fencing token `fencing`; panics unless the result is a put.
    fn claim_with(
        current: Option<&Record>,
        request: &ClaimRequest,
        now: UnixMillis,
        token: u128,
        fencing: u64,
    ) -> (Change, ClaimOutcome) {
        claim(current, request, now, LeaseToken(token), None, || {
            Ok::<_, Infallible>(FencingToken(fencing))
        })
        .unwrap()
    }

    fn put(change: Change) -> Record {
        match change {
            Change::Put(record) => record,
            other => panic!("expected a put, got {other:?}"),
        }
    }

    fn claimed_record() -> Record {
        put(claim_with(None, &claim_request(), T0, 1, 10).0)
    }

    /// Rekey replaces only the live committed record it read: never one
    /// gone, claimed, committed by another claim, re-sealed meanwhile, or
    /// expired; and it changes the answer's bytes only.
    #[test]
    fn reseal_replaces_only_the_record_it_read() {
        let read = committed_record();
        let now = at(Duration::from_secs(2));
        let (change, replaced) = reseal(Some(&read), &read, b"sealed anew", now);
        assert!(replaced);
        assert_eq!(
            put(change),
            Record {
                response: b"sealed anew".to_vec(),
                ..read.clone()
            }
        );
        let other_claim = Record {
            lease_token: LeaseToken(2),
            ..read.clone()
        };
        let other_bytes = Record {
            response: b"sealed by someone else".to_vec(),
            ..read.clone()
        };
        for (case, current, now) in [
            ("forgotten", None, now),
            ("claimed again", Some(claimed_record()), now),
            ("another claim's commit", Some(other_claim), now),
            ("re-sealed meanwhile", Some(other_bytes), now),
            ("expired", Some(read.clone()), read.retain_until),
        ] {
            let (change, replaced) = reseal(current.as_ref(), &read, b"sealed anew", now);
            assert!(matches!(change, Change::Keep) && !replaced, "{case}");
        }
    }

    fn committed_record() -> Record {
        let request = CommitRequest {
            key: key(),
            lease_token: LeaseToken(1),
            response: b"done".to_vec(),
            retention: None,
        };
        put(commit(
            Some(&claimed_record()),
            &request,
            at(Duration::from_secs(1)),
        )
        .0)
    }

    #[test]
    fn claim_of_absent_key_is_claimed_with_first_attempt() {
        let (change, outcome) = claim_with(None, &claim_request(), T0, 1, 10);
        let record = put(change);
        assert_eq!(record.state, RecordState::Claimed);
        assert_eq!(record.fencing_token, FencingToken(10));
        assert_eq!(record.attempt, 1);
        assert_eq!(record.lease_expires_at, at(LEASE));
        assert_eq!(record.retain_until, at(LEASE + RETENTION));
        assert_eq!(
            outcome,
            ClaimOutcome::Claimed {
                record,
                recovered: false
            }
        );
    }

    #[test]
    fn claim_of_expired_record_treats_it_as_absent() {
        let committed = committed_record();
        let after_retention = committed.retain_until;
        let (change, outcome) =
            claim_with(Some(&committed), &claim_request(), after_retention, 2, 11);
        assert_eq!(put(change).attempt, 1);
        assert!(matches!(
            outcome,
            ClaimOutcome::Claimed {
                recovered: false,
                ..
            }
        ));
    }

    #[test]
    fn claim_of_live_lease_is_in_progress_with_remaining_time() {
        let held = claimed_record();
        let now = at(Duration::from_secs(10));
        let mut fencing_issued = false;
        let (change, outcome) = claim(
            Some(&held),
            &claim_request(),
            now,
            LeaseToken(2),
            None,
            || {
                fencing_issued = true;
                Ok::<_, Infallible>(FencingToken(99))
            },
        )
        .unwrap();
        assert_eq!(change, Change::Keep);
        assert!(!fencing_issued, "no fencing token is spent on a refusal");
        assert_eq!(
            outcome,
            ClaimOutcome::InProgress {
                record: held,
                retry_after: Duration::from_secs(20)
            }
        );
    }

    #[test]
    fn claim_after_lease_expiry_is_recovered_with_higher_fencing_and_attempt() {
        let held = claimed_record();
        let (change, outcome) = claim_with(Some(&held), &claim_request(), at(LEASE), 2, 11);
        let record = put(change);
        assert_eq!(record.attempt, 2);
        assert_eq!(record.lease_token, LeaseToken(2));
        assert!(record.fencing_token > held.fencing_token);
        assert!(matches!(
            outcome,
            ClaimOutcome::Claimed {
                recovered: true,
                ..
            }
        ));
    }

    #[test]
    fn claim_of_committed_key_is_duplicate_carrying_the_commit() {
        let committed = committed_record();
        let (change, outcome) = claim_with(
            Some(&committed),
            &claim_request(),
            at(Duration::from_secs(600)),
            2,
            11,
        );
        assert_eq!(change, Change::Keep);
        let ClaimOutcome::Duplicate { record } = outcome else {
            panic!("expected DUPLICATE, got {outcome:?}");
        };
        assert_eq!(record.response, b"done");
        assert_eq!(record.committed_at, Some(at(Duration::from_secs(1))));
        assert_eq!(record.fencing_token, FencingToken(10));
        assert_eq!(record.event_type, "PaymentReceived");
        assert_eq!(record.consumer_version, "1.0.0");
    }

    #[test]
    fn claim_with_other_fingerprint_is_mismatch_in_every_state() {
        let first = ClaimRequest {
            payload_fingerprint: "sha-a".into(),
            request_id: "delivery-7".into(),
            ..claim_request()
        };
        let held = put(claim_with(None, &first, T0, 1, 10).0);
        let released = put(release(
            Some(&held),
            &ReleaseRequest {
                key: key(),
                lease_token: held.lease_token,
            },
            T0,
        )
        .0);
        assert_eq!(released.state, RecordState::Released);
        let other = ClaimRequest {
            payload_fingerprint: "sha-b".into(),
            ..claim_request()
        };
        // Protocol §2: any live record with another non-empty fingerprint
        // answers FINGERPRINT_MISMATCH with the record as it is, changes
        // nothing and spends no fencing token; every state, every row.
        let cases = [
            ("claimed, lease live", held.clone(), at(LEASE / 2), &other),
            (
                "claimed, lease live, the claim's own request_id",
                held.clone(),
                at(LEASE / 2),
                &ClaimRequest {
                    request_id: "delivery-7".into(),
                    ..other.clone()
                },
            ),
            (
                "claimed, lease expired",
                held.clone(),
                at(LEASE * 2),
                &other,
            ),
            (
                "committed",
                committed_with_fingerprint(&held),
                at(LEASE * 2),
                &other,
            ),
            (
                "released",
                released.clone(),
                at(Duration::from_secs(1)),
                &other,
            ),
        ];
        for state in [
            RecordState::Claimed,
            RecordState::Committed,
            RecordState::Released,
        ] {
            assert!(
                cases
                    .iter()
                    .any(|(_, existing, _, _)| existing.state == state),
                "no case for {state:?}"
            );
        }
        for (what, existing, now, request) in cases {
            assert!(live(Some(&existing), now).is_some(), "{what}: live");
            let mut fencing_issued = false;
            let answer = claim(Some(&existing), request, now, LeaseToken(2), None, || {
                fencing_issued = true;
                Ok::<_, Infallible>(FencingToken(11))
            })
            .unwrap();
            assert_eq!(
                answer,
                (
                    Change::Keep,
                    ClaimOutcome::FingerprintMismatch {
                        record: existing.clone()
                    }
                ),
                "{what}"
            );
            assert!(!fencing_issued, "{what}: no fencing token is spent");
        }
        // A record past its retention is absent: the other payload claims.
        let (change, outcome) = claim_with(Some(&released), &other, released.retain_until, 2, 11);
        assert_eq!(put(change).payload_fingerprint, "sha-b");
        assert!(matches!(
            outcome,
            ClaimOutcome::Claimed {
                recovered: false,
                ..
            }
        ));
        // An empty fingerprint on either side is not a mismatch.
        let (_, outcome) = claim_with(Some(&held), &claim_request(), at(LEASE), 2, 11);
        assert!(matches!(outcome, ClaimOutcome::Claimed { .. }));
        let (_, outcome) = claim_with(Some(&held), &first, at(LEASE), 2, 11);
        assert!(matches!(outcome, ClaimOutcome::Claimed { .. }));
    }

    fn committed_with_fingerprint(held: &Record) -> Record {
        let request = CommitRequest {
            key: key(),
            lease_token: held.lease_token,
            response: Vec::new(),
            retention: None,
        };
        put(commit(Some(held), &request, T0).0)
    }

    #[test]
    fn commit_by_holder_commits_even_after_lease_expiry_and_is_idempotent() {
        let held = claimed_record();
        let request = CommitRequest {
            key: key(),
            lease_token: LeaseToken(1),
            response: b"r".to_vec(),
            retention: Some(Duration::from_secs(60)),
        };
        let late = at(LEASE * 3);
        let (change, outcome) = commit(Some(&held), &request, late);
        let committed = put(change);
        assert_eq!(committed.state, RecordState::Committed);
        assert_eq!(committed.committed_at, Some(late));
        assert_eq!(
            committed.retain_until,
            late.saturating_add(Duration::from_secs(60))
        );
        assert_eq!(outcome, Ok(CommitOutcome::Committed(committed.clone())));

        let (change, again) = commit(Some(&committed), &request, late.saturating_add(LEASE));
        assert_eq!(change, Change::Keep);
        assert_eq!(again, Ok(CommitOutcome::AlreadyCommitted(committed)));
    }

    #[test]
    fn commit_with_any_other_token_or_state_is_lease_lost() {
        let held = claimed_record();
        let stranger = CommitRequest {
            key: key(),
            lease_token: LeaseToken(2),
            response: Vec::new(),
            retention: None,
        };
        assert_eq!(
            commit(Some(&held), &stranger, T0),
            (Change::Keep, Err(LeaseLost))
        );
        assert_eq!(commit(None, &stranger, T0), (Change::Keep, Err(LeaseLost)));
        // The holder lost it: someone re-claimed after the lease expired.
        let reclaimed = put(claim_with(Some(&held), &claim_request(), at(LEASE), 2, 11).0);
        let holder = CommitRequest {
            lease_token: LeaseToken(1),
            ..stranger
        };
        assert_eq!(
            commit(Some(&reclaimed), &holder, at(LEASE)),
            (Change::Keep, Err(LeaseLost))
        );
        // ...or released it.
        let release_request = ReleaseRequest {
            key: key(),
            lease_token: LeaseToken(1),
        };
        let released = put(release(Some(&held), &release_request, T0).0);
        assert_eq!(
            commit(Some(&released), &holder, T0),
            (Change::Keep, Err(LeaseLost))
        );
    }

    #[test]
    fn release_makes_key_claimable_at_once_and_keeps_attempts() {
        let held = claimed_record();
        let request = ReleaseRequest {
            key: key(),
            lease_token: LeaseToken(1),
        };
        let now = at(Duration::from_secs(5));
        let (change, outcome) = release(Some(&held), &request, now);
        let released = put(change);
        assert_eq!(outcome, Ok(ReleaseOutcome::Released));
        assert_eq!(released.state, RecordState::Released);
        assert_eq!(released.retain_until, now.saturating_add(RETENTION));

        let (change, outcome) = claim_with(Some(&released), &claim_request(), now, 2, 11);
        assert_eq!(put(change).attempt, 2);
        assert!(matches!(
            outcome,
            ClaimOutcome::Claimed {
                recovered: false,
                ..
            }
        ));
    }

    #[test]
    fn release_is_idempotent_and_fine_on_absent_keys() {
        let request = ReleaseRequest {
            key: key(),
            lease_token: LeaseToken(1),
        };
        let released = put(release(Some(&claimed_record()), &request, T0).0);
        assert_eq!(
            release(Some(&released), &request, T0),
            (Change::Keep, Ok(ReleaseOutcome::AlreadyReleased))
        );
        assert_eq!(
            release(None, &request, T0),
            (Change::Keep, Ok(ReleaseOutcome::NotFound))
        );
    }

    #[test]
    fn release_of_someone_elses_claim_or_a_commit_is_lease_lost() {
        let stranger = ReleaseRequest {
            key: key(),
            lease_token: LeaseToken(2),
        };
        assert_eq!(
            release(Some(&claimed_record()), &stranger, T0),
            (Change::Keep, Err(LeaseLost))
        );
        let holder = ReleaseRequest {
            lease_token: LeaseToken(1),
            ..stranger
        };
        assert_eq!(
            release(Some(&committed_record()), &holder, T0),
            (Change::Keep, Err(LeaseLost))
        );
    }

    #[test]
    fn claim_retried_with_its_request_id_gets_the_same_claim_back() {
        let first = ClaimRequest {
            request_id: "delivery-7".into(),
            ..claim_request()
        };
        let held = put(claim_with(None, &first, T0, 1, 10).0);
        let (change, outcome) = claim_with(Some(&held), &first, at(Duration::from_secs(5)), 2, 11);
        assert_eq!(change, Change::Keep);
        assert_eq!(
            outcome,
            ClaimOutcome::Claimed {
                record: held.clone(),
                recovered: false
            }
        );
        // Another request ID, or none, is someone else: IN_PROGRESS.
        for other in ["delivery-8", ""] {
            let request = ClaimRequest {
                request_id: other.into(),
                ..claim_request()
            };
            let (_, outcome) = claim_with(Some(&held), &request, at(Duration::from_secs(5)), 2, 11);
            assert!(
                matches!(outcome, ClaimOutcome::InProgress { .. }),
                "{other:?}"
            );
        }
        // Once the lease ended, the retry is a new (recovered) claim.
        let (change, outcome) = claim_with(Some(&held), &first, at(LEASE), 3, 12);
        assert_eq!(put(change).fencing_token, FencingToken(12));
        assert!(matches!(
            outcome,
            ClaimOutcome::Claimed {
                recovered: true,
                ..
            }
        ));
    }

    #[test]
    fn release_of_a_record_released_with_another_token_is_lease_lost() {
        let holder = ReleaseRequest {
            key: key(),
            lease_token: LeaseToken(1),
        };
        let released = put(release(Some(&claimed_record()), &holder, T0).0);
        let stranger = ReleaseRequest {
            lease_token: LeaseToken(2),
            ..holder
        };
        assert_eq!(
            release(Some(&released), &stranger, T0),
            (Change::Keep, Err(LeaseLost))
        );
    }

    #[test]
    fn renew_extends_the_holders_lease_only() {
        let held = claimed_record();
        let request = RenewRequest {
            key: key(),
            lease_token: LeaseToken(1),
            lease_ttl: Duration::from_secs(120),
        };
        let now = at(Duration::from_secs(25));
        let (change, outcome) = renew(Some(&held), &request, now);
        let renewed = put(change);
        assert_eq!(outcome, Ok(now.saturating_add(Duration::from_secs(120))));
        assert_eq!(
            renewed.lease_expires_at,
            now.saturating_add(Duration::from_secs(120))
        );
        assert_eq!(
            renewed.retain_until,
            renewed.lease_expires_at.saturating_add(RETENTION)
        );
        // The renewed lease holds off another claimer past the old expiry.
        let (_, outcome) = claim_with(Some(&renewed), &claim_request(), at(LEASE), 2, 11);
        assert!(matches!(outcome, ClaimOutcome::InProgress { .. }));

        let stranger = RenewRequest {
            lease_token: LeaseToken(2),
            ..request.clone()
        };
        assert_eq!(
            renew(Some(&held), &stranger, now),
            (Change::Keep, Err(LeaseLost))
        );
        assert_eq!(
            renew(Some(&committed_record()), &request, now),
            (Change::Keep, Err(LeaseLost))
        );
    }

    #[test]
    fn expired_records_read_as_absent_for_every_call() {
        let committed = committed_record();
        let gone = committed.retain_until;
        assert!(live(Some(&committed), gone).is_none());
        assert!(live(Some(&committed), UnixMillis(gone.0 - 1)).is_some());
        let request = CommitRequest {
            key: key(),
            lease_token: LeaseToken(1),
            response: Vec::new(),
            retention: None,
        };
        assert_eq!(
            commit(Some(&committed), &request, gone),
            (Change::Keep, Err(LeaseLost))
        );
        assert_eq!(forget(Some(&committed), gone), (Change::Delete, false));
        assert_eq!(forget(None, gone), (Change::Keep, false));
        // An abandoned claim stays recoverable for its retention after the lease.
        let held = claimed_record();
        assert!(live(
            Some(&held),
            at(LEASE + RETENTION - Duration::from_millis(1))
        )
        .is_some());
        assert!(live(Some(&held), at(LEASE + RETENTION)).is_none());
    }

    #[test]
    fn stale_sequence_is_refused_and_commit_raises_the_mark() {
        let with_sequence = |sequence| ClaimRequest {
            ordering: Some(OrderingPosition {
                ordering_key: "link-7".into(),
                sequence,
            }),
            ..claim_request()
        };
        for sequence in [1, 2] {
            let (change, outcome) = claim(
                None,
                &with_sequence(sequence),
                T0,
                LeaseToken(1),
                Some(2),
                || Ok::<_, Infallible>(FencingToken(5)),
            )
            .unwrap();
            assert_eq!(change, Change::Keep);
            assert_eq!(
                outcome,
                ClaimOutcome::Stale {
                    highest_committed_sequence: 2
                }
            );
        }
        let (change, _) = claim(None, &with_sequence(3), T0, LeaseToken(1), Some(2), || {
            Ok::<_, Infallible>(FencingToken(5))
        })
        .unwrap();
        let held = put(change);
        let request = CommitRequest {
            key: key(),
            lease_token: LeaseToken(1),
            response: Vec::new(),
            retention: None,
        };
        let committed = put(commit(Some(&held), &request, T0).0);
        let old_mark = SequenceMark {
            highest: 2,
            retain_until: at(RETENTION * 10),
        };
        let raised = raise_mark(Some(old_mark), &committed, T0).expect("raised");
        assert_eq!(raised.highest, 3);
        assert_eq!(raised.retain_until, old_mark.retain_until);
        // A late commit of a lower sequence never lowers the mark.
        let higher = SequenceMark {
            highest: 9,
            ..old_mark
        };
        assert_eq!(raise_mark(Some(higher), &committed, T0), None);
        // Commits without ordering leave marks alone.
        assert_eq!(raise_mark(Some(higher), &committed_record(), T0), None);
    }

    #[test]
    fn duplicate_wins_over_stale_for_a_redelivered_committed_event() {
        let committed = committed_record();
        let request = ClaimRequest {
            ordering: Some(OrderingPosition {
                ordering_key: "link-7".into(),
                sequence: 1,
            }),
            ..claim_request()
        };
        let (_, outcome) = claim(
            Some(&committed),
            &request,
            T0,
            LeaseToken(2),
            Some(5),
            || Ok::<_, Infallible>(FencingToken(5)),
        )
        .unwrap();
        assert!(matches!(outcome, ClaimOutcome::Duplicate { .. }));
    }
}
