//! Time, injected: every rule that depends on "now" asks a [`Clock`], so lease
//! and retention behaviour is tested with a [`ManualClock`] instead of sleeps.

use std::{
    fmt,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// Milliseconds since the Unix epoch: the only time unit records store, so a
/// record means the same thing on every store and across restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct UnixMillis(pub u64);

impl UnixMillis {
    /// `self + duration`, saturating instead of overflowing.
    pub fn saturating_add(self, duration: Duration) -> UnixMillis {
        let millis = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        UnixMillis(self.0.saturating_add(millis))
    }

    /// The time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: UnixMillis) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    /// As a [`SystemTime`], for display and protobuf timestamps.
    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0)
    }
}

impl fmt::Display for UnixMillis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}",
            humantime::format_rfc3339_millis(self.to_system_time())
        )
    }
}

/// A source of the current time.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current wall-clock time.
    fn now(&self) -> UnixMillis;

    /// `Ok` while [`Clock::now`] can be trusted for a decision; why not
    /// otherwise (a store's clock not measured recently enough: see
    /// [`crate::time_policy`]).
    fn verify(&self) -> Result<(), String> {
        Ok(())
    }

    /// How this clock relates to the pod's own, for metrics; `None` for the
    /// pod's own clock.
    fn report(&self) -> Option<ClockReport> {
        None
    }
}

/// A clock measured against another's (see [`crate::time_policy`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClockReport {
    /// This pod's wall clock minus the measured clock.
    pub local_offset_seconds: f64,
    /// How far the measured clock's estimate may be off.
    pub uncertainty_seconds: f64,
}

/// The real wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> UnixMillis {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        UnixMillis(u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to; clones share the same time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    millis: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: UnixMillis) -> Self {
        ManualClock {
            millis: Arc::new(AtomicU64::new(start.0)),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let millis = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.millis.fetch_add(millis, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> UnixMillis {
        UnixMillis(self.millis.load(Ordering::SeqCst))
    }
}
