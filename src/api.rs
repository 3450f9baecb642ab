//! The edge between protobuf and the domain: validation of every request
//! field against protocol §1 (docs/protocol.md) and the server's [`Limits`] (each problem reported
//! as a field violation, all at once), and the conversion of outcomes back.

use std::{collections::HashMap, time::Duration};

use crate::{
    clock::UnixMillis,
    domain::{
        self, ClaimOutcome, CommitOutcome, Key, LeaseLost, LeaseToken, OrderingPosition, Record,
        ReleaseOutcome, DEFAULT_NAMESPACE, MAX_CORRELATION_ID_BYTES, MAX_NAMESPACE_BYTES,
    },
    engine::RekeyPage,
    error::{Error, FieldViolation},
    proto::v1 as pb,
    store::ScanCursor,
};

/// The longest lease any server allows.
pub const HARD_MAX_LEASE_TTL: Duration = Duration::from_secs(3600);
/// The longest retention any server allows.
pub const HARD_MAX_RETENTION: Duration = Duration::from_secs(365 * 24 * 3600);
/// The largest cached response any server allows.
pub const HARD_MAX_RESPONSE_BYTES: usize = 1 << 20;

const MAX_EVENT_TYPE_BYTES: usize = 128;
const MAX_CONSUMER_VERSION_BYTES: usize = 64;
const MAX_OWNER_BYTES: usize = 256;
const MAX_FINGERPRINT_BYTES: usize = 256;
const MAX_ORDERING_KEY_BYTES: usize = 256;
const MAX_REQUEST_ID_BYTES: usize = 128;

/// The server's limits (protocol §5, docs/protocol.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Lease granted when a request does not say.
    pub default_lease_ttl: Duration,
    /// Longest lease a request may ask for.
    pub max_lease_ttl: Duration,
    /// Retention used when neither the request nor its namespace says.
    pub default_retention: Duration,
    /// Longest retention a request may ask for.
    pub max_retention: Duration,
    /// Default retention per namespace.
    pub namespace_retention: HashMap<String, Duration>,
    /// Largest response Commit may cache.
    pub max_response_bytes: usize,
    /// Most items in one batch call.
    pub max_batch_size: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            default_lease_ttl: Duration::from_secs(30),
            max_lease_ttl: HARD_MAX_LEASE_TTL,
            default_retention: Duration::from_secs(7 * 24 * 3600),
            max_retention: HARD_MAX_RETENTION,
            namespace_retention: HashMap::new(),
            max_response_bytes: 64 << 10,
            max_batch_size: 1000,
        }
    }
}

/// Checks that a namespace is valid as written (protocol §1); used for config too.
pub fn check_namespace(namespace: &str) -> Result<(), String> {
    if namespace.len() > MAX_NAMESPACE_BYTES {
        return Err(format!(
            "must be at most {MAX_NAMESPACE_BYTES} bytes, got {}",
            namespace.len()
        ));
    }
    if let Some(bad) = namespace
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        return Err(format!("may hold only A-Z a-z 0-9 . _ : - (found {bad:?})"));
    }
    Ok(())
}

/// The shortest duration dedupd can keep: records count time in whole
/// milliseconds, so anything shorter would become zero.
pub const MIN_DURATION: Duration = Duration::from_millis(1);

/// Checks that a duration is at least [`MIN_DURATION`] and at most `max`;
/// used for config too, so a flag and a request field are held to the same
/// words.
pub fn check_duration(duration: Duration, max: Duration) -> Result<Duration, String> {
    if duration.is_zero() {
        Err("must be positive".into())
    } else if duration < MIN_DURATION {
        Err(format!(
            "must be at least 1ms (dedupd keeps time in milliseconds), got {}",
            human_duration(duration)
        ))
    } else if duration > max {
        Err(format!(
            "must be at most {}, got {}",
            human_duration(max),
            human_duration(duration)
        ))
    } else {
        Ok(duration)
    }
}

/// A duration the way a person writes it in a flag: the largest unit that
/// divides it exactly (`365days`, `1h`, `90m`, `30s`, `1500ms`), so limits
/// print as they were given and not as "11months 30days 3h 50m 24s".
pub fn human_duration(duration: Duration) -> String {
    const UNITS: [(&str, u128); 4] = [
        ("days", 86_400_000_000_000),
        ("h", 3_600_000_000_000),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
    ];
    let nanos = duration.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    for (unit, size) in UNITS {
        if nanos.is_multiple_of(size) {
            return format!("{}{unit}", nanos / size);
        }
    }
    if nanos.is_multiple_of(1_000_000) {
        format!("{}ms", nanos / 1_000_000)
    } else if nanos.is_multiple_of(1_000) {
        format!("{}us", nanos / 1_000)
    } else {
        format!("{nanos}ns")
    }
}

/// A byte count in the largest binary unit that keeps it readable
/// (`512 B`, `3.2 MiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = UNITS[0];
    for next in &UNITS[1..] {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = next;
    }
    format!("{value:.1} {unit}")
}

/// The largest `seconds` a `google.protobuf.Duration` may hold (10,000 years).
const MAX_PROTO_DURATION_SECONDS: i64 = 315_576_000_000;

/// A `google.protobuf.Duration` as its definition allows it: `nanos` within
/// ±999,999,999 with the sign of `seconds`, `seconds` within ±10,000 years.
/// prost would normalise anything else silently; a malformed value is a
/// client bug worth naming.
fn proto_duration(value: &prost_types::Duration) -> Result<Duration, String> {
    let prost_types::Duration { seconds, nanos } = *value;
    if !(-999_999_999..=999_999_999).contains(&nanos)
        || (seconds > 0 && nanos < 0)
        || (seconds < 0 && nanos > 0)
        || !(-MAX_PROTO_DURATION_SECONDS..=MAX_PROTO_DURATION_SECONDS).contains(&seconds)
    {
        return Err(format!(
            "is not a valid google.protobuf.Duration (seconds {seconds}, nanos {nanos}: nanos must be within ±999999999 and have the sign of seconds)"
        ));
    }
    if seconds < 0 || nanos < 0 {
        return Err("must be positive".into());
    }
    let seconds = u64::try_from(seconds).map_err(|_| "must be positive".to_owned())?;
    let nanos = u32::try_from(nanos).map_err(|_| "must be positive".to_owned())?;
    Ok(Duration::new(seconds, nanos))
}

/// Collects every violation of one request before answering.
struct Checker<'a> {
    limits: &'a Limits,
    prefix: String,
    violations: Vec<FieldViolation>,
}

impl<'a> Checker<'a> {
    fn new(limits: &'a Limits) -> Self {
        Checker {
            limits,
            prefix: String::new(),
            violations: Vec::new(),
        }
    }

    fn violation(&mut self, field: &str, description: impl Into<String>) {
        let field = format!("{}{field}", self.prefix);
        self.violations
            .push(FieldViolation::new(field, description));
    }

    fn finish<T>(self, value: Option<T>) -> Result<T, Error> {
        match value {
            Some(value) if self.violations.is_empty() => Ok(value),
            _ => Err(Error::InvalidArgument(self.violations)),
        }
    }

    fn key(&mut self, namespace: &str, correlation_id: &str) -> Option<Key> {
        let namespace = if namespace.is_empty() {
            DEFAULT_NAMESPACE
        } else {
            namespace
        };
        let namespace_ok = match check_namespace(namespace) {
            Ok(()) => true,
            Err(problem) => {
                self.violation("namespace", problem);
                false
            }
        };
        let id_ok = if correlation_id.is_empty() {
            self.violation("correlation_id", "is required");
            false
        } else if correlation_id.len() > MAX_CORRELATION_ID_BYTES {
            self.violation(
                "correlation_id",
                format!(
                    "must be at most {MAX_CORRELATION_ID_BYTES} bytes, got {}",
                    correlation_id.len()
                ),
            );
            false
        } else if correlation_id.chars().any(char::is_control) {
            self.violation("correlation_id", "must not contain control characters");
            false
        } else {
            true
        };
        (namespace_ok && id_ok)
            .then(|| Key::new_unchecked(namespace.to_owned(), correlation_id.to_owned()))
    }

    fn text(&mut self, field: &str, value: &str, max_bytes: usize) -> String {
        if value.len() > max_bytes {
            self.violation(
                field,
                format!("must be at most {max_bytes} bytes, got {}", value.len()),
            );
        } else if value.chars().any(char::is_control) {
            self.violation(field, "must not contain control characters");
        }
        value.to_owned()
    }

    fn duration(
        &mut self,
        field: &str,
        value: Option<&prost_types::Duration>,
        max: Duration,
    ) -> Option<Duration> {
        proto_duration(value?)
            .and_then(|duration| check_duration(duration, max))
            .map_err(|problem| self.violation(field, problem))
            .ok()
    }

    fn lease_token(&mut self, value: &str) -> Option<LeaseToken> {
        if value.is_empty() {
            self.violation("lease_token", "is required (the token returned by Claim)");
            return None;
        }
        let parsed = value.parse().ok();
        if parsed.is_none() {
            self.violation(
                "lease_token",
                "must be the 32 hexadecimal digits returned by Claim",
            );
        }
        parsed
    }

    fn retention_default(&self, key: Option<&Key>) -> Duration {
        key.and_then(|key| self.limits.namespace_retention.get(key.namespace()))
            .copied()
            .unwrap_or(self.limits.default_retention)
    }

    fn claim(&mut self, request: pb::ClaimRequest) -> Option<domain::ClaimRequest> {
        let key = self.key(&request.namespace, &request.correlation_id);
        let lease_ttl = self
            .duration(
                "lease_ttl",
                request.lease_ttl.as_ref(),
                self.limits.max_lease_ttl,
            )
            .unwrap_or(self.limits.default_lease_ttl);
        let retention = self
            .duration(
                "retention",
                request.retention.as_ref(),
                self.limits.max_retention,
            )
            .unwrap_or_else(|| self.retention_default(key.as_ref()));
        let event_type = self.text("event_type", &request.event_type, MAX_EVENT_TYPE_BYTES);
        let consumer_version = self.text(
            "consumer_version",
            &request.consumer_version,
            MAX_CONSUMER_VERSION_BYTES,
        );
        let owner = self.text("owner", &request.owner, MAX_OWNER_BYTES);
        let payload_fingerprint = self.text(
            "payload_fingerprint",
            &request.payload_fingerprint,
            MAX_FINGERPRINT_BYTES,
        );
        let ordering_key = self.text(
            "ordering_key",
            &request.ordering_key,
            MAX_ORDERING_KEY_BYTES,
        );
        let ordering = match (ordering_key.is_empty(), request.sequence) {
            (true, None) => None,
            (false, Some(sequence)) => Some(OrderingPosition {
                ordering_key,
                sequence,
            }),
            (false, None) => {
                self.violation("sequence", "is required when ordering_key is set");
                None
            }
            (true, Some(_)) => {
                self.violation("ordering_key", "is required when sequence is set");
                None
            }
        };
        let request_id = self.text("request_id", &request.request_id, MAX_REQUEST_ID_BYTES);
        Some(domain::ClaimRequest {
            key: key?,
            lease_ttl,
            retention,
            event_type,
            consumer_version,
            owner,
            payload_fingerprint,
            ordering,
            request_id,
        })
    }

    fn commit(&mut self, request: pb::CommitRequest) -> Option<domain::CommitRequest> {
        let key = self.key(&request.namespace, &request.correlation_id);
        let lease_token = self.lease_token(&request.lease_token);
        if request.response.len() > self.limits.max_response_bytes {
            self.violation(
                "response",
                format!(
                    "must be at most {} bytes (the server's --max-response-bytes), got {}",
                    self.limits.max_response_bytes,
                    request.response.len()
                ),
            );
        }
        let retention = self.duration(
            "retention",
            request.retention.as_ref(),
            self.limits.max_retention,
        );
        Some(domain::CommitRequest {
            key: key?,
            lease_token: lease_token?,
            response: request.response,
            retention,
        })
    }

    fn release(&mut self, request: pb::ReleaseRequest) -> Option<domain::ReleaseRequest> {
        let key = self.key(&request.namespace, &request.correlation_id);
        let lease_token = self.lease_token(&request.lease_token);
        Some(domain::ReleaseRequest {
            key: key?,
            lease_token: lease_token?,
        })
    }

    fn batch<P, D>(
        &mut self,
        items: Vec<P>,
        mut convert: impl FnMut(&mut Self, P) -> Option<D>,
    ) -> Option<Vec<D>> {
        if items.len() > self.limits.max_batch_size {
            self.violation(
                "items",
                format!(
                    "must hold at most {} items (the server's --max-batch-size), got {}",
                    self.limits.max_batch_size,
                    items.len()
                ),
            );
            return None;
        }
        let mut converted = Vec::with_capacity(items.len());
        for (index, item) in items.into_iter().enumerate() {
            self.prefix = format!("items[{index}].");
            if let Some(item) = convert(self, item) {
                converted.push(item);
            }
        }
        self.prefix.clear();
        Some(converted)
    }
}

impl Limits {
    /// Validates a Claim.
    pub fn claim(&self, request: pb::ClaimRequest) -> Result<domain::ClaimRequest, Error> {
        let mut checker = Checker::new(self);
        let claim = checker.claim(request);
        checker.finish(claim)
    }

    /// Validates a Commit.
    pub fn commit(&self, request: pb::CommitRequest) -> Result<domain::CommitRequest, Error> {
        let mut checker = Checker::new(self);
        let commit = checker.commit(request);
        checker.finish(commit)
    }

    /// Validates a Release.
    pub fn release(&self, request: pb::ReleaseRequest) -> Result<domain::ReleaseRequest, Error> {
        let mut checker = Checker::new(self);
        let release = checker.release(request);
        checker.finish(release)
    }

    /// Validates a Renew.
    pub fn renew(&self, request: pb::RenewRequest) -> Result<domain::RenewRequest, Error> {
        let mut checker = Checker::new(self);
        let key = checker.key(&request.namespace, &request.correlation_id);
        let lease_token = checker.lease_token(&request.lease_token);
        let lease_ttl = checker
            .duration("lease_ttl", request.lease_ttl.as_ref(), self.max_lease_ttl)
            .unwrap_or(self.default_lease_ttl);
        let renew = key
            .zip(lease_token)
            .map(|(key, lease_token)| domain::RenewRequest {
                key,
                lease_token,
                lease_ttl,
            });
        checker.finish(renew)
    }

    /// Validates the key of a Lookup or Forget.
    pub fn key(&self, namespace: &str, correlation_id: &str) -> Result<Key, Error> {
        let mut checker = Checker::new(self);
        let key = checker.key(namespace, correlation_id);
        checker.finish(key)
    }

    /// Validates a ClaimBatch.
    pub fn claim_batch(
        &self,
        items: Vec<pb::ClaimRequest>,
    ) -> Result<Vec<domain::ClaimRequest>, Error> {
        let mut checker = Checker::new(self);
        let claims = checker.batch(items, Checker::claim);
        checker.finish(claims)
    }

    /// Validates a CommitBatch.
    pub fn commit_batch(
        &self,
        items: Vec<pb::CommitRequest>,
    ) -> Result<Vec<domain::CommitRequest>, Error> {
        let mut checker = Checker::new(self);
        let commits = checker.batch(items, Checker::commit);
        checker.finish(commits)
    }

    /// Validates a ReleaseBatch.
    pub fn release_batch(
        &self,
        items: Vec<pb::ReleaseRequest>,
    ) -> Result<Vec<domain::ReleaseRequest>, Error> {
        let mut checker = Checker::new(self);
        let releases = checker.batch(items, Checker::release);
        checker.finish(releases)
    }

    /// Validates a Rekey page: where it starts and how many records.
    pub fn rekey(&self, request: pb::RekeyRequest) -> Result<(ScanCursor, usize, bool), Error> {
        let mut violations = Vec::new();
        if request.cursor.len() > MAX_REKEY_CURSOR_BYTES {
            violations.push(FieldViolation::new(
                "cursor",
                format!("must be at most {MAX_REKEY_CURSOR_BYTES} bytes (send back next_cursor as it came)"),
            ));
        }
        let page_size = match request.page_size {
            0 => DEFAULT_REKEY_PAGE,
            size if size as usize > MAX_REKEY_PAGE => {
                violations.push(FieldViolation::new(
                    "page_size",
                    format!("must be at most {MAX_REKEY_PAGE}, got {size}"),
                ));
                0
            }
            size => size as usize,
        };
        if violations.is_empty() {
            Ok((
                ScanCursor(request.cursor),
                page_size,
                request.retire_old_keys,
            ))
        } else {
            Err(Error::InvalidArgument(violations))
        }
    }
}

/// Records a Rekey page looks at when the request does not say.
pub const DEFAULT_REKEY_PAGE: usize = 500;
/// The most records one Rekey page may look at.
pub const MAX_REKEY_PAGE: usize = 10_000;
/// A cursor is a store key (or a Redis node and cursor): never longer.
const MAX_REKEY_CURSOR_BYTES: usize = 4096;

/// A rekey page's report as the proto says it.
pub fn rekey_response(page: RekeyPage) -> pb::RekeyResponse {
    pb::RekeyResponse {
        examined: page.examined,
        resealed: page.resealed,
        current: page.current,
        erased: page.erased,
        unreadable: page.unreadable,
        next_cursor: page.next.map(|cursor| cursor.0).unwrap_or_default(),
        retired_old_keys: page.retired_old_keys,
    }
}

/// A time as a protobuf timestamp.
pub fn timestamp(at: UnixMillis) -> prost_types::Timestamp {
    prost_types::Timestamp::from(at.to_system_time())
}

/// A duration as a protobuf duration.
pub fn duration(value: Duration) -> prost_types::Duration {
    prost_types::Duration::try_from(value).unwrap_or(prost_types::Duration {
        seconds: i64::MAX,
        nanos: 0,
    })
}

/// A record as the API shows it (without its lease token).
pub fn record(key: &Key, record: Record) -> pb::Record {
    pb::Record {
        namespace: key.namespace().to_owned(),
        correlation_id: key.correlation_id().to_owned(),
        // The API's enum and the domain's share their numbers.
        state: record.state.code(),
        fencing_token: record.fencing_token.0,
        lease_expires_at: Some(timestamp(record.lease_expires_at)),
        attempt: record.attempt,
        event_type: record.event_type,
        consumer_version: record.consumer_version,
        owner: record.owner,
        payload_fingerprint: record.payload_fingerprint,
        claimed_at: Some(timestamp(record.claimed_at)),
        committed_at: record.committed_at.map(timestamp),
        retain_until: Some(timestamp(record.retain_until)),
        response: record.response,
        ordering_key: record
            .ordering
            .as_ref()
            .map(|o| o.ordering_key.clone())
            .unwrap_or_default(),
        sequence: record.ordering.map_or(0, |o| o.sequence),
        response_erased: record.response_erased,
    }
}

/// A claim's outcome as the API shows it.
pub fn claim_response(key: &Key, outcome: ClaimOutcome) -> pb::ClaimResponse {
    use pb::ClaimOutcome as Pb;
    match outcome {
        ClaimOutcome::Claimed {
            record: claimed,
            recovered,
        } => pb::ClaimResponse {
            outcome: Pb::Claimed as i32,
            lease_token: claimed.lease_token.to_string(),
            fencing_token: claimed.fencing_token.0,
            lease_expires_at: Some(timestamp(claimed.lease_expires_at)),
            attempt: claimed.attempt,
            recovered,
            record: Some(record(key, claimed)),
            ..Default::default()
        },
        ClaimOutcome::Duplicate { record: committed } => pb::ClaimResponse {
            outcome: Pb::Duplicate as i32,
            fencing_token: committed.fencing_token.0,
            record: Some(record(key, committed)),
            ..Default::default()
        },
        ClaimOutcome::InProgress {
            record: held,
            retry_after,
        } => pb::ClaimResponse {
            outcome: Pb::InProgress as i32,
            retry_after: Some(duration(retry_after)),
            record: Some(record(key, held)),
            ..Default::default()
        },
        ClaimOutcome::FingerprintMismatch { record: existing } => pb::ClaimResponse {
            outcome: Pb::FingerprintMismatch as i32,
            record: Some(record(key, existing)),
            ..Default::default()
        },
        ClaimOutcome::Stale {
            highest_committed_sequence,
        } => pb::ClaimResponse {
            outcome: Pb::Stale as i32,
            highest_committed_sequence,
            ..Default::default()
        },
    }
}

/// A commit's outcome as the API shows it.
pub fn commit_response(key: &Key, outcome: Result<CommitOutcome, LeaseLost>) -> pb::CommitResponse {
    match outcome {
        Ok(CommitOutcome::Committed(committed)) => pb::CommitResponse {
            outcome: pb::CommitOutcome::Committed as i32,
            record: Some(record(key, committed)),
        },
        Ok(CommitOutcome::AlreadyCommitted(committed)) => pb::CommitResponse {
            outcome: pb::CommitOutcome::AlreadyCommitted as i32,
            record: Some(record(key, committed)),
        },
        Err(LeaseLost) => pb::CommitResponse {
            outcome: pb::CommitOutcome::LeaseLost as i32,
            record: None,
        },
    }
}

/// A release's outcome as the API shows it.
pub fn release_response(outcome: Result<ReleaseOutcome, LeaseLost>) -> pb::ReleaseResponse {
    let outcome = match outcome {
        Ok(ReleaseOutcome::Released) => pb::ReleaseOutcome::Released,
        Ok(ReleaseOutcome::AlreadyReleased) => pb::ReleaseOutcome::AlreadyReleased,
        Ok(ReleaseOutcome::NotFound) => pb::ReleaseOutcome::NotFound,
        Err(LeaseLost) => pb::ReleaseOutcome::LeaseLost,
    };
    pb::ReleaseResponse {
        outcome: outcome as i32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::RecordState;

    #[test]
    fn limits_print_the_way_flags_are_written() {
        for (duration, text) in [
            (Duration::from_secs(365 * 86_400), "365days"),
            (Duration::from_secs(7 * 86_400), "7days"),
            (Duration::from_secs(3600), "1h"),
            (Duration::from_secs(90 * 60), "90m"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_micros(500), "500us"),
            (Duration::from_nanos(1), "1ns"),
        ] {
            assert_eq!(human_duration(duration), text);
        }
    }

    #[test]
    fn durations_below_a_millisecond_or_malformed_are_refused() {
        let max = Duration::from_secs(3600);
        assert!(check_duration(Duration::from_nanos(1), max)
            .unwrap_err()
            .contains("at least 1ms"));
        assert!(check_duration(Duration::from_micros(999), max).is_err());
        assert_eq!(
            check_duration(MIN_DURATION, max),
            Ok(Duration::from_millis(1))
        );
        assert_eq!(
            check_duration(Duration::from_secs(7200), max),
            Err("must be at most 1h, got 2h".into())
        );
        let proto = |seconds, nanos| proto_duration(&prost_types::Duration { seconds, nanos });
        assert_eq!(proto(1, 500_000_000), Ok(Duration::from_millis(1500)));
        for (seconds, nanos) in [(1, -1), (-1, 1), (0, 1_000_000_000), (0, -1_000_000_000)] {
            assert!(
                proto(seconds, nanos).unwrap_err().contains("not a valid"),
                "{seconds} {nanos}"
            );
        }
        assert_eq!(proto(-5, 0), Err("must be positive".into()));
        assert!(proto(i64::MAX, 0).unwrap_err().contains("not a valid"));
    }

    #[test]
    fn record_states_keep_the_apis_numbers() {
        for (state, api) in [
            (RecordState::Claimed, pb::RecordState::Claimed),
            (RecordState::Committed, pb::RecordState::Committed),
            (RecordState::Released, pb::RecordState::Released),
        ] {
            assert_eq!(state.code(), api as i32);
            assert_eq!(RecordState::from_code(api as i32), Some(state));
        }
        assert_eq!(RecordState::from_code(0), None);
    }
}
