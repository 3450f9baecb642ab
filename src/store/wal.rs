//! The embedded store's write-ahead log: where a change becomes durable.
//!
//! Waiting for sled's own flush costs a device round trip of its own (and
//! sled 0.34.7 made its log writes durable only at the end of a flush
//! round; see `vendor/sled/DEDUPD.md`), so `sync = always` does not rely
//! on it: every change sled makes is also
//! framed here, and an answer waits for one `fdatasync` of this log, shared
//! by every caller of the same group commit. sled is written without
//! waiting and made durable only at a *checkpoint* (its flush, then a sync
//! of its files), after which the log segments before it are deleted; at
//! open, whatever the segments still hold is replayed into sled.
//!
//! Layout: `wal/<sequence>.wal` in the data directory, each segment
//! preallocated (`fallocate`) where the filesystem allows, so that a sync
//! writes data, not the file's size. A segment starts with the 8 bytes
//! [`SEGMENT_MAGIC`] and its *group magic* (a random non-zero `u32`); then
//! come *groups*, one per sync: a 20-byte header `[group magic u32][group
//! number u64][length u32][CRC32C of number, length and frames u32]` and
//! the group's frames. Group numbers rise by one across segments.
//! A frame is `[payload length u32][CRC32C of payload u32][payload]`, the
//! payload `[LSN u64][tree u8][op u8][key length u32][key][value]`, all
//! little-endian. LSNs rise by one from frame to frame across segments:
//! frames are appended under the same lock as sled's compare-and-swap, so
//! the log's order is the order changes were made, and replaying it in
//! order ends each key at its last logged value (no revision compare is
//! needed; a newer value sled already holds that the log lost was never
//! acknowledged).
//!
//! Recovery reads every segment. A group is written and then synced before
//! the next is written, and every error of either ends the store (see the
//! committer), so a group that is not whole — torn, zeroed, checksum wrong —
//! is either the torn tail (its sync never returned: nobody was answered)
//! or damage to acknowledged data. The group headers tell which: if any
//! whole group with a later number follows the bad one, in the same segment
//! or a later one, the store refuses to open and names the file and byte;
//! if none does, the log ends there. Segments holding no group (a creation
//! a power cut or an error cut short) are ignored. Damage *inside* a group
//! whose checksum matches, or an LSN or group number out of sequence, is
//! corruption. Segments written before group headers existed (no magic)
//! are read frame by frame as before: a bad frame ends the log only in the
//! last segment that holds anything.

use std::{
    fs::{File, OpenOptions},
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use super::disk::Capacity;
use crate::error::Error;

mod replay;
pub(super) use replay::replay;
#[cfg(test)]
pub(super) use replay::{Replayed, RUN_FRAMES};
#[cfg(test)]
use replay::{RUN_BYTES, SCAN_BYTES};

/// The log's directory inside the data directory.
pub(super) const WAL_DIR: &str = "wal";

/// Preallocated size of a segment (a group larger than this gets a segment
/// of its own size).
pub(super) const SEGMENT_BYTES: u64 = 16 << 20;

/// A segment is preallocated only while this many times its size is free.
const PREALLOCATE_ROOM_FACTOR: u64 = 4;

const HEADER_BYTES: usize = 8;
/// The first bytes of every segment with group headers.
pub(super) const SEGMENT_MAGIC: &[u8; 8] = b"dedupWAL";
/// The magic, then the segment's group magic: a random non-zero `u32`
/// chosen when the segment is created, which starts each of its groups.
/// Random per segment so that no bytes a client can put in an answer, and
/// no copy of another segment, look like one of its groups.
const SEGMENT_HEADER_BYTES: usize = SEGMENT_MAGIC.len() + 4;
/// How far above the expected number a later group may be numbered and
/// still prove damage (any real one is a few groups on).
const LATER_GROUP_RANGE: u64 = 1 << 32;
const GROUP_HEADER_BYTES: usize = 4 + 8 + 4 + 4;
const FIXED_PAYLOAD_BYTES: usize = 8 + 1 + 1 + 4;

/// Which sled tree a frame changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Tree {
    /// sled's default tree (the fencing reservation).
    Meta = 0,
    /// Claim records.
    Records = 1,
    /// Ordering marks.
    Marks = 2,
}

impl Tree {
    pub(super) fn from_byte(byte: u8) -> Option<Tree> {
        match byte {
            0 => Some(Tree::Meta),
            1 => Some(Tree::Records),
            2 => Some(Tree::Marks),
            _ => None,
        }
    }
}

/// One change read back from the log.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Frame<'a> {
    pub lsn: u64,
    pub tree: Tree,
    pub key: &'a [u8],
    /// `None`: the key was removed.
    pub value: Option<&'a [u8]>,
}

/// Frames appended but not yet written to a segment. Writers append under
/// the lock that also covers their compare-and-swap.
#[derive(Debug)]
pub(super) struct Appender {
    buffer: Vec<u8>,
    next_lsn: u64,
    /// Set when the store closes: later changes are refused.
    closed: bool,
}

impl Appender {
    pub(super) fn new(next_lsn: u64) -> Appender {
        Appender {
            buffer: Vec::new(),
            next_lsn,
            closed: false,
        }
    }

    /// Frames one change.
    pub(super) fn append(&mut self, tree: Tree, key: &[u8], value: Option<&[u8]>) {
        encode_frame(&mut self.buffer, self.next_lsn, tree, key, value);
        self.next_lsn += 1;
    }

    /// Bytes framed and not yet handed over.
    pub(super) fn buffered(&self) -> usize {
        self.buffer.len()
    }

    /// Hands over what was appended since the last call, leaving `spare`
    /// (emptied) in its place so the buffers are reused.
    pub(super) fn take(&mut self, spare: &mut Vec<u8>) {
        spare.clear();
        std::mem::swap(&mut self.buffer, spare);
    }

    pub(super) fn closed(&self) -> bool {
        self.closed
    }

    pub(super) fn close(&mut self) {
        self.closed = true;
    }
}

/// Appends one frame to `buffer`.
pub(super) fn encode_frame(
    buffer: &mut Vec<u8>,
    lsn: u64,
    tree: Tree,
    key: &[u8],
    value: Option<&[u8]>,
) {
    let payload_len = FIXED_PAYLOAD_BYTES + key.len() + value.map_or(0, <[u8]>::len);
    let payload_len32 = u32::try_from(payload_len).expect("a change larger than 4 GiB");
    let key_len = u32::try_from(key.len()).expect("a key larger than 4 GiB");
    let start = buffer.len();
    buffer.reserve(HEADER_BYTES + payload_len);
    buffer.extend_from_slice(&payload_len32.to_le_bytes());
    buffer.extend_from_slice(&[0; 4]);
    buffer.extend_from_slice(&lsn.to_le_bytes());
    buffer.push(tree as u8);
    buffer.push(u8::from(value.is_some()));
    buffer.extend_from_slice(&key_len.to_le_bytes());
    buffer.extend_from_slice(key);
    if let Some(value) = value {
        buffer.extend_from_slice(value);
    }
    let crc = crc32c::crc32c(&buffer[start + HEADER_BYTES..]);
    buffer[start + 4..start + HEADER_BYTES].copy_from_slice(&crc.to_le_bytes());
}

/// The segments in `directory`, oldest first.
pub(super) fn segments(directory: &Path) -> Result<Vec<(u64, PathBuf)>, Error> {
    let entries = match std::fs::read_dir(directory) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(error.into()),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(sequence) = name
            .to_str()
            .and_then(|name| name.strip_suffix(".wal"))
            .and_then(|stem| stem.parse::<u64>().ok())
        else {
            continue;
        };
        found.push((sequence, entry.path()));
    }
    found.sort();
    Ok(found)
}

fn segment_path(directory: &Path, sequence: u64) -> PathBuf {
    directory.join(format!("{sequence:020}.wal"))
}

/// The segment being written, owned by the committer thread.
#[derive(Debug)]
pub(super) struct Writer {
    directory: PathBuf,
    file: File,
    sequence: u64,
    offset: u64,
    capacity: u64,
    /// The current segment's group magic.
    magic: u32,
    /// The number the next group written gets.
    next_group: u64,
    /// Bytes written since the last seal.
    pub since_seal: u64,
}

impl Writer {
    /// Starts segment `sequence` (the ones before it must already be
    /// replayed or gone), its first group numbered `next_group`.
    pub(super) fn create(
        directory: &Path,
        sequence: u64,
        next_group: u64,
    ) -> Result<Writer, Error> {
        if !directory.is_dir() {
            std::fs::create_dir_all(directory)?;
            // The log directory's own entry: without this a power cut can
            // take the whole log of a fresh data directory with it.
            if let Some(parent) = directory.parent() {
                sync_directory(parent)?;
            }
        }
        let (file, capacity, magic) = new_segment(directory, sequence, SEGMENT_BYTES)?;
        Ok(Writer {
            directory: directory.to_path_buf(),
            file,
            sequence,
            offset: SEGMENT_HEADER_BYTES as u64,
            capacity,
            magic,
            next_group,
            since_seal: 0,
        })
    }

    /// The segment being written.
    #[cfg(test)]
    pub(super) fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Writes `frames` (whole frames) as one group after what is there,
    /// moving to a new segment first when they do not fit. Not synced.
    pub(super) fn write(&mut self, frames: &[u8]) -> Result<(), Error> {
        if frames.is_empty() {
            return Ok(());
        }
        let len = (GROUP_HEADER_BYTES + frames.len()) as u64;
        if self.offset + len > self.capacity && self.offset > SEGMENT_HEADER_BYTES as u64 {
            match self.rotate(len) {
                Ok(()) => {}
                // No descriptor or no room for a new file: this segment
                // grows past its preallocation instead (each sync then also
                // writes its size), and the next group tries again.
                Err(error @ (Error::Exhausted(_) | Error::DiskFull(_))) => {
                    tracing::warn!(%error, "could not start a new log segment; the current one grows");
                }
                Err(error) => return Err(error),
            }
        }
        let group_len = u32::try_from(frames.len()).expect("a group larger than 4 GiB");
        let mut header = [0; GROUP_HEADER_BYTES];
        header[..4].copy_from_slice(&self.magic.to_le_bytes());
        header[4..12].copy_from_slice(&self.next_group.to_le_bytes());
        header[12..16].copy_from_slice(&group_len.to_le_bytes());
        let crc = group_crc(&header[4..16], frames);
        header[16..20].copy_from_slice(&crc.to_le_bytes());
        self.file.write_all_at(&header, self.offset)?;
        self.file
            .write_all_at(frames, self.offset + GROUP_HEADER_BYTES as u64)?;
        self.offset += len;
        self.since_seal += len;
        self.next_group += 1;
        Ok(())
    }

    /// Makes what was written durable.
    pub(super) fn sync(&self) -> Result<(), Error> {
        self.file.sync_data()?;
        Ok(())
    }

    /// Ends the current segment (everything in it is synced) and starts
    /// the next; returns the sequence of the one ended. A checkpoint may
    /// then delete it and every one before it. On an error the current
    /// segment goes on.
    pub(super) fn seal(&mut self) -> Result<u64, Error> {
        let sealed = self.sequence;
        self.rotate(0)?;
        self.since_seal = 0;
        Ok(sealed)
    }

    fn rotate(&mut self, at_least: u64) -> Result<(), Error> {
        let sequence = self.sequence + 1;
        let (file, capacity, magic) = new_segment(
            &self.directory,
            sequence,
            SEGMENT_BYTES.max(at_least + SEGMENT_HEADER_BYTES as u64),
        )?;
        self.file = file;
        self.magic = magic;
        self.sequence = sequence;
        self.offset = SEGMENT_HEADER_BYTES as u64;
        self.capacity = capacity;
        Ok(())
    }
}

/// Set once a segment could not be preallocated (warned once a process).
static NOT_PREALLOCATED: AtomicBool = AtomicBool::new(false);

/// Creates a segment, preallocated where it can be, and makes it and its
/// name durable. Preallocation that the filesystem refuses (no
/// `fallocate`, or short of space: the disk reserve refuses writes before
/// that) leaves a segment that grows as it is written, which costs each
/// sync a metadata update but loses nothing.
fn new_segment(directory: &Path, sequence: u64, size: u64) -> Result<(File, u64, u32), Error> {
    let path = segment_path(directory, sequence);
    let created = create_segment(directory, &path, size);
    if created.is_err() {
        // A segment left behind is harmless to recovery (one holding no
        // group is ignored), but its removal is made durable all the same.
        if std::fs::remove_file(&path).is_ok() {
            let _ = sync_directory(directory);
        }
    }
    created
}

fn create_segment(directory: &Path, path: &Path, size: u64) -> Result<(File, u64, u32), Error> {
    // Truncated, not refused, if it exists: a segment of a sequence above
    // every one replayed is what an earlier failed start of it left.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    let magic = rand::random::<u32>().max(1);
    let mut header = [0; SEGMENT_HEADER_BYTES];
    header[..SEGMENT_MAGIC.len()].copy_from_slice(SEGMENT_MAGIC);
    header[SEGMENT_MAGIC.len()..].copy_from_slice(&magic.to_le_bytes());
    file.write_all_at(&header, 0)?;
    // Only with room to spare: a filesystem may take the space page by page
    // before it refuses (tmpfs does), and sled must never see a full disk,
    // not even for a moment. A filesystem that does not report its space
    // is tried (see `disk`).
    let room = Capacity::of(directory)
        .ok()
        .map_or(Some(false), |capacity| {
            capacity.has_room(size.saturating_mul(PREALLOCATE_ROOM_FACTOR))
        })
        .unwrap_or(true);
    let preallocated = if room {
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, size)
            .map_err(io::Error::from)
    } else {
        Err(io::Error::new(
            io::ErrorKind::StorageFull,
            "less free space than preallocating should leave",
        ))
    };
    let capacity = match preallocated {
        Ok(()) => size,
        Err(error) => {
            if !NOT_PREALLOCATED.swap(true, Relaxed) {
                tracing::warn!(
                    %error,
                    segment = %path.display(),
                    "log segment not preallocated (warned once); it grows as it is written"
                );
            }
            u64::MAX
        }
    };
    file.sync_all()?;
    sync_directory(directory)?;
    Ok((file, capacity, magic))
}

/// Deletes every segment up to `sequence` (a checkpoint covers them),
/// oldest first, each deletion made durable before the next: a power loss
/// part-way must leave the newest segments, never an older one with a
/// newer one gone — replayed, its stale changes would overwrite what the
/// deleted one checkpointed (and the LSN gap would refuse to open). One
/// directory sync per segment, at a checkpoint: one or two.
pub(super) fn remove_through(directory: &Path, sequence: u64) -> Result<usize, Error> {
    let mut removed = 0;
    for (found, path) in segments(directory)? {
        if found > sequence {
            break;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {
                removed += 1;
                sync_directory(directory)?;
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(removed)
}

pub(super) fn sync_directory(path: &Path) -> Result<(), Error> {
    File::open(path)?.sync_all()?;
    Ok(())
}

/// A group's checksum: of its number and length, then its frames (a
/// damaged number must not read as a gap in a whole log).
fn group_crc(number_and_len: &[u8], frames: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(number_and_len), frames)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes one segment of groups (each synced), the first numbered
    /// `first_group`; returns its path and where each group starts.
    fn write_groups(
        directory: &Path,
        sequence: u64,
        first_group: u64,
        groups: &[Vec<u8>],
    ) -> (PathBuf, Vec<usize>) {
        let mut writer = Writer::create(directory, sequence, first_group).unwrap();
        let mut starts = Vec::new();
        for frames in groups {
            starts.push(writer.offset as usize);
            writer.write(frames).unwrap();
            writer.sync().unwrap();
        }
        // The preallocated zeros cut to 4 KiB: the cases below read the
        // log hundreds of times each.
        writer.file.set_len(writer.offset + 4096).unwrap();
        (segment_path(directory, sequence), starts)
    }

    fn frames(lsns: std::ops::Range<u64>) -> Vec<u8> {
        let mut buffer = Vec::new();
        for lsn in lsns {
            let value = format!("value-{lsn}");
            let removed = lsn % 5 == 0;
            encode_frame(
                &mut buffer,
                lsn,
                Tree::Records,
                format!("key-{lsn}").as_bytes(),
                (!removed).then_some(value.as_bytes()),
            );
        }
        buffer
    }

    fn overwrite(path: &Path, at: usize, bytes: &[u8]) {
        let file = OpenOptions::new().write(true).open(path).unwrap();
        file.write_all_at(bytes, at as u64).unwrap();
    }

    fn flip(path: &Path, at: usize) {
        let mut byte = [0];
        File::open(path)
            .unwrap()
            .read_exact_at(&mut byte, at as u64)
            .unwrap();
        overwrite(path, at, &[byte[0] ^ 0x10]);
    }

    /// A frame read back: LSN, key, value.
    type Owned = (u64, Vec<u8>, Option<Vec<u8>>);

    fn collect(directory: &Path) -> Result<(Vec<Owned>, Replayed), Error> {
        let mut seen = Vec::new();
        let replayed = replay(directory, |frames| {
            seen.extend(frames.iter().map(|frame| {
                (
                    frame.lsn,
                    frame.key.to_vec(),
                    frame.value.map(<[u8]>::to_vec),
                )
            }));
            Ok(())
        })?;
        Ok((seen, replayed))
    }

    #[test]
    fn groups_written_in_segments_replay_in_order_with_removals() {
        let dir = tempfile::tempdir().unwrap();
        write_groups(dir.path(), 1, 1, &[frames(1..40), frames(40..50)]);
        write_groups(dir.path(), 2, 3, &[frames(50..60)]);
        let (seen, replayed) = collect(dir.path()).unwrap();
        assert_eq!(seen.len(), 59);
        assert_eq!(seen[0], (1, b"key-1".to_vec(), Some(b"value-1".to_vec())));
        assert_eq!(seen[4], (5, b"key-5".to_vec(), None));
        assert_eq!(replayed.next_lsn, 60);
        assert_eq!(replayed.next_group, 4);
        assert_eq!(replayed.last_segment, 2);
        assert_eq!(replayed.torn, None);
    }

    /// Every cut of the last group (a write the power took part of: the
    /// rest reads as the preallocated zeros) ends the log at the group
    /// before it.
    #[test]
    fn a_torn_last_group_ends_the_log_at_the_group_before() {
        let groups = [frames(1..3), frames(3..6)];
        let dir = tempfile::tempdir().unwrap();
        let (path, starts) = write_groups(dir.path(), 1, 1, &groups);
        let whole = std::fs::read(&path).unwrap();
        let end = starts[1] + GROUP_HEADER_BYTES + groups[1].len();
        for cut in starts[1]..end {
            overwrite(&path, cut, &vec![0; end - cut]);
            let (seen, replayed) = collect(dir.path()).unwrap();
            assert_eq!(seen.len(), 2, "cut at {cut}");
            assert_eq!(replayed.next_lsn, 3, "cut at {cut}");
            assert_eq!(replayed.torn.is_some(), cut > starts[1], "cut at {cut}");
            overwrite(&path, 0, &whole);
        }
    }

    /// A flipped bit anywhere in the last group fails its checksum; the
    /// groups before it stand.
    #[test]
    fn a_corrupted_last_group_is_dropped_by_its_checksum() {
        let groups = [frames(1..3), frames(3..6)];
        let dir = tempfile::tempdir().unwrap();
        let (path, starts) = write_groups(dir.path(), 1, 1, &groups);
        for at in starts[1]..starts[1] + GROUP_HEADER_BYTES + groups[1].len() {
            flip(&path, at);
            let (seen, replayed) = collect(dir.path()).unwrap();
            assert_eq!(seen.len(), 2, "bit flipped at {at}");
            assert!(replayed.torn.is_some(), "bit flipped at {at}");
            flip(&path, at);
        }
    }

    /// Issue 38 item 5: damage in an early group with synced groups after
    /// it is not a torn tail. It used to end the log silently, dropping
    /// every acknowledged change after it.
    #[test]
    fn damage_followed_by_a_later_group_refuses_to_open_naming_file_and_byte() {
        let dir = tempfile::tempdir().unwrap();
        let groups = [frames(1..3), frames(3..6), frames(6..9)];
        let (path, starts) = write_groups(dir.path(), 1, 1, &groups);
        flip(&path, starts[1] + GROUP_HEADER_BYTES + 5);
        let error = collect(dir.path()).unwrap_err().to_string();
        assert!(error.contains(&path.display().to_string()), "{error}");
        assert!(error.contains(&format!("at byte {}", starts[1])), "{error}");
        assert!(error.contains("checksum"), "{error}");
        // And when the later group is in a later segment.
        let dir = tempfile::tempdir().unwrap();
        let (path, starts) = write_groups(dir.path(), 1, 1, &groups[..2]);
        write_groups(dir.path(), 2, 3, &groups[2..]);
        flip(&path, starts[1] + 3);
        let error = collect(dir.path()).unwrap_err();
        assert!(matches!(error, Error::Corrupt(_)), "{error}");
    }

    /// A log the store refuses to open over leaves nothing applied,
    /// however many whole frames come before the damage (more than a run's
    /// worth here), in its segment or an earlier one: sled may hold changes
    /// newer than the damage, which those older frames must not overwrite,
    /// and an operator restores over what the crash left.
    #[test]
    fn a_refusal_applies_nothing() {
        let many = RUN_FRAMES as u64 + 10;
        let groups = [
            frames(1..many),
            frames(many..many + 3),
            frames(many + 3..many + 6),
        ];
        let refused = |directory: &Path| {
            let mut applied = 0;
            let refused = replay(directory, |frames| {
                applied += frames.len();
                Ok(())
            });
            assert!(matches!(refused, Err(Error::Corrupt(_))), "{refused:?}");
            assert_eq!(applied, 0);
        };
        // The damage in the segment of the frames before it.
        let dir = tempfile::tempdir().unwrap();
        let (path, starts) = write_groups(dir.path(), 1, 1, &groups);
        flip(&path, starts[1] + GROUP_HEADER_BYTES + 5);
        refused(dir.path());
        // In a later segment: a gap in the group numbers where it starts.
        let dir = tempfile::tempdir().unwrap();
        write_groups(dir.path(), 1, 1, &groups[..1]);
        write_groups(dir.path(), 2, 3, &groups[1..]);
        refused(dir.path());
    }

    /// A group header with a matching checksum inside an answer (a client's
    /// bytes, or a copy of another log) must not make a torn tail read as
    /// damage: the segment's group magic is random, and far numbers are
    /// not taken as proof.
    #[test]
    fn group_like_bytes_in_an_answer_do_not_turn_a_torn_tail_into_damage() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = write_groups(dir.path(), 1, 1, &[frames(1..3)]);
        let own_magic = replay::group_magic(&std::fs::read(&path).unwrap()).unwrap();
        let fake = |magic: u32, number: u64| {
            let inner = frames(100..101);
            let mut header = Vec::new();
            header.extend_from_slice(&magic.to_le_bytes());
            header.extend_from_slice(&number.to_le_bytes());
            header.extend_from_slice(&(inner.len() as u32).to_le_bytes());
            let crc = group_crc(&header[4..16], &inner);
            header.extend_from_slice(&crc.to_le_bytes());
            header.extend_from_slice(&inner);
            header
        };
        for planted in [fake(own_magic ^ 1, 3), fake(own_magic, u64::MAX)] {
            let dir = tempfile::tempdir().unwrap();
            let mut second = Vec::new();
            encode_frame(&mut second, 3, Tree::Records, b"answer", Some(&planted));
            let (path, starts) = write_groups(dir.path(), 1, 1, &[frames(1..3), second]);
            // The power took the second group's first bytes.
            overwrite(&path, starts[1], &[0; 4]);
            let (seen, replayed) = collect(dir.path()).unwrap();
            assert_eq!(seen.len(), 2);
            assert!(replayed.torn.is_some());
        }
    }

    /// Issue 38 item 4: a segment whose creation a power cut (or an error)
    /// cut short holds no group; the torn tail before it is still a tail.
    /// It used to make the store refuse to open.
    #[test]
    fn empty_segments_after_a_torn_tail_are_ignored() {
        for empty in [
            &b""[..],
            &SEGMENT_MAGIC[..],
            &b"dedupWAL\x07\0\0\0"[..],
            &[0; 4096][..],
        ] {
            let dir = tempfile::tempdir().unwrap();
            let groups = [frames(1..3), frames(3..6)];
            let (path, starts) = write_groups(dir.path(), 1, 1, &groups);
            overwrite(&path, starts[1] + GROUP_HEADER_BYTES + 4, &[0; 16]);
            std::fs::write(segment_path(dir.path(), 2), empty).unwrap();
            let (seen, replayed) = collect(dir.path()).unwrap();
            assert_eq!(seen.len(), 2);
            assert!(replayed.torn.is_some());
            // A new writer starts after every segment found.
            assert_eq!(replayed.last_segment, 2);
            assert_eq!(replayed.next_group, 2);
        }
    }

    #[test]
    fn damage_before_the_last_segment_of_frames_only_refuses_to_open() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = frames(1..10);
        first[20] ^= 1;
        std::fs::write(segment_path(dir.path(), 1), &first).unwrap();
        std::fs::write(segment_path(dir.path(), 2), frames(10..12)).unwrap();
        let error = collect(dir.path()).unwrap_err();
        assert!(matches!(error, Error::Corrupt(_)), "{error}");
    }

    /// Segments of the format before group headers (a store upgraded in
    /// place) replay, a torn last frame ending them.
    #[test]
    fn segments_of_frames_only_still_replay() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(segment_path(dir.path(), 1), frames(1..10)).unwrap();
        let mut last = frames(10..13);
        last.truncate(last.len() - 3);
        std::fs::write(segment_path(dir.path(), 2), &last).unwrap();
        let (seen, replayed) = collect(dir.path()).unwrap();
        assert_eq!(seen.len(), 11);
        assert!(replayed.torn.is_some());
        assert_eq!(replayed.next_lsn, 12);
    }

    #[test]
    fn a_gap_in_lsns_or_group_numbers_refuses_to_open() {
        let dir = tempfile::tempdir().unwrap();
        write_groups(dir.path(), 1, 1, &[frames(1..10)]);
        write_groups(dir.path(), 2, 2, &[frames(11..12)]);
        assert!(matches!(collect(dir.path()), Err(Error::Corrupt(_))));
        let dir = tempfile::tempdir().unwrap();
        write_groups(dir.path(), 1, 1, &[frames(1..10)]);
        write_groups(dir.path(), 2, 3, &[frames(10..12)]);
        assert!(matches!(collect(dir.path()), Err(Error::Corrupt(_))));
    }

    #[test]
    fn a_group_larger_than_a_segment_gets_one_of_its_own_and_sealed_segments_go() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = Writer::create(dir.path(), 1, 1).unwrap();
        writer.write(&frames(1..3)).unwrap();
        let mut big = Vec::new();
        encode_frame(
            &mut big,
            3,
            Tree::Records,
            b"big",
            Some(&vec![7; SEGMENT_BYTES as usize]),
        );
        writer.write(&big).unwrap();
        writer.sync().unwrap();
        assert_eq!(writer.sequence(), 2);
        let sealed = writer.seal().unwrap();
        assert_eq!(sealed, 2);
        writer.write(&frames(4..6)).unwrap();
        writer.sync().unwrap();
        let (seen, _) = collect(dir.path()).unwrap();
        assert_eq!(seen.len(), 5);
        assert_eq!(remove_through(dir.path(), sealed).unwrap(), 2);
        let (seen, replayed) = collect(dir.path()).unwrap();
        assert_eq!(seen.iter().map(|frame| frame.0).collect::<Vec<_>>(), [4, 5]);
        assert_eq!(replayed.last_segment, 3);
        assert_eq!(replayed.next_group, 4);
    }

    /// The replay hands the store runs of at most `RUN_FRAMES` frames (or
    /// about `RUN_BYTES`), across groups and segments and splitting a
    /// group, in the log's order: what it holds is a run, not a segment.
    #[test]
    fn frames_are_applied_in_bounded_runs_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let total = 2 * RUN_FRAMES as u64 + 5;
        let middle = RUN_FRAMES as u64 + 100;
        write_groups(dir.path(), 1, 1, &[frames(1..10), frames(10..middle)]);
        write_groups(dir.path(), 2, 3, &[frames(middle..total + 1)]);
        let mut runs = Vec::new();
        let mut lsns = Vec::new();
        replay(dir.path(), |frames| {
            runs.push(frames.len());
            lsns.extend(frames.iter().map(|frame| frame.lsn));
            Ok(())
        })
        .unwrap();
        assert_eq!(runs, [RUN_FRAMES, RUN_FRAMES, 5]);
        assert_eq!(lsns, (1..=total).collect::<Vec<_>>());

        // Large values end a run by its bytes.
        let dir = tempfile::tempdir().unwrap();
        let value = vec![7; 1 << 20];
        let mut big = Vec::new();
        for lsn in 1..=6 {
            encode_frame(&mut big, lsn, Tree::Records, b"key", Some(&value));
        }
        write_groups(dir.path(), 1, 1, &[big]);
        let mut runs = Vec::new();
        replay(dir.path(), |frames| {
            runs.push(frames.len());
            Ok(())
        })
        .unwrap();
        assert_eq!(runs, [RUN_BYTES >> 20, 6 - (RUN_BYTES >> 20)]);
    }

    /// The search for a later group reads a segment a chunk at a time: a
    /// group whose header is cut by a chunk's end is still found.
    #[test]
    fn a_later_group_across_the_searchs_chunks_is_found() {
        for shift in 0..=4 {
            let dir = tempfile::tempdir().unwrap();
            // One frame in the damaged group, sized so that the later
            // group's magic starts `shift` bytes before the end of the
            // first chunk searched (which starts a byte after the damage).
            let frame_len = SCAN_BYTES - GROUP_HEADER_BYTES + 1 - shift;
            let value = vec![3; frame_len - HEADER_BYTES - FIXED_PAYLOAD_BYTES - 1];
            let mut damaged = Vec::new();
            encode_frame(&mut damaged, 3, Tree::Records, b"k", Some(&value));
            assert_eq!(damaged.len(), frame_len);
            let groups = [frames(1..3), damaged, frames(4..6)];
            let (path, starts) = write_groups(dir.path(), 1, 1, &groups);
            assert_eq!(starts[2] - (starts[1] + 1), SCAN_BYTES - shift);
            flip(&path, starts[1] + GROUP_HEADER_BYTES + 9);
            let error = collect(dir.path()).unwrap_err().to_string();
            assert!(
                error.contains(&format!("at byte {}", starts[1]))
                    && error.contains("a whole later group follows"),
                "shift {shift}: {error}"
            );
        }
    }

    /// Issue 38 item 3: a fresh data directory's log directory is created
    /// and its entry synced with it.
    #[test]
    fn the_writer_creates_the_log_directory() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join(WAL_DIR);
        let mut writer = Writer::create(&log, 1, 1).unwrap();
        writer.write(&frames(1..2)).unwrap();
        writer.sync().unwrap();
        assert_eq!(collect(&log).unwrap().0.len(), 1);
    }
}
