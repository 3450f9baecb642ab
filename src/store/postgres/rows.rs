//! Records as rows: the column list, a row read back into a [`Record`], and
//! a record's values as statement parameters.

use std::time::Duration;

use tokio_postgres::Row;

use crate::{
    clock::UnixMillis,
    domain::{FencingToken, LeaseToken, OrderingPosition, Record, RecordState},
    error::Error,
};

/// The record columns, in the order `record_from_row` and the writes use.
pub(super) const COLUMNS: &str =
    "state, lease_token, fencing_token, lease_expires_at_ms, attempt, \
     event_type, consumer_version, owner, payload_fingerprint, claimed_at_ms, committed_at_ms, \
     retain_until_ms, retention_ms, response, ordering_key, sequence, request_id, recovered";

pub(super) fn millis(at: UnixMillis) -> i64 {
    i64::try_from(at.0).unwrap_or(i64::MAX)
}

pub(super) fn at(millis: i64) -> UnixMillis {
    UnixMillis(u64::try_from(millis).unwrap_or(0))
}

pub(super) fn fencing_from_db(value: i64) -> FencingToken {
    FencingToken(u64::try_from(value).unwrap_or(0))
}

pub(super) fn record_from_row(row: &Row) -> Result<Record, Error> {
    let state: i16 = row.get("state");
    let state = RecordState::from_code(i32::from(state))
        .ok_or_else(|| Error::Corrupt(format!("unknown record state {state}")))?;
    let lease_token: uuid_bytes::Uuid = row.get("lease_token");
    let ordering_key: Option<String> = row.get("ordering_key");
    let sequence: Option<i64> = row.get("sequence");
    Ok(Record {
        state,
        lease_token: LeaseToken(lease_token.0),
        fencing_token: fencing_from_db(row.get("fencing_token")),
        lease_expires_at: at(row.get("lease_expires_at_ms")),
        attempt: u32::try_from(row.get::<_, i32>("attempt")).unwrap_or(0),
        event_type: row.get("event_type"),
        consumer_version: row.get("consumer_version"),
        owner: row.get("owner"),
        payload_fingerprint: row.get("payload_fingerprint"),
        claimed_at: at(row.get("claimed_at_ms")),
        committed_at: row.get::<_, Option<i64>>("committed_at_ms").map(at),
        retain_until: at(row.get("retain_until_ms")),
        retention: Duration::from_millis(
            u64::try_from(row.get::<_, i64>("retention_ms")).unwrap_or(0),
        ),
        response: row.get("response"),
        ordering: ordering_key.map(|ordering_key| OrderingPosition {
            ordering_key,
            sequence: u64::try_from(sequence.unwrap_or(0)).unwrap_or(0),
        }),
        request_id: row.get("request_id"),
        recovered: row.get("recovered"),
        // The engine's to set, never stored.
        response_erased: false,
    })
}

/// The values of [`COLUMNS`] for `record`, owned so they can be borrowed as
/// statement parameters.
pub(super) struct RecordValues {
    state: i16,
    lease_token: uuid_bytes::Uuid,
    fencing_token: i64,
    lease_expires_at_ms: i64,
    attempt: i32,
    event_type: String,
    consumer_version: String,
    owner: String,
    payload_fingerprint: String,
    claimed_at_ms: i64,
    committed_at_ms: Option<i64>,
    retain_until_ms: i64,
    retention_ms: i64,
    response: Vec<u8>,
    ordering_key: Option<String>,
    sequence: Option<i64>,
    request_id: String,
    recovered: bool,
}

impl RecordValues {
    pub(super) fn new(record: &Record) -> Self {
        RecordValues {
            state: i16::try_from(record.state.code()).unwrap_or(0),
            lease_token: uuid_bytes::Uuid(record.lease_token.0),
            fencing_token: i64::try_from(record.fencing_token.0).unwrap_or(i64::MAX),
            lease_expires_at_ms: millis(record.lease_expires_at),
            attempt: i32::try_from(record.attempt).unwrap_or(i32::MAX),
            event_type: record.event_type.clone(),
            consumer_version: record.consumer_version.clone(),
            owner: record.owner.clone(),
            payload_fingerprint: record.payload_fingerprint.clone(),
            claimed_at_ms: millis(record.claimed_at),
            committed_at_ms: record.committed_at.map(millis),
            retain_until_ms: millis(record.retain_until),
            retention_ms: i64::try_from(record.retention.as_millis()).unwrap_or(i64::MAX),
            response: record.response.clone(),
            ordering_key: record.ordering.as_ref().map(|o| o.ordering_key.clone()),
            sequence: record
                .ordering
                .as_ref()
                .map(|o| i64::try_from(o.sequence).unwrap_or(i64::MAX)),
            request_id: record.request_id.clone(),
            recovered: record.recovered,
        }
    }

    /// The 18 values, in [`COLUMNS`] order.
    pub(super) fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 18] {
        [
            &self.state,
            &self.lease_token,
            &self.fencing_token,
            &self.lease_expires_at_ms,
            &self.attempt,
            &self.event_type,
            &self.consumer_version,
            &self.owner,
            &self.payload_fingerprint,
            &self.claimed_at_ms,
            &self.committed_at_ms,
            &self.retain_until_ms,
            &self.retention_ms,
            &self.response,
            &self.ordering_key,
            &self.sequence,
            &self.request_id,
            &self.recovered,
        ]
    }
}

/// A 128-bit lease token as PostgreSQL's `uuid` (16 bytes, big-endian),
/// without pulling in a UUID crate for one conversion.
pub(super) mod uuid_bytes {
    use std::error::Error;

    use tokio_postgres::types::{to_sql_checked, FromSql, IsNull, ToSql, Type};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Uuid(pub u128);

    impl ToSql for Uuid {
        fn to_sql(
            &self,
            _: &Type,
            out: &mut bytes::BytesMut,
        ) -> Result<IsNull, Box<dyn Error + Sync + Send>> {
            out.extend_from_slice(&self.0.to_be_bytes());
            Ok(IsNull::No)
        }

        fn accepts(ty: &Type) -> bool {
            *ty == Type::UUID
        }

        to_sql_checked!();
    }

    impl<'a> FromSql<'a> for Uuid {
        fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, Box<dyn Error + Sync + Send>> {
            let bytes: [u8; 16] = raw.try_into()?;
            Ok(Uuid(u128::from_be_bytes(bytes)))
        }

        fn accepts(ty: &Type) -> bool {
            *ty == Type::UUID
        }
    }
}
