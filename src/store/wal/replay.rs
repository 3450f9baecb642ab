//! Recovery: reads the log's segments back at open and hands their frames,
//! checked, to the store in runs (the rules are in the parent module's
//! docs: where the log ends, and when it is damage instead).
//!
//! A segment is read a group at a time with positioned reads, never whole:
//! segments are preallocated to 16 MiB, and a replay that held one whole
//! (and every frame of it decoded) took 20 MB more at the open's peak than
//! the store's budget leaves (docs/memory.md). What it holds now is one
//! group and one run of checked frames waiting to be applied.

use std::{
    fs::File,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use super::{
    group_crc, segments, Frame, Tree, FIXED_PAYLOAD_BYTES, GROUP_HEADER_BYTES, HEADER_BYTES,
    LATER_GROUP_RANGE, SEGMENT_HEADER_BYTES, SEGMENT_MAGIC,
};
use crate::error::Error;

/// Frames applied as one run: the store keeps a last-change map per run
/// (see the replay in `SledStore::open_observed`), near 1 MB at this size.
pub(in crate::store) const RUN_FRAMES: usize = 16_384;
/// A run also ends once its frames hold this many bytes (large answers).
pub(super) const RUN_BYTES: usize = 4 << 20;
/// Bytes read at a time when a segment is searched (for a later group, or
/// for anything but zeros).
pub(super) const SCAN_BYTES: usize = 1 << 20;

/// What [`replay`] found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(in crate::store) struct Replayed {
    /// Frames read and checked (the caller may apply fewer).
    pub frames: u64,
    /// Bytes of those frames.
    pub bytes: u64,
    /// The last segment's sequence number (0: no segment).
    pub last_segment: u64,
    /// The LSN after the last frame applied.
    pub next_lsn: u64,
    /// The group number after the last group read (1: none).
    pub next_group: u64,
    /// Where the log ended on a torn group or frame, and why.
    pub torn: Option<(PathBuf, usize, &'static str)>,
}

/// Calls `apply` with the frames of the segments in `directory`, in
/// order, in runs of at most [`RUN_FRAMES`] frames, stopping at a torn
/// tail (see the parent module's docs). The log is read twice: first every
/// frame of every segment is checked (group numbers, checksums, LSNs, and
/// where each segment's groups end), keeping nothing; only then is any
/// frame applied. So a log the store refuses to open over leaves sled as
/// the crash left it — sled may hold changes newer than the damage, which
/// the log's older frames must not overwrite, and it is what an operator
/// moves aside or restores over.
pub(in crate::store) fn replay(
    directory: &Path,
    mut apply: impl FnMut(&[Frame<'_>]) -> Result<(), Error>,
) -> Result<Replayed, Error> {
    let segments = segments(directory)?;
    let last_sequence = segments.last().map_or(0, |(sequence, _)| *sequence);
    let mut lsns = LsnCheck::default();
    let mut next_group: Option<u64> = None;
    let mut group_buffer = Vec::new();
    let mut checked = Vec::with_capacity(segments.len());
    for (index, (sequence, path)) in segments.iter().enumerate() {
        let segment = Segment::open(path)?;
        let later = &segments[index + 1..];
        let magic = segment.group_magic()?;
        let ends = match magic {
            Some(magic) => check_groups(
                &segment,
                path,
                later,
                magic,
                (&mut next_group, &mut lsns),
                &mut group_buffer,
            )?,
            // The frames-only format from before group headers: small
            // segments of an old data directory, read whole.
            None => check_frames_only(&std::fs::read(path)?, path, later, &mut lsns)?,
        };
        let torn = ends.torn.is_some();
        checked.push((*sequence, path, magic, ends));
        if torn {
            break;
        }
    }

    let mut replayed = Replayed::default();
    let mut run = Run::default();
    for (sequence, path, magic, ends) in checked {
        match magic {
            Some(magic) => {
                let segment = Segment::open(path)?;
                let mut offset = SEGMENT_HEADER_BYTES;
                while offset < ends.end {
                    let GroupRead::Whole(group) =
                        group_at(&segment, offset, magic, &mut group_buffer)?
                    else {
                        return Err(changed(path, offset));
                    };
                    offset = group.next;
                    push_frames(group.frames, path, &mut run, &mut apply)?;
                }
                if offset != ends.end {
                    return Err(changed(path, offset));
                }
            }
            None => {
                let bytes = std::fs::read(path)?;
                let frames = bytes
                    .get(..ends.end)
                    .ok_or_else(|| changed(path, ends.end))?;
                push_frames(frames, path, &mut run, &mut apply)?;
            }
        }
        if let Some(what) = ends.torn {
            replayed.torn = Some((path.clone(), ends.end, what));
            // Later segments hold no group (checked); a new writer starts
            // after all of them.
            replayed.last_segment = last_sequence;
            break;
        }
        replayed.last_segment = sequence;
    }
    run.apply(&mut apply)?;
    replayed.frames = lsns.frames;
    replayed.bytes = lsns.bytes;
    replayed.next_lsn = lsns.expected.unwrap_or(1);
    replayed.next_group = next_group.unwrap_or(1);
    Ok(replayed)
}

/// A segment that no longer reads as it did a moment ago (the store holds
/// the data directory's lock: only something outside dedupd writes it).
fn changed(path: &Path, offset: usize) -> Error {
    Error::Corrupt(format!(
        "write-ahead log {} at byte {offset}: changed while it was replayed",
        path.display()
    ))
}

/// Where a segment's frames end, and why: `torn` when that is the log's
/// torn tail, `None` when the segment ended cleanly (zeros).
struct Checked {
    end: usize,
    torn: Option<&'static str>,
}

/// Checks every group of `segment` in order — numbers following `next`,
/// checksums, the LSNs of their frames — keeping nothing, and finds where
/// they end; corruption (a gap, damage inside a whole group, or a bad
/// group with a whole later one after it, here or in `later`) is an
/// error.
fn check_groups(
    segment: &Segment,
    path: &Path,
    later: &[(u64, PathBuf)],
    magic: u32,
    (next_group, lsns): (&mut Option<u64>, &mut LsnCheck),
    buffer: &mut Vec<u8>,
) -> Result<Checked, Error> {
    let mut offset = SEGMENT_HEADER_BYTES;
    loop {
        let stopped = match group_at(segment, offset, magic, buffer)? {
            GroupRead::Whole(group) if next_group.is_some_and(|next| group.number != next) => {
                return Err(Error::Corrupt(format!(
                    "write-ahead log {} at byte {offset}: group {} where {} was next; \
                     refusing to open over a log with a gap",
                    path.display(),
                    group.number,
                    next_group.unwrap_or_default()
                )));
            }
            GroupRead::Whole(group) => {
                check_group_frames(group.frames, path, offset, lsns)?;
                *next_group = Some(group.number + 1);
                offset = group.next;
                continue;
            }
            GroupRead::Zeros => None,
            GroupRead::Bad(what) => Some(what),
        };
        // The segment's groups end here: zeros, or a group that is not
        // whole. Either is the log's end only if no whole later group
        // follows: zeros, in this segment (they end a segment that was
        // full, and the next goes on); a bad group, in this segment or any
        // later one.
        let after = next_group.unwrap_or(0);
        let mut found = later_group(segment, offset + 1, after, magic)?.map(|at| (path, at));
        let in_later;
        if found.is_none() && stopped.is_some() {
            in_later = later_group_in(later, after)?;
            found = in_later
                .as_ref()
                .map(|(later_path, at)| (later_path.as_path(), *at));
        }
        return match found {
            Some((later_path, at)) => Err(Error::Corrupt(format!(
                "write-ahead log {} at byte {offset}: {}, and a whole later group follows \
                 ({} at byte {at}); refusing to open over a damaged log",
                path.display(),
                stopped.unwrap_or("zeros where a group was due"),
                later_path.display()
            ))),
            None => Ok(Checked {
                end: offset,
                torn: stopped,
            }),
        };
    }
}

/// Checks a segment of the frames-only format: a bad frame ends the log
/// only in the last segment that holds anything (it has no groups).
fn check_frames_only(
    bytes: &[u8],
    path: &Path,
    later: &[(u64, PathBuf)],
    lsns: &mut LsnCheck,
) -> Result<Checked, Error> {
    let mut offset = 0;
    loop {
        match decode_at(bytes, offset) {
            Decoded::Frame(frame, next) => {
                lsns.check(frame.lsn, path, offset)?;
                lsns.bytes += (next - offset) as u64;
                offset = next;
            }
            Decoded::End => {
                return Ok(Checked {
                    end: offset,
                    torn: None,
                })
            }
            Decoded::Bad(what) => {
                for (_, later_path) in later {
                    if Segment::open(later_path)?.holds_anything()? {
                        return Err(Error::Corrupt(format!(
                            "write-ahead log {} at byte {offset}: {what}, and later segments \
                             follow; refusing to open over a damaged log",
                            path.display()
                        )));
                    }
                }
                return Ok(Checked {
                    end: offset,
                    torn: Some(what),
                });
            }
        }
    }
}

/// One segment file, read piece by piece.
struct Segment {
    file: File,
    len: usize,
}

impl Segment {
    fn open(path: &Path) -> Result<Segment, Error> {
        let file = File::open(path)?;
        let len = usize::try_from(file.metadata()?.len())
            .map_err(|_| Error::Corrupt(format!("{} is too large to read", path.display())))?;
        Ok(Segment { file, len })
    }

    /// Reads `len` bytes at `offset` into `into` (replacing what it held),
    /// fewer where the file ends first.
    fn read(&self, offset: usize, len: usize, into: &mut Vec<u8>) -> Result<(), Error> {
        into.clear();
        into.resize(len.min(self.len.saturating_sub(offset)), 0);
        self.file.read_exact_at(into, offset as u64)?;
        Ok(())
    }

    /// The group magic of a segment written with group headers (`None`:
    /// the frames-only format before them, or a creation cut short).
    fn group_magic(&self) -> Result<Option<u32>, Error> {
        let mut header = Vec::with_capacity(SEGMENT_HEADER_BYTES);
        self.read(0, SEGMENT_HEADER_BYTES, &mut header)?;
        Ok(group_magic(&header))
    }

    /// Whether the segment holds anything past its header: one that does
    /// not is a creation cut short, and ignored.
    fn holds_anything(&self) -> Result<bool, Error> {
        let mut start = 0;
        let mut chunk = Vec::new();
        while start < self.len {
            self.read(start, SCAN_BYTES, &mut chunk)?;
            let from = if start == 0 && chunk.starts_with(SEGMENT_MAGIC) {
                SEGMENT_HEADER_BYTES.min(chunk.len())
            } else {
                0
            };
            if chunk[from..].iter().any(|&byte| byte != 0) {
                return Ok(true);
            }
            start += chunk.len();
        }
        Ok(false)
    }
}

/// The group magic in a segment's first bytes.
pub(super) fn group_magic(header: &[u8]) -> Option<u32> {
    let magic = header
        .strip_prefix(SEGMENT_MAGIC)?
        .get(..4)
        .map(|magic| u32::from_le_bytes(magic.try_into().expect("4 bytes")))?;
    (magic != 0).then_some(magic)
}

/// A group header read and checked against its frames.
struct Group<'a> {
    number: u64,
    frames: &'a [u8],
    /// The offset after the group.
    next: usize,
}

/// What [`group_at`] found.
enum GroupRead<'a> {
    Whole(Group<'a>),
    /// A header of zeros: the unwritten rest of a segment.
    Zeros,
    /// Not a whole group.
    Bad(&'static str),
}

/// Reads the group at `offset` of `segment`, its frames into `buffer`.
fn group_at<'a>(
    segment: &Segment,
    offset: usize,
    magic: u32,
    buffer: &'a mut Vec<u8>,
) -> Result<GroupRead<'a>, Error> {
    segment.read(offset, GROUP_HEADER_BYTES, buffer)?;
    let header: &[u8] = buffer;
    if header.iter().all(|&byte| byte == 0) {
        return Ok(GroupRead::Zeros);
    }
    if header.len() < GROUP_HEADER_BYTES {
        return Ok(GroupRead::Bad("a group header cut short"));
    }
    if u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) != magic {
        return Ok(GroupRead::Bad("no group header where one was due"));
    }
    let number = u64::from_le_bytes(header[4..12].try_into().expect("8 bytes"));
    let number_and_len: [u8; 12] = header[4..16].try_into().expect("12 bytes");
    let len = u32::from_le_bytes(header[12..16].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(header[16..20].try_into().expect("4 bytes"));
    let frames_at = offset + GROUP_HEADER_BYTES;
    // Checked before reading: a damaged length must not size the buffer.
    if len > segment.len.saturating_sub(frames_at) {
        return Ok(GroupRead::Bad("a group cut short"));
    }
    segment.read(frames_at, len, buffer)?;
    let frames: &[u8] = buffer;
    if group_crc(&number_and_len, frames) != crc {
        return Ok(GroupRead::Bad("a group whose checksum does not match"));
    }
    Ok(GroupRead::Whole(Group {
        number,
        frames,
        next: frames_at + len,
    }))
}

/// Whether a whole group numbered `after` or a little later starts
/// anywhere in `segment` from `from` on: the proof that what stopped the
/// replay before it was not the torn tail.
fn later_group(
    segment: &Segment,
    from: usize,
    after: u64,
    magic: u32,
) -> Result<Option<usize>, Error> {
    let pattern = magic.to_le_bytes();
    let range = after..after.saturating_add(LATER_GROUP_RANGE);
    let (mut chunk, mut group_buffer) = (Vec::new(), Vec::new());
    let mut start = from;
    while start + GROUP_HEADER_BYTES <= segment.len {
        segment.read(start, SCAN_BYTES, &mut chunk)?;
        let candidates = chunk
            .windows(pattern.len())
            .enumerate()
            .filter(|(_, window)| *window == pattern);
        for (at, _) in candidates {
            // The number first: a group far from `after` is not read whole
            // (it may be as long as the segment) to be dismissed.
            segment.read(start + at + 4, 8, &mut group_buffer)?;
            let number = <[u8; 8]>::try_from(group_buffer.as_slice())
                .map(u64::from_le_bytes)
                .ok();
            if !number.is_some_and(|number| range.contains(&number)) {
                continue;
            }
            if let GroupRead::Whole(_) = group_at(segment, start + at, magic, &mut group_buffer)? {
                return Ok(Some(start + at));
            }
        }
        // The next chunk starts where a pattern cut by this one's end does.
        start += chunk.len().saturating_sub(pattern.len() - 1).max(1);
    }
    Ok(None)
}

/// The first whole group numbered from `after` in the segments of `later`
/// (this runs only when the log has a bad group).
fn later_group_in(later: &[(u64, PathBuf)], after: u64) -> Result<Option<(PathBuf, usize)>, Error> {
    for (_, path) in later {
        let segment = Segment::open(path)?;
        if let Some(magic) = segment.group_magic()? {
            if let Some(at) = later_group(&segment, SEGMENT_HEADER_BYTES, after, magic)? {
                return Ok(Some((path.clone(), at)));
            }
        }
    }
    Ok(None)
}

/// Checks the frames of one whole group (its checksum matched: anything
/// wrong inside it is corruption, not a tear): each decodes, and the LSNs
/// follow.
fn check_group_frames(
    bytes: &[u8],
    path: &Path,
    group_offset: usize,
    lsns: &mut LsnCheck,
) -> Result<(), Error> {
    let mut offset = 0;
    while offset < bytes.len() {
        let Decoded::Frame(frame, next) = decode_at(bytes, offset) else {
            return Err(Error::Corrupt(format!(
                "write-ahead log {} at byte {group_offset}: a group whose checksum matches \
                 holds a frame that does not decode; refusing to open over a damaged log",
                path.display()
            )));
        };
        lsns.check(frame.lsn, path, group_offset)?;
        lsns.bytes += (next - offset) as u64;
        offset = next;
    }
    Ok(())
}

/// Adds frames already checked to `run`, one by one.
fn push_frames(
    bytes: &[u8],
    path: &Path,
    run: &mut Run,
    apply: &mut impl FnMut(&[Frame<'_>]) -> Result<(), Error>,
) -> Result<(), Error> {
    let mut offset = 0;
    while offset < bytes.len() {
        let Decoded::Frame(_, next) = decode_at(bytes, offset) else {
            return Err(Error::Corrupt(format!(
                "write-ahead log {}: a frame checked a moment ago no longer decodes",
                path.display()
            )));
        };
        run.push(&bytes[offset..next], apply)?;
        offset = next;
    }
    Ok(())
}

/// Frames checked and not yet applied, as they were encoded.
#[derive(Default)]
struct Run {
    bytes: Vec<u8>,
    frames: usize,
}

impl Run {
    /// Adds one checked frame, applying the run once it is full.
    fn push(
        &mut self,
        frame: &[u8],
        apply: &mut impl FnMut(&[Frame<'_>]) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.bytes.extend_from_slice(frame);
        self.frames += 1;
        if self.frames >= RUN_FRAMES || self.bytes.len() >= RUN_BYTES {
            self.apply(apply)?;
        }
        Ok(())
    }

    /// Applies the frames held, if any, and empties the run.
    fn apply(
        &mut self,
        apply: &mut impl FnMut(&[Frame<'_>]) -> Result<(), Error>,
    ) -> Result<(), Error> {
        if self.frames == 0 {
            return Ok(());
        }
        let mut frames = Vec::with_capacity(self.frames);
        let mut offset = 0;
        while offset < self.bytes.len() {
            let Decoded::Frame(frame, next) = decode_at(&self.bytes, offset) else {
                unreachable!("a run holds only frames that decoded");
            };
            frames.push(frame);
            offset = next;
        }
        apply(&frames)?;
        drop(frames);
        self.bytes.clear();
        self.frames = 0;
        // A run of large answers is not kept between runs.
        self.bytes.shrink_to(RUN_BYTES);
        Ok(())
    }
}

/// Frames counted and their LSNs checked to rise by one.
#[derive(Default)]
struct LsnCheck {
    expected: Option<u64>,
    frames: u64,
    bytes: u64,
}

impl LsnCheck {
    fn check(&mut self, lsn: u64, path: &Path, offset: usize) -> Result<(), Error> {
        if let Some(expected) = self.expected {
            if lsn != expected {
                return Err(Error::Corrupt(format!(
                    "write-ahead log {} at byte {offset}: LSN {lsn} where {expected} was next; \
                     refusing to open over a log with a gap",
                    path.display()
                )));
            }
        }
        self.expected = Some(lsn + 1);
        self.frames += 1;
        Ok(())
    }
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
