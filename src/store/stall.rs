//! Noticing an embedded store that stopped answering, without relying on
//! anything that such a store can block.
//!
//! sled's calls are synchronous and short, so they run inline on the
//! runtime's worker threads. On a failing disk sled 0.34.7 can block a call
//! for good (a write reservation spinning on a log buffer that is never
//! written, a thread parked on a mutex that one holds); with every worker
//! thread inside sled nothing else on the runtime runs — no deadline, no
//! health check, no shutdown. So every thread marks itself busy for the
//! length of each sled call (a stamp in a slot of its own: two stores to a
//! thread-local atomic, no shared cache line), the committer stamps each
//! disk sync, and [`StallWatch::stalled`] finds the oldest stamp. It is
//! read by the health checks and by the sync watch thread (whose probes run
//! on threads of their own), off the request path and out of reach of a
//! stuck sled call; `server::fail_stop_watchdog` ends the process if the
//! runtime cannot. Not watched: the local tier's sled (a cache in front of
//! a shared store).
//!
//! Stamps are process-wide: a thread runs one sled call at a time, whatever
//! the store (sled calls never nest).

use std::{
    cell::Cell,
    marker::PhantomData,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::SeqCst},
        mpsc, Arc, Mutex, OnceLock,
    },
    thread,
    time::{Duration, Instant},
};

/// Milliseconds since the first stamp of the process, plus one (0: idle).
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_millis())
        .unwrap_or(u64::MAX - 1)
        .saturating_add(1)
}

/// The busy slots of every thread alive that ever made a sled call.
static SLOTS: Mutex<Vec<Arc<AtomicU64>>> = Mutex::new(Vec::new());

/// A thread's slot, removed from [`SLOTS`] when the thread ends (blocking
/// pool threads come and go).
struct Slot(Arc<AtomicU64>);

impl Slot {
    fn register() -> Slot {
        let slot = Arc::new(AtomicU64::new(0));
        SLOTS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(Arc::clone(&slot));
        Slot(slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        SLOTS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|slot| !Arc::ptr_eq(slot, &self.0));
    }
}

thread_local! {
    static SLOT: Slot = Slot::register();
    static NESTED: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread busy in sled until dropped. Not `Send`: the
/// stamp is the thread's, so the guard must not cross an `.await`.
#[derive(Debug)]
pub(super) struct Busy {
    outermost: bool,
    _thread_bound: PhantomData<*const ()>,
}

/// Marks the calling thread busy in sled until the guard drops.
pub(super) fn busy() -> Busy {
    let outermost = !NESTED.with(|nested| nested.replace(true));
    if outermost {
        SLOT.with(|slot| slot.0.store(now_ms(), SeqCst));
    }
    Busy {
        outermost,
        _thread_bound: PhantomData,
    }
}

impl Busy {
    /// Starts the clock again: a loop of many short sled calls (the reaper's
    /// sweep) is judged call by call, not as one long call.
    pub(super) fn renew(&self) {
        if self.outermost {
            SLOT.with(|slot| slot.0.store(now_ms(), SeqCst));
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if self.outermost {
            SLOT.with(|slot| slot.0.store(0, SeqCst));
            NESTED.with(|nested| nested.set(false));
        }
    }
}

/// How long the oldest sled call in flight on any thread has run.
fn longest_busy() -> Option<Duration> {
    let now = now_ms();
    SLOTS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .iter()
        .map(|slot| slot.load(SeqCst))
        .filter(|started| *started != 0)
        .min()
        .map(|oldest| Duration::from_millis(now.saturating_sub(oldest)))
}

/// What has run for too long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stall {
    /// The committer's disk sync.
    Sync(Duration),
    /// A store call on some thread.
    Call(Duration),
}

impl Stall {
    /// Why the store failed, for the log and the callers.
    pub(super) fn reason(self) -> String {
        let (what, running) = match self {
            Stall::Sync(running) => ("a disk sync", running),
            Stall::Call(running) => ("a store call", running),
        };
        format!(
            "the store stopped answering: {what} has run for {} (over the stall timeout); restart dedupd",
            crate::api::human_duration(Duration::from_secs(running.as_secs()))
        )
    }
}

/// The stall timeout and the committer's running sync.
#[derive(Debug)]
pub(super) struct StallWatch {
    /// When the running sync started ([`now_ms`]); 0: none.
    sync_started_ms: AtomicU64,
    limit: Duration,
}

impl StallWatch {
    pub(super) fn new(limit: Duration) -> StallWatch {
        StallWatch {
            sync_started_ms: AtomicU64::new(0),
            limit,
        }
    }

    pub(super) fn sync_starting(&self) {
        self.sync_started_ms.store(now_ms(), SeqCst);
    }

    pub(super) fn sync_done(&self) {
        self.sync_started_ms.store(0, SeqCst);
    }

    /// The running sync (its start stamp) and how long it has run.
    fn running_sync(&self) -> Option<(u64, Duration)> {
        let started = self.sync_started_ms.load(SeqCst);
        let running = Duration::from_millis(now_ms().saturating_sub(started));
        (started != 0).then_some((started, running))
    }

    /// A sync or a store call that has run for longer than the limit.
    pub(super) fn stalled(&self) -> Option<Stall> {
        if let Some((_, running)) = self.running_sync().filter(|(_, r)| *r > self.limit) {
            return Some(Stall::Sync(running));
        }
        longest_busy()
            .filter(|running| *running > self.limit)
            .map(Stall::Call)
    }
}

/// A sync running this long gets a probe write (see [`watch_syncs`]).
pub(super) const PROBE_AFTER: Duration = Duration::from_secs(1);

/// Wakes a committer that sled forgot to wake, and fails a stalled store
/// even when nothing asks for its health.
///
/// When sled's I/O thread fails to write a log buffer that the last writer
/// leaving it handed over, sled 0.34.7 records the error for good but does
/// not notify threads waiting in `flush()` (`exit_reservation` in its
/// `pagecache/logger.rs`, unlike its other write paths): the committer would
/// wait until the stall timeout while every caller of the group hangs. A
/// write reservation that sees the recorded error notifies those waiters,
/// so while a sync has run for `probe_after` ([`PROBE_AFTER`]) or more,
/// each tick starts a `probe` (a tiny write) — a disk may take long to
/// return its error, so one probe could come too early: on a failed disk it
/// fails and the store fails at once, on a slow disk it costs a few bytes.
/// A probe runs on a thread of its own, one at a time, so one that sled
/// blocks never stops the stall checks here; `stalled` is called on every
/// tick. Ends when `stop`'s sender is dropped.
pub(super) fn watch_syncs(
    watch: &StallWatch,
    stop: &mpsc::Receiver<()>,
    probe_after: Duration,
    probe: Arc<dyn Fn() + Send + Sync>,
    mut stalled: impl FnMut(Stall),
) {
    let probing = Arc::new(AtomicBool::new(false));
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(probe_after / 4) {
        if let Some(stall) = watch.stalled() {
            stalled(stall);
        }
        let Some((_, running)) = watch.running_sync() else {
            continue;
        };
        if running >= probe_after && !probing.swap(true, SeqCst) {
            tracing::debug!(
                ?running,
                "a disk sync is slow: probing the store with a write"
            );
            let (probe, done) = (Arc::clone(&probe), Arc::clone(&probing));
            let spawned = thread::Builder::new()
                .name("dedupd-probe".into())
                .spawn(move || {
                    probe();
                    done.store(false, SeqCst);
                });
            if spawned.is_err() {
                probing.store(false, SeqCst);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stamps are process-wide: the tests that hold one for long take turns.
    static LONG_STAMPS: Mutex<()> = Mutex::new(());

    #[test]
    fn a_call_in_flight_past_the_limit_is_a_stall_and_ends_with_its_guard() {
        let _turn = LONG_STAMPS.lock().unwrap_or_else(|p| p.into_inner());
        let watch = StallWatch::new(Duration::from_millis(50));
        let (started, finished) = (mpsc::channel(), mpsc::channel::<()>());
        let (started_tx, started_rx) = started;
        let (finish_tx, finish_rx) = finished;
        let stuck = std::thread::spawn(move || {
            let _busy = busy();
            // Nested calls do not clear the outer stamp.
            drop(busy());
            started_tx.send(()).unwrap();
            finish_rx.recv().unwrap();
        });
        started_rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(120));
        match watch.stalled() {
            Some(Stall::Call(running)) => assert!(running >= Duration::from_millis(100)),
            other => panic!("expected a stalled call, got {other:?}"),
        }
        finish_tx.send(()).unwrap();
        stuck.join().unwrap();
        // Other tests' threads may be inside a short call right now, never
        // for 50 ms of nothing but a stamp.
        assert_eq!(
            watch
                .stalled()
                .filter(|s| matches!(s, Stall::Call(r) if *r > Duration::from_secs(5))),
            None
        );
    }

    /// Runs [`watch_syncs`] on `watch` for `time` (probing after 40 ms):
    /// how many probes it started (counted once they ran) and the stalls
    /// it reported.
    fn watch_for(watch: &StallWatch, time: Duration) -> (u64, Vec<Stall>) {
        let (stop_tx, stop) = mpsc::channel::<()>();
        let probes = Arc::new(AtomicU64::new(0));
        let mut stalls = Vec::new();
        let ticker = std::thread::spawn(move || {
            std::thread::sleep(time);
            drop(stop_tx);
        });
        let counted = Arc::clone(&probes);
        watch_syncs(
            watch,
            &stop,
            Duration::from_millis(40),
            Arc::new(move || {
                counted.fetch_add(1, SeqCst);
            }),
            |stall| stalls.push(stall),
        );
        ticker.join().unwrap();
        // The last probe's thread may still be counting.
        std::thread::sleep(Duration::from_millis(50));
        (probes.load(SeqCst), stalls)
    }

    #[test]
    fn a_slow_sync_is_probed_while_it_runs_and_a_stalled_one_reported() {
        let watch = StallWatch::new(Duration::from_millis(100));
        watch.sync_starting();
        let (probes, stalls) = watch_for(&watch, Duration::from_millis(400));
        // Ticks every 10 ms from 40 ms on: several probes, one at a time.
        assert!(probes >= 3, "probed {probes} times during a 400 ms sync");
        assert!(
            !stalls.is_empty() && stalls.iter().all(|stall| matches!(stall, Stall::Sync(_))),
            "{stalls:?}"
        );
        // A sync that ended is neither probed nor stalled.
        watch.sync_done();
        let (probes, stalls) = watch_for(&watch, Duration::from_millis(150));
        assert_eq!(probes, 0, "no sync runs: no probe");
        assert!(
            stalls.iter().all(|stall| !matches!(stall, Stall::Sync(_))),
            "{stalls:?}"
        );
    }

    #[test]
    fn a_renewed_stamp_starts_the_clock_again() {
        let _turn = LONG_STAMPS.lock().unwrap_or_else(|p| p.into_inner());
        let watch = StallWatch::new(Duration::from_millis(500));
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let (ready_tx, ready_rx) = mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            let busy = busy();
            for _ in 0..8 {
                std::thread::sleep(Duration::from_millis(100));
                busy.renew();
            }
            ready_tx.send(()).unwrap();
            done_rx.recv().unwrap();
        });
        ready_rx.recv().unwrap();
        // 800 ms inside one guard, renewed every 100 ms: no stall.
        assert_eq!(watch.stalled(), None);
        done_tx.send(()).unwrap();
        worker.join().unwrap();
    }
}
