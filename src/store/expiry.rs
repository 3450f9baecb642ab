//! The embedded store's expiry index: which keys fall due when, kept in
//! files of dedupd's own beside sled, so that a reaper pass reads what is
//! due and nothing else, and a whole interval's file goes at once.
//!
//! Two kinds of files in `<data-dir>/expiry/`: `<n>` holds what falls due
//! in the n-th interval of `width` (the reaper's interval, 1 s to 60 s),
//! for the next [`FINE_AHEAD`] intervals; `c<n>` what falls due later, by
//! intervals of `FINE_AHEAD × width`, split into fine files as its time
//! comes near. So the files number the retention over 64 intervals, not
//! over one (24 h at the default 10 s: 135 coarse files and up to 128
//! fine ones, instead of 8 640).
//!
//! Outside sled on purpose: entries written once and left until due
//! pinned sled's log segments (an index in a sled tree made its log grow
//! with everything that went through it). Here an entry costs an append
//! to a file of ours, and a due file is deleted after its keys are reaped.
//!
//! Nothing here decides what is expired: an entry only says "look at this
//! key then"; the reaper reads the record and removes it only if it is
//! expired by then (a stale entry costs one read). The entries are not
//! synced as they are written: after anything but a clean close (the
//! `clean` marker, written last at close and removed at open) the files
//! are dropped and the reaper sweeps the trees once, filing every record
//! it finds, before it trusts the index again.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::{self, File, OpenOptions},
    io::{self, Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use super::wal::{sync_directory, Tree};
use crate::{clock::UnixMillis, error::Error};

/// The index's folder in the data directory.
pub(super) const DIR: &str = "expiry";

/// The shortest and longest time one fine file covers: a record is reaped
/// up to this long after it expired (it reads as absent from then on
/// anyway).
pub(super) const BUCKET_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(60));

/// How many fine intervals ahead an entry goes into a fine file (further,
/// into a coarse one, which covers as many).
pub(super) const FINE_AHEAD: u64 = 64;

/// Entries kept in memory before they are appended to their files.
const BUFFER_BYTES: usize = 256 << 10;

/// Entries read from a file at a time.
const READ_BYTES: u64 = 64 << 10;

/// Written last at a clean close, removed at open.
const CLEAN_MARKER: &str = "clean";

/// The longest key an entry holds (sled keys of records are far shorter).
const MAX_KEY: usize = u16::MAX as usize;

/// An entry's bytes before its key: tree, key length, when it falls due.
const HEADER: usize = 1 + 2 + 8;

/// A file of the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Bucket {
    /// What falls due in `[n × width, (n + 1) × width)`.
    Fine(u64),
    /// What falls due in `[n × width × FINE_AHEAD, (n + 1) × …)`.
    Coarse(u64),
}

/// One due entry: the key to look at, and where its file's reading stands
/// once it is done.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct DueEntry {
    pub tree: Tree,
    pub key: Vec<u8>,
    /// The fine bucket and the offset just past this entry.
    pub done: (u64, u64),
}

/// One entry read back, with the offset just past it in its file.
struct Entry {
    tree: Tree,
    retain_until: UnixMillis,
    key: Vec<u8>,
    end: u64,
}

/// The index (one per store).
#[derive(Debug)]
pub(super) struct ExpiryIndex {
    dir: PathBuf,
    /// Milliseconds one fine file covers.
    width: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Entries not yet appended to their bucket's file.
    buffers: BTreeMap<Bucket, Vec<u8>>,
    buffered: usize,
    /// Buckets with a file or a buffer.
    buckets: BTreeSet<Bucket>,
    /// Files appended to since open (synced at close).
    written: BTreeSet<Bucket>,
    /// Whether every record has an entry.
    complete: bool,
    /// Moved each time entries may have been lost (a failed append): a
    /// sweep that started before proves nothing.
    epoch: u64,
    /// The clean marker is on disk (after close): the next filing removes
    /// it first.
    marked: bool,
    /// How far each file has been read (fine ones by the reaper, a coarse
    /// one by its split).
    cursors: BTreeMap<Bucket, u64>,
    /// The last fine bucket whose file the reaper started reading: an
    /// entry in it or before may be gone.
    read_from: Option<u64>,
    /// The last coarse bucket whose split started: what falls due in it or
    /// before is filed fine.
    split_from: Option<u64>,
    /// Closed: the reaper changes no file any more (a pass still running
    /// as the store closes would split a coarse file after the marker).
    closed: bool,
}

/// Whether the index was whole, and its epoch, when a write began: a
/// write may skip filing only if the index was whole before its swap and
/// stayed so (a sweep that ends between the swap and the filing may have
/// passed the record before as expired, with no entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Whole(Option<u64>);

impl Whole {
    /// For a filing that never skips (the sweep's).
    pub const NOT: Whole = Whole(None);
}

/// What [`ExpiryIndex::open`] found.
#[derive(Debug)]
pub(super) struct Opened {
    pub index: ExpiryIndex,
    /// The record count the last clean close left (`None` after anything
    /// else: the reaper's sweep counts).
    pub record_count: Option<u64>,
}

/// Split steps one call of [`ExpiryIndex::due`] takes at most (a read
/// each): the rest waits for the next pass.
const SPLIT_STEPS: usize = 64;

/// What one step of [`ExpiryIndex::due`] did.
enum Step {
    Entries(Vec<DueEntry>),
    Again,
    Nothing,
}

impl ExpiryIndex {
    /// Opens the index of the store in `store_dir`, each fine file covering
    /// `width` (within [`BUCKET_RANGE`]). `stamp` is a value every open of
    /// the store changes, whatever dedupd wrote it (the fencing
    /// reservation, read before this open moves it). Trusted only after a
    /// clean close with the same width and stamp (no other open since: an
    /// older dedupd does not file); else its files go and the index waits
    /// for a sweep.
    pub fn open(store_dir: &Path, width: Duration, stamp: u64) -> Result<Opened, Error> {
        let width = width.clamp(BUCKET_RANGE.0, BUCKET_RANGE.1).as_millis() as u64;
        let dir = store_dir.join(DIR);
        fs::create_dir_all(&dir)?;
        let marker = dir.join(CLEAN_MARKER);
        let (record_count, found) = match fs::read(&marker) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let fields: Vec<&str> = text.split_whitespace().collect();
                let count = match fields[..] {
                    [count, closed_width, closed_stamp]
                        if closed_width.parse() == Ok(width)
                            && closed_stamp.parse() == Ok(stamp) =>
                    {
                        count.parse().ok()
                    }
                    _ => None,
                };
                (count, true)
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => (None, false),
            Err(error) => return Err(error.into()),
        };
        let trusted = record_count.is_some();
        if found {
            // Gone for good before the first write: a crash from now on
            // must find it missing.
            fs::remove_file(&marker)?;
        }
        let mut buckets = BTreeSet::new();
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let Some(bucket) = entry.file_name().to_str().and_then(parse_name) else {
                continue;
            };
            if !entry.file_type()?.is_file() {
                continue;
            }
            if trusted {
                buckets.insert(bucket);
            } else {
                // It may lack entries (or end torn): the sweep files all.
                fs::remove_file(entry.path())?;
            }
        }
        sync_directory(&dir)?;
        if !trusted {
            tracing::info!(
                "the expiry index was not closed cleanly: the reaper sweeps the store once \
                 and files every record again"
            );
        }
        Ok(Opened {
            index: ExpiryIndex {
                dir,
                width,
                state: Mutex::new(State {
                    buckets,
                    complete: trusted,
                    ..State::default()
                }),
            },
            record_count,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("expiry index lock")
    }

    /// Whether every record has an entry (else the reaper sweeps), and the
    /// epoch a sweep starting now proves complete.
    pub fn complete(&self) -> (bool, u64) {
        let state = self.lock();
        (state.complete, state.epoch)
    }

    /// Taken before a write's swap, for its [`ExpiryIndex::file`].
    pub fn whole(&self) -> Whole {
        let state = self.lock();
        Whole(state.complete.then_some(state.epoch))
    }

    /// Entries may be missing (records were written without them, as by
    /// the log's replay): the reaper sweeps before trusting the index.
    pub fn distrust(&self) {
        distrust(&mut self.lock());
    }

    /// A sweep that started at `epoch` went through both trees, filing
    /// every record it found: the index holds them all, unless entries
    /// were lost since.
    pub fn swept(&self, epoch: u64) {
        let mut state = self.lock();
        if state.epoch == epoch && !state.complete {
            state.complete = true;
            tracing::info!("the expiry index is whole again: the reaper reads only what is due");
        }
    }

    /// Notes that `key` of `tree` is due at `retain_until` (it was due at
    /// `before`, if it existed). Never fails the write that called it: an
    /// entry that cannot be kept makes the index incomplete, and the
    /// reaper sweeps.
    pub fn file(
        &self,
        whole: Whole,
        tree: Tree,
        key: &[u8],
        before: Option<UnixMillis>,
        retain_until: UnixMillis,
    ) {
        let mut state = self.lock();
        if key.len() > MAX_KEY {
            tracing::warn!(len = key.len(), "a key too long for the expiry index");
            distrust(&mut state);
            return;
        }
        let fine = retain_until.0 / self.width;
        // Already filed by the write before, in the same fine interval,
        // and not read yet: that entry (or what its coarse file's split
        // makes of it) will find the record as it is then. Only once the
        // index is whole: during a sweep the record before may have no
        // entry (the sweep passed it as expired).
        if state.complete
            && whole.0 == Some(state.epoch)
            && before.map(|before| before.0 / self.width) == Some(fine)
            && state.read_from.is_none_or(|read| fine > read)
        {
            return;
        }
        if state.marked {
            // Written after close: the marker would vouch for an index
            // that lacks this entry.
            match fs::remove_file(self.dir.join(CLEAN_MARKER))
                .and_then(|()| File::open(&self.dir)?.sync_all())
            {
                Ok(()) => state.marked = false,
                Err(error) => {
                    tracing::warn!(%error, "the expiry index's clean marker could not go");
                }
            }
        }
        let bucket = self.bucket_for(&state, retain_until);
        push_entry(&mut state, bucket, tree, key, retain_until);
        if state.buffered >= BUFFER_BYTES {
            self.flush(&mut state);
        }
    }

    /// The file an entry due at `retain_until` goes into now.
    fn bucket_for(&self, state: &State, retain_until: UnixMillis) -> Bucket {
        let fine = retain_until.0 / self.width;
        let coarse = fine / FINE_AHEAD;
        let now_fine = wall_millis() / self.width;
        if fine > now_fine + FINE_AHEAD && state.split_from.is_none_or(|split| coarse > split) {
            Bucket::Coarse(coarse)
        } else {
            Bucket::Fine(fine)
        }
    }

    /// Appends every buffered entry to its file (not synced).
    fn flush(&self, state: &mut State) {
        let buffers = std::mem::take(&mut state.buffers);
        state.buffered = 0;
        for (bucket, entries) in buffers {
            self.append(state, bucket, &entries);
        }
    }

    /// Appends `entries` to `bucket`'s file; a failed append is cut off
    /// (no torn entry before later ones) and makes the index incomplete.
    fn append(&self, state: &mut State, bucket: Bucket, entries: &[u8]) {
        state.written.insert(bucket);
        let appended = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path(bucket))
            .and_then(|mut file| {
                let before = file.metadata()?.len();
                file.write_all(entries).inspect_err(|_| {
                    let _ = file.set_len(before);
                })
            });
        if let Err(error) = appended {
            tracing::warn!(
                %error,
                "the expiry index lost entries: the reaper sweeps the store again"
            );
            distrust(state);
        }
    }

    fn path(&self, bucket: Bucket) -> PathBuf {
        self.dir.join(match bucket {
            Bucket::Fine(n) => n.to_string(),
            Bucket::Coarse(n) => format!("c{n}"),
        })
    }

    /// Entries of the first fine bucket whose time has passed by `now`,
    /// from where its reading stands (empty: nothing is due). Splits the
    /// coarse files whose time comes within one of their intervals.
    pub fn due(&self, now: UnixMillis) -> Vec<DueEntry> {
        for _ in 0..SPLIT_STEPS {
            // The lock is let go between steps: a split of a large coarse
            // file does not hold writers up.
            let mut state = self.lock();
            if state.closed {
                return Vec::new();
            }
            match self.due_step(&mut state, now) {
                Step::Entries(entries) => return entries,
                Step::Again => continue,
                Step::Nothing => return Vec::new(),
            }
        }
        Vec::new()
    }

    fn due_step(&self, state: &mut State, now: UnixMillis) -> Step {
        let coarse_width = self.width.saturating_mul(FINE_AHEAD);
        let coarse_near = |c: u64| c.saturating_sub(1).saturating_mul(coarse_width) <= now.0;
        let Some(&first) = state.buckets.first() else {
            return Step::Nothing;
        };
        let n = match first {
            Bucket::Fine(n) if n.saturating_add(1).saturating_mul(self.width) <= now.0 => n,
            // No fine file due; a coarse one may have come near.
            _ => {
                return match state.buckets.range(Bucket::Coarse(0)..).next() {
                    Some(&Bucket::Coarse(c)) if coarse_near(c) => self.split_step(state, c),
                    _ => Step::Nothing,
                };
            }
        };
        state.read_from = Some(state.read_from.map_or(n, |read| read.max(n)));
        self.write_out(state, first);
        let offset = state.cursors.get(&first).copied().unwrap_or(0);
        match self.read(&self.path(first), offset) {
            Ok(entries) if !entries.is_empty() => {
                return Step::Entries(
                    entries
                        .into_iter()
                        .map(|entry| DueEntry {
                            tree: entry.tree,
                            key: entry.key,
                            done: (n, entry.end),
                        })
                        .collect(),
                );
            }
            Ok(_) => {}
            Err(error) => unreadable(state, first, &error),
        }
        self.finished(state, first);
        Step::Again
    }

    /// Moves one read's worth of the coarse file `c` into fine files.
    fn split_step(&self, state: &mut State, c: u64) -> Step {
        let bucket = Bucket::Coarse(c);
        // From now on what falls due in `c` is filed fine.
        state.split_from = Some(state.split_from.map_or(c, |split| split.max(c)));
        self.write_out(state, bucket);
        let offset = state.cursors.get(&bucket).copied().unwrap_or(0);
        match self.read(&self.path(bucket), offset) {
            Ok(entries) if !entries.is_empty() => {
                let end = entries.last().map_or(offset, |entry| entry.end);
                for entry in entries {
                    let fine = Bucket::Fine(entry.retain_until.0 / self.width);
                    push_entry(state, fine, entry.tree, &entry.key, entry.retain_until);
                }
                if state.buffered >= BUFFER_BYTES {
                    self.flush(state);
                }
                state.cursors.insert(bucket, end);
                return Step::Again;
            }
            Ok(_) => {}
            Err(error) => unreadable(state, bucket, &error),
        }
        // The moved entries reach their files before the coarse one goes.
        self.flush(state);
        self.finished(state, bucket);
        Step::Again
    }

    /// Appends what is buffered for `bucket` to its file, so a read sees
    /// every entry.
    fn write_out(&self, state: &mut State, bucket: Bucket) {
        if let Some(entries) = state.buffers.remove(&bucket) {
            state.buffered -= entries.len();
            self.append(state, bucket, &entries);
        }
    }

    /// `bucket`'s file was read to its end with nothing buffered for it:
    /// it goes (one that cannot go is left, and the index distrusted).
    fn finished(&self, state: &mut State, bucket: Bucket) {
        match fs::remove_file(self.path(bucket)) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => {
                tracing::warn!(%error, ?bucket, "an expiry index file could not go: the reaper sweeps");
                distrust(state);
            }
            _ => {}
        }
        state.buckets.remove(&bucket);
        state.written.remove(&bucket);
        state.cursors.remove(&bucket);
    }

    /// Up to [`READ_BYTES`] of whole entries of the file at `path` from
    /// `offset`.
    fn read(&self, path: &Path, offset: u64) -> Result<Vec<Entry>, Error> {
        let mut file = match File::open(path) {
            Ok(file) => file,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(error) => return Err(error.into()),
        };
        file.seek(SeekFrom::Start(offset))?;
        let mut bytes = Vec::new();
        file.take(READ_BYTES + (HEADER + MAX_KEY) as u64)
            .read_to_end(&mut bytes)?;
        let cut_short = || Error::Corrupt("an expiry entry cut short".into());
        let mut entries = Vec::new();
        let mut at = 0usize;
        while at < bytes.len() && (at as u64) < READ_BYTES {
            let header = bytes.get(at..at + HEADER).ok_or_else(cut_short)?;
            let tree = Tree::from_byte(header[0])
                .ok_or_else(|| Error::Corrupt(format!("an expiry entry of tree {}", header[0])))?;
            let len = usize::from(u16::from_le_bytes([header[1], header[2]]));
            let retain_until = u64::from_le_bytes(header[3..HEADER].try_into().expect("8 bytes"));
            let key = bytes
                .get(at + HEADER..at + HEADER + len)
                .ok_or_else(cut_short)?;
            at += HEADER + len;
            entries.push(Entry {
                tree,
                retain_until: UnixMillis(retain_until),
                key: key.to_vec(),
                end: offset + at as u64,
            });
        }
        Ok(entries)
    }

    /// The reaper is done with every entry up to `done` (from
    /// [`DueEntry::done`]).
    pub fn advance(&self, done: (u64, u64)) {
        let mut state = self.lock();
        let bucket = Bucket::Fine(done.0);
        if state.buckets.contains(&bucket) {
            state.cursors.insert(bucket, done.1);
        }
    }

    /// Bytes of the index's files on disk.
    pub fn bytes(&self) -> u64 {
        fs::read_dir(&self.dir)
            .map(|entries| {
                entries
                    .filter_map(|entry| entry.ok()?.metadata().ok())
                    .map(|metadata| metadata.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// At close: every entry appended and synced, then the marker (with
    /// `record_count`, the width and `stamp`, the value the next open
    /// must find) if the index is whole. Entries filed later remove the
    /// marker again.
    pub fn close(&self, record_count: Option<u64>, stamp: u64) -> Result<(), Error> {
        let mut state = self.lock();
        state.closed = true;
        self.flush(&mut state);
        for bucket in std::mem::take(&mut state.written) {
            match File::open(self.path(bucket)) {
                Ok(file) => file.sync_data()?,
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => return Err(error.into()),
            }
        }
        sync_directory(&self.dir)?;
        let (true, Some(count)) = (state.complete, record_count) else {
            return Ok(());
        };
        let temporary = self.dir.join("clean.tmp");
        let mut file = File::create(&temporary)?;
        file.write_all(format!("{count} {} {stamp}", self.width).as_bytes())?;
        file.sync_all()?;
        fs::rename(&temporary, self.dir.join(CLEAN_MARKER))?;
        sync_directory(&self.dir)?;
        state.marked = true;
        Ok(())
    }
}

fn distrust(state: &mut State) {
    state.complete = false;
    state.epoch += 1;
}

/// `bucket`'s file cannot be read (the caller drops it): what it held is
/// filed again by a sweep.
fn unreadable(state: &mut State, bucket: Bucket, error: &Error) {
    tracing::warn!(%error, ?bucket, "an expiry index file is unreadable: dropped, the reaper sweeps");
    distrust(state);
}

fn push_entry(state: &mut State, bucket: Bucket, tree: Tree, key: &[u8], retain_until: UnixMillis) {
    let buffer = state.buffers.entry(bucket).or_default();
    let before = buffer.len();
    buffer.push(tree as u8);
    buffer.extend_from_slice(&(key.len() as u16).to_le_bytes());
    buffer.extend_from_slice(&retain_until.0.to_le_bytes());
    buffer.extend_from_slice(key);
    state.buffered += buffer.len() - before;
    state.buckets.insert(bucket);
}

fn parse_name(name: &str) -> Option<Bucket> {
    match name.strip_prefix('c') {
        Some(coarse) => coarse.parse().ok().map(Bucket::Coarse),
        None => name.parse().ok().map(Bucket::Fine),
    }
}

/// The wall clock, for choosing between a fine and a coarse file only (a
/// wrong choice costs a split, never an entry).
fn wall_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    /// The minute the tests count from: now, taken once (the wall clock
    /// decides fine or coarse; a minute ending mid-test must not move the
    /// times a test compares).
    fn minute_now() -> u64 {
        static NOW: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        *NOW.get_or_init(|| wall_millis() / 60_000)
    }

    /// Minutes from [`minute_now`].
    fn at(minutes: u64) -> UnixMillis {
        UnixMillis((minute_now() + minutes) * 60_000)
    }

    fn open(dir: &Path, stamp: u64) -> Opened {
        ExpiryIndex::open(dir, MINUTE, stamp).unwrap()
    }

    /// A new index, made whole (as by a sweep of an empty store).
    fn whole(dir: &Path) -> ExpiryIndex {
        let index = open(dir, 0).index;
        index.swept(index.complete().1);
        index
    }

    fn drain(index: &ExpiryIndex, now: UnixMillis) -> Vec<Vec<u8>> {
        let mut keys = Vec::new();
        loop {
            let entries = index.due(now);
            let Some(last) = entries.last() else {
                return keys;
            };
            index.advance(last.done);
            keys.extend(entries.into_iter().map(|entry| entry.key));
        }
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir.join(DIR))
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn only_what_is_due_is_read_and_a_read_file_goes() {
        let dir = tempfile::tempdir().unwrap();
        let index = whole(dir.path());
        index.file(Whole(Some(0)), Tree::Records, b"a", None, at(10));
        index.file(Whole(Some(0)), Tree::Records, b"b", None, at(20));
        index.file(Whole(Some(0)), Tree::Marks, b"c", None, at(10));
        assert!(drain(&index, at(10)).is_empty(), "its minute ends at 11");
        assert_eq!(drain(&index, at(11)), vec![b"a".to_vec(), b"c".to_vec()]);
        assert!(files(dir.path()).is_empty(), "read and gone");
        assert_eq!(drain(&index, at(30)), vec![b"b".to_vec()]);
    }

    #[test]
    fn far_entries_wait_in_a_coarse_file_and_are_split_as_they_come_near() {
        let dir = tempfile::tempdir().unwrap();
        let index = whole(dir.path());
        // Minutes from now at the start of a coarse file, the third ahead
        // or later (so `far` and `far + 1` share one).
        let far = (3 * FINE_AHEAD..4 * FINE_AHEAD)
            .find(|m| (minute_now() + m).is_multiple_of(FINE_AHEAD))
            .unwrap();
        for minute in [far, far + 1, far + 1] {
            index.file(
                Whole(Some(0)),
                Tree::Records,
                format!("k{minute}").as_bytes(),
                None,
                at(minute),
            );
        }
        index.flush(&mut index.lock());
        let coarse = (at(far).0 / 60_000) / FINE_AHEAD;
        assert_eq!(
            files(dir.path()),
            vec![format!("c{coarse}")],
            "one file for all three"
        );
        // Not within a coarse interval of its start: left alone.
        assert!(index.due(at(10)).is_empty());
        assert_eq!(files(dir.path()), vec![format!("c{coarse}")]);
        // Within it: split into minutes, none due yet.
        let near = UnixMillis((coarse - 1) * FINE_AHEAD * 60_000);
        assert!(index.due(near).is_empty());
        index.flush(&mut index.lock());
        let fine = at(far).0 / 60_000;
        assert_eq!(
            files(dir.path()),
            vec![fine.to_string(), (fine + 1).to_string()]
        );
        // A write into that coarse interval now goes to its minute.
        index.file(Whole(Some(0)), Tree::Records, b"late", None, at(far));
        assert_eq!(
            drain(&index, at(far + 2)),
            vec![
                format!("k{far}").into_bytes(),
                b"late".to_vec(),
                format!("k{}", far + 1).into_bytes(),
                format!("k{}", far + 1).into_bytes()
            ]
        );
    }

    #[test]
    fn a_clean_restart_keeps_the_coarse_files_and_a_closed_index_splits_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let index = whole(dir.path());
        let far = FINE_AHEAD * 3;
        index.file(Whole(Some(0)), Tree::Records, b"far", None, at(far));
        index.close(Some(1), 5).unwrap();
        let coarse = files(dir.path());
        assert_eq!(coarse.len(), 2, "a coarse file and the marker: {coarse:?}");
        // A reaper pass still running after close changes nothing.
        assert!(index.due(at(far + 1)).is_empty());
        assert_eq!(files(dir.path()), coarse);
        drop(index);
        let opened = open(dir.path(), 5);
        assert_eq!(opened.record_count, Some(1));
        assert_eq!(drain(&opened.index, at(far + 1)), vec![b"far".to_vec()]);
    }

    #[test]
    fn a_rewrite_in_the_same_unread_minute_files_nothing_more() {
        let dir = tempfile::tempdir().unwrap();
        let index = whole(dir.path());
        index.file(Whole(Some(0)), Tree::Records, b"a", None, at(10));
        index.file(
            Whole(Some(0)),
            Tree::Records,
            b"a",
            Some(at(10)),
            UnixMillis(at(10).0 + 5),
        );
        index.file(Whole(Some(0)), Tree::Records, b"a", Some(at(10)), at(12));
        index.file(Whole(Some(0)), Tree::Records, b"b", None, at(21));
        assert_eq!(drain(&index, at(20)).len(), 2);
        // Minute 21 not read yet, 10 read: a rewrite in 21 is covered, one
        // in 10 (its entry may be read already) is filed again.
        index.file(Whole(Some(0)), Tree::Records, b"b", Some(at(21)), at(21));
        index.file(Whole(Some(0)), Tree::Records, b"c", Some(at(10)), at(10));
        assert_eq!(drain(&index, at(22)), vec![b"c".to_vec(), b"b".to_vec()]);
    }

    #[test]
    fn while_a_sweep_is_under_way_every_rewrite_is_filed() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(dir.path(), 0).index;
        // The record before may be one the sweep passed as expired, with
        // no entry: the rewrite in its minute must be filed.
        index.file(Whole(Some(0)), Tree::Records, b"a", Some(at(10)), at(10));
        index.swept(index.complete().1);
        // A write that began before the sweep ended files too, though it
        // files after.
        index.file(Whole(None), Tree::Records, b"b", Some(at(10)), at(10));
        assert_eq!(drain(&index, at(11)), vec![b"a".to_vec(), b"b".to_vec()]);
    }

    #[test]
    fn only_a_clean_close_after_the_same_open_is_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let index = whole(dir.path());
        index.file(Whole(Some(0)), Tree::Records, b"a", None, at(10));
        index.close(Some(7), 41).unwrap();
        drop(index);
        // Another open came between (an older dedupd, say): the stamp
        // differs.
        assert_eq!(open(dir.path(), 40).record_count, None);
        let index = whole(dir.path());
        index.file(Whole(Some(0)), Tree::Records, b"a", None, at(10));
        index.close(Some(7), 42).unwrap();
        drop(index);
        // Another width: the files' numbers mean other times.
        let other = ExpiryIndex::open(dir.path(), Duration::from_secs(10), 42).unwrap();
        assert_eq!(other.record_count, None);
        let index = other.index;
        index.swept(index.complete().1);
        index.file(Whole(Some(0)), Tree::Records, b"a", None, at(10));
        index.close(Some(7), 42).unwrap();
        drop(index);

        let opened = ExpiryIndex::open(dir.path(), Duration::from_secs(10), 42).unwrap();
        assert_eq!(opened.record_count, Some(7));
        assert!(opened.index.complete().0);
        assert_eq!(drain(&opened.index, at(11)), vec![b"a".to_vec()]);
        opened
            .index
            .file(Whole(Some(0)), Tree::Records, b"b", None, at(10));
        drop(opened); // no close: a crash

        let opened = ExpiryIndex::open(dir.path(), Duration::from_secs(10), 42).unwrap();
        assert_eq!(opened.record_count, None);
        assert!(!opened.index.complete().0);
        assert!(files(dir.path()).is_empty(), "an untrusted file is dropped");
        opened.index.swept(opened.index.complete().1);
        opened.index.close(Some(0), 42).unwrap();
        // A write after close: the marker goes, the next open sweeps.
        opened
            .index
            .file(Whole(Some(0)), Tree::Records, b"c", None, at(10));
        drop(opened);
        assert!(
            !ExpiryIndex::open(dir.path(), Duration::from_secs(10), 42)
                .unwrap()
                .index
                .complete()
                .0
        );
    }

    #[test]
    fn a_sweep_proves_nothing_when_entries_were_lost_during_it() {
        let dir = tempfile::tempdir().unwrap();
        let index = open(dir.path(), 0).index;
        let (_, epoch) = index.complete();
        index.file(Whole(Some(0)), Tree::Records, b"a", None, at(10));
        // The files' folder gone: the append fails.
        fs::remove_dir_all(dir.path().join(DIR)).unwrap();
        index.flush(&mut index.lock());
        index.swept(epoch);
        assert!(!index.complete().0);
        fs::create_dir_all(dir.path().join(DIR)).unwrap();
        index.swept(index.complete().1);
        assert!(index.complete().0);
    }

    #[test]
    fn entries_cross_the_read_size_whole() {
        let dir = tempfile::tempdir().unwrap();
        let index = whole(dir.path());
        let keys: Vec<Vec<u8>> = (0..20_000u32)
            .map(|n| format!("namespace/key-{n:08}").into_bytes())
            .collect();
        for key in &keys {
            index.file(Whole(Some(0)), Tree::Records, key, None, at(3));
        }
        assert!(index.due(at(4)).len() < keys.len(), "one read is bounded");
        assert_eq!(drain(&index, at(4)), keys);
    }
}
