//! The byte form of records and ordering marks at rest (sled, Redis, the
//! local tier). A record is [`RECORD_V2`], its `retain_until` (u64
//! big-endian), then a protobuf message with the rest, so new fields can be
//! added without rewriting old data and the reaper learns whether a record
//! expired from its first nine bytes, without decoding it. Records written
//! before the prefix existed (bare protobuf) still decode.

use std::time::Duration;

use prost::Message;

use crate::{
    clock::UnixMillis,
    domain::{LeaseToken, OrderingPosition, Record, RecordState},
    error::Error,
    machine::SequenceMark,
};

#[derive(Clone, PartialEq, Message)]
struct StoredRecord {
    #[prost(int32, tag = "1")]
    state: i32,
    #[prost(fixed64, tag = "2")]
    lease_token_high: u64,
    #[prost(fixed64, tag = "3")]
    lease_token_low: u64,
    #[prost(uint64, tag = "4")]
    fencing_token: u64,
    #[prost(uint64, tag = "5")]
    lease_expires_at_ms: u64,
    #[prost(uint32, tag = "6")]
    attempt: u32,
    #[prost(string, tag = "7")]
    event_type: String,
    #[prost(string, tag = "8")]
    consumer_version: String,
    #[prost(string, tag = "9")]
    owner: String,
    #[prost(string, tag = "10")]
    payload_fingerprint: String,
    #[prost(uint64, tag = "11")]
    claimed_at_ms: u64,
    #[prost(uint64, optional, tag = "12")]
    committed_at_ms: Option<u64>,
    #[prost(uint64, tag = "13")]
    retain_until_ms: u64,
    #[prost(uint64, tag = "14")]
    retention_ms: u64,
    #[prost(bytes = "vec", tag = "15")]
    response: Vec<u8>,
    #[prost(string, optional, tag = "16")]
    ordering_key: Option<String>,
    #[prost(uint64, tag = "17")]
    sequence: u64,
    #[prost(string, tag = "18")]
    request_id: String,
    #[prost(bool, tag = "19")]
    recovered: bool,
}

/// First byte of a record with the expiry prefix. A bare protobuf record
/// never starts with it: it would be the tag of field 26, length-delimited,
/// and `StoredRecord` has no such field.
const RECORD_V2: u8 = 0xD2;

/// Encodes a record.
pub fn encode_record(record: &Record) -> Vec<u8> {
    let stored = StoredRecord {
        state: record.state.code(),
        lease_token_high: (record.lease_token.0 >> 64) as u64,
        lease_token_low: record.lease_token.0 as u64,
        fencing_token: record.fencing_token.0,
        lease_expires_at_ms: record.lease_expires_at.0,
        attempt: record.attempt,
        event_type: record.event_type.clone(),
        consumer_version: record.consumer_version.clone(),
        owner: record.owner.clone(),
        payload_fingerprint: record.payload_fingerprint.clone(),
        claimed_at_ms: record.claimed_at.0,
        committed_at_ms: record.committed_at.map(|at| at.0),
        // In the prefix instead.
        retain_until_ms: 0,
        retention_ms: u64::try_from(record.retention.as_millis()).unwrap_or(u64::MAX),
        response: record.response.clone(),
        ordering_key: record.ordering.as_ref().map(|o| o.ordering_key.clone()),
        sequence: record.ordering.as_ref().map_or(0, |o| o.sequence),
        request_id: record.request_id.clone(),
        recovered: record.recovered,
    };
    let mut bytes = Vec::with_capacity(9 + stored.encoded_len());
    bytes.push(RECORD_V2);
    bytes.extend_from_slice(&record.retain_until.0.to_be_bytes());
    stored
        .encode(&mut bytes)
        .expect("a Vec grows to fit the message");
    bytes
}

/// When the record in `bytes` stops being live, read from its prefix
/// without decoding the rest (a record without the prefix is decoded).
pub fn record_retain_until(bytes: &[u8]) -> Result<UnixMillis, Error> {
    match split_prefix(bytes)? {
        Some((retain_until, _)) => Ok(retain_until),
        None => Ok(decode_record(bytes)?.retain_until),
    }
}

/// The expiry prefix and the message after it; `None` for a bare protobuf
/// record.
fn split_prefix(bytes: &[u8]) -> Result<Option<(UnixMillis, &[u8])>, Error> {
    if bytes.first() != Some(&RECORD_V2) {
        return Ok(None);
    }
    let prefix: [u8; 8] = bytes
        .get(1..9)
        .and_then(|prefix| prefix.try_into().ok())
        .ok_or_else(|| Error::Corrupt(format!("record of {} bytes", bytes.len())))?;
    Ok(Some((UnixMillis(u64::from_be_bytes(prefix)), &bytes[9..])))
}

/// Decodes a record written by [`encode_record`] (or before the prefix).
pub fn decode_record(bytes: &[u8]) -> Result<Record, Error> {
    let (prefix, message) = match split_prefix(bytes)? {
        Some((retain_until, message)) => (Some(retain_until), message),
        None => (None, bytes),
    };
    let stored =
        StoredRecord::decode(message).map_err(|e| Error::Corrupt(format!("record: {e}")))?;
    let state = RecordState::from_code(stored.state)
        .ok_or_else(|| Error::Corrupt(format!("record: unknown state {}", stored.state)))?;
    let sequence = stored.sequence;
    Ok(Record {
        state,
        lease_token: LeaseToken(
            (u128::from(stored.lease_token_high) << 64) | u128::from(stored.lease_token_low),
        ),
        fencing_token: crate::domain::FencingToken(stored.fencing_token),
        lease_expires_at: UnixMillis(stored.lease_expires_at_ms),
        attempt: stored.attempt,
        event_type: stored.event_type,
        consumer_version: stored.consumer_version,
        owner: stored.owner,
        payload_fingerprint: stored.payload_fingerprint,
        claimed_at: UnixMillis(stored.claimed_at_ms),
        committed_at: stored.committed_at_ms.map(UnixMillis),
        retain_until: prefix.unwrap_or(UnixMillis(stored.retain_until_ms)),
        retention: Duration::from_millis(stored.retention_ms),
        response: stored.response,
        ordering: stored.ordering_key.map(|ordering_key| OrderingPosition {
            ordering_key,
            sequence,
        }),
        request_id: stored.request_id,
        recovered: stored.recovered,
        // The engine's to set, never stored.
        response_erased: false,
    })
}

/// Encodes an ordering mark: 16 bytes, big-endian highest then retain_until.
pub fn encode_mark(mark: SequenceMark) -> [u8; 16] {
    let mut bytes = [0; 16];
    bytes[..8].copy_from_slice(&mark.highest.to_be_bytes());
    bytes[8..].copy_from_slice(&mark.retain_until.0.to_be_bytes());
    bytes
}

/// Decodes a mark written by [`encode_mark`].
pub fn decode_mark(bytes: &[u8]) -> Result<SequenceMark, Error> {
    let bytes: [u8; 16] = bytes
        .try_into()
        .map_err(|_| Error::Corrupt(format!("ordering mark of {} bytes", bytes.len())))?;
    let [highest, retain_until] = [&bytes[..8], &bytes[8..]]
        .map(|half| u64::from_be_bytes(half.try_into().expect("8 bytes")));
    Ok(SequenceMark {
        highest,
        retain_until: UnixMillis(retain_until),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::FencingToken;

    #[test]
    fn record_round_trips() {
        let record = Record {
            state: RecordState::Committed,
            lease_token: LeaseToken(u128::MAX - 7),
            fencing_token: FencingToken(42),
            lease_expires_at: UnixMillis(1_000),
            attempt: 3,
            event_type: "PaymentReceived".into(),
            consumer_version: "1.2.3".into(),
            owner: "pod-a".into(),
            payload_fingerprint: "abc".into(),
            claimed_at: UnixMillis(900),
            committed_at: Some(UnixMillis(950)),
            retain_until: UnixMillis(10_000),
            retention: Duration::from_secs(9),
            response: b"ok".to_vec(),
            ordering: Some(OrderingPosition {
                ordering_key: "account-1".into(),
                sequence: 0,
            }),
            request_id: "7f1c".into(),
            recovered: true,
            response_erased: false,
        };
        assert_eq!(decode_record(&encode_record(&record)).unwrap(), record);
        let bare = Record {
            committed_at: None,
            ordering: None,
            ..record
        };
        assert_eq!(decode_record(&encode_record(&bare)).unwrap(), bare);
        assert_eq!(
            record_retain_until(&encode_record(&bare)).unwrap(),
            UnixMillis(10_000)
        );
    }

    #[test]
    fn records_written_before_the_expiry_prefix_still_decode() {
        let legacy = StoredRecord {
            state: RecordState::Committed.code(),
            lease_token_low: 5,
            fencing_token: 7,
            retain_until_ms: 123_456,
            response: b"ok".to_vec(),
            ..StoredRecord::default()
        }
        .encode_to_vec();
        let record = decode_record(&legacy).unwrap();
        assert_eq!(record.retain_until, UnixMillis(123_456));
        assert_eq!(record.fencing_token.0, 7);
        assert_eq!(record.response, b"ok");
        assert_eq!(record_retain_until(&legacy).unwrap(), UnixMillis(123_456));
        assert!(matches!(
            record_retain_until(&[RECORD_V2, 1, 2]),
            Err(Error::Corrupt(_))
        ));
    }

    #[test]
    fn garbage_is_corrupt_not_a_panic() {
        assert!(matches!(
            decode_record(&[0xff, 0xff]),
            Err(Error::Corrupt(_))
        ));
        assert!(matches!(decode_mark(&[1, 2, 3]), Err(Error::Corrupt(_))));
        let mark = SequenceMark {
            highest: 9,
            retain_until: UnixMillis(77),
        };
        assert_eq!(decode_mark(&encode_mark(mark)).unwrap(), mark);
    }
}
