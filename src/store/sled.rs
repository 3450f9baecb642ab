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
//! right edge. Expired records read as absent whether swept or not. The
//! sweep also counts the records (see [`RecordCount`]): a scrape of
//! `/metrics` reads a number, never the tree.
//!
//! Durability (`sync = always`) lives in dedupd's own write-ahead log
//! ([`super::wal`]), not in sled: waiting for sled's `flush()` costs a
//! device round trip of its own (an `fdatasync` of its log buffer in our
//! copy of sled; `sync_file_range` in sled 0.34.7, which survives no power
//! loss) before our own sync. Every change is made in sled by
//! compare-and-swap and framed into the log under one lock (so the log's
//! order is the order of the swaps); the committer thread writes what was
//! framed and `fdatasync`s the log once per group commit, and the answers
//! of everyone waiting while one sync runs share the next one. sled writes
//! in the background; a checkpoint thread, every `checkpoint_interval` or
//! `checkpoint_log_bytes` of log, flushes sled and syncs its files (its log
//! and the blob files it writes for large entries and never syncs), and
//! only then deletes the log segments the checkpoint covers. Opening
//! replays whatever segments are left into sled, then checkpoints.
//!
//! Fencing tokens come from a counter of our own whose reservation (a block
//! ahead) is a change like any other: written to sled before any record
//! holding a token from that block, and logged. A record sled persisted
//! whose log frame was lost (never acknowledged) therefore never holds a
//! token above what recovery resumes from.
//!
//! Reads wait too: an answer that reveals a write (a DUPLICATE reporting
//! someone's commit) must not leave before that write is durable. Two
//! counters of writes started and finished let a reader skip the wait when
//! every write that began before its read was finished before the last sync.

use std::{
    fs::File,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::SeqCst},
        mpsc, Arc, Mutex, OnceLock,
    },
    thread,
    time::{Duration, Instant},
};

use sled::IVec;
use tokio::sync::Notify;

use super::{
    codec::{decode_mark, decode_record, encode_mark, encode_record, record_retain_until},
    disk::{DiskSpace, WriteKind},
    expiry::{ExpiryIndex, Whole},
    optimistic::{self, with_token, Conditional, Swapped, Versioned},
    stall::{busy, watch_syncs, Busy, StallWatch, PROBE_AFTER},
    wal::sync_directory,
    wal::{self, Appender, Tree},
    Attempt, ReapReport, ScanCursor, ScanPage, Store, StoreObserver, StoreStats,
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
    /// Every answer waits until its change is in the write-ahead log on disk
    /// (one fdatasync, shared by group commit). Survives `kill -9` and power
    /// loss.
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
    /// Longest time between checkpoints while changes arrive.
    pub checkpoint_interval: Duration,
    /// A checkpoint starts once this much log was written since the last.
    pub checkpoint_log_bytes: u64,
    /// The time one file of the expiry index covers (1 s to 60 s): how late
    /// after its expiry a record may be reaped. The reaper's interval.
    pub expiry_bucket: Duration,
}

impl SledConfig {
    /// `path` with the defaults: `sync = always`, a 64 MiB cache, a 64 MiB
    /// disk reserve, a 30 s stall timeout, a checkpoint every 30 s or
    /// 16 MiB of log, and expiry filed by 10 s.
    pub fn new(path: impl Into<PathBuf>) -> SledConfig {
        SledConfig {
            path: path.into(),
            sync: SyncMode::Always,
            cache_capacity_bytes: 64 << 20,
            disk_reserve_bytes: 64 << 20,
            stall_timeout: Duration::from_secs(30),
            checkpoint_interval: Duration::from_secs(30),
            checkpoint_log_bytes: 16 << 20,
            expiry_bucket: Duration::from_secs(10),
        }
    }
}

/// sled's background flush interval (durability comes from the log, or,
/// with `sync = none`, from this flush alone).
const LAZY_FLUSH_MS: u64 = 500;

/// The key of the fencing reservation in sled's default tree: every token
/// issued is below it.
const FENCE_KEY: &[u8] = b"meta/fence-reserved";

/// How many fencing tokens one reservation covers.
const FENCE_BLOCK: u64 = 1 << 20;

/// Reads when an entry of a tree stops being live.
type RetainUntilOf = fn(&[u8]) -> Result<UnixMillis, Error>;

/// How `tree`'s entries say when they stop being live (`None`: never).
fn retain_until_of(tree: Tree) -> Option<RetainUntilOf> {
    match tree {
        Tree::Records => Some(record_retain_until),
        Tree::Marks => Some(|bytes| Ok(decode_mark(bytes)?.retain_until)),
        Tree::Meta => None,
    }
}

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
    /// Where the reaper's sweep goes on from, and what it counted so far.
    sweep: Mutex<Sweep>,
    /// Which keys fall due when: once whole, a reaper pass reads only what
    /// is due instead of sweeping.
    expiry: ExpiryIndex,
    /// How many records there are, without a scan per scrape.
    record_count: RecordCount,
    /// sled's log file, synced by checkpoints.
    log_file: Arc<File>,
    path: PathBuf,
    sync: SyncMode,
    /// Frames not yet handed to the committer (`sync = always` only); held
    /// across each compare-and-swap so the log's order is sled's.
    appender: Option<Arc<Mutex<Appender>>>,
    fencing: Fencing,
    counters: Arc<WriteCounters>,
    /// Also holds the callers waiting for the committer's next sync.
    failure: Arc<Failure>,
    committer: Mutex<Option<Committer>>,
    /// The last figure of the files' size, and when it was taken.
    disk_bytes: Mutex<Option<(std::time::Instant, Option<u64>)>>,
    space: Arc<DiskSpace>,
    stall: Arc<StallWatch>,
    /// The checkpoint thread's syncs (one sync at a time per watch).
    checkpoint_stall: Arc<StallWatch>,
}

/// The reaper's sweep between passes.
#[derive(Debug, Default)]
struct Sweep {
    /// Where the sweep of each tree goes on from (empty: the start).
    cursors: [Vec<u8>; 2],
    /// The tree the sweep is in (0: records, 1: marks): the records are
    /// not swept again before the marks are through.
    phase: usize,
    /// Records looked at since the sweep of `records` last started over,
    /// and `RecordCount::changes` then (`None` until a sweep starts at the
    /// beginning of the tree, so that a count covers the whole of it).
    counting: Option<(u64, i64)>,
    /// The expiry index's epoch when this sweep started at the beginning
    /// of the records while the index was not whole (it files every record
    /// it passes; at its end the index is whole, unless entries were lost
    /// since).
    filing: Option<u64>,
}

/// The number of records, kept without reading them: the reaper's sweep
/// passes over every record anyway, so each sweep of the `records` tree
/// from its start to its end counts them, and the compare-and-swaps that
/// create and remove records move the figure from the sweep's start on.
/// (sled's `len()` walks the whole tree: a scrape every 30 s pulled a
/// million records' pages through the cache.) A gauge, not an exact
/// figure: a record created during a sweep at a key the sweep had not yet
/// reached is counted twice, and one removed there taken off twice (the
/// sweep sees the first, misses the second, and the change counts too),
/// until the next sweep counts again. Keys that grow (time-ordered IDs)
/// are all created ahead of the cursor: the figure is then high by the
/// records created during one sweep (one or two reaper passes).
#[derive(Debug, Default)]
struct RecordCount {
    /// The last whole sweep's count and `changes` when it started (`None`
    /// until a sweep has gone through the tree since open).
    counted: Mutex<Option<(u64, i64)>>,
    /// Records created minus records removed, since open.
    changes: AtomicI64,
}

impl RecordCount {
    /// A change of one record: it existed before (or not), exists now (or
    /// not).
    fn changed(&self, existed: bool, exists: bool) {
        let delta = i64::from(exists) - i64::from(existed);
        if delta != 0 {
            self.changes.fetch_add(delta, SeqCst);
        }
    }

    /// `None` until a sweep has counted.
    fn get(&self) -> Option<u64> {
        let (counted, changes_then) = (*self.counted.lock().expect("count lock"))?;
        let since = self.changes.load(SeqCst) - changes_then;
        Some(counted.saturating_add_signed(since))
    }
}

/// The fencing token source (see the module docs).
#[derive(Debug)]
struct Fencing {
    next: AtomicU64,
    /// Tokens below this are covered by a reservation written to sled.
    reserved: AtomicU64,
    reserving: Mutex<()>,
}

/// The store's permanent failure: set once, never cleared; callers waiting
/// for a sync (held here, as every thread that can fail the store must
/// wake them) are woken when it is set.
#[derive(Debug, Default)]
struct Failure {
    reason: OnceLock<String>,
    waiters: SyncWaiters,
}

impl Failure {
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
        self.waiters.synced.notify_waiters();
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
}

/// Sizing the files walks the directory: do it at most this often.
const STATS_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(30);

/// The committer thread and the threads it started.
#[derive(Debug)]
struct Committer {
    thread: Option<thread::JoinHandle<()>>,
    /// Ends when the committer (which holds the sender of its seals) has.
    checkpointer: Option<thread::JoinHandle<()>>,
    /// Dropped to end the sync watch.
    watch_stop: Option<mpsc::Sender<()>>,
    watch: Option<thread::JoinHandle<()>>,
    failure: Arc<Failure>,
}

impl Committer {
    /// Lets the committer answer what is queued, sync the last frames and
    /// end, lets a checkpoint under way finish, ends the sync watch, and
    /// waits for all three — they hold the database open, and a store
    /// reopened in this process must find it closed. Not once the store has
    /// failed: either may then be stuck in sled for good.
    fn shut_down(&mut self) {
        self.failure.waiters.stopping.store(true, SeqCst);
        self.failure.waiters.wake_committer();
        drop(self.watch_stop.take());
        if self.failure.get().is_some() {
            return;
        }
        for thread in [
            self.thread.take(),
            self.checkpointer.take(),
            self.watch.take(),
        ]
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

/// How callers ask the committer for a sync and learn it happened, without
/// a channel or an allocation per call: a caller takes a ticket (one atomic
/// add) and wakes the committer thread; the committer reads the tickets
/// issued *before* it takes the log's frames, so the group it syncs covers
/// every write those callers could have seen, then publishes that count as
/// served and wakes every waiting caller at once. A caller whose ticket is
/// not yet served waits for the next wake-up.
#[derive(Debug, Default)]
struct SyncWaiters {
    /// Tickets issued.
    requested: AtomicU64,
    /// Tickets whose group was synced.
    served: AtomicU64,
    /// Woken after each group commit, when the store fails and when the
    /// committer ends.
    synced: Notify,
    /// Set at shut down: the committer syncs what is left and ends.
    stopping: AtomicBool,
    /// The committer ended: no more syncs.
    ended: AtomicBool,
    /// The committer thread, unparked by each ticket.
    committer: OnceLock<thread::Thread>,
    /// Set when frames nobody waits for have piled up (see `Inner::swap`):
    /// the committer syncs them without a ticket (a ticket would count as
    /// a caller in the group sizes).
    sync_wanted: AtomicBool,
}

impl SyncWaiters {
    /// Takes a ticket and wakes the committer: its next group covers every
    /// write made (or seen) before this call.
    fn request(&self) -> u64 {
        let ticket = self.requested.fetch_add(1, SeqCst) + 1;
        self.wake_committer();
        ticket
    }

    fn wake_committer(&self) {
        if let Some(committer) = self.committer.get() {
            committer.unpark();
        }
    }

    /// Asks the committer for a group commit nobody waits for.
    fn want_sync(&self) {
        self.sync_wanted.store(true, SeqCst);
        self.wake_committer();
    }

    /// Tickets issued and not yet served (the committer's view).
    fn pending(&self, served: u64) -> u64 {
        self.requested.load(SeqCst).saturating_sub(served)
    }

    /// Parks the committer until a ticket is pending, a sync is wanted,
    /// shut down begins or `timeout` passes.
    fn wait_for_request(&self, served: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.pending(served) == 0
            && !self.stopping.load(SeqCst)
            && !self.sync_wanted.load(SeqCst)
        {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            thread::park_timeout(left);
        }
    }
}

/// Marks the committer ended however its thread leaves (return or panic),
/// and wakes the callers still waiting: nobody will sync for them. Ending
/// when nobody asked it to (a panic) fails the store: writes would go on
/// being framed with nobody to sync them, and health must say so.
struct CommitterEnded(Arc<Failure>);

impl Drop for CommitterEnded {
    fn drop(&mut self) {
        let failure = &self.0;
        if thread::panicking() || !failure.waiters.stopping.load(SeqCst) {
            // (A no-op when a failure already ended it: the first reason stays.)
            failure.fail("the committer thread ended unexpectedly; restart dedupd".into());
        }
        failure.waiters.ended.store(true, SeqCst);
        failure.waiters.synced.notify_waiters();
    }
}

/// See the module docs ("Reads wait too").
#[derive(Debug, Default)]
struct WriteCounters {
    started: AtomicU64,
    finished: AtomicU64,
    /// `finished` as read just before the last successful sync (or by a
    /// group with nothing new to sync: everything before was synced).
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
        restore_removed_blobs(&config.path)?;
        let db = sled::Config::new()
            .path(&config.path)
            .cache_capacity(config.cache_capacity_bytes)
            .mode(sled::Mode::HighThroughput)
            .flush_every_ms(Some(LAZY_FLUSH_MS))
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
        // sled writes its configuration file at every open and never syncs
        // it; after a power cut it finds it empty and writes it again.
        // Synced here so that a cut finds it whole (and says nothing).
        File::open(config.path.join("conf"))?.sync_all()?;
        let records = db.open_tree("records")?;
        let marks = db.open_tree("marks")?;

        // Whatever the log holds since the last checkpoint goes back into
        // sled, in the order it was made.
        let wal_dir = config.path.join(wal::WAL_DIR);
        let started = Instant::now();
        let mut highest_token = 0;
        // Read before the replay: sled may hold a newer reservation than the
        // log's last one (its frame lost, never answered), and a token from
        // it may be in a record sled kept; the replay must not lower it.
        let reserved_before_replay = db
            .get(FENCE_KEY)?
            .map(|bytes| decode_u64(&bytes))
            .transpose()?;
        let replayed = wal::replay(&wal_dir, |frames| {
            // Only a key's last change in a run of frames is applied (a
            // claim and its commit are usually two frames close together):
            // start-up after a crash is mostly these reads of sled. Per
            // run, not per segment, so the map stays small: a segment's
            // 133 000 frames took a 10 MB map at the open's peak (heap
            // profile, docs/memory.md); runs applied in order leave each
            // key at its last change all the same. Every record frame
            // still counts for the tokens.
            let mut last_change = std::collections::HashMap::with_capacity(frames.len());
            for (index, frame) in frames.iter().enumerate() {
                if let (Tree::Records, Some(value)) = (frame.tree, frame.value) {
                    highest_token = highest_token.max(decode_record(value)?.fencing_token.0);
                }
                last_change.insert((frame.tree, frame.key), index);
            }
            for (index, frame) in frames.iter().enumerate() {
                if last_change.get(&(frame.tree, frame.key)) != Some(&index) {
                    continue;
                }
                let tree: &sled::Tree = match frame.tree {
                    Tree::Meta => &db,
                    Tree::Records => &records,
                    Tree::Marks => &marks,
                };
                // After a kill -9 sled holds nearly all of it already: a
                // change it has is not written again (sled's log would grow
                // by the whole replay, on a disk that may be at its reserve).
                let current = tree.get(frame.key)?;
                match frame.value {
                    Some(value) if current.as_deref() != Some(value) => {
                        tree.insert(frame.key, value)?;
                    }
                    None if current.is_some() => {
                        tree.remove(frame.key)?;
                    }
                    _ => {}
                }
            }
            Ok(())
        })?;
        if let Some((segment, offset, what)) = &replayed.torn {
            tracing::warn!(
                segment = %segment.display(), offset, what,
                "the write-ahead log ends in a torn frame (a group commit the process died in, \
                 answered to nobody): recovered up to it"
            );
        }
        if replayed.frames > 0 {
            tracing::info!(
                frames = replayed.frames,
                bytes = replayed.bytes,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "replayed the write-ahead log"
            );
        }

        // Tokens resume above every reservation and every logged token; a
        // data directory from before the log has only sled's own counter.
        let floor = match (reserved_before_replay, db.get(FENCE_KEY)?) {
            (None, None) => db.generate_id()? + 1,
            (before, after) => before.unwrap_or(0).max(
                after
                    .map(|bytes| decode_u64(&bytes))
                    .transpose()?
                    .unwrap_or(0),
            ),
        };
        let next_token = floor.max(highest_token + 1);
        db.insert(FENCE_KEY, &(next_token + FENCE_BLOCK).to_le_bytes()[..])?;
        db.insert("meta/opened", &[1u8][..])?;

        // Trusted only if no open came between the last clean close and
        // this one: every open moves the fencing reservation.
        let mut expiry = ExpiryIndex::open(
            &config.path,
            config.expiry_bucket,
            reserved_before_replay.unwrap_or(0),
        )?;
        if replayed.frames > 0 {
            // Records the replay wrote have no entries in the index.
            expiry.index.distrust();
            expiry.record_count = None;
        }
        // Stores written before the sweep kept an expiry index: drop it.
        if db.tree_names().iter().any(|name| &name[..] == b"expiry") {
            db.drop_tree("expiry")?;
        }
        // The checkpoint that makes the replay (and the open write proving
        // the disk writable) durable; only then may the log go.
        let blobs = BlobSyncer::new(config.path.join("blobs"));
        let blobs = bounded_checkpoint(&db, &log_file, blobs, &config.path, config.stall_timeout)?;
        wal::remove_through(&wal_dir, replayed.last_segment)?;

        let counters = Arc::new(WriteCounters::default());
        let failure = Arc::new(Failure::default());
        let stall = Arc::new(StallWatch::new(config.stall_timeout));
        let checkpoint_stall = Arc::new(StallWatch::new(config.stall_timeout));
        let space = Arc::new(DiskSpace::new(
            config.path.clone(),
            config.disk_reserve_bytes,
        ));
        space.refresh()?;
        let (committer, appender) = match config.sync {
            SyncMode::Always => {
                let appender = Arc::new(Mutex::new(Appender::new(replayed.next_lsn)));
                let writer =
                    wal::Writer::create(&wal_dir, replayed.last_segment + 1, replayed.next_group)?;
                let committer = spawn_committer(
                    CommitterParts {
                        db: db.clone(),
                        log_file: Arc::clone(&log_file),
                        blobs,
                        path: config.path.clone(),
                        writer,
                        appender: Arc::clone(&appender),
                        counters: Arc::clone(&counters),
                        space: Arc::clone(&space),
                        failure: Arc::clone(&failure),
                        stall: Arc::clone(&stall),
                        checkpoint_stall: Arc::clone(&checkpoint_stall),
                        checkpoint_interval: config.checkpoint_interval,
                        checkpoint_log_bytes: config.checkpoint_log_bytes,
                    },
                    observer,
                )?;
                (Some(committer), Some(appender))
            }
            SyncMode::None => (None, None),
        };
        Ok(SledStore {
            inner: Arc::new(Inner {
                records,
                marks,
                sweep: Mutex::default(),
                expiry: expiry.index,
                record_count: RecordCount {
                    counted: Mutex::new(expiry.record_count.map(|count| (count, 0))),
                    changes: AtomicI64::new(0),
                },
                db,
                log_file,
                path: config.path.clone(),
                sync: config.sync,
                appender,
                fencing: Fencing {
                    next: AtomicU64::new(next_token),
                    reserved: AtomicU64::new(next_token + FENCE_BLOCK),
                    reserving: Mutex::new(()),
                },
                counters,
                failure,
                committer: Mutex::new(committer),
                disk_bytes: Mutex::new(None),
                space,
                stall,
                checkpoint_stall,
            }),
        })
    }

    /// Bytes sled, the write-ahead log and the expiry index use on disk.
    pub fn size_on_disk(&self) -> Result<u64, Error> {
        self.inner.size_on_disk()
    }

    /// Whether the reaper's sweep of the records is between its start and
    /// its end (for tests: a whole sweep counts the records).
    pub fn sweep_under_way(&self) -> bool {
        let sweep = self.inner.lock_sweep();
        sweep.phase != 0 || !sweep.cursors[0].is_empty()
    }

    /// Number of records stored, expired ones not yet reaped included
    /// (counted by walking the tree: for tests).
    pub fn record_count(&self) -> usize {
        self.inner.records.len()
    }

    fn issue_fencing(&self) -> Result<FencingToken, Error> {
        let fencing = &self.inner.fencing;
        let token = fencing.next.fetch_add(1, SeqCst);
        if token >= fencing.reserved.load(SeqCst) {
            let _one = fencing.reserving.lock().expect("fencing lock");
            if token >= fencing.reserved.load(SeqCst) {
                // Written (and logged) before any record holding `token`.
                let reserved = token + FENCE_BLOCK;
                self.inner
                    .put(Tree::Meta, FENCE_KEY, &reserved.to_le_bytes())?;
                fencing.reserved.store(reserved, SeqCst);
            }
        }
        Ok(FencingToken(token))
    }
}

fn decode_u64(bytes: &[u8]) -> Result<u64, Error> {
    Ok(u64::from_le_bytes(bytes.try_into().map_err(|_| {
        Error::Corrupt(format!("a fencing reservation of {} bytes", bytes.len()))
    })?))
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
        match inner.swap(Tree::Records, &key.to_bytes(), current, replacement)? {
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
    fn tree(&self, tree: Tree) -> &sled::Tree {
        match tree {
            Tree::Meta => &self.db,
            Tree::Records => &self.records,
            Tree::Marks => &self.marks,
        }
    }

    /// The log's lock, taken for the length of one change so the log's
    /// order is sled's (`None` with `sync = none`): refused once closed.
    fn lock_log(&self) -> Result<Option<std::sync::MutexGuard<'_, Appender>>, Error> {
        let Some(appender) = &self.appender else {
            return Ok(None);
        };
        let appender = appender.lock().expect("log lock poisoned");
        if appender.closed() {
            return Err(Error::Unavailable("the store is closed".into()));
        }
        Ok(Some(appender))
    }

    /// Replaces `current` by `replacement` under `key` in `tree` with one
    /// compare-and-swap, logged; on a conflict, the value found instead
    /// (nothing written).
    fn swap(
        &self,
        tree: Tree,
        key: &[u8],
        current: Option<&[u8]>,
        replacement: Option<Vec<u8>>,
    ) -> Result<Result<(), Option<IVec>>, Error> {
        self.space.admit(if replacement.is_some() {
            WriteKind::Put
        } else {
            WriteKind::Delete
        })?;
        let replacement = replacement.map(IVec::from);
        // Before the swap: see `Whole` (a removal files nothing).
        let whole = if replacement.is_some() {
            self.expiry.whole()
        } else {
            Whole::NOT
        };
        let mut log = self.lock_log()?;
        // Dropped before the log's lock: the committer, holding that lock,
        // finds every write finished.
        let write = WriteGuard::new(&self.counters);
        let swapped = self
            .tree(tree)
            .compare_and_swap(key, current, replacement.clone())
            .map_err(|error| self.failure.write_failed(error))?;
        match swapped {
            Ok(()) => {
                if let Some(log) = &mut log {
                    let before = log.buffered();
                    log.append(tree, key, replacement.as_deref());
                    // Changes nobody waits for (the reaper's removals)
                    // would wait in the buffer for the next checkpoint's
                    // sync: removing 500 000 records held 24 MiB there.
                    // Past a mebibyte, a group commit takes them.
                    if before < UNSYNCED_FRAMES_BYTES && log.buffered() >= UNSYNCED_FRAMES_BYTES {
                        self.failure.waiters.want_sync();
                    }
                }
                if tree == Tree::Records {
                    self.record_count
                        .changed(current.is_some(), replacement.is_some());
                }
                drop(write);
                // Under the log's lock: close takes it before the index
                // writes its marker, so no change is left unfiled then.
                if let Some(replacement) = &replacement {
                    self.file_expiry(whole, tree, key, current, replacement);
                }
                Ok(Ok(()))
            }
            Err(conflict) => {
                write.cancel();
                Ok(Err(conflict.current))
            }
        }
    }

    /// Files `key`'s new expiry in the index (after the swap: a crash
    /// between the two leaves no clean marker, and the next open sweeps).
    fn file_expiry(
        &self,
        whole: Whole,
        tree: Tree,
        key: &[u8],
        current: Option<&[u8]>,
        replacement: &[u8],
    ) {
        let Some(retain_until_of) = retain_until_of(tree) else {
            return;
        };
        match retain_until_of(replacement) {
            Ok(retain_until) => {
                let before = current.and_then(|bytes| retain_until_of(bytes).ok());
                self.expiry.file(whole, tree, key, before, retain_until);
            }
            Err(error) => {
                // The sweep skips it too; the index says it lacks one.
                tracing::warn!(%error, "an unreadable expiry was not filed");
                self.expiry.distrust();
            }
        }
    }

    /// Sets `key` in `tree` whatever it held, logged.
    fn put(&self, tree: Tree, key: &[u8], value: &[u8]) -> Result<(), Error> {
        let mut log = self.lock_log()?;
        let write = WriteGuard::new(&self.counters);
        self.tree(tree)
            .insert(key, value)
            .map_err(|error| self.failure.write_failed(error))?;
        if let Some(log) = &mut log {
            log.append(tree, key, Some(value));
        }
        drop(write);
        Ok(())
    }

    /// Bytes sled, the write-ahead log and the expiry index use on disk.
    fn size_on_disk(&self) -> Result<u64, Error> {
        Ok(self.db.size_on_disk()? + self.log_bytes() + self.expiry.bytes())
    }

    /// Bytes of the log's segments on disk (preallocated space included).
    fn log_bytes(&self) -> u64 {
        wal::segments(&self.path.join(wal::WAL_DIR))
            .unwrap_or_default()
            .iter()
            .filter_map(|(_, path)| std::fs::metadata(path).ok())
            .map(|metadata| metadata.len())
            .sum()
    }

    /// Removes what expired by `now`: at most `budget` removals, and
    /// `budget × SWEEP_PER_REMOVAL` entries looked at. Reads the index's
    /// due entries once it is whole, else sweeps on from where the last
    /// pass stopped, over both trees, filing what it passes.
    fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        // Held for the pass: one pass at a time goes on from the cursors
        // (taken before the stall watch counts this thread busy).
        let mut sweep = self.lock_sweep();
        let busy = self.enter()?;
        let (whole, epoch) = self.expiry.complete();
        if whole {
            return self.reap_due(&busy, now, budget);
        }
        if sweep.phase == 0 && sweep.cursors[0].is_empty() {
            sweep.filing = Some(epoch);
        }
        let swept = self.sweep_on(&mut sweep, &busy, now, budget);
        if swept.is_err() {
            // Records it looked at are not in the count, its removals are
            // in the changes: this sweep's count is off, the next counts.
            sweep.counting = None;
        }
        swept
    }

    /// One pass over the index's due entries: each key's record is read
    /// and removed if it expired by `now` (an entry a later write made
    /// stale finds it live, and that write filed another).
    fn reap_due(&self, busy: &Busy, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        let mut report = ReapReport::default();
        let limit = budget.saturating_mul(SWEEP_PER_REMOVAL);
        loop {
            let entries = self.expiry.due(now);
            if entries.is_empty() {
                return Ok(report);
            }
            for entry in entries {
                busy.renew();
                if report.examined >= limit || report.removed >= budget {
                    return Ok(report);
                }
                report.examined += 1;
                if let Some(retain_until_of) = retain_until_of(entry.tree) {
                    if let Some(value) = self.tree(entry.tree).get(&entry.key)? {
                        let expired =
                            retain_until_of(&value).is_ok_and(|retain_until| retain_until <= now);
                        // A swap, not a remove: a claim may have replaced
                        // the record since we read it.
                        if expired
                            && self
                                .swap(entry.tree, &entry.key, Some(&value), None)?
                                .is_ok()
                        {
                            report.removed += 1;
                        }
                    }
                }
                self.expiry.advance(entry.done);
            }
        }
    }

    /// The reaper's sweep; after a pass that panicked, from the start.
    fn lock_sweep(&self) -> std::sync::MutexGuard<'_, Sweep> {
        self.sweep.lock().unwrap_or_else(|poisoned| {
            self.sweep.clear_poison();
            let mut sweep = poisoned.into_inner();
            *sweep = Sweep::default();
            sweep
        })
    }

    /// One pass of [`Inner::reap`], going on from `sweep`.
    fn sweep_on(
        &self,
        sweep: &mut Sweep,
        busy: &Busy,
        now: UnixMillis,
        budget: usize,
    ) -> Result<ReapReport, Error> {
        let mut report = ReapReport::default();
        let limit = budget.saturating_mul(SWEEP_PER_REMOVAL);
        for (index, tag) in [Tree::Records, Tree::Marks]
            .into_iter()
            .enumerate()
            .skip(sweep.phase)
        {
            let retain_until_of = retain_until_of(tag).expect("the trees that expire");
            let tree = self.tree(tag);
            if tag == Tree::Records && sweep.cursors[index].is_empty() {
                // From the start: a new count (the changes from now on are
                // the sweep's to see, or counted after it).
                sweep.counting = Some((0, self.record_count.changes.load(SeqCst)));
            }
            let from = sweep.cursors[index].clone();
            let mut looked_at = 0u64;
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
                busy.renew();
                if report.examined >= limit || report.removed >= budget {
                    break;
                }
                let (key, value) = entry?;
                report.examined += 1;
                looked_at += 1;
                let expired = match retain_until_of(&value) {
                    Ok(retain_until) if retain_until <= now => true,
                    Ok(retain_until) => {
                        if sweep.filing.is_some() {
                            self.expiry.file(Whole::NOT, tag, &key, None, retain_until);
                        }
                        false
                    }
                    Err(error) => {
                        tracing::warn!(%error, "the reaper skips an unreadable entry");
                        false
                    }
                };
                // A swap, not a remove: a claim may have replaced the record
                // since we read it, and then the new record must stay.
                if expired && self.swap(tag, &key, Some(&value), None)?.is_ok() {
                    report.removed += 1;
                }
                stopped_at = Some(key);
            }
            let done = report.examined < limit && report.removed < budget;
            if tag == Tree::Records {
                // Removed ones counted too: their removal is a change
                // since the count started, which takes them off again.
                if let Some((seen, _)) = &mut sweep.counting {
                    *seen += looked_at;
                }
                if done {
                    if let Some(count) = sweep.counting.take() {
                        *self.record_count.counted.lock().expect("count lock") = Some(count);
                    }
                }
            }
            sweep.cursors[index] = match (done, stopped_at) {
                // Reached the end of the tree: start over next time.
                (true, _) | (false, None) => Vec::new(),
                (false, Some(key)) => key.to_vec(),
            };
            if !done {
                break;
            }
            sweep.phase = (index + 1) % 2;
            if tag == Tree::Marks {
                // Both trees gone through from their start.
                if let Some(epoch) = sweep.filing.take() {
                    self.expiry.swept(epoch);
                }
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

    /// The last checkpoint, at close: everything logged is then in sled's
    /// synced files, and the log goes (the next open replays nothing).
    fn final_checkpoint(&self) -> Result<(), Error> {
        let mut blobs = BlobSyncer::new(self.path.join("blobs"));
        checkpoint(&self.db, &self.log_file, &mut blobs, &self.path)?;
        wal::remove_through(&self.path.join(wal::WAL_DIR), u64::MAX)?;
        Ok(())
    }
}

impl Store for SledStore {
    fn kind(&self) -> &'static str {
        "sled"
    }

    async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
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

    async fn scan(&self, cursor: &ScanCursor, limit: usize) -> Result<ScanPage, Error> {
        let _busy = self.inner.enter()?;
        let records = &self.inner.records;
        let range = if cursor.0.is_empty() {
            records.range::<&[u8], _>(..)
        } else {
            records.range::<&[u8], _>((
                std::ops::Bound::Excluded(&cursor.0[..]),
                std::ops::Bound::Unbounded,
            ))
        };
        let mut page = ScanPage::default();
        let mut last = None;
        for key_bytes in range.keys().take(limit.max(1)) {
            let key_bytes = key_bytes?;
            let key = Key::from_bytes(&key_bytes)
                .ok_or_else(|| Error::Corrupt(format!("a record key {key_bytes:?}")))?;
            page.keys.push(key);
            last = Some(key_bytes.to_vec());
        }
        if page.keys.len() >= limit.max(1) {
            page.next = last.map(ScanCursor);
        }
        Ok(page)
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
            match inner.swap(Tree::Marks, &key, current_bytes.as_deref(), replacement)? {
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
        let waiters = &inner.failure.waiters;
        let mut ticket = None;
        loop {
            // Created before the checks: a wake-up after them is not lost.
            let synced = waiters.synced.notified();
            if let Some(ticket) = ticket {
                // The committer's answer is the truth about its group (a
                // failure after it does not undo a sync that happened).
                if waiters.served.load(SeqCst) >= ticket {
                    return Ok(());
                }
            }
            // A failed sync, or a wedged one the stall watch gave up on.
            inner.failure.check()?;
            if waiters.ended.load(SeqCst) {
                return Err(Error::Unavailable("the store is closed".into()));
            }
            if ticket.is_none() {
                ticket = Some(waiters.request());
            }
            synced.await;
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
        if let Some(stall) = inner
            .stall
            .stalled()
            .or_else(|| inner.checkpoint_stall.stalled())
        {
            inner.failure.fail(stall.reason());
        }
        inner.failure.check()
    }

    fn writable(&self) -> Result<(), Error> {
        self.health()?;
        self.inner.space.writable()
    }

    async fn stats(&self) -> StoreStats {
        if self.inner.failure.get().is_some() {
            // sled is left alone once failed (it may block a call).
            return StoreStats::default();
        }
        let records = self.inner.record_count.get();
        if let Some((at, disk_bytes)) = *self.inner.disk_bytes.lock().expect("stats lock") {
            if at.elapsed() < STATS_MAX_AGE {
                return StoreStats {
                    records,
                    disk_bytes,
                    local_tier_on: None,
                };
            }
        }
        let inner = Arc::clone(&self.inner);
        let disk_bytes = tokio::task::spawn_blocking(move || inner.size_on_disk().ok())
            .await
            .unwrap_or_default();
        *self.inner.disk_bytes.lock().expect("stats lock") =
            Some((std::time::Instant::now(), disk_bytes));
        StoreStats {
            records,
            disk_bytes,
            local_tier_on: None,
        }
    }

    async fn close(&self) -> Result<(), Error> {
        // Callers already waiting are answered by the committer's last group;
        // later ones find it ended and fail fast.
        let committer = self.inner.committer.lock().expect("lock").take();
        // A failed store syncs nothing more, and its committer may be stuck
        // in sled for good: do not wait for it.
        self.inner.failure.check()?;
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || {
            if let Some(appender) = &inner.appender {
                appender.lock().expect("log lock poisoned").close();
            }
            if let Some(mut committer) = committer {
                committer.shut_down();
            }
            inner.failure.check()?;
            // The sync watch has ended: health (the watchdog) sees this one.
            inner.stall.sync_starting();
            let synced = inner.final_checkpoint().and_then(|()| {
                // Last: its marker vouches for entries of every write, and
                // names the reservation the next open must find (sled holds
                // the last one put, checkpointed above).
                let stamp = inner.fencing.reserved.load(SeqCst);
                inner.expiry.close(inner.record_count.get(), stamp)
            });
            inner.stall.sync_done();
            synced
        })
        .await
        .map_err(|join| Error::Store(format!("final sync task failed: {join}")))?
    }
}

/// What the committer and checkpoint threads work with.
struct CommitterParts {
    db: sled::Db,
    log_file: Arc<File>,
    blobs: BlobSyncer,
    path: PathBuf,
    writer: wal::Writer,
    appender: Arc<Mutex<Appender>>,
    counters: Arc<WriteCounters>,
    space: Arc<DiskSpace>,
    failure: Arc<Failure>,
    stall: Arc<StallWatch>,
    checkpoint_stall: Arc<StallWatch>,
    checkpoint_interval: Duration,
    checkpoint_log_bytes: u64,
}

fn spawn_committer(
    parts: CommitterParts,
    observer: Option<Arc<dyn StoreObserver>>,
) -> Result<Committer, Error> {
    let CommitterParts {
        db,
        log_file,
        blobs,
        path,
        mut writer,
        appender,
        counters,
        space,
        failure,
        stall,
        checkpoint_stall,
        checkpoint_interval,
        checkpoint_log_bytes,
    } = parts;
    let (seals, sealed) = mpsc::channel::<(u64, u64)>();
    let checkpointing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let checkpointer = spawn_checkpointer(
        db.clone(),
        log_file,
        blobs,
        path.clone(),
        sealed,
        Arc::clone(&checkpointing),
        Arc::clone(&space),
        Arc::clone(&failure),
        checkpoint_stall,
    )?;
    let (db_for_watch, stall_for_watch, failure_for_watch, failure_for_shutdown) = (
        db.clone(),
        Arc::clone(&stall),
        Arc::clone(&failure),
        Arc::clone(&failure),
    );
    let thread = thread::Builder::new()
        .name("dedupd-committer".into())
        .spawn(move || {
            let _ended = CommitterEnded(Arc::clone(&failure));
            let waiters = &failure.waiters;
            let mut served = 0;
            let mut frames = Vec::new();
            let mut gather = Gather::default();
            let mut last_seal = Instant::now();
            loop {
                // Not less than a moment: a checkpoint due while the last
                // one still runs must not turn this loop into a spin.
                let until_checkpoint = checkpoint_interval
                    .saturating_sub(last_seal.elapsed())
                    .max(CHECKPOINT_POLL);
                // Woken by a ticket; or by a mebibyte of frames logged
                // without a waiter (the reaper's removals), or the time for
                // a checkpoint, and those frames are synced first; or
                // shutting down, and the last frames are synced before the
                // final checkpoint.
                waiters.wait_for_request(served, until_checkpoint);
                let ending = waiters.stopping.load(SeqCst);
                // (Not for a checkpoint's sync nobody waits for.)
                if !ending && waiters.pending(served) > 0 {
                    gather.more(|| waiters.pending(served));
                }
                // Read before the frames are taken: every ticket counted
                // here was issued after its caller's write was framed (or
                // was visible, and so is framed once the lock is ours).
                let tickets = waiters.requested.load(SeqCst);
                let group = tickets - served;
                // Cleared before the frames are taken: a buffer that fills
                // up again after the take asks again.
                waiters.sync_wanted.store(false, SeqCst);
                let outcome: Result<(), ()> = match failure.get() {
                    Some(_) => Err(()),
                    None => 'group: {
                        let finished = {
                            let mut appender = appender.lock().expect("log lock poisoned");
                            appender.take(&mut frames);
                            // Under the lock no write is between its swap
                            // and its frame: every write counted is framed.
                            counters.finished.load(SeqCst)
                        };
                        if frames.is_empty() {
                            // Every frame before was synced by an earlier
                            // group (this thread's), so these callers (a
                            // read that saw a write while its group was
                            // syncing) are served without a sync of their
                            // own.
                            counters.durable.fetch_max(finished, SeqCst);
                            break 'group Ok(());
                        }
                        let started = Instant::now();
                        stall.sync_starting();
                        space.owe(frames.len() as u64);
                        // Close to the reserve, sled is written through as
                        // it was before the log: its background writes
                        // could otherwise overrun the reserve the admission
                        // check measured, and sled 0.34 never recovers
                        // from a write that met a full disk.
                        let written_through = if space.tight() {
                            db.flush()
                                .map(drop)
                                .map_err(|error| format!("sled flush failed ({error})"))
                        } else {
                            Ok(())
                        };
                        let synced = written_through
                            .and_then(|()| {
                                writer
                                    .write(&frames)
                                    .map_err(|error| format!("log write failed ({error})"))
                            })
                            .and_then(|()| {
                                writer
                                    .sync()
                                    .map_err(|error| format!("disk sync failed ({error})"))
                            });
                        stall.sync_done();
                        let elapsed = started.elapsed();
                        if group > 0 {
                            let group = group as usize;
                            tracing::trace!(
                                group,
                                bytes = frames.len(),
                                sync_us = elapsed.as_micros() as u64,
                                "group commit"
                            );
                            gather.synced(group, elapsed);
                            if let Some(observer) = &observer {
                                observer.group_commit(group, elapsed);
                            }
                        }
                        if frames.capacity() > SPARE_FRAMES_BYTES {
                            frames = Vec::new();
                        }
                        match synced {
                            Ok(()) => {
                                counters.durable.fetch_max(finished, SeqCst);
                                Ok(())
                            }
                            Err(failed) => {
                                // After a failed fsync the kernel may have
                                // dropped the dirty pages: retrying could
                                // report success for lost data. Fail for
                                // good; frames not written are lost with
                                // the process, answered to nobody.
                                // (fail() wakes every waiting caller.)
                                failure.fail(format!("{failed}; restart dedupd"));
                                Err(())
                            }
                        }
                    }
                };
                if outcome.is_err() {
                    return;
                }
                served = tickets;
                waiters.served.store(served, SeqCst);
                if group > 0 {
                    waiters.synced.notify_waiters();
                }
                if ending {
                    return;
                }
                let due = writer.since_seal >= checkpoint_log_bytes
                    || (writer.since_seal > 0 && last_seal.elapsed() >= checkpoint_interval)
                    || (writer.since_seal >= TIGHT_CHECKPOINT_BYTES && space.tight());
                if due && !checkpointing.load(SeqCst) {
                    let bytes = writer.since_seal;
                    // A new segment means syncs of its own: watched too.
                    stall.sync_starting();
                    let sealed = writer.seal();
                    stall.sync_done();
                    match sealed {
                        Ok(through) => {
                            checkpointing.store(true, SeqCst);
                            last_seal = Instant::now();
                            let _ = seals.send((through, bytes));
                        }
                        Err(error @ (Error::Exhausted(_) | Error::DiskFull(_))) => {
                            tracing::warn!(%error, "checkpoint postponed: no new log segment");
                        }
                        Err(error) => {
                            failure.fail(format!(
                                "starting a log segment failed ({error}); restart dedupd"
                            ));
                            return;
                        }
                    }
                } else if writer.since_seal == 0 {
                    last_seal = Instant::now();
                }
            }
        })?;
    failure_for_shutdown
        .waiters
        .committer
        .set(thread.thread().clone())
        .expect("one committer per store");
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
    // Built before the last spawn: if that fails, dropping it stops the
    // committer and the checkpointer (they hold the database open).
    let mut committer = Committer {
        thread: Some(thread),
        checkpointer: Some(checkpointer),
        watch_stop: Some(watch_stop),
        watch: None,
        failure: failure_for_shutdown,
    };
    committer.watch = Some(
        thread::Builder::new()
            .name("dedupd-sync-watch".into())
            .spawn(move || {
                watch_syncs(&stall_for_watch, &stop, PROBE_AFTER, probe, |stall| {
                    failure_for_watch.fail(stall.reason());
                });
            })?,
    );
    Ok(committer)
}

/// On a disk close to its reserve, a checkpoint starts once this much log
/// was written, to give the log's space back.
const TIGHT_CHECKPOINT_BYTES: u64 = 1 << 20;
/// How often the committer looks whether a checkpoint is due while idle.
const CHECKPOINT_POLL: Duration = Duration::from_millis(100);

/// A frames buffer grown past this (a large cached response) is not kept.
const SPARE_FRAMES_BYTES: usize = 4 << 20;

/// Frames no caller waits for are synced once this many bytes of them are
/// buffered (see `Inner::swap`), not only at the next checkpoint.
const UNSYNCED_FRAMES_BYTES: usize = 1 << 20;

/// Runs each checkpoint the committer asks for: sled made durable, then the
/// sealed segments deleted (see the module docs).
#[allow(clippy::too_many_arguments)]
fn spawn_checkpointer(
    db: sled::Db,
    log_file: Arc<File>,
    mut blobs: BlobSyncer,
    path: PathBuf,
    sealed: mpsc::Receiver<(u64, u64)>,
    checkpointing: Arc<std::sync::atomic::AtomicBool>,
    space: Arc<DiskSpace>,
    failure: Arc<Failure>,
    stall: Arc<StallWatch>,
) -> Result<thread::JoinHandle<()>, Error> {
    let wal_dir = path.join(wal::WAL_DIR);
    Ok(thread::Builder::new()
        .name("dedupd-checkpoint".into())
        .spawn(move || {
            // Bytes sealed whose checkpoint was postponed.
            let mut unsettled = 0;
            while let Ok((through, bytes)) = sealed.recv() {
                unsettled += bytes;
                if failure.get().is_some() {
                    return;
                }
                let started = Instant::now();
                stall.sync_starting();
                let done = checkpoint(&db, &log_file, &mut blobs, &path)
                    .and_then(|()| wal::remove_through(&wal_dir, through));
                stall.sync_done();
                match done {
                    Ok(removed) => {
                        space.settle(std::mem::take(&mut unsettled));
                        tracing::debug!(
                            segments = removed,
                            elapsed_ms = started.elapsed().as_millis() as u64,
                            "checkpoint"
                        );
                    }
                    // Listing or opening a file failed, no sync did: the
                    // segments stay, and the next checkpoint covers them.
                    Err(Error::Exhausted(reason)) => {
                        tracing::warn!(%reason, "checkpoint postponed");
                    }
                    Err(error) => {
                        failure.fail(format!("checkpoint failed ({error}); restart dedupd"));
                        return;
                    }
                }
                checkpointing.store(false, SeqCst);
            }
        })?)
}

/// [`checkpoint`] at open, given at most `limit`: sled 0.34 never returns
/// from a flush that met a full disk, and a process that hangs before it
/// serves tells nobody why.
fn bounded_checkpoint(
    db: &sled::Db,
    log_file: &Arc<File>,
    mut blobs: BlobSyncer,
    path: &Path,
    limit: Duration,
) -> Result<BlobSyncer, Error> {
    let (done, finished) = mpsc::channel();
    let (db, log_file, path_owned) = (db.clone(), Arc::clone(log_file), path.to_path_buf());
    thread::Builder::new()
        .name("dedupd-open-checkpoint".into())
        .spawn(move || {
            let result = checkpoint(&db, &log_file, &mut blobs, &path_owned);
            let _ = done.send(result.map(|()| blobs));
        })?;
    match finished.recv_timeout(limit) {
        Ok(result) => result,
        Err(_) => Err(Error::Unavailable(format!(
            "making {} durable at open did not finish within the stall timeout ({}): \
             is the disk full or failing?",
            path.display(),
            humantime::format_duration(limit)
        ))),
    }
}

/// Makes everything sled holds durable: its flush, then `fdatasync` of its
/// log (sled's periodic flush round may have written more since), of every
/// blob file it wrote, and of the directory.
///
/// Blobs sled removed (our copy of sled moves them to `blobs.removed`, see
/// `vendor/sled/DEDUPD.md`) before the flush began are no longer needed by
/// the state it made durable: those, and only those, are deleted after it.
fn checkpoint(
    db: &sled::Db,
    log_file: &File,
    blobs: &mut BlobSyncer,
    path: &Path,
) -> Result<(), Error> {
    let removed = blobs.removed()?;
    db.flush()?;
    log_file.sync_data()?;
    blobs.sync_new()?;
    sync_directory(path)?;
    blobs.delete(&removed);
    Ok(())
}

/// sled's removed blobs' folder (see `vendor/sled/DEDUPD.md`).
const REMOVED_BLOBS_DIR: &str = "blobs.removed";

/// Before sled opens after a crash: moves every blob sled removed since the
/// last checkpoint back where sled looks. The state sled recovers may be
/// older than the removal and point at it; one it no longer points at is
/// left behind unused (sled cannot say which): at most the blobs removed
/// within one checkpoint interval, per crash.
fn restore_removed_blobs(path: &Path) -> Result<(), Error> {
    let removed = path.join(REMOVED_BLOBS_DIR);
    let entries = match std::fs::read_dir(&removed) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error.into()),
    };
    let blobs = path.join("blobs");
    let mut restored = 0_u64;
    for entry in entries {
        let entry = entry?;
        if !blobs.is_dir() {
            std::fs::create_dir_all(&blobs)?;
            sync_directory(path)?;
        }
        std::fs::rename(entry.path(), blobs.join(entry.file_name()))?;
        restored += 1;
    }
    if restored > 0 {
        sync_directory(&blobs)?;
        sync_directory(&removed)?;
        tracing::info!(
            restored,
            "moved blobs sled removed after the last checkpoint back for its recovery"
        );
    }
    Ok(())
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
    /// Parks the committer (each ticket unparks it) until `pending()` reaches
    /// the last group's size or the gathering time is up.
    fn more(&self, pending: impl Fn() -> u64) {
        let wanted = self.last_group as u64;
        if pending() >= wanted {
            return;
        }
        let deadline = Instant::now() + (self.last_sync / 2).min(MAX_GATHER);
        while pending() < wanted {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            thread::park_timeout(left);
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

    /// The blobs sled has removed so far.
    fn removed(&self) -> Result<Vec<PathBuf>, Error> {
        let Some(data) = self.directory.parent() else {
            return Ok(Vec::new());
        };
        match std::fs::read_dir(data.join(REMOVED_BLOBS_DIR)) {
            Ok(entries) => Ok(entries
                .map(|entry| entry.map(|entry| entry.path()))
                .collect::<Result<_, _>>()?),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(error) => Err(error.into()),
        }
    }

    /// Deletes removed blobs a checkpoint made unneeded. Not synced: one
    /// that a power cut brings back is restored at open and left unused.
    fn delete(&self, removed: &[PathBuf]) {
        for path in removed {
            if let Err(error) = std::fs::remove_file(path) {
                if error.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(%error, blob = %path.display(), "could not delete a removed blob");
                }
            }
        }
    }
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
            // The previous commit (1 ms retention) has expired, and its
            // minute in the expiry index is due.
            clock.advance(Duration::from_secs(60));
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

    /// The record count comes from the sweep and the writes, not from a
    /// scan: unknown until a sweep has gone through the tree, then exact
    /// as records are created, released and reaped, and counted again by
    /// each sweep (a count sled's own `len()` agrees with).
    #[tokio::test]
    async fn the_sweep_counts_the_records_and_writes_keep_the_count() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let clock = ManualClock::new(UnixMillis(1_000_000));
        let engine = Engine::new(Arc::new(store.clone()), Arc::new(clock.clone()));
        let claim = |i: usize, hours: u64| {
            let mut request = claim_request(&format!("evt-{i:04}"));
            request.retention = Duration::from_secs(3600 * hours);
            request.lease_ttl = Duration::from_secs(3600 * hours);
            request
        };
        for i in 0..300 {
            engine.claim(&claim(i, 1 + (i % 2) as u64)).await.unwrap();
        }
        assert_eq!(store.stats().await.records, None, "no sweep yet");
        // Passes of at most 64 entries: the count waits for the end.
        let first = store.reap(clock.now(), 1).await.unwrap();
        assert_eq!(first.examined, SWEEP_PER_REMOVAL);
        assert_eq!(store.stats().await.records, None, "a sweep under way");
        // Created during a sweep: behind its cursor, counted once; ahead of
        // it, twice (by the sweep and by the change), until a sweep counts
        // again.
        let behind = |i: usize| {
            let mut request = claim(i, 2);
            request.key = crate::api::Limits::default()
                .key("reap", &format!("evt-0000-{i}"))
                .unwrap();
            request
        };
        engine.claim(&behind(1)).await.unwrap();
        engine.claim(&claim(9999, 2)).await.unwrap();
        let sweep_through = || async {
            while store.sweep_under_way() {
                store.reap(clock.now(), 1).await.unwrap();
            }
        };
        sweep_through().await;
        assert_eq!(
            store.stats().await.records,
            Some(303),
            "the one ahead twice"
        );
        // The index is whole now: passes read what is due, no sweep.
        store.reap(clock.now(), 1).await.unwrap();
        assert!(!store.sweep_under_way());
        // Entries lost (as by a failed append): a sweep again, which counts.
        store.inner.expiry.distrust();
        store.reap(clock.now(), 1).await.unwrap();
        assert!(store.sweep_under_way());
        sweep_through().await;
        assert_eq!(store.stats().await.records, Some(302), "counted again");
        for key in [behind(1).key, claim(9999, 2).key] {
            assert!(engine.forget(&key).await.unwrap());
        }
        assert_eq!(store.stats().await.records, Some(300));

        // Created, released (the record stays), forgotten (it goes), then
        // the one-hour half expired and reaped.
        let mut leases = Vec::new();
        for i in 300..310 {
            let ClaimOutcome::Claimed { record, .. } = engine.claim(&claim(i, 1)).await.unwrap()
            else {
                panic!("{i} not claimed");
            };
            leases.push((i, record.lease_token));
        }
        assert_eq!(store.stats().await.records, Some(310));
        for (i, lease_token) in leases.drain(..5) {
            engine
                .release(&crate::domain::ReleaseRequest {
                    key: claim(i, 1).key,
                    lease_token,
                })
                .await
                .unwrap();
        }
        assert_eq!(
            store.stats().await.records,
            Some(310),
            "released records stay"
        );
        for i in 305..310 {
            assert!(engine.forget(&claim(i, 1).key).await.unwrap());
        }
        assert_eq!(store.stats().await.records, Some(305));
        // A claim is kept for its lease and its retention: two hours for
        // the one-hour ones (and the released ones), four for the others.
        // (And the index's minute of lateness.)
        clock.advance(Duration::from_secs(2 * 3600 + 61));
        let reaped = store.reap(clock.now(), 1000).await.unwrap();
        assert!(store.inner.expiry.complete().0, "the index, not a sweep");
        assert_eq!(
            reaped.removed, 155,
            "the one-hour records and the released ones went"
        );
        assert_eq!(store.stats().await.records, Some(150));
        assert_eq!(store.record_count(), 150, "sled agrees");

        // A clean close leaves the count; a crash does not.
        store.close().await.unwrap();
        drop((engine, store));
        let store = reopen(dir.path()).await;
        assert_eq!(store.stats().await.records, Some(150), "from the close");
        drop(store);
        let store = reopen(dir.path()).await;
        assert_eq!(store.stats().await.records, None, "no clean close");
    }

    /// Once the index is whole a pass reads only what is due: as many
    /// entries as records expired, whatever else is stored, also after a
    /// clean restart; after a crash the reaper sweeps everything once,
    /// then reads only what is due again.
    #[tokio::test]
    async fn a_reaper_pass_reads_only_what_is_due() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(UnixMillis(1_000_000));
        let claim_all = |store: &SledStore, prefix: &str, stays: usize, goes: usize| {
            let engine = Engine::new(Arc::new(store.clone()), Arc::new(clock.clone()));
            let prefix = prefix.to_owned();
            async move {
                for i in 0..stays + goes {
                    let mut request = claim_request(&format!("{prefix}-{i:04}"));
                    if i < stays {
                        request.retention = Duration::from_secs(3600);
                    }
                    engine.claim(&request).await.unwrap();
                }
            }
        };
        let store = store(dir.path());
        // A new store: its first pass sweeps (nothing), then the index.
        assert_eq!(store.reap(clock.now(), 1000).await.unwrap().examined, 0);
        assert!(store.inner.expiry.complete().0);
        claim_all(&store, "a", 900, 100).await;
        clock.advance(Duration::from_secs(20));
        let pass = store.reap(clock.now(), 1000).await.unwrap();
        assert_eq!((pass.removed, pass.examined), (100, 100), "only the due");

        store.close().await.unwrap();
        drop(store);
        let store = reopen(dir.path()).await;
        assert!(
            store.inner.expiry.complete().0,
            "trusted after a clean close"
        );
        claim_all(&store, "b", 0, 50).await;
        clock.advance(Duration::from_secs(20));
        let pass = store.reap(clock.now(), 1000).await.unwrap();
        assert_eq!((pass.removed, pass.examined), (50, 50));

        drop(store); // a crash
        let store = reopen(dir.path()).await;
        assert!(!store.inner.expiry.complete().0);
        claim_all(&store, "c", 0, 50).await;
        clock.advance(Duration::from_secs(20));
        let pass = store.reap(clock.now(), 1000).await.unwrap();
        assert_eq!(pass.removed, 50);
        assert_eq!(pass.examined, 950, "the sweep after a crash reads all");
        claim_all(&store, "d", 0, 50).await;
        clock.advance(Duration::from_secs(20));
        let pass = store.reap(clock.now(), 1000).await.unwrap();
        // Then only the due: these 50, and the 50 entries the writes
        // before the sweep filed (the sweep removed their records).
        assert_eq!(
            (pass.removed, pass.examined),
            (50, 100),
            "then only the due"
        );
        assert_eq!(store.record_count(), 900);
    }

    /// The reaper's removals are framed for the log with nobody waiting for
    /// their sync: past a mebibyte of them, a group commit takes them
    /// instead of the buffer holding them until the next checkpoint (an
    /// hour here), and without counting as a caller in a group.
    #[tokio::test]
    async fn removals_nobody_waits_for_leave_the_buffer_past_a_mebibyte() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(&SledConfig {
            cache_capacity_bytes: 4 << 20,
            checkpoint_interval: Duration::from_secs(3600),
            checkpoint_log_bytes: 1 << 30,
            ..SledConfig::new(dir.path())
        })
        .unwrap();
        let clock = ManualClock::new(UnixMillis(1_000_000));
        let engine = Engine::new(Arc::new(store.clone()), Arc::new(clock.clone()));
        let padding = "x".repeat(100);
        for batch in 0..12 {
            let requests: Vec<ClaimRequest> = (0..1000)
                .map(|i| claim_request(&format!("{padding}-{batch}-{i}")))
                .collect();
            engine.claim_batch(&requests).await.unwrap();
        }
        let buffered = || {
            let appender = store.inner.appender.as_ref().expect("sync = always");
            appender.lock().unwrap().buffered()
        };
        clock.advance(Duration::from_secs(60));
        let reaped = store.reap(clock.now(), 100_000).await.unwrap();
        assert_eq!(reaped.removed, 12_000);
        let tickets = store.inner.failure.waiters.requested.load(SeqCst);
        // 12 000 frames of over 100 bytes: past the mebibyte once.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while buffered() >= UNSYNCED_FRAMES_BYTES {
            assert!(
                std::time::Instant::now() < deadline,
                "{} bytes of removals still wait for a sync",
                buffered()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            store.inner.failure.waiters.requested.load(SeqCst),
            tickets,
            "no ticket taken"
        );
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

    /// Replay after a crash applies only each key's last change in a
    /// segment: a key removed after it was written is gone, a key written
    /// twice holds the second value, a logged fencing reservation below
    /// sled's lowers nothing, and a token seen only in a superseded frame
    /// still counts.
    #[tokio::test]
    async fn the_replay_applies_each_keys_last_change_and_counts_every_token() {
        let dir = tempfile::tempdir().unwrap();
        let (gone, kept, with_token) = gone_and_kept(dir.path()).await;
        // A log as a crash leaves it (the close checkpointed and removed
        // the last one): sled holds both keys, the log says otherwise.
        let high = 50 * FENCE_BLOCK;
        let mut frames = Vec::new();
        let (gone_bytes, kept_bytes) = (gone.to_bytes(), kept.to_bytes());
        let high_record = with_token(high);
        wal::encode_frame(
            &mut frames,
            1,
            Tree::Records,
            &gone_bytes,
            Some(&high_record),
        );
        wal::encode_frame(
            &mut frames,
            2,
            Tree::Meta,
            FENCE_KEY,
            Some(&1u64.to_le_bytes()),
        );
        wal::encode_frame(
            &mut frames,
            3,
            Tree::Records,
            &kept_bytes,
            Some(&with_token(7)),
        );
        wal::encode_frame(&mut frames, 4, Tree::Records, &gone_bytes, None);
        wal::encode_frame(
            &mut frames,
            5,
            Tree::Records,
            &kept_bytes,
            Some(&with_token(8)),
        );
        let mut writer = wal::Writer::create(&dir.path().join(wal::WAL_DIR), 1, 1).unwrap();
        writer.write(&frames).unwrap();
        writer.sync().unwrap();
        drop(writer);

        let store = reopen(dir.path()).await;
        assert!(store.get(&gone).await.unwrap().is_none(), "removed last");
        assert_eq!(
            store.get(&kept).await.unwrap().unwrap().fencing_token,
            FencingToken(8),
            "the last of two changes"
        );
        assert!(store.issue_fencing().unwrap().0 > high);
    }

    /// A store closed cleanly holding two claimed keys, `gone` and `kept`,
    /// and a function encoding `kept`'s record with another token: what the
    /// replay tests write into a log as a crash would leave it.
    async fn gone_and_kept(path: &Path) -> (Key, Key, impl Fn(u64) -> Vec<u8>) {
        let (gone, kept) = (claim_request("gone").key, claim_request("kept").key);
        let store = store(path);
        let engine = Engine::new(
            Arc::new(store.clone()),
            Arc::new(ManualClock::new(UnixMillis(1_000_000))),
        );
        engine.claim(&claim_request("gone")).await.unwrap();
        let ClaimOutcome::Claimed { record, .. } =
            engine.claim(&claim_request("kept")).await.unwrap()
        else {
            panic!("a fresh key is claimable");
        };
        store.close().await.unwrap();
        let with_token = move |token| {
            encode_record(&Record {
                fencing_token: FencingToken(token),
                ..record.clone()
            })
        };
        (gone, kept, with_token)
    }

    /// The replay keeps its last-change map per run of frames: a key
    /// changed on both sides of a run's end ends at its last change.
    #[tokio::test]
    async fn a_key_changed_across_replay_runs_ends_at_its_last_change() {
        let dir = tempfile::tempdir().unwrap();
        let (gone, kept, with_token) = gone_and_kept(dir.path()).await;
        let (gone_bytes, kept_bytes) = (gone.to_bytes(), kept.to_bytes());
        let (nine, eight) = (with_token(9), with_token(8));
        // Run one: `kept` at 9 in its last frame; run two: `gone`
        // removed, `kept` at 8.
        let mut frames = Vec::new();
        let mut lsn = 0;
        let mut frame = |frames: &mut Vec<u8>, tree, key: &[u8], value: Option<&[u8]>| {
            lsn += 1;
            wal::encode_frame(frames, lsn, tree, key, value);
        };
        for filler in 0..wal::RUN_FRAMES - 1 {
            let value = (filler as u64).to_le_bytes();
            frame(&mut frames, Tree::Meta, b"test/filler", Some(&value));
        }
        frame(&mut frames, Tree::Records, &kept_bytes, Some(&nine));
        frame(&mut frames, Tree::Records, &gone_bytes, None);
        frame(&mut frames, Tree::Records, &kept_bytes, Some(&eight));
        let mut writer = wal::Writer::create(&dir.path().join(wal::WAL_DIR), 1, 1).unwrap();
        writer.write(&frames).unwrap();
        writer.sync().unwrap();
        drop(writer);

        let store = reopen(dir.path()).await;
        assert_eq!(
            store.inner.db.get(b"test/filler").unwrap().as_deref(),
            Some(&((wal::RUN_FRAMES - 2) as u64).to_le_bytes()[..]),
            "run one's last change applied"
        );
        assert!(
            store.get(&gone).await.unwrap().is_none(),
            "removed in run two"
        );
        assert_eq!(
            store.get(&kept).await.unwrap().unwrap().fencing_token,
            FencingToken(8),
            "run two's change, after run one's"
        );
    }

    /// Counts group commits (each is one log sync).
    #[derive(Debug, Default)]
    struct CountSyncs(AtomicU64);

    impl StoreObserver for CountSyncs {
        fn group_commit(&self, _callers: usize, _elapsed: Duration) {
            self.0.fetch_add(1, SeqCst);
        }
        fn local_tier(&self, _hit: bool) {}
    }

    /// A ticket with no new frame behind it (a read that saw a write while
    /// that write's group was syncing) is served without a sync; the next
    /// write is synced as before.
    #[tokio::test]
    async fn a_group_with_no_new_frames_skips_its_sync() {
        let dir = tempfile::tempdir().unwrap();
        let syncs = Arc::new(CountSyncs::default());
        let store = SledStore::open_observed(
            &SledConfig {
                cache_capacity_bytes: 4 << 20,
                ..SledConfig::new(dir.path())
            },
            Some(Arc::clone(&syncs) as Arc<dyn StoreObserver>),
        )
        .unwrap();
        let inner = &store.inner;
        let served = |ticket: u64| async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while inner.failure.waiters.served.load(SeqCst) < ticket {
                assert!(Instant::now() < deadline, "ticket {ticket} never served");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };

        inner.put(Tree::Meta, b"first", b"1").unwrap();
        store.durable().await.unwrap();
        assert_eq!(syncs.0.load(SeqCst), 1, "a write is synced");

        let ticket = inner.failure.waiters.request();
        served(ticket).await;
        assert_eq!(syncs.0.load(SeqCst), 1, "no new frame: no sync");

        inner.put(Tree::Meta, b"second", b"2").unwrap();
        store.durable().await.unwrap();
        assert_eq!(syncs.0.load(SeqCst), 2, "a new frame: a sync");
    }

    /// A group commit waits for as many callers as the last one answered,
    /// and no longer than its bound; a lone caller at low load never waits.
    #[test]
    fn a_group_commit_gathers_what_the_last_one_answered() {
        use std::cell::Cell;
        let mut gather = Gather::default();
        let asked = Cell::new(0);
        let pending = |waiting: u64| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                waiting
            }
        };

        gather.more(pending(1));
        assert_eq!(asked.get(), 1, "the first group never waits");

        gather.synced(3, Duration::from_millis(10));
        asked.set(0);
        gather.more(pending(3));
        assert_eq!(
            asked.get(),
            1,
            "a group as large as the last one syncs at once"
        );

        // Callers arriving one by one (each unparks the committer).
        let arrived = Cell::new(1u64);
        let started = Instant::now();
        gather.more(|| {
            let now = arrived.get();
            arrived.set(now + 1);
            thread::current().unpark();
            now
        });
        // (Unless the machine stalled this thread past the gathering bound.)
        assert!(
            arrived.get() == 4 || started.elapsed() >= MAX_GATHER,
            "it waits until the last group's size is there"
        );
        assert!(arrived.get() <= 4, "and asks no further once it is");

        gather.synced(64, Duration::from_secs(5));
        let started = Instant::now();
        gather.more(pending(1));
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "a slow last sync does not stretch the wait past MAX_GATHER"
        );
    }
}
