//! The state machine of SPEC §2, as pure functions of (record, request, now).
//!
//! Every store runs these same functions inside its atomic read-modify-write
//! of one key, so no rule exists twice. A function answers with the
//! [`Change`] to apply and the outcome to report; it never does I/O. The one
//! thing it cannot invent, a fresh fencing token, it asks the store for
//! through `issue_fencing`, and only when it grants a claim.

use crate::{
    clock::UnixMillis,
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
pub fn live(current: Option<&Record>, now: UnixMillis) -> Option<&Record> {
    current.filter(|record| now < record.retain_until)
}

/// Same rule for ordering marks.
pub fn live_mark(mark: Option<SequenceMark>, now: UnixMillis) -> Option<SequenceMark> {
    mark.filter(|mark| now < mark.retain_until)
}

/// Claim: see the table in SPEC §2. `highest_committed_sequence` is the live
/// mark of the request's ordering scope, if it has one.
pub fn claim<E>(
    current: Option<&Record>,
    request: &ClaimRequest,
    now: UnixMillis,
    lease_token: LeaseToken,
    highest_committed_sequence: Option<u64>,
    issue_fencing: impl FnOnce() -> Result<FencingToken, E>,
) -> Result<(Change, ClaimOutcome), E> {
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
            RecordState::Claimed if now < record.lease_expires_at => {
                let retry_after = record.lease_expires_at.saturating_since(now);
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
    let lease_expires_at = now.saturating_add(request.lease_ttl);
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
        claimed_at: now,
        committed_at: None,
        retain_until: lease_expires_at.saturating_add(request.retention),
        retention: request.retention,
        response: Vec::new(),
        ordering: request.ordering.clone(),
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
    now: UnixMillis,
) -> (Change, Result<CommitOutcome, LeaseLost>) {
    let Some(record) = held_by(live(current, now), request.lease_token) else {
        return (Change::Keep, Err(LeaseLost));
    };
    match record.state {
        RecordState::Claimed => {
            let retention = request.retention.unwrap_or(record.retention);
            let committed = Record {
                state: RecordState::Committed,
                committed_at: Some(now),
                retain_until: now.saturating_add(retention),
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
/// so the attempt count is kept. Releasing what is already released or
/// absent is fine; releasing someone else's claim or a commit is not.
pub fn release(
    current: Option<&Record>,
    request: &ReleaseRequest,
    now: UnixMillis,
) -> (Change, Result<ReleaseOutcome, LeaseLost>) {
    let Some(record) = live(current, now) else {
        return (Change::Keep, Ok(ReleaseOutcome::NotFound));
    };
    match record.state {
        RecordState::Released => (Change::Keep, Ok(ReleaseOutcome::AlreadyReleased)),
        RecordState::Claimed if record.lease_token == request.lease_token => {
            let released = Record {
                state: RecordState::Released,
                lease_expires_at: now,
                retain_until: now.saturating_add(record.retention),
                ..record.clone()
            };
            (Change::Put(released), Ok(ReleaseOutcome::Released))
        }
        RecordState::Claimed | RecordState::Committed => (Change::Keep, Err(LeaseLost)),
    }
}

/// Renew: extends the lease of the latest claim (expired or not, as long as
/// nobody claimed the key since) to `now + lease_ttl`.
pub fn renew(
    current: Option<&Record>,
    request: &RenewRequest,
    now: UnixMillis,
) -> (Change, Result<UnixMillis, LeaseLost>) {
    match held_by(live(current, now), request.lease_token) {
        Some(record) if record.state == RecordState::Claimed => {
            let lease_expires_at = now.saturating_add(request.lease_ttl);
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
pub fn forget(current: Option<&Record>, now: UnixMillis) -> (Change, bool) {
    let existed = live(current, now).is_some();
    let change = if current.is_some() {
        Change::Delete
    } else {
        Change::Keep
    };
    (change, existed)
}

/// The ordering mark after `record` was committed: a commit raises the
/// highest committed sequence of its ordering scope (never lowers it) and
/// keeps the mark at least as long as the record. `None` means no change.
pub fn raise_mark(
    current: Option<SequenceMark>,
    committed: &Record,
    now: UnixMillis,
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
