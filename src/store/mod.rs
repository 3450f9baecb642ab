//! What a store must provide, and nothing more: an atomic read-modify-write
//! of one key, a fencing-token source that never goes backwards, expiry
//! (records past `retain_until` are reaped), and durability.
//!
//! The rules of protocol §2 (docs/protocol.md) live in [`crate::machine`];
//! a store only runs the closure the engine gives it, atomically, and
//! applies the [`Change`] it returns. The loop that does so is written once,
//! in [`optimistic`] (with its rules for trusting a belief about the
//! record); each store gives it a read and a conditional write: sled by
//! compare-and-swap, PostgreSQL by an insert for a fresh key or an update
//! conditional on the row's revision, Redis by a script that writes only if
//! the record is what was read. In
//! front of a shared store, [`tiered::Tiered`] answers duplicates of keys
//! this sidecar has seen committed from its own local tier.

pub mod codec;
mod disk;
mod expiry;
pub mod memory;
pub mod optimistic;
pub mod postgres;
pub mod redis;
pub mod shared;
pub mod sled;
mod stall;
pub mod tiered;
mod wal;

use std::{fmt, future::Future, time::Duration};

use crate::{
    clock::UnixMillis,
    domain::{FencingToken, Key, OrderingScope, Record},
    error::Error,
    machine::{Change, SequenceMark},
};

/// Issues fencing tokens inside a read-modify-write; called only when a
/// claim is granted.
pub type IssueFencing<'a> = &'a mut dyn FnMut() -> Result<FencingToken, Error>;

/// What one run of an update's `apply` is given besides the record.
pub struct Attempt<'a> {
    /// Draws the fencing token of a claim this run grants.
    pub issue_fencing: IssueFencing<'a>,
    /// This run repeats the one before it with the fencing token that run's
    /// write drew: it must reach that run's decision, so it decides at that
    /// run's time. Otherwise it is a new attempt (the first, or a retry
    /// after a conflict), which reads the time afresh.
    pub repeats: bool,
}

impl fmt::Debug for Attempt<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attempt")
            .field("repeats", &self.repeats)
            .finish_non_exhaustive()
    }
}

impl<'a> Attempt<'a> {
    /// A new attempt: the first run, or one after a conflict.
    pub fn new(issue_fencing: IssueFencing<'a>) -> Self {
        Attempt {
            issue_fencing,
            repeats: false,
        }
    }

    /// The run that repeats the last attempt with its drawn token.
    pub fn repeat(issue_fencing: IssueFencing<'a>) -> Self {
        Attempt {
            issue_fencing,
            repeats: true,
        }
    }
}

/// Told what a store did (group commits, local-tier lookups), so a store
/// reports without knowing the metrics.
pub trait StoreObserver: Send + Sync + fmt::Debug {
    /// One group commit finished: how many callers one disk sync answered,
    /// and how long it took.
    fn group_commit(&self, callers: usize, elapsed: Duration);

    /// The local tier answered a call (`hit`) or sent it on to the shared
    /// store.
    fn local_tier(&self, hit: bool);
}

/// What one pass of the reaper did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReapReport {
    /// Expired records and ordering marks removed.
    pub removed: usize,
    /// Entries looked at (removed ones included).
    pub examined: usize,
}

/// Size figures for metrics; `None` where a store cannot tell cheaply.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Records stored, expired ones not yet reaped included.
    pub records: Option<u64>,
    /// Bytes on disk.
    pub disk_bytes: Option<u64>,
    /// In front of a shared store: whether the local tier answers (its
    /// deletion feed connected); `None` without a local tier.
    pub local_tier_on: Option<bool>,
}

/// Where a pass over every record goes on from: opaque to the caller, as
/// the store that gave it wrote it (empty: the start).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanCursor(pub Vec<u8>);

/// One page of a pass over every record ([`Store::scan`]): keys only, so
/// a page's memory does not grow with the answers stored (the caller reads
/// and changes each record in its own update).
#[derive(Debug, Default)]
pub struct ScanPage {
    /// The keys of the page's records, expired ones included.
    pub keys: Vec<Key>,
    /// Where the next page starts; `None` once the pass is through.
    pub next: Option<ScanCursor>,
}

/// A place to keep records. Every method is safe to call concurrently.
pub trait Store: Send + Sync + 'static {
    /// What the store is, for traces (`db.system.name`): `sled`,
    /// `postgresql`, `redis`, `memory`.
    fn kind(&self) -> &'static str {
        "other"
    }

    /// Atomically reads the record of `key`, calls `apply` with it and stores
    /// the change it returns. If the record changes underneath, `apply` runs
    /// again on the new one, so it must not have side effects besides
    /// issuing fencing tokens; its last answer is returned.
    fn update<T, F>(&self, key: &Key, apply: F) -> impl Future<Output = Result<T, Error>> + Send
    where
        T: Send,
        F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send;

    /// Reads the record of `key`, expired or not (the caller applies expiry).
    fn get(&self, key: &Key) -> impl Future<Output = Result<Option<Record>, Error>> + Send;

    /// Atomically updates the ordering mark of `scope`: `apply` returns the
    /// new mark, or `None` to leave it.
    fn update_mark<F>(
        &self,
        scope: &OrderingScope,
        apply: F,
    ) -> impl Future<Output = Result<(), Error>> + Send
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send;

    /// Reads the ordering mark of `scope`, expired or not.
    fn get_mark(
        &self,
        scope: &OrderingScope,
    ) -> impl Future<Output = Result<Option<SequenceMark>, Error>> + Send;

    /// Resolves once everything this task has written or read is durable (as
    /// the store's sync mode defines it): no answer may reveal state that a
    /// crash could lose.
    fn durable(&self) -> impl Future<Output = Result<(), Error>> + Send;

    /// Removes up to `budget` records and marks whose retention ended by
    /// `now`; the caller calls again while a pass removes a full `budget`.
    fn reap(
        &self,
        now: UnixMillis,
        budget: usize,
    ) -> impl Future<Output = Result<ReapReport, Error>> + Send;

    /// `Ok` while the store works; an error here is permanent (a failed or
    /// stalled sync): the process should restart.
    fn health(&self) -> Result<(), Error>;

    /// `Ok` while the store takes writes: healthy, and not short of disk
    /// space. Unlike [`Store::health`] this passes by itself.
    fn writable(&self) -> Result<(), Error> {
        self.health()
    }

    /// The keys of about `limit` records from `cursor` on, for a pass over every record
    /// (re-sealing answers under a new key). A record written or removed
    /// during the pass may or may not be in it; every record there through
    /// the whole pass is in it once (on a Redis Cluster whose slots move
    /// meanwhile, at least once). Stores that cannot be scanned say so.
    fn scan(
        &self,
        cursor: &ScanCursor,
        limit: usize,
    ) -> impl Future<Output = Result<ScanPage, Error>> + Send {
        let _ = (cursor, limit);
        async { Err(Error::Store("this store cannot be scanned".into())) }
    }

    /// Size figures for metrics (may be cached for a while).
    fn stats(&self) -> impl Future<Output = StoreStats> + Send;

    /// Makes everything written so far durable; called once at shutdown.
    fn close(&self) -> impl Future<Output = Result<(), Error>> + Send;
}
