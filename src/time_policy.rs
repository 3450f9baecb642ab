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
//! clock. Within the bound, a lease or a retention can end at most twice the
//! bound early or late, whatever the pods' own clocks say.
//!
//! The embedded sled store keeps the pod's clock: one pod, one clock.

use std::{
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicBool, AtomicI64, Ordering::SeqCst},
        Arc, RwLock,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use crate::{
    clock::{Clock, ClockReport, SystemClock, UnixMillis},
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
    measured: RwLock<Option<Measurement>>,
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
    /// `max_uncertainty`.
    pub fn new(max_uncertainty: Duration) -> Self {
        StoreClock {
            max_uncertainty,
            measured: RwLock::new(None),
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
                        // tells the truth now.
                        tracing::warn!(
                            gap = ?gap,
                            "the store's clock moved against this pod's monotonic clock (a step of the store's clock, or a paused pod): measured again"
                        );
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

    /// Compares this pod's wall clock with the store's: only reported (a
    /// metric, and a log line when it steps), never used.
    fn note_local_offset(&self, at: Instant) {
        let Some(measured) = *self.measured.read().expect("store clock lock") else {
            return;
        };
        let store = measured.store_micros_at(at);
        let local = wall_micros();
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

    /// How uncertain the estimate is now, if measured.
    pub fn uncertainty(&self) -> Option<Duration> {
        let measured = *self.measured.read().expect("store clock lock");
        measured.map(|measured| measured.uncertainty_at(Instant::now()))
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STORE: u64 = 1_800_000_000_000_000;

    /// A moment `millis` ago: readings are taken in the past.
    fn ago(millis: u64) -> Instant {
        Instant::now()
            .checked_sub(Duration::from_millis(millis))
            .unwrap()
    }

    #[test]
    fn untrusted_until_measured_then_follows_the_store_not_the_pod() {
        let clock = StoreClock::new(Duration::from_millis(500));
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
        let clock = StoreClock::new(Duration::from_millis(500));
        let sent = ago(3000);
        clock.observe(sent, STORE, sent + Duration::from_secs(2));
        let refused = clock.verify().unwrap_err();
        assert!(refused.contains("--max-clock-uncertainty"), "{refused}");
        clock.observe(sent, STORE + 1_000_000, sent + Duration::from_millis(10));
        clock.verify().unwrap();
        // A looser reading later does not replace it.
        let later = sent + Duration::from_millis(20);
        clock.observe(
            later,
            STORE + 1_000_000 + 20_000,
            later + Duration::from_millis(400),
        );
        assert!(clock.uncertainty().unwrap() < Duration::from_millis(50));
    }

    #[test]
    fn a_step_of_the_store_clock_is_taken_at_once() {
        let clock = StoreClock::new(Duration::from_millis(500));
        let sent = ago(100);
        clock.observe(sent, STORE, sent + Duration::from_millis(1));
        // 60 s later by the store, though the monotonic clock moved 0 s: the
        // store stepped (or we were frozen); the new reading replaces the
        // old even though it is no tighter.
        clock.observe(sent, STORE + 60_000_000, sent + Duration::from_millis(1));
        let now = clock.now().0;
        assert!(now >= (STORE + 60_000_000) / 1000, "{now}");
    }

    #[test]
    fn a_store_that_answers_slowly_is_not_silent() {
        let clock = StoreClock::new(Duration::from_millis(500));
        // A tight reading 40 s ago, then only slow (not kept) answers: the
        // kept reading is old, but the store is heard from.
        let tight = ago(40_000);
        clock.observe(tight, STORE, tight + Duration::from_micros(200));
        let slow = ago(10);
        clock.observe(slow, STORE + 40_000_000, slow + Duration::from_millis(200));
        clock.verify().unwrap();
        // Nothing heard for longer than the limit: untrusted.
        let quiet = StoreClock::new(Duration::from_millis(500));
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
