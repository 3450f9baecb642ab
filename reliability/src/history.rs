//! A history: every call the clients made, with when it was sent and when
//! (if ever) its answer came, in milliseconds of the wall clock the sidecar
//! reads too.

/// A lease token as the clients see it (the 128-bit value).
pub type Token = u128;

/// One call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// Claim with this lease.
    Claim { lease_ms: u64 },
    /// Commit with this token.
    Commit { token: Token },
    /// Release with this token.
    Release { token: Token },
    /// Renew this token's lease to this length.
    Renew { token: Token, lease_ms: u64 },
    /// Lookup.
    Lookup,
}

/// The record's state as Lookup shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Held (its lease may have run out).
    Claimed,
    /// Processed.
    Committed,
    /// Given back.
    Released,
}

/// What a Release answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// Released now.
    Released,
    /// Released before with this token.
    AlreadyReleased,
    /// No record.
    NotFound,
}

/// What the sidecar answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// CLAIMED.
    Claimed {
        token: Token,
        fencing: u64,
        attempt: u32,
        recovered: bool,
        lease_expires_ms: u64,
    },
    /// DUPLICATE.
    Duplicate { fencing: u64, attempt: u32 },
    /// IN_PROGRESS.
    InProgress { retry_after_ms: u64 },
    /// COMMITTED (`already`: ALREADY_COMMITTED).
    Committed { already: bool },
    /// Commit, Release or Renew refused: FAILED_PRECONDITION.
    LeaseLost,
    /// A Release's outcome.
    Release(Released),
    /// Renewed to this expiry.
    Renewed { lease_expires_ms: u64 },
    /// Lookup found a record.
    Found {
        state: State,
        fencing: u64,
        attempt: u32,
    },
    /// Lookup found nothing.
    Absent,
    /// No answer (the sidecar was killed, the call timed out): the call may
    /// or may not have taken effect, at any time after it was sent and
    /// before `Operation::completed_ms`.
    Unknown,
}

/// One call and its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    /// Which client made it (for reports).
    pub client: usize,
    /// Which key (histories are checked key by key).
    pub key: u32,
    /// What was asked.
    pub call: Call,
    /// When it was sent (floor, ms).
    pub invoked_ms: u64,
    /// When the answer came (ceil, ms); for an unknown answer, the latest
    /// moment it could still have taken effect (e.g. when the sidecar was
    /// killed).
    pub completed_ms: u64,
    /// What came back.
    pub answer: Answer,
}

impl Answer {
    /// A short name of the answer's kind, for counts.
    pub fn kind(&self) -> &'static str {
        match self {
            Answer::Claimed {
                recovered: false, ..
            } => "claimed",
            Answer::Claimed {
                recovered: true, ..
            } => "claimed_recovered",
            Answer::Duplicate { .. } => "duplicate",
            Answer::InProgress { .. } => "in_progress",
            Answer::Committed { already: false } => "committed",
            Answer::Committed { already: true } => "already_committed",
            Answer::LeaseLost => "lease_lost",
            Answer::Release(Released::Released) => "released",
            Answer::Release(Released::AlreadyReleased) => "already_released",
            Answer::Release(Released::NotFound) => "release_not_found",
            Answer::Renewed { .. } => "renewed",
            Answer::Found { .. } => "found",
            Answer::Absent => "absent",
            Answer::Unknown => "unknown",
        }
    }
}

/// How many answers of each kind a history has.
pub fn answer_counts(history: &[Operation]) -> std::collections::BTreeMap<&'static str, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for operation in history {
        *counts.entry(operation.answer.kind()).or_insert(0) += 1;
    }
    counts
}
