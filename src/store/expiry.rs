//! The embedded store's expiry index: which keys fall due when, kept in
//! files of dedupd's own beside sled (`expiry/<n>`, one per interval of
//! time — the reaper's, from one second to a minute — in which something
//! falls due), so that a reaper pass reads what is due and nothing else,
//! and a whole interval's file goes at once.
//!
//! Outside sled on purpose: entries written once and left until due pinned
//! sled's log segments (an index in a sled tree made its log grow with
//! everything that went through it). Here an entry costs an append to a
//! file of ours, and a due file is deleted after its keys are reaped.
//!
//! Nothing here decides what is expired: an entry only says "look at this
//! key then"; the reaper reads the record and removes it only if it is
//! expired by then (a stale entry costs one read). The entries are not
//! synced as they are written: after anything but a clean close (the
//! `clean` marker, written last at close and removed at open) the files are
//! dropped and the reaper sweeps the trees once, filing every record it
//! finds, before it trusts the index again.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::{self, File, OpenOptions},
    io::{self, Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::Mutex,
    time::Duration,
};

use super::wal::{sync_directory, Tree};
use crate::{clock::UnixMillis, error::Error};

/// The index's folder in the data directory.
pub(super) const DIR: &str = "expiry";

/// The shortest and longest time one file covers: a record is reaped up
/// to this long after it expired (it reads as absent from then on anyway).
pub(super) const BUCKET_RANGE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(60));

/// Entries kept in memory before they are appended to their files.
const BUFFER_BYTES: usize = 256 << 10;

/// Entries read from a due file at a time.
const READ_BYTES: u64 = 64 << 10;

/// Written last at a clean close (with the record count and the files'
/// width), removed at open.
const CLEAN_MARKER: &str = "clean";

/// The longest key an entry holds (sled keys of records are far shorter).
const MAX_KEY: usize = u16::MAX as usize;

/// One due entry: the key to look at, and where the file's reading
/// stands once it is done.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct DueEntry {
    pub tree: Tree,
    pub key: Vec<u8>,
    /// The bucket and the offset just past this entry.
    pub done: (u64, u64),
}

/// The index (one per store).
#[derive(Debug)]
pub(super) struct ExpiryIndex {
    dir: PathBuf,
    /// Milliseconds one file covers (file `n` holds what falls due in
    /// `[n × width, (n + 1) × width)`).
    width: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Entries not yet appended to their bucket's file.
    buffers: BTreeMap<u64, Vec<u8>>,
    buffered: usize,
    /// Buckets with a file or a buffer.
    buckets: BTreeSet<u64>,
    /// Files appended to since open (synced at close).
    written: BTreeSet<u64>,
    /// Whether every record has an entry.
    complete: bool,
    /// Moved each time entries may have been lost (a failed append): a
    /// sweep that started before proves nothing.
    epoch: u64,
    /// The clean marker is on disk (after close): the next filing removes
    /// it first.
    marked: bool,
    /// How far the first due bucket's file has been read.
    cursor: Option<(u64, u64)>,
    /// The last bucket whose file the reaper started reading: an entry in
    /// it or before may be gone.
    read_from: Option<u64>,
}

/// What [`ExpiryIndex::open`] found.
#[derive(Debug)]
pub(super) struct Opened {
    pub index: ExpiryIndex,
    /// The record count the last clean close left (`None` after anything
    /// else: the reaper's sweep counts).
    pub record_count: Option<u64>,
}

impl ExpiryIndex {
    /// Opens the index of the store in `store_dir`, each file covering
    /// `width` (within [`BUCKET_RANGE`]). Trusted only after a clean close
    /// with the same width; else its files go and the index waits for a
    /// sweep.
    pub fn open(store_dir: &Path, width: Duration) -> Result<Opened, Error> {
        let width = width.clamp(BUCKET_RANGE.0, BUCKET_RANGE.1).as_millis() as u64;
        let dir = store_dir.join(DIR);
        fs::create_dir_all(&dir)?;
        let marker = dir.join(CLEAN_MARKER);
        let record_count = match fs::read_to_string(&marker) {
            Ok(text) => match text.split_whitespace().collect::<Vec<_>>()[..] {
                [count, closed_width] if closed_width.parse() == Ok(width) => count.parse().ok(),
                _ => None,
            },
            Err(error) if error.kind() == io::ErrorKind::NotFound => None,
            Err(error) => return Err(error.into()),
        };
        let trusted = record_count.is_some();
        if marker.exists() {
            // Gone for good before the first write: a crash from now on
            // must find it missing.
            fs::remove_file(&marker)?;
        }
        let mut buckets = BTreeSet::new();
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let Some(bucket) = entry
                .file_name()
                .to_str()
                .and_then(|name| name.parse().ok())
            else {
                continue;
            };
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

    /// Entries may be missing (records were written without them, as by
    /// the log's replay): the reaper sweeps before trusting the index.
    pub fn distrust(&self) {
        let mut state = self.lock();
        state.complete = false;
        state.epoch += 1;
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
        tree: Tree,
        key: &[u8],
        before: Option<UnixMillis>,
        retain_until: UnixMillis,
    ) {
        if key.len() > MAX_KEY {
            tracing::warn!(len = key.len(), "a key too long for the expiry index");
            return;
        }
        let bucket = retain_until.0 / self.width;
        let mut state = self.lock();
        // Already filed in this bucket by the write before, and not read
        // yet: that entry will find the record as it is then.
        if before.map(|before| before.0 / self.width) == Some(bucket)
            && state.read_from.is_none_or(|read| bucket > read)
        {
            return;
        }
        if state.marked {
            // Written after close: the marker would vouch for an index
            // that lacks this entry.
            if let Err(error) = fs::remove_file(self.dir.join(CLEAN_MARKER))
                .and_then(|()| File::open(&self.dir)?.sync_all())
            {
                tracing::warn!(%error, "the expiry index's clean marker could not go");
            }
            state.marked = false;
        }
        let buffer = state.buffers.entry(bucket).or_default();
        let before_len = buffer.len();
        buffer.push(tree as u8);
        buffer.extend_from_slice(&(key.len() as u16).to_le_bytes());
        buffer.extend_from_slice(key);
        let added = buffer.len() - before_len;
        state.buffered += added;
        state.buckets.insert(bucket);
        if state.buffered >= BUFFER_BYTES {
            self.flush(&mut state);
        }
    }

    /// Appends every buffered entry to its file (not synced). Entries
    /// that cannot be written are dropped and the index made incomplete.
    fn flush(&self, state: &mut State) {
        let buffers = std::mem::take(&mut state.buffers);
        state.buffered = 0;
        for (bucket, entries) in buffers {
            if let Err(error) = self.append(bucket, &entries) {
                tracing::warn!(
                    %error,
                    "the expiry index lost entries: the reaper sweeps the store again"
                );
                state.complete = false;
                state.epoch += 1;
            }
            state.written.insert(bucket);
        }
    }

    fn append(&self, bucket: u64, entries: &[u8]) -> io::Result<()> {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path(bucket))?
            .write_all(entries)
    }

    fn path(&self, bucket: u64) -> PathBuf {
        self.dir.join(bucket.to_string())
    }

    /// Entries of the first bucket whose time has passed by `now`, from
    /// where the reading stands (empty: nothing is due).
    pub fn due(&self, now: UnixMillis) -> Vec<DueEntry> {
        let mut state = self.lock();
        loop {
            let Some(&bucket) = state.buckets.first() else {
                return Vec::new();
            };
            // Due from the first millisecond after it.
            if bucket.saturating_add(1).saturating_mul(self.width) > now.0 {
                return Vec::new();
            }
            if let Some(entries) = state.buffers.remove(&bucket) {
                state.buffered -= entries.len();
                if let Err(error) = self.append(bucket, &entries) {
                    tracing::warn!(%error, "the expiry index lost due entries: the reaper sweeps");
                    state.complete = false;
                    state.epoch += 1;
                }
                state.written.insert(bucket);
            }
            state.read_from = Some(state.read_from.map_or(bucket, |read| read.max(bucket)));
            let offset = match state.cursor {
                Some((at, offset)) if at == bucket => offset,
                _ => 0,
            };
            match self.read(bucket, offset) {
                Ok(entries) if !entries.is_empty() => return entries,
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(
                        %error, bucket,
                        "an expiry index file is unreadable: dropped, the reaper sweeps"
                    );
                    state.complete = false;
                    state.epoch += 1;
                }
            }
            // Read to its end, nothing buffered for it: it goes.
            match fs::remove_file(self.path(bucket)) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => {
                    tracing::warn!(%error, bucket, "an expiry index file could not go");
                    return Vec::new();
                }
                _ => {}
            }
            state.buckets.remove(&bucket);
            state.written.remove(&bucket);
            state.cursor = None;
        }
    }

    /// Up to [`READ_BYTES`] of whole entries of `bucket`'s file from
    /// `offset`.
    fn read(&self, bucket: u64, offset: u64) -> Result<Vec<DueEntry>, Error> {
        let mut file = match File::open(self.path(bucket)) {
            Ok(file) => file,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(error) => return Err(error.into()),
        };
        file.seek(SeekFrom::Start(offset))?;
        let mut bytes = Vec::new();
        file.take(READ_BYTES + 3 + MAX_KEY as u64)
            .read_to_end(&mut bytes)?;
        let mut entries = Vec::new();
        let mut at = 0usize;
        while at < bytes.len() && (at as u64) < READ_BYTES {
            let header = bytes
                .get(at..at + 3)
                .ok_or_else(|| Error::Corrupt("an expiry entry cut short".into()))?;
            let tree = Tree::from_byte(header[0])
                .ok_or_else(|| Error::Corrupt(format!("an expiry entry of tree {}", header[0])))?;
            let len = usize::from(u16::from_le_bytes([header[1], header[2]]));
            let key = bytes
                .get(at + 3..at + 3 + len)
                .ok_or_else(|| Error::Corrupt("an expiry entry cut short".into()))?;
            at += 3 + len;
            entries.push(DueEntry {
                tree,
                key: key.to_vec(),
                done: (bucket, offset + at as u64),
            });
        }
        Ok(entries)
    }

    /// The reaper is done with every entry up to `done` (from
    /// [`DueEntry::done`]).
    pub fn advance(&self, done: (u64, u64)) {
        self.lock().cursor = Some(done);
    }

    /// At close: every entry appended and synced, then the marker (with
    /// `record_count`) if the index is whole. Entries filed later remove
    /// the marker again.
    pub fn close(&self, record_count: Option<u64>) -> Result<(), Error> {
        let mut state = self.lock();
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
        file.write_all(format!("{count} {}", self.width).as_bytes())?;
        file.sync_all()?;
        fs::rename(&temporary, self.dir.join(CLEAN_MARKER))?;
        sync_directory(&self.dir)?;
        state.marked = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn at(minutes: u64) -> UnixMillis {
        UnixMillis(minutes * 60_000)
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

    #[test]
    fn only_what_is_due_is_read_and_a_read_file_goes() {
        let dir = tempfile::tempdir().unwrap();
        let index = ExpiryIndex::open(dir.path(), MINUTE).unwrap().index;
        index.file(Tree::Records, b"a", None, at(10));
        index.file(Tree::Records, b"b", None, at(20));
        index.file(Tree::Marks, b"c", None, at(10));
        assert!(drain(&index, at(10)).is_empty(), "bucket 10 ends at 11");
        assert_eq!(drain(&index, at(11)), vec![b"a".to_vec(), b"c".to_vec()]);
        assert!(!dir.path().join(DIR).join("10").exists());
        assert_eq!(drain(&index, at(30)), vec![b"b".to_vec()]);
    }

    #[test]
    fn a_rewrite_in_the_same_far_bucket_files_nothing_more() {
        let dir = tempfile::tempdir().unwrap();
        let index = ExpiryIndex::open(dir.path(), MINUTE).unwrap().index;
        index.file(Tree::Records, b"a", None, at(10));
        index.file(Tree::Records, b"a", Some(at(10)), UnixMillis(at(10).0 + 5));
        index.file(Tree::Records, b"a", Some(at(10)), at(12));
        index.file(Tree::Records, b"b", None, at(21));
        assert_eq!(drain(&index, at(20)).len(), 2);
        // Bucket 21 not read yet, 10 read: a rewrite in 21 is covered, one
        // in 10 (its entry may be read already) is filed again.
        index.file(Tree::Records, b"b", Some(at(21)), at(21));
        index.file(Tree::Records, b"c", Some(at(10)), at(10));
        assert_eq!(drain(&index, at(22)), vec![b"c".to_vec(), b"b".to_vec()]);
    }

    #[test]
    fn only_a_clean_close_is_trusted_and_a_later_filing_undoes_it() {
        let dir = tempfile::tempdir().unwrap();
        let opened = ExpiryIndex::open(dir.path(), MINUTE).unwrap();
        assert_eq!(opened.record_count, None);
        let (complete, epoch) = opened.index.complete();
        assert!(!complete, "a new index waits for a sweep");
        opened.index.swept(epoch);
        opened.index.file(Tree::Records, b"a", None, at(10));
        opened.index.close(Some(7)).unwrap();
        drop(opened);

        // Another width: the files' numbers mean other times.
        let other = ExpiryIndex::open(dir.path(), Duration::from_secs(10)).unwrap();
        assert_eq!(other.record_count, None);
        other.index.close(Some(7)).unwrap();
        drop(other);
        let opened = ExpiryIndex::open(dir.path(), MINUTE).unwrap();
        assert!(
            !opened.index.complete().0,
            "closed whole under another width only"
        );
        let (_, epoch) = opened.index.complete();
        opened.index.swept(epoch);
        opened.index.file(Tree::Records, b"a", None, at(10));
        opened.index.close(Some(7)).unwrap();
        drop(opened);
        let opened = ExpiryIndex::open(dir.path(), MINUTE).unwrap();
        assert_eq!(opened.record_count, Some(7));
        assert!(opened.index.complete().0);
        assert_eq!(drain(&opened.index, at(11)), vec![b"a".to_vec()]);
        opened.index.file(Tree::Records, b"b", None, at(10));
        drop(opened); // no close: a crash

        let opened = ExpiryIndex::open(dir.path(), MINUTE).unwrap();
        assert_eq!(opened.record_count, None);
        assert!(!opened.index.complete().0);
        assert!(
            drain(&opened.index, at(11)).is_empty(),
            "an untrusted file is dropped"
        );
        let (_, epoch) = opened.index.complete();
        opened.index.swept(epoch);
        opened.index.close(Some(0)).unwrap();
        // A write after close: the marker goes, the next open sweeps.
        opened.index.file(Tree::Records, b"c", None, at(10));
        drop(opened);
        assert!(
            !ExpiryIndex::open(dir.path(), MINUTE)
                .unwrap()
                .index
                .complete()
                .0
        );
    }

    #[test]
    fn a_sweep_proves_nothing_when_entries_were_lost_during_it() {
        let dir = tempfile::tempdir().unwrap();
        let index = ExpiryIndex::open(dir.path(), MINUTE).unwrap().index;
        let (_, epoch) = index.complete();
        index.file(Tree::Records, b"a", None, at(10));
        // The files' folder gone: the append fails.
        fs::remove_dir_all(dir.path().join(DIR)).unwrap();
        index.flush(&mut index.lock());
        index.swept(epoch);
        assert!(!index.complete().0);
        fs::create_dir_all(dir.path().join(DIR)).unwrap();
        let (_, epoch) = index.complete();
        index.swept(epoch);
        assert!(index.complete().0);
    }

    #[test]
    fn entries_cross_the_read_size_whole() {
        let dir = tempfile::tempdir().unwrap();
        let index = ExpiryIndex::open(dir.path(), MINUTE).unwrap().index;
        let keys: Vec<Vec<u8>> = (0..20_000u32)
            .map(|n| format!("namespace/key-{n:08}").into_bytes())
            .collect();
        for key in &keys {
            index.file(Tree::Records, key, None, at(3));
        }
        assert!(index.due(at(4)).len() < keys.len(), "one read is bounded");
        assert_eq!(drain(&index, at(4)), keys);
    }
}
