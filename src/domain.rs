//! The vocabulary shared by the state machine, the stores and the API: keys,
//! tokens, records and the validated requests the engine executes.

use std::{fmt, str::FromStr, time::Duration};

use crate::clock::UnixMillis;

/// The namespace used when a request leaves it empty.
pub const DEFAULT_NAMESPACE: &str = "default";
/// Longest namespace, in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 128;
/// Longest correlation ID, in bytes.
pub const MAX_CORRELATION_ID_BYTES: usize = 256;

/// A deduplication key: `(namespace, correlation_id)`, both already validated.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    namespace: String,
    correlation_id: String,
}

impl Key {
    /// Builds a key from parts the caller has validated (see `api::validate`).
    pub(crate) fn new_unchecked(namespace: String, correlation_id: String) -> Self {
        Key {
            namespace,
            correlation_id,
        }
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The producer's correlation ID.
    pub fn correlation_id(&self) -> &str {
        &self.correlation_id
    }

    /// The byte form stores index by: `namespace NUL correlation_id`. NUL can
    /// appear in neither part, so the encoding is unambiguous and keeps one
    /// namespace's keys contiguous.
    pub fn to_bytes(&self) -> Vec<u8> {
        join_scoped(&self.namespace, &self.correlation_id)
    }

    /// Inverse of [`Key::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Option<Key> {
        let (namespace, correlation_id) = split_scoped(bytes)?;
        Some(Key::new_unchecked(namespace, correlation_id))
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.correlation_id)
    }
}

/// An ordering key scoped to its namespace: the unit of the ordering guard.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OrderingScope {
    /// The namespace of the claims that carry it.
    pub namespace: String,
    /// The ordering key, e.g. the entity the events are about.
    pub ordering_key: String,
}

impl OrderingScope {
    /// The byte form stores index by (same layout as [`Key::to_bytes`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        join_scoped(&self.namespace, &self.ordering_key)
    }

    /// Inverse of [`OrderingScope::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Option<OrderingScope> {
        let (namespace, ordering_key) = split_scoped(bytes)?;
        Some(OrderingScope {
            namespace,
            ordering_key,
        })
    }
}

fn join_scoped(namespace: &str, name: &str) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(namespace.len() + 1 + name.len());
    bytes.extend_from_slice(namespace.as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(name.as_bytes());
    bytes
}

fn split_scoped(bytes: &[u8]) -> Option<(String, String)> {
    let separator = bytes.iter().position(|&b| b == 0)?;
    let namespace = std::str::from_utf8(&bytes[..separator]).ok()?;
    let name = std::str::from_utf8(&bytes[separator + 1..]).ok()?;
    Some((namespace.to_owned(), name.to_owned()))
}

/// The secret a claimer presents to Commit, Release or Renew: 128 random bits,
/// shown as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken(pub u128);

impl LeaseToken {
    /// A fresh random token.
    pub fn random() -> Self {
        LeaseToken(rand::random())
    }
}

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

// Lease tokens are capabilities: keep them out of logs and panic messages.
impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseToken(..)")
    }
}

/// A malformed lease token string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MalformedLeaseToken;

impl FromStr for LeaseToken {
    type Err = MalformedLeaseToken;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(MalformedLeaseToken);
        }
        u128::from_str_radix(text, 16)
            .map(LeaseToken)
            .map_err(|_| MalformedLeaseToken)
    }
}

/// A number that grows with every claim a store grants, across restarts:
/// downstream systems can reject writes from a holder whose token is older
/// than one they have seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct FencingToken(pub u64);

/// Where a record is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordState {
    /// Held by the lease token's owner until `lease_expires_at`.
    Claimed,
    /// Processed; duplicates are answered from the record.
    Committed,
    /// Given up by its holder; claimable at once.
    Released,
}

impl RecordState {
    /// The state's number, the same in the API's `RecordState` enum and in
    /// records at rest (so neither may ever renumber).
    pub fn code(self) -> i32 {
        match self {
            RecordState::Claimed => 1,
            RecordState::Committed => 2,
            RecordState::Released => 3,
        }
    }

    /// The state numbered `code`, if any.
    pub fn from_code(code: i32) -> Option<RecordState> {
        [
            RecordState::Claimed,
            RecordState::Committed,
            RecordState::Released,
        ]
        .into_iter()
        .find(|state| state.code() == code)
    }
}

/// An event's position in its ordering key's sequence.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OrderingPosition {
    /// The ordering key (namespace-scoped).
    pub ordering_key: String,
    /// The event's sequence number within the ordering key.
    pub sequence: u64,
}

/// Everything stored for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Where the record is in its life.
    pub state: RecordState,
    /// The token of the latest claim.
    pub lease_token: LeaseToken,
    /// The fencing token of the latest claim.
    pub fencing_token: FencingToken,
    /// When the latest claim's lease ends.
    pub lease_expires_at: UnixMillis,
    /// How many claims the key has had.
    pub attempt: u32,
    /// Event type given at claim.
    pub event_type: String,
    /// Consumer version given at claim.
    pub consumer_version: String,
    /// Free text naming the claimer.
    pub owner: String,
    /// Payload fingerprint given at the first claim that had one.
    pub payload_fingerprint: String,
    /// When the latest claim was granted.
    pub claimed_at: UnixMillis,
    /// When the event was committed.
    pub committed_at: Option<UnixMillis>,
    /// After this moment the record reads as absent and may be reaped.
    pub retain_until: UnixMillis,
    /// The retention asked for, kept to recompute `retain_until`.
    pub retention: Duration,
    /// The response cached at commit.
    pub response: Vec<u8>,
    /// The ordering position given at claim.
    pub ordering: Option<OrderingPosition>,
    /// The client's ID of the latest Claim (empty: none given), so that the
    /// same Claim retried gets the same claim back.
    pub request_id: String,
    /// Whether the latest claim took over an expired one.
    pub recovered: bool,
    /// Never stored: set by the engine on a committed record whose sealed
    /// answer's key is not configured (erased by removing it); `response`
    /// is then empty.
    pub response_erased: bool,
}

/// A validated Claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The key to claim.
    pub key: Key,
    /// The lease to grant (already defaulted and bounded).
    pub lease_ttl: Duration,
    /// The retention to keep the record for (already defaulted and bounded).
    pub retention: Duration,
    /// Event type, stored for Lookup.
    pub event_type: String,
    /// Consumer version, stored for Lookup.
    pub consumer_version: String,
    /// Free text naming the claimer.
    pub owner: String,
    /// Payload fingerprint; empty when not given.
    pub payload_fingerprint: String,
    /// The ordering position, when the guard is used.
    pub ordering: Option<OrderingPosition>,
    /// The client's ID of this Claim (empty: none): retried while the claim
    /// it made is live, the same claim is answered again.
    pub request_id: String,
}

impl ClaimRequest {
    /// A Claim of `key` carrying nothing else: no metadata, fingerprint,
    /// ordering position or request ID.
    pub fn plain(key: Key, lease_ttl: Duration, retention: Duration) -> Self {
        ClaimRequest {
            key,
            lease_ttl,
            retention,
            event_type: String::new(),
            consumer_version: String::new(),
            owner: String::new(),
            payload_fingerprint: String::new(),
            ordering: None,
            request_id: String::new(),
        }
    }
}

/// A validated Commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitRequest {
    /// The key to commit.
    pub key: Key,
    /// The claimer's lease token.
    pub lease_token: LeaseToken,
    /// The response to cache for duplicates.
    pub response: Vec<u8>,
    /// A retention overriding the one given at claim.
    pub retention: Option<Duration>,
}

/// A validated Release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseRequest {
    /// The key to release.
    pub key: Key,
    /// The claimer's lease token.
    pub lease_token: LeaseToken,
}

/// A validated Renew.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenewRequest {
    /// The key whose lease to extend.
    pub key: Key,
    /// The claimer's lease token.
    pub lease_token: LeaseToken,
    /// The new lease, counted from now.
    pub lease_ttl: Duration,
}

/// The answer to a Claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller holds the key.
    Claimed {
        /// The new record (holding the new lease and fencing tokens).
        record: Record,
        /// A previous holder's lease expired without Commit or Release.
        recovered: bool,
    },
    /// Already committed.
    Duplicate {
        /// The committed record.
        record: Record,
    },
    /// Another holder has a live lease.
    InProgress {
        /// The current record.
        record: Record,
        /// Time left on the holder's lease.
        retry_after: Duration,
    },
    /// The key exists with a different payload fingerprint.
    FingerprintMismatch {
        /// The existing record.
        record: Record,
    },
    /// A sequence at least as high was committed for the ordering key.
    Stale {
        /// The highest committed sequence of the ordering key.
        highest_committed_sequence: u64,
    },
}

impl ClaimOutcome {
    /// What kind of answer this is, for metrics and logs (which must not
    /// carry payloads).
    pub fn kind(&self) -> OutcomeKind {
        match self {
            ClaimOutcome::Claimed {
                recovered: true, ..
            } => OutcomeKind::Recovered,
            ClaimOutcome::Claimed { .. } => OutcomeKind::Claimed,
            ClaimOutcome::Duplicate { .. } => OutcomeKind::Duplicate,
            ClaimOutcome::InProgress { .. } => OutcomeKind::InProgress,
            ClaimOutcome::FingerprintMismatch { .. } => OutcomeKind::FingerprintMismatch,
            ClaimOutcome::Stale { .. } => OutcomeKind::Stale,
        }
    }
}

/// Every kind of answer the engine counts (protocol §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutcomeKind {
    /// A fresh claim.
    Claimed,
    /// A claim after an expired lease.
    Recovered,
    /// DUPLICATE.
    Duplicate,
    /// IN_PROGRESS.
    InProgress,
    /// FINGERPRINT_MISMATCH.
    FingerprintMismatch,
    /// STALE.
    Stale,
    /// COMMITTED (by this call).
    Committed,
    /// LEASE_LOST on Commit, Release or Renew.
    LeaseLost,
    /// RELEASED (by this call).
    Released,
}

impl OutcomeKind {
    /// The name in metrics labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeKind::Claimed => "claimed",
            OutcomeKind::Recovered => "recovered",
            OutcomeKind::Duplicate => "duplicate",
            OutcomeKind::InProgress => "in_progress",
            OutcomeKind::FingerprintMismatch => "fingerprint_mismatch",
            OutcomeKind::Stale => "stale",
            OutcomeKind::Committed => "committed",
            OutcomeKind::LeaseLost => "lease_lost",
            OutcomeKind::Released => "released",
        }
    }
}

/// The answer to a Commit that kept its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitOutcome {
    /// Committed by this call.
    Committed(Record),
    /// Committed before with the same lease token.
    AlreadyCommitted(Record),
}

impl CommitOutcome {
    /// The committed record.
    pub fn record(&self) -> &Record {
        match self {
            CommitOutcome::Committed(record) | CommitOutcome::AlreadyCommitted(record) => record,
        }
    }
}

/// The answer to a Release that kept its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// Released by this call.
    Released,
    /// Released before with the same lease token.
    AlreadyReleased,
    /// No live record.
    NotFound,
}

/// The lease token no longer holds the key (someone else claimed or
/// committed it, or it was released).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLost;

#[cfg(test)]
impl Record {
    /// A committed record, live for ever, with `response`: for the stores'
    /// unit tests.
    pub(crate) fn committed_for_tests(response: Vec<u8>) -> Record {
        Record {
            state: RecordState::Committed,
            lease_token: LeaseToken(7),
            fencing_token: FencingToken(9),
            lease_expires_at: UnixMillis(1),
            attempt: 1,
            event_type: String::new(),
            consumer_version: String::new(),
            owner: String::new(),
            payload_fingerprint: String::new(),
            claimed_at: UnixMillis(1),
            committed_at: Some(UnixMillis(2)),
            retain_until: UnixMillis(u64::MAX),
            retention: std::time::Duration::from_secs(60),
            response,
            ordering: None,
            request_id: String::new(),
            recovered: false,
            response_erased: false,
        }
    }
}
