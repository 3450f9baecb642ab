//! Which sealing keys a store holds answers under: the check that refuses
//! to start a sidecar without a key its store needs (exit 64, one line),
//! instead of finding out answer by answer.
//!
//! The store keeps one reserved record (namespace `dedupd`, an ID with a
//! control character no request may carry, so no caller reaches it, and
//! never sealed or hashed): the ID of every key that has sealed an answer,
//! with when it last did. An engine registers its sealing key before the
//! first answer it seals with it, and again at most every
//! [`REGISTRATION_REFRESH`], so the time is never older than that. At
//! start, every key registered within the longest retention (plus the
//! refresh) must be configured — to seal or to open — or declared erased;
//! older ones sealed nothing that can still be read.

use std::{collections::BTreeMap, time::Duration};

use crate::{
    clock::UnixMillis,
    domain::{FencingToken, Key, LeaseToken, Record, RecordState},
    error::Error,
    machine::Change,
    sealing::KeyId,
};

/// How often an engine renews its sealing key's registration.
pub const REGISTRATION_REFRESH: Duration = Duration::from_secs(3600);
/// How long the registry record is kept from its last change.
const KEPT_FOR: Duration = Duration::from_secs(400 * 24 * 3600);

/// The registry's key.
pub fn registry_key() -> Key {
    Key::new_unchecked("dedupd".into(), "\u{1}sealing-keys".into())
}

/// The reserved record naming the key correlation IDs are hashed with
/// (its check value), once a sidecar hashing them has started.
pub fn id_hashing_key() -> Key {
    Key::new_unchecked("dedupd".into(), "\u{1}id-hashing".into())
}

/// The id-hashing record holding `check` (a hasher's check value).
pub fn id_hashing_record(check: &str, now: UnixMillis) -> Record {
    reserved_record(check.as_bytes().to_vec(), now)
}

/// A reserved record holding `content`: committed, kept long, never
/// sealed (no caller reaches it; a rekey pass skips it).
fn reserved_record(content: Vec<u8>, now: UnixMillis) -> Record {
    Record {
        state: RecordState::Committed,
        lease_token: LeaseToken(0),
        fencing_token: FencingToken(1),
        lease_expires_at: now,
        attempt: 1,
        event_type: String::new(),
        consumer_version: String::new(),
        owner: "dedupd".into(),
        payload_fingerprint: String::new(),
        claimed_at: now,
        committed_at: Some(now),
        retain_until: now.saturating_add(KEPT_FOR),
        retention: KEPT_FOR,
        response: content,
        ordering: None,
        request_id: String::new(),
        recovered: false,
        response_erased: false,
    }
}

/// Key ID → when it last sealed an answer.
pub type Registered = BTreeMap<KeyId, UnixMillis>;

/// The keys `record` (the registry, if any) holds.
pub fn registered(record: Option<&Record>) -> Result<Registered, Error> {
    let Some(record) = record else {
        return Ok(Registered::new());
    };
    let text = std::str::from_utf8(&record.response)
        .map_err(|_| Error::Corrupt("the sealing-key registry is not text".into()))?;
    text.lines()
        .filter(|line| !line.is_empty())
        .map(|line| {
            let corrupt = || Error::Corrupt(format!("the sealing-key registry line {line:?}"));
            let (id, at) = line.split_once(' ').ok_or_else(corrupt)?;
            Ok((
                id.parse().map_err(|_| corrupt())?,
                UnixMillis(at.parse().map_err(|_| corrupt())?),
            ))
        })
        .collect()
}

/// The registry after `id` sealed at `now`: the change to make.
pub fn register(current: Option<&Record>, id: KeyId, now: UnixMillis) -> Result<Change, Error> {
    let mut keys = registered(current)?;
    let at = keys.entry(id).or_insert(now);
    *at = (*at).max(now);
    let text: String = keys
        .iter()
        .map(|(id, at)| format!("{id} {}\n", at.0))
        .collect();
    Ok(Change::Put(reserved_record(text.into_bytes(), now)))
}

/// The registry naming only those of `keep` it names (the old keys
/// retired after a rekey pass).
pub fn keep_only(current: Option<&Record>, keep: &[KeyId]) -> Result<Change, Error> {
    let Some(record) = current else {
        return Ok(Change::Keep);
    };
    let text: String = registered(Some(record))?
        .iter()
        .filter(|(id, _)| keep.contains(id))
        .map(|(id, at)| format!("{id} {}\n", at.0))
        .collect();
    Ok(Change::Put(Record {
        response: text.into_bytes(),
        ..record.clone()
    }))
}

/// The registered keys that sealed within `longest_retention` of `now`
/// and that `known` says are neither configured nor declared erased.
pub fn missing(
    keys: &Registered,
    now: UnixMillis,
    longest_retention: Duration,
    known: impl Fn(KeyId) -> bool,
) -> Vec<(KeyId, UnixMillis)> {
    keys.iter()
        .filter(|(id, at)| {
            at.saturating_add(longest_retention + REGISTRATION_REFRESH) > now && !known(**id)
        })
        .map(|(id, at)| (*id, *at))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sealing::Keyring;

    fn id(byte: u8) -> KeyId {
        Keyring::from_bytes(&[[byte; 32]]).unwrap().sealing_id()
    }

    fn put(change: Change) -> Record {
        match change {
            Change::Put(record) => record,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn registrations_keep_the_latest_time_and_age_out() {
        let first = put(register(None, id(1), UnixMillis(1_000)).unwrap());
        let both = put(register(Some(&first), id(2), UnixMillis(2_000)).unwrap());
        let again = put(register(Some(&both), id(1), UnixMillis(500)).unwrap());
        let keys = registered(Some(&again)).unwrap();
        assert_eq!(keys[&id(1)], UnixMillis(1_000), "never moved back");
        assert_eq!(keys[&id(2)], UnixMillis(2_000));
        let day = Duration::from_secs(24 * 3600);
        let later = UnixMillis(2_000).saturating_add(day);
        // Key 1 configured; key 2 not: missing while its answers may live.
        assert_eq!(
            missing(&keys, later, day, |known| known == id(1)),
            vec![(id(2), UnixMillis(2_000))]
        );
        let long_after = later.saturating_add(day + REGISTRATION_REFRESH);
        assert!(missing(&keys, long_after, day, |_| false).is_empty());
        let mut damaged = again.clone();
        damaged.response = b"not a registry".to_vec();
        assert!(registered(Some(&damaged)).is_err());
    }
}
