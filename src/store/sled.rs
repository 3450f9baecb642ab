//! The embedded store: sled 0.34 with two trees and one committer thread.
//!
//! - `records`: key bytes → encoded [`Record`] (its `retain_until` in the
//!   first bytes, see [`super::codec`]); changed only by compare-and-swap,
//!   so concurrent calls on one key serialize through the state machine
//!   without locks. A call starts by assuming the key is absent: a fresh
//!   Claim is one `compare_and_swap(key, None, record)`, and when the key
//!   exists the failed swap hands back its value without writing (a
//!   DUPLICATE costs that one traversal). A call whose answer would change
//!   nothing reads first, since an assumption cannot answer it.
//! - `marks`: ordering scope → highest committed sequence.
//!
//! No expiry index: the reaper sweeps both trees with a cursor, a bounded
//! number of entries per pass, reading each one's expiry from its prefix and
//! removing it by compare-and-swap (so a claim that replaced it meanwhile
//! wins). An index would cost two more tree writes per change, all at its
//! right edge. Expired records read as absent whether swept or not.
//!
//! Durability (`sync = always`): sled's `flush()` only `sync_file_range`s its
//! log on Linux, which does not persist the file's metadata or survive power
//! loss, so the committer calls `sync_data()` on sled's log file after each
//! flush. All callers waiting while one sync runs share the next one (group
//! commit); one thread does every flush because sled stalls when many tasks
//! flush at once. sled writes a log entry larger than a quarter of a segment
//! (128 KiB: a large cached response, or a node holding several) to a blob
//! file of its own that it never syncs, so the committer also syncs every
//! new file under `blobs/` before it acknowledges.
//!
//! Reads wait too: an answer that reveals a write (a DUPLICATE reporting
//! someone's commit) must not leave before that write is durable. Two
//! counters of writes started and finished let a reader skip the wait when
//! every write that began before its read was finished before the last sync.

use std::{
    fs::File,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering::SeqCst},
        mpsc, Arc, Mutex, OnceLock,
    },
    thread,
    time::{Duration, Instant},
};

use sled::IVec;
use tokio::sync::{oneshot, watch};

use super::{
    codec::{decode_mark, decode_record, encode_mark, encode_record, record_retain_until},
    disk::{DiskSpace, WriteKind},
    optimistic::{self, with_token, Conditional, Swapped, Versioned},
    stall::{busy, watch_syncs, Busy, StallWatch, PROBE_AFTER},
    IssueFencing, ReapReport, Store, StoreObserver, StoreStats,
};
use crate::{
    clock::UnixMillis,
    domain::{FencingToken, Key, OrderingScope, Record},
    error::Error,
    machine::{Change, SequenceMark},
};

impl From<sled::Error> for Error {
    fn from(error: sled::Error) -> Self {
        match error {
            sled::Error::Io(io_error) => io_error.into(),
            sled::Error::Corruption { .. } => Error::Corrupt(error.to_string()),
            sled::Error::CollectionNotFound(_)
            | sled::Error::Unsupported(_)
            | sled::Error::ReportableBug(_) => Error::Store(error.to_string()),
        }
    }
}

/// When a change counts as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// Every answer waits until its change is on disk (fdatasync), shared by
    /// group commit. Survives `kill -9` and power loss.
    Always,
    /// Answers do not wait; sled flushes every 500 ms. A crash of the machine
    /// can lose the last half second of commits (and fencing order across
    /// such a crash is not guaranteed).
    None,
}

/// How to open the sled store.
#[derive(Debug, Clone)]
pub struct SledConfig {
    /// The directory holding sled's files; created if missing.
    pub path: PathBuf,
    /// When a change counts as stored.
    pub sync: SyncMode,
    /// sled's page cache size in bytes.
    pub cache_capacity_bytes: u64,
    /// Writes are refused while the filesystem has less than this free (0:
    /// never), so sled never meets a full disk.
    pub disk_reserve_bytes: u64,
    /// A disk sync that takes longer than this means the store stopped
    /// answering: it fails for good (fail-stop) instead of hanging callers.
    pub stall_timeout: Duration,
}

impl SledConfig {
    /// `path` with the defaults: `sync = always`, a 64 MiB cache, a 64 MiB
    /// disk reserve and a 30 s stall timeout.
    pub fn new(path: impl Into<PathBuf>) -> SledConfig {
        SledConfig {
            path: path.into(),
            sync: SyncMode::Always,
            cache_capacity_bytes: 64 << 20,
            disk_reserve_bytes: 64 << 20,
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// Background flush interval when `sync = none`.
const LAZY_FLUSH_MS: u64 = 500;

/// Reads when an entry of a tree stops being live.
type RetainUntilOf = fn(&[u8]) -> Result<UnixMillis, Error>;

/// A reaper pass looks at up to this many entries per record it may remove:
/// a sweep covers the trees even when little in them has expired.
const SWEEP_PER_REMOVAL: usize = 64;

/// The sled store; clones share one database.
#[derive(Debug, Clone)]
pub struct SledStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    db: sled::Db,
    records: sled::Tree,
    marks: sled::Tree,
    /// Where the reaper's sweep of each tree goes on from (empty: the start).
    sweep_cursors: Mutex<[Vec<u8>; 2]>,
    log_file: Arc<File>,
    sync: SyncMode,
    counters: Arc<WriteCounters>,
    failure: Arc<Failure>,
    committer: Mutex<Option<Committer>>,
    stats: Mutex<Option<(std::time::Instant, StoreStats)>>,
    space: DiskSpace,
    stall: Arc<StallWatch>,
}

/// The store's permanent failure: set once, never cleared; callers waiting
/// for a sync are woken when it is set.
#[derive(Debug)]
struct Failure {
    reason: OnceLock<String>,
    failed: watch::Sender<bool>,
}

impl Failure {
    fn new() -> Self {
        Failure {
            reason: OnceLock::new(),
            failed: watch::Sender::new(false),
        }
    }

    fn get(&self) -> Option<&String> {
        self.reason.get()
    }

    /// Fails the store with `reason` (the first reason wins; it is logged
    /// once) and wakes every caller waiting for a sync.
    fn fail(&self, reason: String) -> String {
        let mut first = false;
        let reason = self
            .reason
            .get_or_init(|| {
                first = true;
                reason
            })
            .clone();
        if first {
            tracing::error!(%reason, "the store failed for good: NOT_SERVING; the process stops");
        }
        self.failed.send_replace(true);
        reason
    }

    /// What a write sled could not make means. sled keeps an I/O error of
    /// its log for good (every later write fails with it), and an error the
    /// disk returned (EIO, EROFS) means it can no longer be trusted: the
    /// store fails for good (fail-stop), which also answers every caller
    /// waiting for a sync at once. A full disk or a short resource is a
    /// refusal of this one write, as before.
    fn write_failed(&self, error: sled::Error) -> Error {
        match Error::from(error) {
            Error::Io(io) => {
                Error::Unavailable(self.fail(format!("disk write failed ({io}); restart dedupd")))
            }
            refused => refused,
        }
    }

    /// `Err` (UNAVAILABLE, with the reason) once the store has failed.
    fn check(&self) -> Result<(), Error> {
        match self.get() {
            Some(reason) => Err(Error::Unavailable(reason.clone())),
            None => Ok(()),
        }
    }

    /// Resolves once the store has failed.
    async fn failed(&self) {
        let mut failed = self.failed.subscribe();
        let _ = failed.wait_for(|failed| *failed).await;
    }
}

/// Counting records walks the whole tree: do it at most this often.
const STATS_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(30);

/// The committer thread and the queue of callers waiting for its next sync.
#[derive(Debug)]
struct Committer {
    queue: Option<mpsc::Sender<Waiter>>,
    thread: Option<thread::JoinHandle<()>>,
    /// Dropped to end the sync watch.
    watch_stop: Option<mpsc::Sender<()>>,
    watch: Option<thread::JoinHandle<()>>,
    failure: Arc<Failure>,
}

impl Committer {
    /// Lets the committer answer what is queued and end, ends the sync
    /// watch, and waits for both — both hold the database open, and a store
    /// reopened in this process must find it closed. Not once the store has
    /// failed: either may then be stuck in sled for good.
    fn shut_down(&mut self) {
        drop(self.queue.take());
        drop(self.watch_stop.take());
        if self.failure.get().is_some() {
            return;
        }
        for thread in [self.thread.take(), self.watch.take()]
            .into_iter()
            .flatten()
        {
            let _ = thread.join();
        }
    }
}

impl Drop for Committer {
    fn drop(&mut self) {
        self.shut_down();
    }
}

type Waiter = oneshot::Sender<Result<(), SyncRefusal>>;

/// Why a group commit did not make its callers' writes durable.
#[derive(Debug, Clone)]
enum SyncRefusal {
    /// A resource ran short before anything was synced (file descriptors):
    /// nothing is known to be lost, the next group commit tries again.
    Exhausted(String),
    /// A sync failed: the store stops for good.
    Failed(String),
}

impl From<SyncRefusal> for Error {
    fn from(refusal: SyncRefusal) -> Error {
        match refusal {
            SyncRefusal::Exhausted(reason) => Error::Exhausted(reason),
            SyncRefusal::Failed(reason) => Error::Unavailable(reason),
        }
    }
}

/// See the module docs ("Reads wait too").
#[derive(Debug, Default)]
struct WriteCounters {
    started: AtomicU64,
    finished: AtomicU64,
    /// `finished` as read just before the last successful sync.
    durable: AtomicU64,
}

/// Counts one write as started for as long as it lives.
struct WriteGuard<'a>(&'a WriteCounters);

impl<'a> WriteGuard<'a> {
    fn new(counters: &'a WriteCounters) -> Self {
        counters.started.fetch_add(1, SeqCst);
        WriteGuard(counters)
    }

    /// Nothing was written after all (a compare-and-swap that found another
    /// value): readers need not wait for a sync on its account.
    fn cancel(self) {
        self.0.started.fetch_sub(1, SeqCst);
        std::mem::forget(self);
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.0.finished.fetch_add(1, SeqCst);
    }
}

impl SledStore {
    /// Opens (or creates) the store and proves it writable with one synced
    /// write before returning.
    pub fn open(config: &SledConfig) -> Result<SledStore, Error> {
        SledStore::open_observed(config, None)
    }

    /// Like [`SledStore::open`], telling `observer` about each group commit.
    pub fn open_observed(
        config: &SledConfig,
        observer: Option<Arc<dyn StoreObserver>>,
    ) -> Result<SledStore, Error> {
        std::fs::create_dir_all(&config.path)?;
        let db = sled::Config::new()
            .path(&config.path)
            .cache_capacity(config.cache_capacity_bytes)
            .mode(sled::Mode::HighThroughput)
            .flush_every_ms(match config.sync {
                SyncMode::Always => None,
                SyncMode::None => Some(LAZY_FLUSH_MS),
            })
            .open()
            .map_err(|error| match error {
                // sled reports "another process has the database open" as a
                // bare I/O error; say what it means.
                sled::Error::Io(io) if io.to_string().contains("could not acquire lock") => {
                    Error::Unavailable(format!(
                        "{} is in use by another dedupd process",
                        config.path.display()
                    ))
                }
                other => other.into(),
            })?;
        let log_file = Arc::new(File::open(config.path.join("db"))?);
        db.insert("meta/opened", &[1u8][..])?;
        db.flush()?;
        log_file.sync_data()?;
        sync_directory(&config.path)?;

        let counters = Arc::new(WriteCounters::default());
        let failure = Arc::new(Failure::new());
        let stall = Arc::new(StallWatch::new(config.stall_timeout));
        let space = DiskSpace::new(config.path.clone(), config.disk_reserve_bytes);
        space.refresh()?;
        let committer = match config.sync {
            SyncMode::Always => Some(spawn_committer(
                db.clone(),
                Arc::clone(&log_file),
                BlobSyncer::new(config.path.join("blobs")),
                Arc::clone(&counters),
                Arc::clone(&failure),
                Arc::clone(&stall),
                observer,
            )?),
            SyncMode::None => None,
        };
        // Stores written before the sweep kept an expiry index: drop it.
        if db.tree_names().iter().any(|name| &name[..] == b"expiry") {
            db.drop_tree("expiry")?;
        }
        Ok(SledStore {
            inner: Arc::new(Inner {
                records: db.open_tree("records")?,
                marks: db.open_tree("marks")?,
                sweep_cursors: Mutex::new([Vec::new(), Vec::new()]),
                db,
                log_file,
                sync: config.sync,
                counters,
                failure,
                committer: Mutex::new(committer),
                stats: Mutex::new(None),
                space,
                stall,
            }),
        })
    }

    /// Bytes sled uses on disk.
    pub fn size_on_disk(&self) -> Result<u64, Error> {
        Ok(self.inner.db.size_on_disk()?)
    }

    /// Number of records stored, expired ones not yet reaped included.
    pub fn record_count(&self) -> usize {
        self.inner.records.len()
    }

    fn issue_fencing(&self) -> Result<FencingToken, Error> {
        // sled persists its ID generator ahead of use and skips past the
        // persisted value on recovery, so IDs never repeat across restarts.
        let id = self
            .inner
            .db
            .generate_id()
            .map_err(|error| self.inner.failure.write_failed(error))?;
        Ok(FencingToken(id + 1))
    }
}

impl Conditional for SledStore {
    type Version = IVec;

    async fn read(&self, key: &Key) -> Result<Option<Versioned<IVec>>, Error> {
        let Some(bytes) = self.inner.records.get(key.to_bytes())? else {
            return Ok(None);
        };
        Ok(Some(Versioned {
            record: decode_record(&bytes)?,
            version: bytes,
        }))
    }

    fn issue_now(&self) -> Option<Result<FencingToken, Error>> {
        Some(self.issue_fencing())
    }

    async fn write_if(
        &self,
        key: &Key,
        believed: Option<&Versioned<IVec>>,
        change: &Change,
        draw_token: bool,
    ) -> Result<Swapped<IVec>, Error> {
        let (replacement, token) = match change {
            Change::Put(record) if draw_token => {
                let token = self.issue_fencing()?;
                (Some(encode_record(&with_token(record, token))), Some(token))
            }
            Change::Put(record) => (Some(encode_record(record)), None),
            Change::Delete => (None, None),
            Change::Keep => {
                return Ok(Swapped::Done {
                    token: None,
                    version: None,
                })
            }
        };
        let inner = &self.inner;
        let current = believed.map(|stored| &stored.version[..]);
        match inner.swap(&inner.records, &key.to_bytes(), current, replacement)? {
            // Nothing is remembered between calls here: reads are local.
            Ok(()) => Ok(Swapped::Done {
                token,
                version: None,
            }),
            Err(found) => Ok(Swapped::Conflict(
                found
                    .map(|bytes| {
                        Ok::<_, Error>(Box::new(Versioned {
                            record: decode_record(&bytes)?,
                            version: bytes,
                        }))
                    })
                    .transpose()?,
            )),
        }
    }
}

impl Inner {
    /// Replaces `current` by `replacement` under `key` in `tree` with one
    /// compare-and-swap; on a conflict, the value found instead (nothing
    /// written).
    fn swap(
        &self,
        tree: &sled::Tree,
        key: &[u8],
        current: Option<&[u8]>,
        replacement: Option<Vec<u8>>,
    ) -> Result<Result<(), Option<IVec>>, Error> {
        self.space.admit(if replacement.is_some() {
            WriteKind::Put
        } else {
            WriteKind::Delete
        })?;
        let write = WriteGuard::new(&self.counters);
        let swapped = tree
            .compare_and_swap(key, current, replacement)
            .map_err(|error| self.failure.write_failed(error))?;
        match swapped {
            Ok(()) => Ok(Ok(())),
            Err(conflict) => {
                write.cancel();
                Ok(Err(conflict.current))
            }
        }
    }

    /// Sweeps on from where the last pass stopped, removing what expired by
    /// `now`: at most `budget` removals, and `budget × SWEEP_PER_REMOVAL`
    /// entries looked at, over both trees.
    fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        let _busy = self.enter()?;
        let mut report = ReapReport::default();
        let limit = budget.saturating_mul(SWEEP_PER_REMOVAL);
        let trees: [(&sled::Tree, RetainUntilOf); 2] = [
            (&self.records, record_retain_until),
            (&self.marks, |bytes| Ok(decode_mark(bytes)?.retain_until)),
        ];
        for (index, (tree, retain_until_of)) in trees.into_iter().enumerate() {
            let from = self.sweep_cursors.lock().expect("sweep lock")[index].clone();
            let range = if from.is_empty() {
                tree.range::<&[u8], _>(..)
            } else {
                tree.range::<&[u8], _>((
                    std::ops::Bound::Excluded(&from[..]),
                    std::ops::Bound::Unbounded,
                ))
            };
            let mut stopped_at = None;
            for entry in range {
                _busy.renew();
                if report.examined >= limit || report.removed >= budget {
                    break;
                }
                let (key, value) = entry?;
                report.examined += 1;
                let expired = match retain_until_of(&value) {
                    Ok(retain_until) => retain_until <= now,
                    Err(error) => {
                        tracing::warn!(%error, "the reaper skips an unreadable entry");
                        false
                    }
                };
                // A swap, not a remove: a claim may have replaced the record
                // since we read it, and then the new record must stay.
                if expired && self.swap(tree, &key, Some(&value), None)?.is_ok() {
                    report.removed += 1;
                }
                stopped_at = Some(key);
            }
            let done = report.examined < limit && report.removed < budget;
            self.sweep_cursors.lock().expect("sweep lock")[index] = match (done, stopped_at) {
                // Reached the end of the tree: start over next time.
                (true, _) | (false, None) => Vec::new(),
                (false, Some(key)) => key.to_vec(),
            };
            if !done {
                break;
            }
        }
        Ok(report)
    }

    /// Starts a sled call: refused once the store has failed (sled may
    /// block any call for good on a failed disk, reads included, since a
    /// read can split a node), else marked busy for the stall watch.
    fn enter(&self) -> Result<Busy, Error> {
        self.failure.check().map(|()| busy())
    }

    fn sync_now(&self) -> Result<(), Error> {
        self.db.flush()?;
        self.log_file.sync_data()?;
        Ok(())
    }
}

impl Store for SledStore {
    async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, IssueFencing<'_>) -> Result<(Change, T), Error> + Send,
    {
        use futures_util::FutureExt;

        let _busy = self.inner.enter()?;
        // Assume the key absent (see the module docs); a failed swap tells
        // the truth. sled's read and swap never wait, so the driver is done
        // in one poll, on this thread (the busy stamp is per thread).
        let updated = optimistic::update(self, key, None, apply).now_or_never();
        Ok(updated
            .ok_or_else(|| Error::Store("a sled update waited, which it cannot".into()))??
            .0)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        let _busy = self.inner.enter()?;
        self.inner
            .records
            .get(key.to_bytes())?
            .as_deref()
            .map(decode_record)
            .transpose()
    }

    async fn update_mark<F>(&self, scope: &OrderingScope, mut apply: F) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        let _busy = self.inner.enter()?;
        let inner = &self.inner;
        let key = scope.to_bytes();
        let mut current_bytes = inner.marks.get(&key)?;
        loop {
            let current = current_bytes.as_deref().map(decode_mark).transpose()?;
            let Some(replacement) = apply(current) else {
                return Ok(());
            };
            let replacement = Some(encode_mark(replacement).to_vec());
            match inner.swap(&inner.marks, &key, current_bytes.as_deref(), replacement)? {
                Ok(()) => return Ok(()),
                Err(found) => current_bytes = found,
            }
        }
    }

    async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
        let _busy = self.inner.enter()?;
        self.inner
            .marks
            .get(scope.to_bytes())?
            .as_deref()
            .map(decode_mark)
            .transpose()
    }

    async fn durable(&self) -> Result<(), Error> {
        let inner = &self.inner;
        // The failure alone (one load): stalls are found by the sync watch
        // and the health checks, off the request path.
        inner.failure.check()?;
        if inner.sync == SyncMode::None
            || inner.counters.started.load(SeqCst) <= inner.counters.durable.load(SeqCst)
        {
            return Ok(());
        }
        let (waiter, synced) = oneshot::channel();
        let queued = match &*inner.committer.lock().expect("committer lock poisoned") {
            Some(Committer {
                queue: Some(queue), ..
            }) => queue.send(waiter).is_ok(),
            _ => false,
        };
        if !queued {
            return Err(Error::Unavailable("the store is closed".into()));
        }
        tokio::select! {
            // The committer's answer is the truth about its group; the
            // failure is for a sync that never answers.
            biased;
            synced = synced => match synced {
                Ok(result) => result.map_err(Error::from),
                Err(_) => Err(Error::Unavailable("the store is closed".into())),
            },
            // A wedged sync never answers: the stall watch fails the store
            // and wakes everyone here instead.
            () = inner.failure.failed() => Err(self.health().err().unwrap_or_else(|| {
                Error::Unavailable("the store failed".into())
            })),
        }
    }

    async fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || inner.reap(now, budget))
            .await
            .map_err(|join| Error::Store(format!("reaper task failed: {join}")))?
    }

    fn health(&self) -> Result<(), Error> {
        let inner = &self.inner;
        if let Some(stall) = inner.stall.stalled() {
            inner.failure.fail(stall.reason());
        }
        inner.failure.check()
    }

    fn writable(&self) -> Result<(), Error> {
        self.health()?;
        self.inner.space.writable()
    }

    async fn stats(&self) -> StoreStats {
        if let Some((at, stats)) = *self.inner.stats.lock().expect("stats lock") {
            if at.elapsed() < STATS_MAX_AGE {
                return stats;
            }
        }
        if self.inner.failure.get().is_some() {
            // sled is left alone once failed (it may block a call).
            return StoreStats::default();
        }
        let inner = Arc::clone(&self.inner);
        let stats = tokio::task::spawn_blocking(move || StoreStats {
            records: Some(inner.records.len() as u64),
            disk_bytes: inner.db.size_on_disk().ok(),
        })
        .await
        .unwrap_or_default();
        *self.inner.stats.lock().expect("stats lock") = Some((std::time::Instant::now(), stats));
        stats
    }

    async fn close(&self) -> Result<(), Error> {
        // Later durable() calls fail fast; waiters already queued are still
        // answered by the committer, which exits once the queue is drained.
        let committer = self.inner.committer.lock().expect("lock").take();
        // A failed store syncs nothing more, and its committer may be stuck
        // in sled for good: do not wait for it.
        self.inner.failure.check()?;
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || {
            if let Some(mut committer) = committer {
                committer.shut_down();
            }
            inner.failure.check()?;
            // The sync watch has ended: health (the watchdog) sees this one.
            inner.stall.sync_starting();
            let synced = inner.sync_now();
            inner.stall.sync_done();
            synced
        })
        .await
        .map_err(|join| Error::Store(format!("final sync task failed: {join}")))?
    }
}

fn spawn_committer(
    db: sled::Db,
    log_file: Arc<File>,
    mut blobs: BlobSyncer,
    counters: Arc<WriteCounters>,
    failure: Arc<Failure>,
    stall: Arc<StallWatch>,
    observer: Option<Arc<dyn StoreObserver>>,
) -> Result<Committer, Error> {
    let (queue, waiters) = mpsc::channel::<Waiter>();
    let (db_for_watch, stall_for_watch, failure_for_watch, failure_for_shutdown) = (
        db.clone(),
        Arc::clone(&stall),
        Arc::clone(&failure),
        Arc::clone(&failure),
    );
    let thread = thread::Builder::new()
        .name("dedupd-committer".into())
        .spawn(move || {
            let mut batch = Vec::new();
            let mut gather = Gather::default();
            while let Ok(first) = waiters.recv() {
                batch.push(first);
                batch.extend(waiters.try_iter());
                gather.more(&mut batch, &waiters);
                let outcome = match failure.get() {
                    Some(reason) => Err(SyncRefusal::Failed(reason.clone())),
                    None => {
                        let finished = counters.finished.load(SeqCst);
                        let started = std::time::Instant::now();
                        stall.sync_starting();
                        let flushed = db.flush().map_err(Error::from);
                        let flush_time = started.elapsed();
                        let synced = flushed
                            .and_then(|_| log_file.sync_data().map_err(Error::from))
                            .and_then(|()| blobs.sync_new());
                        stall.sync_done();
                        let elapsed = started.elapsed();
                        tracing::trace!(
                            group = batch.len(),
                            flush_us = flush_time.as_micros() as u64,
                            sync_us = (elapsed - flush_time).as_micros() as u64,
                            "group commit"
                        );
                        gather.synced(batch.len(), elapsed);
                        if let Some(observer) = &observer {
                            observer.group_commit(batch.len(), elapsed);
                        }
                        match synced {
                            Ok(()) => {
                                counters.durable.fetch_max(finished, SeqCst);
                                Ok(())
                            }
                            // Listing or opening a file failed, no sync did:
                            // an overload that passes, not a broken disk.
                            Err(Error::Exhausted(reason)) => {
                                tracing::warn!(%reason, "group commit postponed");
                                Err(SyncRefusal::Exhausted(reason))
                            }
                            Err(error) => {
                                // After a failed fsync the kernel may have
                                // dropped the dirty pages: retrying could
                                // report success for lost data. Fail for good.
                                let reason = format!("disk sync failed ({error}); restart dedupd");
                                Err(SyncRefusal::Failed(failure.fail(reason)))
                            }
                        }
                    }
                };
                for waiter in batch.drain(..) {
                    let _ = waiter.send(outcome.clone());
                }
            }
        })?;
    let (watch_stop, stop) = mpsc::channel();
    let failure_for_probe = Arc::clone(&failure_for_watch);
    let probe = Arc::new(move || {
        // Once failed, sled is left alone (it may block a call).
        if failure_for_probe.get().is_none() {
            if let Err(error) = db_for_watch.insert(PROBE_KEY, &[][..]) {
                failure_for_probe.write_failed(error);
            }
        }
    });
    let watch = thread::Builder::new()
        .name("dedupd-sync-watch".into())
        .spawn(move || {
            watch_syncs(&stall_for_watch, &stop, PROBE_AFTER, probe, |stall| {
                failure_for_watch.fail(stall.reason());
            });
        })?;
    Ok(Committer {
        queue: Some(queue),
        thread: Some(thread),
        watch_stop: Some(watch_stop),
        watch: Some(watch),
        failure: failure_for_shutdown,
    })
}

/// The key the sync watch's probe writes (never read).
const PROBE_KEY: &[u8] = b"meta/probe";

/// The longest a group commit waits for more callers before it syncs.
const MAX_GATHER: Duration = Duration::from_millis(1);

/// How long the committer waits for the rest of a group before it syncs.
///
/// Starting a sync for the first caller that arrives makes groups chase
/// each other under load: one caller gets a sync to itself while the rest,
/// a few microseconds behind it, wait for all of that sync and the next.
/// When the previous sync answered more callers than are waiting now, more
/// are most likely on their way, so wait for as many (at most half a sync's
/// time, and [`MAX_GATHER`]). A lone caller at low load (the last group was
/// one) never waits; a load that falls costs one short wait, no more.
#[derive(Debug, Default)]
struct Gather {
    last_group: usize,
    last_sync: Duration,
}

impl Gather {
    fn more<T>(&self, batch: &mut Vec<T>, waiters: &mpsc::Receiver<T>) {
        if batch.len() >= self.last_group {
            return;
        }
        let deadline = Instant::now() + (self.last_sync / 2).min(MAX_GATHER);
        while batch.len() < self.last_group {
            let left = deadline.saturating_duration_since(Instant::now());
            match waiters.recv_timeout(left) {
                Ok(waiter) => batch.push(waiter),
                Err(_) => return,
            }
        }
    }

    fn synced(&mut self, group: usize, took: Duration) {
        self.last_group = group;
        self.last_sync = took;
    }
}

/// Syncs the blob files sled wrote since the last call (see module docs).
#[derive(Debug)]
struct BlobSyncer {
    directory: PathBuf,
    synced: std::collections::HashSet<std::ffi::OsString>,
}

impl BlobSyncer {
    fn new(directory: PathBuf) -> Self {
        BlobSyncer {
            directory,
            synced: std::collections::HashSet::new(),
        }
    }

    fn sync_new(&mut self) -> Result<(), Error> {
        let entries = match std::fs::read_dir(&self.directory) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(error) => return Err(error.into()),
        };
        let mut present = std::collections::HashSet::new();
        let mut any_new = false;
        for entry in entries {
            let name = entry?.file_name();
            if !self.synced.contains(&name) {
                match File::open(self.directory.join(&name)) {
                    Ok(file) => file.sync_data()?,
                    // Deleted by sled since we listed it: nothing to sync.
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(error) => return Err(error.into()),
                }
                any_new = true;
            }
            present.insert(name);
        }
        if any_new {
            sync_directory(&self.directory)?;
        }
        // sled deletes blobs it no longer needs; forget those names.
        self.synced = present;
        Ok(())
    }
}

fn sync_directory(path: &Path) -> Result<(), Error> {
    File::open(path)?.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::{
        clock::{Clock, ManualClock},
        domain::{ClaimOutcome, ClaimRequest, CommitRequest, RecordState},
        engine::Engine,
    };

    fn store(dir: &Path) -> SledStore {
        SledStore::open(&SledConfig {
            cache_capacity_bytes: 4 << 20,
            ..SledConfig::new(dir)
        })
        .unwrap()
    }

    /// Opens `dir` again, waiting (at most 10 s) while an earlier store of
    /// this process still holds its lock.
    async fn reopen(dir: &Path) -> SledStore {
        let config = SledConfig {
            cache_capacity_bytes: 4 << 20,
            ..SledConfig::new(dir)
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match SledStore::open(&config) {
                Ok(store) => return store,
                Err(Error::Unavailable(reason))
                    if reason.contains("in use") && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(error) => panic!("reopen: {error}"),
            }
        }
    }

    fn claim_request(id: &str) -> ClaimRequest {
        ClaimRequest::plain(
            crate::api::Limits::default().key("reap", id).unwrap(),
            Duration::from_millis(5),
            Duration::from_millis(1),
        )
    }

    /// The reaper sweeps without pause while one key is claimed and
    /// committed over and over, each time after the last record expired: a
    /// claim that replaced the expired record the reaper read must survive
    /// its removal (a compare-and-swap, not a remove), so every commit with
    /// the lease just granted succeeds and fencing only grows.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_reaper_never_removes_a_claim_that_replaced_what_it_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(store(dir.path()));
        let clock = ManualClock::new(UnixMillis(1_000_000));
        let engine = Engine::new(Arc::clone(&store), Arc::new(clock.clone()));
        let stop = Arc::new(AtomicBool::new(false));
        let reaper = {
            let (store, clock, stop) = (Arc::clone(&store), clock.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut removed = 0;
                while !stop.load(SeqCst) {
                    removed += store.reap(clock.now(), 8).await.unwrap().removed;
                }
                removed
            })
        };
        let mut last_fencing = 0;
        for round in 0..500 {
            // The previous commit (1 ms retention) has expired.
            clock.advance(Duration::from_millis(10));
            let request = claim_request("contended");
            let ClaimOutcome::Claimed { record, .. } = engine.claim(&request).await.unwrap() else {
                panic!("round {round}: the expired key was not claimable");
            };
            assert!(record.fencing_token.0 > last_fencing, "round {round}");
            last_fencing = record.fencing_token.0;
            let committed = engine
                .commit(&CommitRequest {
                    key: request.key.clone(),
                    lease_token: record.lease_token,
                    response: Vec::new(),
                    retention: None,
                })
                .await
                .unwrap_or_else(|error| panic!("round {round}: {error}"));
            assert_eq!(committed.record().state, RecordState::Committed);
        }
        stop.store(true, SeqCst);
        let removed = reaper.await.unwrap();
        assert!(removed > 0, "the reaper raced for real");
    }

    /// A pass looks at a bounded number of entries and the next one goes on
    /// from there; every expired record goes within one sweep, live ones
    /// stay.
    #[tokio::test]
    async fn the_sweep_is_bounded_per_pass_and_covers_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let clock = ManualClock::new(UnixMillis(1_000_000));
        let engine = Engine::new(Arc::new(store.clone()), Arc::new(clock.clone()));
        for i in 0..1000 {
            let mut request = claim_request(&format!("evt-{i:04}"));
            if i % 10 == 0 {
                request.retention = Duration::from_secs(3600); // stays
            }
            engine.claim(&request).await.unwrap();
        }
        clock.advance(Duration::from_secs(60));
        let first = store.reap(clock.now(), 1).await.unwrap();
        assert_eq!(first.removed, 1);
        assert!(first.examined <= SWEEP_PER_REMOVAL, "{first:?}");
        let mut passes = 1;
        while store.record_count() > 100 {
            store.reap(clock.now(), 10).await.unwrap();
            passes += 1;
            assert!(passes < 200, "the sweep did not cover the tree");
        }
        assert_eq!(store.record_count(), 100, "live records stay");
        assert_eq!(store.reap(clock.now(), 10).await.unwrap().removed, 0);
    }

    /// A data directory from before the sweep had an expiry index: it is
    /// dropped at open, and its records are still there.
    #[tokio::test]
    async fn the_old_expiry_index_is_dropped_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let key = crate::api::Limits::default().key("old", "evt").unwrap();
        {
            let store = store(dir.path());
            let engine = Engine::new(
                Arc::new(store.clone()),
                Arc::new(ManualClock::new(UnixMillis(1_000_000))),
            );
            engine.claim(&claim_request("evt")).await.unwrap();
            store
                .inner
                .db
                .open_tree("expiry")
                .unwrap()
                .insert(b"x", b"")
                .unwrap();
            store.close().await.unwrap();
        }
        // sled releases its directory lock when its own flusher thread has
        // let go of the database, a moment after the last handle drops.
        let store = reopen(dir.path()).await;
        let names = store.inner.db.tree_names();
        assert!(!names.iter().any(|name| &name[..] == b"expiry"));
        let old = crate::api::Limits::default().key("reap", "evt").unwrap();
        assert!(store.get(&old).await.unwrap().is_some());
        assert!(store.get(&key).await.unwrap().is_none());
    }

    /// A group commit waits for as many callers as the last one answered,
    /// and no longer than its bound; a lone caller at low load never waits.
    #[test]
    fn a_group_commit_gathers_what_the_last_one_answered() {
        let (queue, waiters) = mpsc::channel::<u32>();
        let mut gather = Gather::default();

        let mut batch = vec![1];
        gather.more(&mut batch, &waiters);
        assert_eq!(batch, [1], "the first group never waits");

        gather.synced(3, Duration::from_millis(10));
        queue.send(2).unwrap();
        queue.send(3).unwrap();
        queue.send(4).unwrap();
        let mut batch = vec![1];
        gather.more(&mut batch, &waiters);
        assert_eq!(batch, [1, 2, 3], "callers behind the first join its group");
        assert_eq!(
            waiters.try_recv(),
            Ok(4),
            "and the group stops at the last size"
        );

        gather.synced(64, Duration::from_secs(5));
        let started = Instant::now();
        let mut batch = vec![1];
        gather.more(&mut batch, &waiters);
        assert_eq!(batch, [1]);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "a slow last sync does not stretch the wait past MAX_GATHER"
        );

        gather.synced(1, Duration::from_millis(10));
        queue.send(2).unwrap();
        let mut batch = vec![1];
        gather.more(&mut batch, &waiters);
        assert_eq!(batch, [1], "a group as large as the last one syncs at once");
    }
}
