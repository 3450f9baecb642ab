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

use std::{
    io,
    path::PathBuf,
    sync::atomic::{AtomicU64, Ordering::Relaxed},
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

    /// Reads the free space now.
    pub(crate) fn refresh(&self) -> io::Result<u64> {
        let stat = rustix::fs::statvfs(&self.path)?;
        let free = stat.f_bavail.saturating_mul(stat.f_frsize);
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
