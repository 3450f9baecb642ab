//! Records and ordering marks as Redis holds them: a record's hash (its
//! bytes with the fencing token zeroed, and the token apart, where a script
//! can draw it) read back into a [`Record`], and a mark as a string.

use crate::{
    clock::UnixMillis,
    domain::{FencingToken, Record},
    error::Error,
    machine::SequenceMark,
    store::{
        codec,
        optimistic::{Versioned, PROVISIONAL},
    },
};

/// A record's hash as it is in Redis: what a conditional write must find.
#[derive(Debug, Clone)]
pub struct Held {
    /// The encoded record, its fencing token zeroed (`r`).
    pub(super) bytes: Vec<u8>,
    /// Its fencing token (`f`).
    pub(super) token: String,
}

/// A record as read from Redis, with its hash's fields.
pub(super) type Stored = Versioned<Held>;

/// The record in a hash's fields (`None` for a hash that is not there).
pub(super) fn decode_stored(bytes: Vec<u8>, token: String) -> Result<Option<Stored>, Error> {
    if token.is_empty() {
        return Ok(None);
    }
    let mut record = codec::decode_record(&bytes)?;
    record.fencing_token = parse_token(&token)?;
    Ok(Some(Versioned {
        record,
        version: Held { bytes, token },
    }))
}

pub(super) fn parse_token(token: &str) -> Result<FencingToken, Error> {
    token
        .parse()
        .map(FencingToken)
        .map_err(|_| Error::Corrupt(format!("fencing token {token:?}")))
}

/// The record's bytes at rest: its fencing token lives in the hash's `f`
/// field, where the script can draw it.
pub(super) fn encode_without_token(record: &Record) -> Vec<u8> {
    codec::encode_record(&Record {
        fencing_token: PROVISIONAL,
        ..record.clone()
    })
}

pub(super) fn encode_mark(mark: SequenceMark) -> String {
    format!("{}:{}", mark.highest, mark.retain_until.0)
}

pub(super) fn decode_mark(text: &str) -> Result<Option<SequenceMark>, Error> {
    if text.is_empty() {
        return Ok(None);
    }
    let corrupt = || Error::Corrupt(format!("ordering mark {text:?}"));
    let (highest, until) = text.split_once(':').ok_or_else(corrupt)?;
    Ok(Some(SequenceMark {
        highest: highest.parse().map_err(|_| corrupt())?,
        retain_until: UnixMillis(until.parse().map_err(|_| corrupt())?),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_round_trip() {
        let mark = SequenceMark {
            highest: 42,
            retain_until: UnixMillis(1_700_000_000_000),
        };
        assert_eq!(decode_mark(&encode_mark(mark)).unwrap(), Some(mark));
        assert_eq!(decode_mark("").unwrap(), None);
        assert!(decode_mark("42").is_err());
    }
}
