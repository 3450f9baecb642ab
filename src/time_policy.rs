//! The time policy (docs/protocol.md, "Time"), in one place: on a shared
//! store every decision that compares with "now" — is a lease live, is a
//! retention over, what the reaper deletes, a Redis time to live — is taken
//! by the *store's* clock, never by the pod's. Pods whose own clocks
//! disagree by minutes still agree on every lease.
//!
//! [`StoreClock`] is that clock. Once a second it asks the store for its time
//! (PostgreSQL's `clock_timestamp()`, Redis's `TIME`) and relates the answer
//! to this process's monotonic clock, NTP-style: the store read its clock
//! somewhere within the round trip, so the estimate is the answer placed at
//! the round trip's middle, uncertain by half the round trip. Between
//! measurements the estimate advances with the monotonic clock, and its
//! uncertainty grows by [`DRIFT_PER_SECOND`]. The pod's wall clock is never
//! read for a decision: a step of it (NTP, a resumed VM, an operator) is only
//! reported.
//!
//! While the estimate cannot be trusted within `--max-clock-uncertainty`
//! (never measured, no answer from the store for [`MAX_MEASUREMENT_AGE`], or
//! round trips too slow to tell), [`Clock::verify`] fails: calls answer
//! `UNAVAILABLE` and health is `NOT_SERVING`, rather than deciding on a wrong
//! clock.
//!
//! Decisions take the estimate as an interval ([`Clock::interval`]: the
//! estimate, give or take its uncertainty), each at its safe end (see
//! [`crate::clock::Now`]): a lease ends when the earliest the store's time
//! may be is past it, and is set from the latest. Two pods at opposite ends
//! of the bound still never both hold a key; a lease may last up to four
//! times the bound longer than asked, never shorter.
//!
//! A step of the store's clock (a failover to a server whose clock is
//! ahead, an operator) is taken at once, as the new truth; but leases were
//! set by the old clock, and other pods have not measured the new one yet.
//! So for the longest lease after it the interval is widened by the step on
//! both sides: no lease ends early by the new clock, and no new end is set
//! early for a pod still on the old one. Each step is logged and counted
//! (`dedupd_store_clock_steps_total`).
//!
//! The embedded sled store keeps the pod's clock: one pod, one clock.

use std::{
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::SeqCst},
        Arc, RwLock,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use crate::{
    clock::{Clock, ClockReport, Now, SystemClock, UnixMillis},
    error::Error,
};

/// How often the store's clock is measured.
pub const MEASURE_EVERY: Duration = Duration::from_secs(1);

/// Longest the store may leave a clock reading unanswered: past it
/// decisions stop until the next answer.
pub const MAX_MEASUREMENT_AGE: Duration = Duration::from_secs(30);

/// How fast the store's clock and this pod's monotonic clock may drift
/// apart between measurements, in parts per million: NTP slews a clock by
/// at most 500 ppm, and oscillators drift by far less.
pub const DRIFT_PER_SECOND: u64 = 500;

/// A change of the pod's wall clock against the store's larger than this is
/// logged as a step.
const STEP_REPORTED: Duration = Duration::from_secs(1);

/// A store that can tell its time.
pub trait TimeSource: Send + Sync + 'static {
    /// The store's clock, read in one round trip (bounded by the store's
    /// timeout), with the moments that round trip began and ended — taken
    /// around the exchange alone, not around waiting for a connection.
    fn read_clock(&self) -> impl Future<Output = Result<ClockReading, Error>> + Send;
}

/// One answer of a store's clock.
#[derive(Debug, Clone, Copy)]
pub struct ClockReading {
    /// When the question was sent.
    pub sent: Instant,
    /// The store's clock, in µs since the Unix epoch.
    pub store_micros: u64,
    /// When the answer came.
    pub received: Instant,
}

/// One reading of the store's clock, placed on this process's monotonic
/// clock.
#[derive(Debug, Clone, Copy)]
struct Measurement {
    /// The store's time at `at`, in µs.
    store_micros: u64,
    /// The middle of the round trip.
    at: Instant,
    /// Half the round trip: how far from `at` the store may have read.
    half_round_trip: Duration,
}

impl Measurement {
    fn store_micros_at(&self, when: Instant) -> u64 {
        match when.checked_duration_since(self.at) {
            Some(after) => self.store_micros.saturating_add(micros(after)),
            None => self
                .store_micros
                .saturating_sub(micros(self.at.duration_since(when))),
        }
    }

    fn uncertainty_at(&self, when: Instant) -> Duration {
        let age = when.saturating_duration_since(self.at);
        self.half_round_trip + Duration::from_micros(micros(age) * DRIFT_PER_SECOND / 1_000_000)
    }
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

fn wall_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, micros)
}

/// The store's clock, as measured from this pod (see the module's text).
pub struct StoreClock {
    max_uncertainty: Duration,
    /// How long a step widens the interval: the longest lease.
    widen_for: Duration,
    measured: RwLock<Option<Measurement>>,
    /// The largest step still widening the interval, and until when.
    step: RwLock<Option<(Duration, Instant)>>,
    /// Steps seen.
    steps: AtomicU64,
    /// This pod's wall clock, in µs since the Unix epoch (a test's own).
    wall: fn() -> u64,
    /// When the store last answered a reading, kept or not: a store that
    /// answers is not silent, even while its round trips are too slow to
    /// improve on the kept reading.
    last_heard: RwLock<Option<Instant>>,
    /// This pod's wall clock minus the store's, in µs, at the last
    /// measurement (for metrics and step reports).
    local_offset_micros: AtomicI64,
    /// Whether `local_offset_micros` holds a measurement yet.
    offset_known: AtomicBool,
}

impl fmt::Debug for StoreClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClock")
            .field("max_uncertainty", &self.max_uncertainty)
            .field(
                "measured",
                &*self.measured.read().expect("store clock lock"),
            )
            .finish()
    }
}

impl StoreClock {
    /// A clock not measured yet, trusted once measured within
    /// `max_uncertainty`; a step widens it for `longest_lease`.
    pub fn new(max_uncertainty: Duration, longest_lease: Duration) -> Self {
        StoreClock {
            max_uncertainty,
            widen_for: longest_lease,
            measured: RwLock::new(None),
            step: RwLock::new(None),
            steps: AtomicU64::new(0),
            wall: wall_micros,
            last_heard: RwLock::new(None),
            local_offset_micros: AtomicI64::new(0),
            offset_known: AtomicBool::new(false),
        }
    }

    /// Takes one reading: the store answered `store_micros` to a question
    /// sent at `sent` and answered at `received`.
    pub fn observe(&self, sent: Instant, store_micros: u64, received: Instant) {
        let half_round_trip = received.saturating_duration_since(sent) / 2;
        let reading = Measurement {
            store_micros,
            at: sent + half_round_trip,
            half_round_trip,
        };
        {
            let mut measured = self.measured.write().expect("store clock lock");
            let keep = match *measured {
                None => true,
                Some(earlier) => {
                    let predicted = earlier.store_micros_at(reading.at);
                    let gap = Duration::from_micros(predicted.abs_diff(store_micros));
                    let explained = earlier.uncertainty_at(reading.at)
                        + half_round_trip
                        + Duration::from_millis(1);
                    if gap > explained {
                        // Not drift: the store's clock was stepped, or this
                        // process was frozen (a paused VM) while its
                        // monotonic clock stood still. Only the new reading
                        // tells the truth now. After a pause the pod's wall
                        // clock moved with the store's, and leases set
                        // before it were set by the right clock; after a
                        // step of the store's, leases set by the old one
                        // are covered by widening the interval.
                        if self.paused_by(gap, &reading, received) {
                            tracing::warn!(
                                gap = ?gap,
                                "this pod was paused (its wall clock moved with the store's, its monotonic clock did not): the store's clock measured again"
                            );
                        } else {
                            self.widen(gap, received);
                            tracing::warn!(
                                gap = ?gap,
                                widened_for = ?self.widen_for,
                                "the store's clock stepped: measured again, and the time interval widened by the step for the longest lease"
                            );
                        }
                        true
                    } else {
                        // NTP's rule: the tighter reading wins.
                        half_round_trip <= earlier.uncertainty_at(reading.at)
                    }
                }
            };
            if keep {
                *measured = Some(reading);
            }
        }
        *self.last_heard.write().expect("store clock lock") = Some(received);
        self.note_local_offset(received);
    }

    /// Whether a reading `gap` off the prediction is this pod's pause, not
    /// the store's step: the pod's wall clock, against the store's, is
    /// where it was before (within half the gap).
    fn paused_by(&self, gap: Duration, reading: &Measurement, at: Instant) -> bool {
        if !self.offset_known.load(SeqCst) {
            return false;
        }
        let before = i128::from(self.local_offset_micros.load(SeqCst));
        let now = i128::from((self.wall)()) - i128::from(reading.store_micros_at(at));
        (now - before).unsigned_abs() < gap.as_micros() / 2
    }

    /// Widens the interval by `step`, on top of any step still in force
    /// (two steps of 5 s leave leases set before both 10 s off), for the
    /// longest lease from `at`.
    fn widen(&self, step: Duration, at: Instant) {
        self.steps.fetch_add(1, SeqCst);
        let mut current = self.step.write().expect("store clock lock");
        let still = current
            .filter(|(_, until)| *until > at)
            .map(|(size, _)| size);
        *current = Some((still.unwrap_or_default() + step, at + self.widen_for));
    }

    /// What a step adds to the uncertainty at `at`.
    fn step_widening(&self, at: Instant) -> Duration {
        match *self.step.read().expect("store clock lock") {
            Some((size, until)) if at < until => size,
            _ => Duration::ZERO,
        }
    }

    /// Steps of the store's clock seen so far.
    pub fn steps(&self) -> u64 {
        self.steps.load(SeqCst)
    }

    /// The interval at `at` ([`Clock::interval`] at a given moment).
    fn interval_at(&self, at: Instant) -> Now {
        let Some(measured) = *self.measured.read().expect("store clock lock") else {
            return Now::exact(SystemClock.now());
        };
        let estimate = measured.store_micros_at(at);
        let doubt = micros(measured.uncertainty_at(at) + self.step_widening(at));
        Now {
            earliest: UnixMillis(estimate.saturating_sub(doubt) / 1000),
            latest: UnixMillis(estimate.saturating_add(doubt).div_ceil(1000)),
        }
    }

    /// Compares this pod's wall clock with the store's: only reported (a
    /// metric, and a log line when it steps), never used.
    fn note_local_offset(&self, at: Instant) {
        let Some(measured) = *self.measured.read().expect("store clock lock") else {
            return;
        };
        let store = measured.store_micros_at(at);
        let local = (self.wall)();
        let offset = i64::try_from(i128::from(local) - i128::from(store)).unwrap_or(i64::MAX);
        let previous = self.local_offset_micros.swap(offset, SeqCst);
        let known = self.offset_known.swap(true, SeqCst);
        let shown = |micros: i64| Duration::from_micros(micros.unsigned_abs());
        if !known {
            if shown(offset) > STEP_REPORTED {
                tracing::warn!(
                    offset = ?shown(offset),
                    ahead = offset > 0,
                    "this pod's clock disagrees with the store's; leases and retentions follow the store's"
                );
            }
        } else if shown(offset.saturating_sub(previous)) > STEP_REPORTED {
            tracing::warn!(
                step = ?shown(offset.saturating_sub(previous)),
                forward = offset > previous,
                "this pod's wall clock stepped; leases and retentions follow the store's clock"
            );
        }
    }

    /// How uncertain the estimate is now, if measured: the measurement's
    /// own uncertainty, plus a step still widening it.
    pub fn uncertainty(&self) -> Option<Duration> {
        let measured = *self.measured.read().expect("store clock lock");
        let now = Instant::now();
        measured.map(|measured| measured.uncertainty_at(now) + self.step_widening(now))
    }

    /// Measures the store's clock every [`MEASURE_EVERY`] for as long as the
    /// task runs. Each measurement is also a call to the store, so a store
    /// gone silent is noticed (and health follows) within a second or two
    /// even without traffic.
    pub async fn keep_measured<T: TimeSource>(self: Arc<Self>, source: T) {
        let mut ticker = tokio::time::interval(MEASURE_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            match source.read_clock().await {
                Ok(reading) => self.observe(reading.sent, reading.store_micros, reading.received),
                Err(error) => tracing::debug!(%error, "cannot read the store's clock"),
            }
        }
    }
}

impl Clock for StoreClock {
    fn now(&self) -> UnixMillis {
        match *self.measured.read().expect("store clock lock") {
            Some(measured) => UnixMillis(measured.store_micros_at(Instant::now()) / 1000),
            // Never used for a decision: `verify` fails until measured.
            None => SystemClock.now(),
        }
    }

    fn interval(&self) -> Now {
        self.interval_at(Instant::now())
    }

    fn verify(&self) -> Result<(), String> {
        let Some(measured) = *self.measured.read().expect("store clock lock") else {
            return Err("the store's clock has not been measured yet".into());
        };
        let now = Instant::now();
        let heard = self
            .last_heard
            .read()
            .expect("store clock lock")
            .unwrap_or(measured.at);
        let silent = now.saturating_duration_since(heard);
        if silent > MAX_MEASUREMENT_AGE {
            return Err(format!(
                "the store has not answered a clock reading for {}s",
                silent.as_secs()
            ));
        }
        let uncertainty = measured.uncertainty_at(now);
        if uncertainty > self.max_uncertainty {
            return Err(format!(
                "the store's clock is known only to within {uncertainty:?}, more than --max-clock-uncertainty ({:?})",
                self.max_uncertainty
            ));
        }
        Ok(())
    }

    fn report(&self) -> Option<ClockReport> {
        let uncertainty = self.uncertainty()?;
        Some(ClockReport {
            local_offset_seconds: self.local_offset_micros.load(SeqCst) as f64 / 1e6,
            uncertainty_seconds: uncertainty.as_secs_f64(),
            steps: self.steps(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STORE: u64 = 1_800_000_000_000_000;
    const LEASE: Duration = Duration::from_secs(30);

    /// A moment `millis` ago: readings are taken in the past.
    fn ago(millis: u64) -> Instant {
        Instant::now()
            .checked_sub(Duration::from_millis(millis))
            .unwrap()
    }

    #[test]
    fn untrusted_until_measured_then_follows_the_store_not_the_pod() {
        let clock = StoreClock::new(Duration::from_millis(500), LEASE);
        assert!(clock.verify().is_err());
        let sent = ago(100);
        clock.observe(sent, STORE, sent + Duration::from_millis(2));
        clock.verify().unwrap();
        // The store is far from this machine's wall clock: the estimate is
        // the store's time, not ours.
        let now = clock.now().0;
        assert!((STORE / 1000..STORE / 1000 + 5_000).contains(&now), "{now}");
        assert!(clock.uncertainty().unwrap() >= Duration::from_millis(1));
        let report = clock.report().unwrap();
        assert!(report.local_offset_seconds < -1e6, "{report:?}");
    }

    #[test]
    fn slow_round_trips_are_not_trusted_and_the_tighter_reading_wins() {
        let clock = StoreClock::new(Duration::from_millis(500), LEASE);
        let sent = ago(3000);
        clock.observe(sent, STORE, sent + Duration::from_secs(2));
        let refused = clock.verify().unwrap_err();
        assert!(refused.contains("--max-clock-uncertainty"), "{refused}");
        // Within what the slow reading allows (not a step): kept, tighter.
        clock.observe(sent, STORE - 900_000, sent + Duration::from_millis(10));
        clock.verify().unwrap();
        // A looser reading later does not replace it.
        let later = sent + Duration::from_millis(20);
        clock.observe(
            later,
            STORE - 900_000 + 20_000,
            later + Duration::from_millis(400),
        );
        assert!(clock.uncertainty().unwrap() < Duration::from_millis(50));
    }

    /// What a test's code logged.
    #[derive(Clone, Default)]
    struct Logged(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Logged {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logged {
        type Writer = Logged;
        fn make_writer(&'a self) -> Logged {
            self.clone()
        }
    }

    /// A step of the store's clock (+5 s, the monotonic clock unmoved) is
    /// taken at once as the new estimate, but for the longest lease the
    /// interval keeps the old time as its earliest: no lease set by the old
    /// clock ends early. The step is logged and counted; past the longest
    /// lease the interval narrows again.
    #[test]
    fn a_step_of_the_store_clock_widens_the_interval_for_the_longest_lease() {
        let logged = Logged::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logged.clone())
            .with_ansi(false)
            .finish();
        let clock = StoreClock::new(Duration::from_millis(500), LEASE);
        let sent = ago(100);
        let at = Instant::now();
        tracing::subscriber::with_default(subscriber, || {
            clock.observe(sent, STORE, sent + Duration::from_millis(1));
            let before = clock.interval_at(at);
            clock.observe(sent, STORE + 5_000_000, sent + Duration::from_millis(1));
            let after = clock.interval_at(at);
            assert!(
                clock.now().0 >= (STORE + 5_000_000) / 1000,
                "the new estimate"
            );
            assert!(
                after.earliest <= before.earliest,
                "a lease could end early: {before:?} then {after:?}"
            );
            assert!(after.latest.0 >= (STORE + 10_000_000) / 1000, "{after:?}");
        });
        assert_eq!(clock.steps(), 1);
        assert_eq!(clock.report().unwrap().steps, 1);
        let text = String::from_utf8(logged.0.lock().unwrap().clone()).unwrap();
        assert!(text.contains("the time interval widened"), "{text}");

        // Past the longest lease, the step no longer widens it.
        let long_ago = ago(LEASE.as_millis() as u64 + 1_000);
        let narrow = StoreClock::new(Duration::from_millis(500), LEASE);
        narrow.observe(long_ago, STORE, long_ago + Duration::from_millis(1));
        narrow.observe(
            long_ago,
            STORE + 5_000_000,
            long_ago + Duration::from_millis(1),
        );
        let interval = narrow.interval();
        assert!(
            interval.latest.0 - interval.earliest.0 < 1_000,
            "still widened: {interval:?}"
        );
    }

    /// The pod's wall clock for [`a_pause_of_the_pod_is_not_a_step`].
    static WALL: AtomicU64 = AtomicU64::new(0);

    fn test_wall() -> u64 {
        WALL.load(SeqCst)
    }

    /// A reading 5 s ahead of the prediction while this pod's own wall
    /// clock also moved 5 s (its monotonic clock stood still: a paused VM)
    /// is the pod's pause, not the store's step: measured again, not
    /// widened, not counted. Two steps in force add up.
    #[test]
    fn a_pause_of_the_pod_is_not_a_step_and_steps_add_up() {
        let mut clock = StoreClock::new(Duration::from_millis(500), LEASE);
        clock.wall = test_wall;
        let sent = ago(100);
        WALL.store(1_000_000_000_000_000, SeqCst);
        clock.observe(sent, STORE, sent + Duration::from_millis(1));
        WALL.store(1_000_000_005_000_000, SeqCst);
        clock.observe(sent, STORE + 5_000_000, sent + Duration::from_millis(1));
        assert_eq!(clock.steps(), 0);
        let at = Instant::now();
        let interval = clock.interval_at(at);
        assert!(
            interval.latest.0 - interval.earliest.0 < 1_000,
            "{interval:?}"
        );

        // The store steps twice, 5 s each, the wall clock standing.
        clock.observe(sent, STORE + 10_000_000, sent + Duration::from_millis(1));
        clock.observe(sent, STORE + 15_000_000, sent + Duration::from_millis(1));
        assert_eq!(clock.steps(), 2);
        let widened = clock.interval_at(at);
        assert!(
            widened.latest.0 - widened.earliest.0 >= 20_000,
            "both steps, on both sides: {widened:?}"
        );
    }

    #[test]
    fn a_store_that_answers_slowly_is_not_silent() {
        let clock = StoreClock::new(Duration::from_millis(500), LEASE);
        // A tight reading 40 s ago, then only slow (not kept) answers: the
        // kept reading is old, but the store is heard from.
        let tight = ago(40_000);
        clock.observe(tight, STORE, tight + Duration::from_micros(200));
        let slow = ago(10);
        clock.observe(slow, STORE + 40_000_000, slow + Duration::from_millis(200));
        clock.verify().unwrap();
        // Nothing heard for longer than the limit: untrusted.
        let quiet = StoreClock::new(Duration::from_millis(500), LEASE);
        quiet.observe(tight, STORE, tight + Duration::from_micros(200));
        assert!(quiet.verify().unwrap_err().contains("has not answered"));
    }

    #[test]
    fn uncertainty_grows_with_age() {
        let measured = Measurement {
            store_micros: STORE,
            at: Instant::now(),
            half_round_trip: Duration::from_millis(1),
        };
        let later = measured.at + Duration::from_secs(100);
        assert_eq!(
            measured.uncertainty_at(later),
            Duration::from_millis(1) + Duration::from_millis(50)
        );
        assert_eq!(measured.store_micros_at(later), STORE + 100_000_000);
    }
}
