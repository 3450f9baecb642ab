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

/// "Now" as a clock can vouch for it: the true time lies within
/// [`earliest`, `latest`] (SPEC §5). Every decision takes the end that is
/// safe: a lease or a retention lasts until `earliest` is past its end, so
/// no pod takes it for over while it may still run by another's reckoning;
/// new ends are set from `latest`, so none ends sooner than asked by
/// anyone's. Two pods whose estimates differ within their bounds therefore
/// never both hold a key.
///
/// [`earliest`]: Now::earliest
/// [`latest`]: Now::latest
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// The true time is this or later.
    pub earliest: UnixMillis,
    /// The true time is this or earlier.
    pub latest: UnixMillis,
}

impl Now {
    /// A time known exactly (one pod's own clock: one clock, no doubt).
    pub fn exact(at: UnixMillis) -> Now {
        Now {
            earliest: at,
            latest: at,
        }
    }

    /// Whether `end` may still be ahead: a lease or retention ending then
    /// still holds.
    pub fn before(&self, end: UnixMillis) -> bool {
        self.earliest < end
    }

    /// An end `after` from now, by the latest reckoning.
    pub fn plus(&self, after: Duration) -> UnixMillis {
        self.latest.saturating_add(after)
    }

    /// How long until `end` has surely passed.
    pub fn until(&self, end: UnixMillis) -> Duration {
        end.saturating_since(self.earliest)
    }
}

impl From<UnixMillis> for Now {
    fn from(at: UnixMillis) -> Now {
        Now::exact(at)
    }
}

/// A source of the current time.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current wall-clock time (the clock's best estimate).
    fn now(&self) -> UnixMillis;

    /// The current time as an interval the true time lies in; a clock that
    /// knows it exactly (the pod's own, for its own store) answers a point.
    fn interval(&self) -> Now {
        Now::exact(self.now())
    }

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
    /// How far the measured clock's estimate may be off (a step of it
    /// included, while it widens the interval).
    pub uncertainty_seconds: f64,
    /// Steps of the measured clock seen so far.
    pub steps: u64,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interval_ends_a_lease_late_and_sets_ends_late() {
        let now = Now {
            earliest: UnixMillis(1_000),
            latest: UnixMillis(2_000),
        };
        assert!(now.before(UnixMillis(1_001)));
        assert!(!now.before(UnixMillis(1_000)));
        assert_eq!(now.plus(Duration::from_millis(500)), UnixMillis(2_500));
        assert_eq!(now.until(UnixMillis(1_600)), Duration::from_millis(600));
        assert_eq!(Now::from(UnixMillis(7)), Now::exact(UnixMillis(7)));
    }
}
