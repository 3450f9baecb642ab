//! The free-space guard of an embedded store: writes are refused while the
//! filesystem holding the data has less than a reserve free, so the store's
//! own writes never meet a full disk (sled 0.34 wedges its flush for good
//! when a log write fails with ENOSPC). Reads, and writes that change
//! nothing, never ask; deletes may go on down to half the reserve, so the
//! reaper can still make room. The figure is read with `statvfs`, at most
//! every [`REFRESH`] while space is plentiful and on every write once it is
//! within twice the reserve. With a write-ahead log, a Put also needs room
//! for the log not yet checkpointed ([`DiskSpace::owe`]): a restart replays
//! it into sled, which must not meet a full disk either.
//!
//! Some filesystems cannot say how much is free: FUSE ones such as LazyFS,
//! some network ones, answer `statvfs` with all zeros. Zero *total* blocks is
//! not a full disk but an unknown one ([`Capacity::Unknown`]): the guard
//! says so once and stands aside, and what protects the store there is
//! what can be known — a failed write is an error, never an acknowledgement.

use std::{
    io,
    path::PathBuf,
    sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    time::{Duration, Instant},
};

use crate::{api::human_bytes, error::Error};

/// How old the free-space figure may be while space is plentiful.
const REFRESH: Duration = Duration::from_millis(100);

/// What a write is about to do to the store's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteKind {
    /// Stores a record: needs the full reserve free.
    Put,
    /// Removes one: allowed down to half the reserve.
    Delete,
}

/// What `statvfs` tells of a filesystem's free space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Capacity {
    /// Bytes free for unprivileged writers.
    Known(u64),
    /// The filesystem reports no size at all (every figure zero).
    Unknown,
}

impl Capacity {
    /// Reads the filesystem holding `path`.
    pub(crate) fn of(path: &std::path::Path) -> io::Result<Capacity> {
        let stat = rustix::fs::statvfs(path)?;
        Ok(Capacity::from_figures(
            stat.f_blocks,
            stat.f_bavail,
            stat.f_frsize,
        ))
    }

    /// A filesystem of zero blocks (or zero-byte blocks) holds nothing, so
    /// it is not reporting: a real full disk still counts its blocks.
    fn from_figures(blocks: u64, available: u64, fragment: u64) -> Capacity {
        if blocks == 0 || fragment == 0 {
            Capacity::Unknown
        } else {
            Capacity::Known(available.saturating_mul(fragment))
        }
    }

    /// Whether at least `bytes` are known to be free (`None`: unknown).
    pub(crate) fn has_room(self, bytes: u64) -> Option<bool> {
        match self {
            Capacity::Known(free) => Some(free >= bytes),
            Capacity::Unknown => None,
        }
    }
}

/// Free space of one filesystem against a reserve.
#[derive(Debug)]
pub(crate) struct DiskSpace {
    path: PathBuf,
    reserve: u64,
    free: AtomicU64,
    /// Bytes of write-ahead log that a replay may still write into sled.
    owed: AtomicU64,
    /// When `free` was last read: microseconds after `epoch`, plus one (0:
    /// never). An atomic, not a lock: every write asks.
    checked_at: AtomicU64,
    epoch: Instant,
    /// Set once the filesystem was found not to report its size (warned once).
    unknown: AtomicBool,
}

impl DiskSpace {
    /// Watches the filesystem holding `path`; `reserve` 0 turns the guard off.
    pub(crate) fn new(path: PathBuf, reserve: u64) -> Self {
        DiskSpace {
            path,
            reserve,
            free: AtomicU64::new(u64::MAX),
            owed: AtomicU64::new(0),
            checked_at: AtomicU64::new(0),
            epoch: Instant::now(),
            unknown: AtomicBool::new(false),
        }
    }

    /// `bytes` more of log a replay may have to write into sled.
    pub(crate) fn owe(&self, bytes: u64) {
        self.owed.fetch_add(bytes, Relaxed);
    }

    /// `bytes` of log a checkpoint made sled hold (and deleted).
    pub(crate) fn settle(&self, bytes: u64) {
        let _ = self
            .owed
            .fetch_update(Relaxed, Relaxed, |owed| Some(owed.saturating_sub(bytes)));
    }

    /// Whether free space (as last read) is within twice what a Put needs:
    /// time to checkpoint early, so the log's space comes back.
    pub(crate) fn tight(&self) -> bool {
        self.reserve > 0
            && self.free()
                < self
                    .reserve
                    .saturating_add(self.owed.load(Relaxed))
                    .saturating_mul(2)
    }

    /// Bytes free for unprivileged writers, as last read.
    pub(crate) fn free(&self) -> u64 {
        self.free.load(Relaxed)
    }

    fn micros_since_epoch(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Reads the free space now; a filesystem that does not report it
    /// counts as having room (warned once), see the module docs.
    pub(crate) fn refresh(&self) -> io::Result<u64> {
        let free = match Capacity::of(&self.path)? {
            Capacity::Known(free) => free,
            Capacity::Unknown => {
                if self.reserve > 0 && !self.unknown.swap(true, Relaxed) {
                    tracing::warn!(
                        path = %self.path.display(),
                        "the data directory's filesystem does not report its free space \
                         (statvfs answers zeros); the --disk-reserve guard stands aside \
                         and a failed write is refused as an error"
                    );
                }
                u64::MAX
            }
        };
        self.free.store(free, Relaxed);
        self.checked_at
            .store(self.micros_since_epoch().saturating_add(1), Relaxed);
        Ok(free)
    }

    fn current(&self) -> io::Result<u64> {
        let cached = self.free();
        let checked_at = self.checked_at.load(Relaxed);
        let fresh = checked_at > 0
            && self.micros_since_epoch().saturating_sub(checked_at - 1)
                < REFRESH.as_micros() as u64;
        if fresh
            && cached
                > self
                    .reserve
                    .saturating_add(self.owed.load(Relaxed))
                    .saturating_mul(2)
        {
            Ok(cached)
        } else {
            self.refresh()
        }
    }

    /// `Ok` when a write of `kind` leaves the reserve alone; otherwise
    /// [`Error::DiskFull`], which changes nothing.
    pub(crate) fn admit(&self, kind: WriteKind) -> Result<(), Error> {
        if self.reserve == 0 {
            return Ok(());
        }
        let owed = self.owed.load(Relaxed);
        let needed = match kind {
            WriteKind::Put => self.reserve.saturating_add(owed),
            WriteKind::Delete => self.reserve / 2,
        };
        let free = self.current()?;
        if free >= needed {
            return Ok(());
        }
        Err(Error::DiskFull(io::Error::new(
            io::ErrorKind::StorageFull,
            if owed > 0 && kind == WriteKind::Put {
                format!(
                    "{} free on the data directory's filesystem, below the --disk-reserve of {} \
                     plus {} of write-ahead log not yet checkpointed",
                    human_bytes(free),
                    human_bytes(self.reserve),
                    human_bytes(owed)
                )
            } else {
                format!(
                    "{} free on the data directory's filesystem, below the --disk-reserve of {}",
                    human_bytes(free),
                    human_bytes(self.reserve)
                )
            },
        )))
    }

    /// `Ok` while writes are admitted; for health reports.
    pub(crate) fn writable(&self) -> Result<(), Error> {
        self.admit(WriteKind::Put)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filesystem_reporting_zeros_is_unknown_not_full() {
        assert_eq!(Capacity::from_figures(0, 0, 0), Capacity::Unknown);
        assert_eq!(Capacity::from_figures(0, 0, 4096), Capacity::Unknown);
        assert_eq!(Capacity::from_figures(1000, 0, 4096), Capacity::Known(0));
        assert_eq!(
            Capacity::from_figures(1000, 10, 4096),
            Capacity::Known(40960)
        );
        assert_eq!(Capacity::Unknown.has_room(1), None);
        assert_eq!(Capacity::Known(10).has_room(11), Some(false));
    }
}
