//! The embedded store's write-ahead log: where a change becomes durable.
//!
//! sled's own log is synced with `sync_file_range` (no metadata, no power
//! loss) and waiting for its flush costs a device round trip of its own, so
//! `sync = always` does not rely on it: every change sled makes is also
//! framed here, and an answer waits for one `fdatasync` of this log, shared
//! by every caller of the same group commit. sled is written without
//! waiting and made durable only at a *checkpoint* (its flush, then a sync
//! of its files), after which the log segments before it are deleted; at
//! open, whatever the segments still hold is replayed into sled.
//!
//! Layout: `wal/<sequence>.wal` in the data directory, each segment
//! preallocated (`fallocate`) so that a sync writes data, not the file's
//! size. A frame is `[payload length u32][CRC32C of payload u32][payload]`,
//! the payload `[LSN u64][tree u8][op u8][key length u32][key][value]`, all
//! little-endian. LSNs rise by one from frame to frame across segments:
//! frames are appended under the same lock as sled's compare-and-swap, so
//! the log's order is the order changes were made, and replaying it in
//! order ends each key at its last logged value (no revision compare is
//! needed; a newer value sled already holds that the log lost was never
//! acknowledged).
//!
//! Recovery reads every segment: a bad frame (zero length, short, CRC
//! mismatch) in the last segment is a torn tail — a group whose sync never
//! returned, so nobody was answered — and ends the log there; anything
//! wrong in an earlier segment, or an LSN out of sequence, is corruption
//! of acknowledged data, and the store refuses to open.

use std::{
    fs::{File, OpenOptions},
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use crate::error::Error;

/// The log's directory inside the data directory.
pub(super) const WAL_DIR: &str = "wal";

/// Preallocated size of a segment (a group larger than this gets a segment
/// of its own size).
pub(super) const SEGMENT_BYTES: u64 = 16 << 20;

/// A segment is preallocated only while this many times its size is free.
const PREALLOCATE_ROOM_FACTOR: u64 = 4;

const HEADER_BYTES: usize = 8;
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
    fn from_byte(byte: u8) -> Option<Tree> {
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

/// What decoding at one offset found.
#[derive(Debug, PartialEq, Eq)]
enum Decoded<'a> {
    /// A whole frame, and the offset after it.
    Frame(Frame<'a>, usize),
    /// Zeros: the preallocated rest of a segment.
    End,
    /// Not a frame: short, wrong checksum, or unreadable payload.
    Bad(&'static str),
}

fn decode_at(bytes: &[u8], offset: usize) -> Decoded<'_> {
    let rest = &bytes[offset..];
    if rest.len() < HEADER_BYTES {
        return if rest.iter().all(|&byte| byte == 0) {
            Decoded::End
        } else {
            Decoded::Bad("a frame header cut short")
        };
    }
    let payload_len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
    if payload_len == 0 {
        return if crc == 0 {
            Decoded::End
        } else {
            Decoded::Bad("a frame of length zero")
        };
    }
    if payload_len < FIXED_PAYLOAD_BYTES {
        return Decoded::Bad("a frame shorter than its fixed fields");
    }
    let Some(payload) = rest.get(HEADER_BYTES..HEADER_BYTES + payload_len) else {
        return Decoded::Bad("a frame cut short");
    };
    if crc32c::crc32c(payload) != crc {
        return Decoded::Bad("a frame whose checksum does not match");
    }
    let lsn = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"));
    let Some(tree) = Tree::from_byte(payload[8]) else {
        return Decoded::Bad("a frame naming an unknown tree");
    };
    let put = match payload[9] {
        0 => false,
        1 => true,
        _ => return Decoded::Bad("a frame with an unknown operation"),
    };
    let key_len = u32::from_le_bytes(payload[10..14].try_into().expect("4 bytes")) as usize;
    let Some(key) = payload.get(FIXED_PAYLOAD_BYTES..FIXED_PAYLOAD_BYTES + key_len) else {
        return Decoded::Bad("a frame whose key runs past its end");
    };
    let value = &payload[FIXED_PAYLOAD_BYTES + key_len..];
    if !put && !value.is_empty() {
        return Decoded::Bad("a removal carrying a value");
    }
    Decoded::Frame(
        Frame {
            lsn,
            tree,
            key,
            value: put.then_some(value),
        },
        offset + HEADER_BYTES + payload_len,
    )
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

/// What [`replay`] found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Replayed {
    /// Frames read and checked (the caller may apply fewer).
    pub frames: u64,
    /// Bytes of those frames.
    pub bytes: u64,
    /// The last segment's sequence number (0: no segment).
    pub last_segment: u64,
    /// The LSN after the last frame applied.
    pub next_lsn: u64,
    /// Where the log ended on a torn frame, and why.
    pub torn: Option<(PathBuf, usize, &'static str)>,
}

/// Calls `apply` with the frames of each segment in `directory`, segment
/// by segment, in order, stopping at a torn tail (see the module docs).
/// Every frame is checked before any of its segment is applied.
pub(super) fn replay(
    directory: &Path,
    mut apply: impl FnMut(&[Frame<'_>]) -> Result<(), Error>,
) -> Result<Replayed, Error> {
    let segments = segments(directory)?;
    let mut replayed = Replayed::default();
    let mut expected_lsn: Option<u64> = None;
    for (index, (sequence, path)) in segments.iter().enumerate() {
        let last = index + 1 == segments.len();
        let bytes = std::fs::read(path)?;
        let mut offset = 0;
        let mut frames = Vec::new();
        loop {
            match decode_at(&bytes, offset) {
                Decoded::Frame(frame, next) => {
                    if let Some(expected) = expected_lsn {
                        if frame.lsn != expected {
                            return Err(Error::Corrupt(format!(
                                "write-ahead log {} at byte {offset}: LSN {} where {expected} \
                                 was next; refusing to open over a log with a gap",
                                path.display(),
                                frame.lsn
                            )));
                        }
                    }
                    expected_lsn = Some(frame.lsn + 1);
                    replayed.frames += 1;
                    replayed.bytes += (next - offset) as u64;
                    frames.push(frame);
                    offset = next;
                }
                Decoded::End => break,
                Decoded::Bad(what) if last => {
                    replayed.torn = Some((path.clone(), offset, what));
                    break;
                }
                Decoded::Bad(what) => {
                    return Err(Error::Corrupt(format!(
                        "write-ahead log {} at byte {offset}: {what}, and later segments \
                         follow; refusing to open over a damaged log",
                        path.display()
                    )));
                }
            }
        }
        apply(&frames)?;
        replayed.last_segment = *sequence;
    }
    replayed.next_lsn = expected_lsn.unwrap_or(1);
    Ok(replayed)
}

/// The segment being written, owned by the committer thread.
#[derive(Debug)]
pub(super) struct Writer {
    directory: PathBuf,
    file: File,
    sequence: u64,
    offset: u64,
    capacity: u64,
    /// Bytes written since the last seal.
    pub since_seal: u64,
}

impl Writer {
    /// Starts segment `sequence` (the ones before it must already be
    /// replayed or gone).
    pub(super) fn create(directory: &Path, sequence: u64) -> Result<Writer, Error> {
        std::fs::create_dir_all(directory)?;
        let (file, capacity) = new_segment(directory, sequence, SEGMENT_BYTES)?;
        Ok(Writer {
            directory: directory.to_path_buf(),
            file,
            sequence,
            offset: 0,
            capacity,
            since_seal: 0,
        })
    }

    /// The segment being written.
    #[cfg(test)]
    pub(super) fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Writes `frames` (whole frames) after what is there, moving to a new
    /// segment first when they do not fit. Not synced.
    pub(super) fn write(&mut self, frames: &[u8]) -> Result<(), Error> {
        if frames.is_empty() {
            return Ok(());
        }
        let len = frames.len() as u64;
        if self.offset + len > self.capacity && self.offset > 0 {
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
        self.file.write_all_at(frames, self.offset)?;
        self.offset += len;
        self.since_seal += len;
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
        let (file, capacity) = new_segment(&self.directory, sequence, SEGMENT_BYTES.max(at_least))?;
        self.file = file;
        self.sequence = sequence;
        self.offset = 0;
        self.capacity = capacity;
        Ok(())
    }
}

/// Creates a preallocated segment and makes its name durable. Preallocation
/// that the filesystem refuses (no `fallocate`, or short of space: the disk
/// reserve refuses writes before that) leaves a segment that grows as it is
/// written, which costs each sync a metadata update but loses nothing.
fn new_segment(directory: &Path, sequence: u64, size: u64) -> Result<(File, u64), Error> {
    let path = segment_path(directory, sequence);
    let created = create_segment(directory, &path, size);
    if created.is_err() {
        // A segment left behind would make the current one not the last,
        // and a torn tail there would then read as damage.
        let _ = std::fs::remove_file(&path);
    }
    created
}

fn create_segment(directory: &Path, path: &Path, size: u64) -> Result<(File, u64), Error> {
    // Truncated, not refused, if it exists: a segment of a sequence above
    // every one replayed is what an earlier failed start of it left.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    // Only with room to spare: a filesystem may take the space page by page
    // before it refuses (tmpfs does), and sled must never see a full disk,
    // not even for a moment.
    let room = rustix::fs::statvfs(directory)
        .map(|stat| stat.f_bavail.saturating_mul(stat.f_frsize))
        .unwrap_or(0);
    let preallocated = if room >= size.saturating_mul(PREALLOCATE_ROOM_FACTOR) {
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, size)
            .map_err(io::Error::from)
    } else {
        Err(io::Error::new(
            io::ErrorKind::StorageFull,
            "less free space than preallocating should leave",
        ))
    };
    let capacity = match preallocated {
        Ok(()) => {
            file.sync_all()?;
            size
        }
        Err(error) => {
            tracing::warn!(%error, segment = %path.display(), "log segment not preallocated");
            u64::MAX
        }
    };
    sync_directory(directory)?;
    Ok((file, capacity))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn write_segment(directory: &Path, sequence: u64, frames: &[u8]) -> PathBuf {
        let mut writer = Writer::create(directory, sequence).unwrap();
        writer.write(frames).unwrap();
        writer.sync().unwrap();
        segment_path(directory, sequence)
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
    fn frames_written_in_segments_replay_in_order_with_removals() {
        let dir = tempfile::tempdir().unwrap();
        write_segment(dir.path(), 1, &frames(1..50));
        write_segment(dir.path(), 2, &frames(50..60));
        let (seen, replayed) = collect(dir.path()).unwrap();
        assert_eq!(seen.len(), 59);
        assert_eq!(seen[0], (1, b"key-1".to_vec(), Some(b"value-1".to_vec())));
        assert_eq!(seen[4], (5, b"key-5".to_vec(), None));
        assert_eq!(replayed.next_lsn, 60);
        assert_eq!(replayed.last_segment, 2);
        assert_eq!(replayed.torn, None);
    }

    /// Every cut of the last frame (a write the power took half of) ends
    /// the log at the frame before it.
    #[test]
    fn a_torn_tail_ends_the_log_at_the_last_whole_frame() {
        let whole = frames(1..4);
        let two = frames(1..3).len();
        for cut in two + 1..whole.len() {
            let dir = tempfile::tempdir().unwrap();
            write_segment(dir.path(), 1, &whole[..cut]);
            let (seen, replayed) = collect(dir.path()).unwrap();
            assert_eq!(seen.len(), 2, "cut at {cut}");
            assert!(replayed.torn.is_some(), "cut at {cut}");
            assert_eq!(replayed.next_lsn, 3);
        }
    }

    /// A flipped bit anywhere in the last frame fails its checksum; the
    /// frames before it stand.
    #[test]
    fn a_corrupted_last_frame_is_dropped_by_its_checksum() {
        let whole = frames(1..4);
        let two = frames(1..3).len();
        for at in two..whole.len() {
            let mut damaged = whole.clone();
            damaged[at] ^= 0x10;
            let dir = tempfile::tempdir().unwrap();
            write_segment(dir.path(), 1, &damaged);
            let (seen, replayed) = collect(dir.path()).unwrap();
            assert_eq!(seen.len(), 2, "bit flipped at {at}");
            assert!(replayed.torn.is_some());
        }
    }

    #[test]
    fn damage_before_the_last_segment_refuses_to_open() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = frames(1..10);
        first[20] ^= 1;
        write_segment(dir.path(), 1, &first);
        write_segment(dir.path(), 2, &frames(10..12));
        let error = collect(dir.path()).unwrap_err();
        assert!(matches!(error, Error::Corrupt(_)), "{error}");
    }

    #[test]
    fn a_gap_in_lsns_refuses_to_open() {
        let dir = tempfile::tempdir().unwrap();
        write_segment(dir.path(), 1, &frames(1..10));
        write_segment(dir.path(), 2, &frames(11..12));
        assert!(matches!(collect(dir.path()), Err(Error::Corrupt(_))));
    }

    #[test]
    fn a_group_larger_than_a_segment_gets_one_of_its_own_and_sealed_segments_go() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = Writer::create(dir.path(), 1).unwrap();
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
    }
}
