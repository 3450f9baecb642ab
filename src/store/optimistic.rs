//! The one optimistic read-modify-write every store runs
//! ([`Store::update`](super::Store::update)), so its rules are written once:
//!
//! - The machine runs on a *belief* about the record: this sidecar's own
//!   last write (PostgreSQL, Redis), or "absent" — the cheap guess for a
//!   fresh key, which a Claim's one conditional write then checks.
//! - A change is written only if the record is still what was believed
//!   (sled: compare-and-swap of the bytes; PostgreSQL: the row's revision;
//!   Redis: a script comparing bytes and token). A wrong belief costs one
//!   round trip: the conflict tells the truth, and the machine runs again.
//! - An answer that changes nothing (Keep, or Delete of an absent record)
//!   is given only from the record as read, never from a belief: it writes
//!   nothing that would check it.
//! - A write refused for want of disk space on a belief nobody checked
//!   reads the truth first: the call may need no write at all (a DUPLICATE
//!   on a full disk).
//! - A claim's fencing token is drawn by the write itself (the store's
//!   source, above the key's last token); the machine then runs once more
//!   with it — a pure function, so it agrees but for the token. That run
//!   is marked as repeating its attempt ([`Attempt::repeat`]): it decides
//!   at its attempt's time, while each new attempt reads the time afresh.

use std::future::Future;

use super::Attempt;
use crate::{
    domain::{FencingToken, Key, Record},
    error::Error,
    machine::Change,
};

/// The fencing token the machine is given before the write has drawn the
/// real one; no claim is ever answered with it.
pub const PROVISIONAL: FencingToken = FencingToken(0);

/// A record as a store holds it, with what a conditional write compares.
#[derive(Debug, Clone)]
pub struct Versioned<V> {
    /// The record.
    pub record: Record,
    /// What a conditional write must find.
    pub version: V,
}

/// What a conditional write did.
#[derive(Debug)]
pub enum Swapped<V> {
    /// Written. `token`: the fencing token drawn, when asked to draw one;
    /// `version`: what the key now holds (`None` after a delete).
    Done {
        token: Option<FencingToken>,
        version: Option<V>,
    },
    /// The record was not what was believed: here is what it is.
    Conflict(Option<Box<Versioned<V>>>),
}

/// What a store provides for [`update`]: a read, and a write conditional on
/// what was read.
pub trait Conditional: Sync {
    /// What a conditional write compares.
    type Version: Send + Sync;

    /// The record of `key` as it is now.
    fn read(
        &self,
        key: &Key,
    ) -> impl Future<Output = Result<Option<Versioned<Self::Version>>, Error>> + Send;

    /// A fencing token drawn at once, for a store whose source is local and
    /// cheap (sled's counter): the machine then runs once, with the real
    /// token. `None` (the default): the write draws it.
    fn issue_now(&self) -> Option<Result<FencingToken, Error>> {
        None
    }

    /// Makes `change` if the record of `key` is still `believed` (`None`:
    /// absent). With `draw_token` the change's record holds
    /// [`PROVISIONAL`]: the store draws the fencing token — above
    /// `believed`'s — and writes that instead.
    fn write_if(
        &self,
        key: &Key,
        believed: Option<&Versioned<Self::Version>>,
        change: &Change,
        draw_token: bool,
    ) -> impl Future<Output = Result<Swapped<Self::Version>, Error>> + Send;
}

/// Runs `apply` on the record of `key`, starting from `belief`, until its
/// change is written or it needs none (the rules in the module's text).
/// Returns the answer, and what the key now holds if this call wrote it
/// (for a store that remembers its own writes).
pub async fn update<S, T, F>(
    store: &S,
    key: &Key,
    belief: Option<Versioned<S::Version>>,
    mut apply: F,
) -> Result<(T, Option<Versioned<S::Version>>), Error>
where
    S: Conditional,
    T: Send,
    F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
{
    let mut believed = belief;
    let mut verified = false;
    loop {
        let record = believed.as_ref().map(|stored| &stored.record);
        let mut draw_token = false;
        let (change, answer) = apply(
            record,
            Attempt::new(&mut || match store.issue_now() {
                Some(issued) => issued,
                None => {
                    draw_token = true;
                    Ok(PROVISIONAL)
                }
            }),
        )?;
        let needs_write = match &change {
            Change::Keep => false,
            Change::Delete => believed.is_some(),
            Change::Put(_) => true,
        };
        if !needs_write {
            if verified {
                return Ok((answer, None));
            }
            believed = store.read(key).await?;
            verified = true;
            continue;
        }
        let swapped = match store
            .write_if(key, believed.as_ref(), &change, draw_token)
            .await
        {
            Ok(swapped) => swapped,
            Err(Error::DiskFull(_)) if !verified => {
                believed = store.read(key).await?;
                verified = true;
                continue;
            }
            Err(error) => return Err(error),
        };
        match swapped {
            Swapped::Done { token, version } => {
                let (change, answer) = match (draw_token, token) {
                    (true, Some(token)) => apply(record, Attempt::repeat(&mut || Ok(token)))?,
                    (true, None) => {
                        return Err(Error::Store(
                            "the store wrote a claim without drawing its fencing token".into(),
                        ))
                    }
                    (false, _) => (change, answer),
                };
                let now = match (change, version) {
                    (Change::Put(record), Some(version)) => Some(Versioned { record, version }),
                    _ => None,
                };
                return Ok((answer, now));
            }
            Swapped::Conflict(current) => {
                believed = current.map(|current| *current);
                verified = true;
            }
        }
    }
}

/// The record of `change` with the fencing token the write drew.
pub fn with_token(record: &Record, token: FencingToken) -> Record {
    Record {
        fencing_token: token,
        ..record.clone()
    }
}
