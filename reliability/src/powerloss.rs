//! The power-loss suite (issue 38): the real binary with its data directory
//! on LazyFS ([`crate::lazyfs`]), cycles of load, then `SIGKILL` and
//! `lazyfs::clear-cache` — everything not synced is gone, as after a power
//! cut — a restart, and a check of everything acknowledged before:
//!
//! - every acknowledged commit is there, COMMITTED, with its answer byte
//!   for byte (answers of every size up to the maximum, so sled's blob
//!   files are used);
//! - every acknowledged Forget stays forgotten, every acknowledged Release
//!   stays released, every acknowledged Renew's lease still runs;
//! - fencing tokens only go up across restarts;
//! - and the store opens, every time.
//!
//! The load: Claim and Commit of fresh keys (long retentions, checked; and
//! short ones, so the reaper and sled's segment reuse work), Claim+Release,
//! Claim+Renew kept held, Commit then Forget, and batches; checkpoints every
//! second. Then targeted cuts: fresh data directories with a LazyFS
//! injection armed that drops the cache right before or after a chosen
//! fsync, creation or removal of the log, of sled's files or of the
//! checkpoint, or tears a log write (`torn-op`, `torn-seq`), and crashes
//! the file system there.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use dedupd::proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient};
use rand::{Rng, SeedableRng};
use tokio::task::JoinSet;
use tonic::transport::Channel;

use crate::{
    lazyfs::{Injection, LazyFs},
    sidecar::{warnings, Sidecar},
};

/// The largest answer dedupd accepts (`HARD_MAX_RESPONSE_BYTES`), and the
/// sidecar is started to accept it.
pub const MAX_ANSWER: usize = 1 << 20;

/// What a power-loss run does.
#[derive(Debug, Clone)]
pub struct PowerLossConfig {
    /// The LazyFS binary.
    pub lazyfs: PathBuf,
    /// Power cuts at random moments of the mixed load.
    pub cuts: usize,
    /// Power cuts at random moments of the segment-reuse load.
    pub reuse_cuts: usize,
    /// How long the load runs before a cut: uniformly in this range.
    pub load: (Duration, Duration),
    /// Whether the targeted cuts run too.
    pub targeted: bool,
    /// The answer sizes of commits, in turn.
    pub answer_sizes: Vec<usize>,
    /// Client tasks.
    pub tasks: usize,
    /// More flags for the sidecar, after the suite's own.
    pub extra_flags: Vec<String>,
}

/// The figures of one store's cycles of load, cut, restart and check.
#[derive(Debug, Default, Clone, Copy)]
pub struct Cycles {
    /// Power cuts made at random moments of the load, each followed by a
    /// restart and a check.
    pub cuts: usize,
    /// Seconds of load (a checkpoint a second).
    pub load_seconds: f64,
    /// Bytes of answers below [`LARGE`] committed (kept in sled's log, not
    /// its blob files), and the size of sled's log (`db`) at the end: the
    /// first many times the second means sled freed segments and wrote
    /// them again.
    pub small_answer_bytes: u64,
    pub sled_log_bytes: u64,
    /// dedupd's log segments the store created: one per checkpoint, and
    /// one per start.
    pub log_segments: u64,
}

/// The run's figures, and what is wrong (empty: passed).
#[derive(Debug, Default)]
pub struct PowerLoss {
    /// The mixed load's store: every kind of call, fresh keys.
    pub random: Cycles,
    /// The segment-reuse store: a fixed set of keys forgotten and committed
    /// again and again, so sled's log stays small while far more is written
    /// through it — its garbage collection moves live pages out of old
    /// segments, frees them and writes new pages over them, across many
    /// checkpoints (issue 38, item 2).
    pub reuse: Cycles,
    /// Targeted cuts made (injections that fired).
    pub targeted: usize,
    /// Targeted cuts whose injection never fired (its operation never came).
    pub not_fired: Vec<String>,
    /// Calls acknowledged over the run.
    pub acknowledged: u64,
    /// Commits acknowledged over the run, and of them the ones with an
    /// answer sent to sled's blob files (≥ 32 KiB).
    pub commits: u64,
    /// Large answers committed.
    pub large_commits: u64,
    /// Checks made after restarts (a key looked up, a token compared).
    pub checks: u64,
    /// The longest restart (open, replay, checkpoint) after a cut.
    pub slowest_restart: Duration,
    /// Times LazyFS died by itself during a random cut's load, restart or
    /// check (a fault of its own, seen once in CI: "Resource deadlock
    /// avoided" after truncates); each is a cut at the moment it died.
    pub lazyfs_crashes: usize,
    /// What is wrong.
    pub failures: Vec<String>,
}

/// An acknowledged commit: its answer is the `size` bytes [`answer`] makes.
#[derive(Debug, Clone, Copy)]
struct Committed {
    size: usize,
    fencing: u64,
    /// Wall-clock seconds its retention surely runs until.
    retained_until: u64,
}

/// What the run has had acknowledged (only acknowledged calls are here:
/// one the cut interrupted may or may not have happened).
#[derive(Debug, Default)]
struct Model {
    committed: BTreeMap<String, Committed>,
    /// Keys committed since the last check (all checked; older ones sampled).
    fresh: BTreeSet<String>,
    forgotten: BTreeSet<String>,
    /// The segment-reuse load's keys: the fencing token of the last
    /// acknowledged Claim of each, and the highest one of a generation
    /// whose Forget was acknowledged — a record of the key with a token at
    /// or below that is a forgotten generation come back.
    reuse_claimed: BTreeMap<String, u64>,
    forgotten_through: BTreeMap<String, u64>,
    released: BTreeSet<String>,
    /// Held keys and the wall-clock second their renewed lease surely runs to.
    held: BTreeMap<String, u64>,
    /// The highest fencing token acknowledged so far.
    highest_fencing: u64,
    acknowledged: u64,
    commits: u64,
    large_commits: u64,
    small_answer_bytes: u64,
    /// Set from just before a random cut: calls failing while it is not
    /// set go to `failed_before_cut`, and fail the run (after it, or under
    /// a targeted cut's injection, any call may fail).
    cutting: bool,
    failed_before_cut: BTreeMap<String, u64>,
    /// Whether the store may fail calls at any time (targeted cuts).
    any_failure_expected: bool,
    /// Wrong answers: fail the run.
    wrong: Vec<String>,
}

impl Model {
    /// A commit acknowledged: counted, and kept for the checks after the
    /// cuts when its retention outlasts the run.
    fn commit_acknowledged(
        &mut self,
        id: &str,
        size: usize,
        fencing: u64,
        sent_s: u64,
        retention: Duration,
    ) {
        self.acknowledged += 1;
        self.commits += 1;
        if size >= LARGE {
            self.large_commits += 1;
        } else {
            self.small_answer_bytes += size as u64;
        }
        if retention == LONG_RETENTION {
            // Started between the Commit's sending and its answer: a few
            // seconds' margin for the sidecar's clock and the check's.
            let retained_until = sent_s + retention.as_secs() - 5;
            self.committed.insert(
                id.to_owned(),
                Committed {
                    size,
                    fencing,
                    retained_until,
                },
            );
            self.fresh.insert(id.to_owned());
        }
    }
}

/// Answers at least this large go to sled's blob files.
const LARGE: usize = 32 << 10;
/// A short retention: expires during the run, so the reaper works.
const SHORT_RETENTION: Duration = Duration::from_secs(3);
/// A long one: checked after every cut.
const LONG_RETENTION: Duration = Duration::from_secs(3600);
/// How long the load's tasks go on after a cut's moment (they fail, and end).
const CUT_TAIL: Duration = Duration::from_secs(1);
/// Older commits checked after each cut, besides every new one.
const SAMPLED_OLDER: usize = 300;

/// The bytes of the answer committed for `id`.
fn answer(id: &str, size: usize) -> Vec<u8> {
    let seed = id
        .bytes()
        .fold(0u8, |hash, byte| hash.wrapping_mul(31) ^ byte);
    (0..size).map(|i| seed.wrapping_add(i as u8)).collect()
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

fn seconds(duration: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: duration.as_secs() as i64,
        nanos: 0,
    }
}

/// The sidecar's flags: checkpoints every second or MiB, a short default
/// retention and a quick reaper, answers up to the maximum, and the disk
/// guard at its default (LazyFS reports no free space: it must stand aside).
fn flags(config: &PowerLossConfig) -> Vec<String> {
    let mut flags: Vec<String> = [
        "--sync",
        "always",
        "--checkpoint-interval",
        "1s",
        "--checkpoint-log-mb",
        "1",
        "--default-retention",
        "3s",
        "--reaper-interval",
        "1s",
        "--max-response-bytes",
        "1048576",
        "--max-message-bytes",
        "4194304",
        "--max-lease-ttl",
        "1h",
    ]
    .iter()
    .map(|flag| (*flag).to_owned())
    .collect();
    flags.extend(config.extra_flags.iter().cloned());
    flags
}

/// Runs the suite with `binary` (dedupd) under `work`.
pub async fn run(binary: &Path, work: &Path, config: &PowerLossConfig) -> PowerLoss {
    let mut report = PowerLoss::default();
    for (workload, cuts) in [
        (Workload::Mixed, config.cuts),
        (Workload::Reuse, config.reuse_cuts),
    ] {
        if cuts == 0 || !report.failures.is_empty() {
            continue;
        }
        let model = Arc::new(Mutex::new(Model::default()));
        let dir = work.join(workload.directory());
        let mut cycles = Cycles::default();
        if let Err(failure) = random_cuts(
            binary,
            &dir,
            config,
            (workload, cuts),
            &model,
            &mut cycles,
            &mut report,
        )
        .await
        {
            report.failures.push(failure);
        }
        tally(&model, &mut report);
        match workload {
            Workload::Mixed => report.random = cycles,
            Workload::Reuse => {
                report.reuse = cycles;
                if report.failures.is_empty() {
                    report.failures.extend(reuse_shortfall(&cycles));
                }
            }
        }
    }
    if config.targeted && report.failures.is_empty() {
        for (index, injection) in targeted_cuts().into_iter().enumerate() {
            let dir = work.join(format!("target-{index}"));
            let model = Arc::new(Mutex::new(Model::default()));
            let outcome = targeted_cut(binary, &dir, config, &injection, &model, &mut report).await;
            tally(&model, &mut report);
            match outcome {
                Ok(true) => report.targeted += 1,
                Ok(false) => report.not_fired.push(injection.label()),
                Err(failure) => {
                    report
                        .failures
                        .push(format!("{}: {failure}", injection.label()));
                    break;
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    report
}

/// What the load's tasks do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    /// Every kind of call, on fresh keys: the store grows.
    Mixed,
    /// Each task's fixed keys forgotten and committed again in turn (small
    /// answers of changing sizes), and short-retention commits the reaper
    /// removes: what is live stays small, what is written through sled's
    /// log does not.
    Reuse,
}

impl Workload {
    fn directory(self) -> &'static str {
        match self {
            Workload::Mixed => "random",
            Workload::Reuse => "reuse",
        }
    }
}

/// Keys each task of the segment-reuse load cycles through.
const REUSE_KEYS: usize = 16;
/// Its answers' sizes, a key's next generation taking the next one (all
/// below [`LARGE`]: they go through sled's log).
const REUSE_SIZES: [usize; 4] = [700, 3000, 9000, 20000];
/// The shortest range of a segment-reuse cycle's load.
const REUSE_LOAD: (Duration, Duration) = (Duration::from_secs(2), Duration::from_secs(4));
/// How many times the small answers committed must outweigh sled's log at
/// the end for the stage to show that sled wrote over freed segments.
const REUSE_FACTOR: u64 = 3;
/// How many times its cuts the segment-reuse stage may make while it has
/// not shown the reuse.
const REUSE_MORE: usize = 4;
/// Checkpoints the segment-reuse load must span (issue 38: at least three).
const REUSE_CHECKPOINTS: u64 = 3;

/// Why the segment-reuse stage did not show what it is for, if it did not.
fn reuse_shortfall(cycles: &Cycles) -> Option<String> {
    // One segment per start (the cuts' restarts and the last check's) and
    // one per checkpoint.
    let checkpoints = cycles.log_segments.saturating_sub(cycles.cuts as u64 + 1);
    (cycles.small_answer_bytes < REUSE_FACTOR * cycles.sled_log_bytes
        || checkpoints < REUSE_CHECKPOINTS)
        .then(|| {
            format!(
                "the segment-reuse stage did not reuse sled's segments across checkpoints: {} \
                 bytes of answers committed through a log of {} bytes (at least {REUSE_FACTOR}× \
                 needed), over {checkpoints} checkpoints (at least {REUSE_CHECKPOINTS})",
                cycles.small_answer_bytes, cycles.sled_log_bytes
            )
        })
}

/// `cuts` cycles of `workload`'s load, cut, restart, check on one data
/// directory.
async fn random_cuts(
    binary: &Path,
    work: &Path,
    config: &PowerLossConfig,
    (workload, cuts): (Workload, usize),
    model: &Arc<Mutex<Model>>,
    cycles: &mut Cycles,
    report: &mut PowerLoss,
) -> Result<(), String> {
    let mut lazyfs = LazyFs::mount(&config.lazyfs, work, &[])?;
    let data = lazyfs.mount.join("data");
    let mut rng = rand::rngs::StdRng::seed_from_u64(now_s());
    // The segment-reuse load goes on past its cuts while it has not yet
    // shown the reuse (a loaded machine commits less per second).
    let most = match workload {
        Workload::Mixed => cuts,
        Workload::Reuse => cuts * REUSE_MORE,
    };
    for cut in 0..most {
        let restarted = Restart {
            binary,
            work,
            data: &data,
            config,
        };
        let sidecar = restarted
            .and_check(&mut lazyfs, model, report, &mut rng)
            .await
            .map_err(|e| format!("after cut {cut}, {e}"))?;
        if !report.failures.is_empty() {
            report.failures.push(format!(
                "after cut {cut}; the sidecar's warnings:\n{}",
                warnings(&std::fs::read_to_string(sidecar.log_path()).unwrap_or_default())
                    .join("\n")
            ));
            return Ok(());
        }
        let (shortest, longest) = match workload {
            Workload::Mixed => config.load,
            // Long enough for many times the live set to go through sled.
            Workload::Reuse => (
                config.load.0.max(REUSE_LOAD.0),
                config.load.1.max(REUSE_LOAD.1),
            ),
        };
        let load_for = rng.random_range(shortest..=longest);
        let before = model.lock().expect("not poisoned").commits;
        // The cut comes in the middle of the load: calls in flight, groups
        // half written. The tasks end a moment after it.
        let mut tasks = start_load(
            &sidecar,
            config,
            (workload, cut),
            model,
            Instant::now() + load_for + CUT_TAIL,
        )
        .await?;
        tokio::time::sleep(load_for).await;
        model.lock().expect("not poisoned").cutting = true;
        sidecar.kill_9().await;
        // LazyFS may have died by itself during the load: its cache — every
        // write not synced — died with it, which is a power cut at that
        // moment, checked after the restart like any other. Only the calls
        // that failed between its death and ours are not held against the
        // store.
        let died_by_itself = lazyfs.crashed();
        if died_by_itself {
            lazyfs_died(&mut lazyfs, report, "the load")?;
        } else {
            lazyfs.clear_cache()?;
        }
        while tasks.join_next().await.is_some() {}
        cycles.load_seconds += load_for.as_secs_f64();
        // No call may fail before the cut, and the load must have done
        // something (a store that refuses every write would pass).
        let (commits, failed_before_cut) = {
            let mut model = model.lock().expect("not poisoned");
            model.cutting = false;
            (
                model.commits - before,
                std::mem::take(&mut model.failed_before_cut),
            )
        };
        if !died_by_itself && (commits == 0 || !failed_before_cut.is_empty()) {
            report.failures.push(format!(
                "cycle {cut}: {load_for:?} of load, {commits} commits acknowledged, calls \
                 failed before the cut: {failed_before_cut:?}"
            ));
            return Ok(());
        }
        cycles.cuts += 1;
        if cut + 1 >= cuts && shown(workload, cycles, model, &data) {
            break;
        }
        if (cut + 1) % 10 == 0 {
            let model = model.lock().expect("not poisoned");
            println!(
                "{} {} cuts: {} commits acknowledged ({} large), {} checks",
                workload.directory(),
                cut + 1,
                model.commits,
                model.large_commits,
                report.checks
            );
        }
    }
    // And once more: the state after the last cut opens and checks out.
    let sidecar = Restart {
        binary,
        work,
        data: &data,
        config,
    }
    .and_check(&mut lazyfs, model, report, &mut rng)
    .await
    .map_err(|e| format!("after the last cut, {e}"))?;
    sidecar.kill_9().await;
    measure(cycles, model, &data);
    Ok(())
}

/// Takes the figures of the store in `data` (stopped) into `cycles`.
fn measure(cycles: &mut Cycles, model: &Arc<Mutex<Model>>, data: &Path) {
    cycles.sled_log_bytes = std::fs::metadata(data.join("db")).map_or(0, |meta| meta.len());
    cycles.small_answer_bytes = model.lock().expect("not poisoned").small_answer_bytes;
    cycles.log_segments = highest_segment(&data.join("wal"));
}

/// Whether `workload`'s cycles have shown what they are for: the segment
/// reuse's are measured on the files the last cut left (one start fewer
/// than [`reuse_shortfall`] counts: a checkpoint too few, never too many).
fn shown(workload: Workload, cycles: &mut Cycles, model: &Arc<Mutex<Model>>, data: &Path) -> bool {
    match workload {
        Workload::Mixed => true,
        Workload::Reuse => {
            measure(cycles, model, data);
            reuse_shortfall(cycles).is_none()
        }
    }
}

/// The number of the newest segment in dedupd's log folder (0: none).
fn highest_segment(wal: &Path) -> u64 {
    std::fs::read_dir(wal)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            name.to_str()?.strip_suffix(".wal")?.parse::<u64>().ok()
        })
        .max()
        .unwrap_or(0)
}

/// How many times over a run LazyFS may die by itself (a fault of its
/// own) before the run fails: each such death replaces a cut of ours.
const LAZYFS_DEATHS_ALLOWED: usize = 2;

/// How a check's failure that is a call failing (not a wrong answer)
/// begins: when LazyFS died under the store, those are the file system's.
const CALL_FAILED: &str = "call failed: ";

/// A restart after a random cut, on `data`.
struct Restart<'a> {
    binary: &'a Path,
    work: &'a Path,
    data: &'a Path,
    config: &'a PowerLossConfig,
}

impl Restart<'_> {
    /// Starts the sidecar and checks what was acknowledged. When LazyFS
    /// died by itself meanwhile (the store then fails every call), the calls
    /// that failed are the file system's, not the store's (a wrong answer
    /// stays a failure): LazyFS is mounted again — a power cut at that
    /// moment — and the restart and the check are made again.
    async fn and_check(
        &self,
        lazyfs: &mut LazyFs,
        model: &Arc<Mutex<Model>>,
        report: &mut PowerLoss,
        rng: &mut rand::rngs::StdRng,
    ) -> Result<Sidecar, String> {
        loop {
            let fresh = model.lock().expect("not poisoned").fresh.clone();
            let failures = report.failures.len();
            let started = Instant::now();
            let sidecar = Sidecar::start_on(self.binary, self.work, self.data, &flags(self.config))
                .await
                .map_err(|e| format!("the store did not open: {e}"));
            let checked = match &sidecar {
                Ok(sidecar) => match connect(sidecar).await {
                    Ok(mut client) => {
                        let opened = started.elapsed();
                        check(&mut client, model, report, rng).await;
                        Ok(opened)
                    }
                    Err(error) => Err(error),
                },
                Err(error) => Err(error.clone()),
            };
            if lazyfs.crashed() {
                // Calls failing are the file system's; a wrong answer
                // never is, and stays.
                let found: Vec<String> = report.failures.drain(failures..).collect();
                let (failed_calls, wrong): (Vec<String>, Vec<String>) = found
                    .into_iter()
                    .partition(|failure| failure.starts_with(CALL_FAILED));
                report.failures.extend(wrong);
                eprintln!(
                    "dedupd-reliability: {} calls of the check failed with the file system \
                     (not held against the store; the check is made again)",
                    failed_calls.len()
                );
                model.lock().expect("not poisoned").fresh.extend(fresh);
                if let Ok(sidecar) = sidecar {
                    sidecar.kill_9().await;
                }
                lazyfs_died(lazyfs, report, "a restart")?;
                continue;
            }
            let opened = checked?;
            report.slowest_restart = report.slowest_restart.max(opened);
            return sidecar;
        }
    }
}

/// LazyFS died by itself during `when` (a fault of its own): its cache,
/// every unsynced write, went with it, which is a power cut at that
/// moment. Counted, its log's last lines printed, mounted again; more than
/// [`LAZYFS_DEATHS_ALLOWED`] in a run fail it.
fn lazyfs_died(lazyfs: &mut LazyFs, report: &mut PowerLoss, when: &str) -> Result<(), String> {
    report.lazyfs_crashes += 1;
    eprintln!(
        "dedupd-reliability: LazyFS died by itself during {when} (a power cut then); the last \
         lines of its log:\n{}",
        lazyfs.log_tail(3)
    );
    if report.lazyfs_crashes > LAZYFS_DEATHS_ALLOWED {
        return Err(format!(
            "LazyFS died by itself {} times: too few cuts of our own",
            report.lazyfs_crashes
        ));
    }
    lazyfs.remount(&[])
}

/// One targeted cut: a fresh store under load until the injection fires
/// (`Ok(false)`: it never did within the time), then a restart and a check.
async fn targeted_cut(
    binary: &Path,
    work: &Path,
    config: &PowerLossConfig,
    injection: &Injection,
    model: &Arc<Mutex<Model>>,
    report: &mut PowerLoss,
) -> Result<bool, String> {
    let _ = std::fs::remove_dir_all(work);
    model.lock().expect("not poisoned").any_failure_expected = true;
    let mut lazyfs = LazyFs::mount(&config.lazyfs, work, std::slice::from_ref(injection))?;
    let data = lazyfs.mount.join("data");
    let mut rng = rand::rngs::StdRng::seed_from_u64(now_s());
    let deadline = Instant::now() + Duration::from_secs(20);
    // The injection may fire while the store opens (a create, the first
    // syncs): then it does not start, which is right.
    if let Ok(sidecar) = Sidecar::start_on(binary, work, &data, &flags(config)).await {
        while !lazyfs.crashed() && Instant::now() < deadline {
            load(&sidecar, config, model, 0, Duration::from_millis(500)).await?;
        }
        sidecar.kill_9().await;
    }
    if !lazyfs.crashed() {
        return Ok(false);
    }
    lazyfs.remount(&[])?;
    let started = Instant::now();
    let sidecar = Sidecar::start_on(binary, work, &data, &flags(config))
        .await
        .map_err(|e| format!("the store did not open after the cut: {e}"))?;
    report.slowest_restart = report.slowest_restart.max(started.elapsed());
    let mut client = connect(&sidecar).await?;
    check(&mut client, model, report, &mut rng).await;
    if !report.failures.is_empty() {
        let log = std::fs::read_to_string(sidecar.log_path()).unwrap_or_default();
        return Err(format!(
            "checks failed; the sidecar's warnings:\n{}",
            warnings(&log).join("\n")
        ));
    }
    // And a cut of the recovered store, with its load.
    load(&sidecar, config, model, 1, Duration::from_secs(1)).await?;
    sidecar.kill_9().await;
    lazyfs.clear_cache()?;
    let sidecar = Sidecar::start_on(binary, work, &data, &flags(config))
        .await
        .map_err(|e| format!("the store did not open after a second cut: {e}"))?;
    let mut client = connect(&sidecar).await?;
    check(&mut client, model, report, &mut rng).await;
    sidecar.kill_9().await;
    if report.failures.is_empty() {
        Ok(true)
    } else {
        Err("checks failed after the second cut".into())
    }
}

/// The cuts LazyFS makes by itself, in a fresh data directory each. The log
/// of a fresh store is segment 1, the next segment 2 (after the first
/// checkpoint, within a second); `db` is sled's log, `snap.*` its snapshot.
fn targeted_cuts() -> Vec<Injection> {
    let segment = |n: u32| format!("data/wal/{n:020}.wal");
    let mut cuts = Vec::new();
    for timing in ["before", "after"] {
        for occurrence in [1, 2, 5, 40] {
            cuts.push(Injection::ClearCache {
                timing,
                op: "fsync",
                file: segment(1),
                occurrence,
            });
        }
        for occurrence in [1, 3] {
            cuts.push(Injection::ClearCache {
                timing,
                op: "fsync",
                file: segment(2),
                occurrence,
            });
        }
        for occurrence in [1, 2, 3] {
            cuts.push(Injection::ClearCache {
                timing,
                op: "fsync",
                file: "data/db".into(),
                occurrence,
            });
        }
    }
    // (LazyFS fires a creation's fault after it only.)
    cuts.push(Injection::ClearCache {
        timing: "after",
        op: "create",
        file: segment(3),
        occurrence: 1,
    });
    cuts.push(Injection::ClearCache {
        timing: "before",
        op: "unlink",
        file: segment(1),
        occurrence: 1,
    });
    for occurrence in [4, 10] {
        cuts.push(Injection::TornOp {
            file: segment(1),
            occurrence,
            parts: 3,
            persist: vec![1],
        });
        cuts.push(Injection::TornOp {
            file: segment(1),
            occurrence,
            parts: 2,
            persist: vec![2],
        });
    }
    for persist in [vec![1], vec![2]] {
        cuts.push(Injection::TornSeq {
            file: segment(1),
            occurrence: 5,
            persist,
        });
    }
    cuts
}

async fn connect(sidecar: &Sidecar) -> Result<ClaimAndCommitClient<Channel>, String> {
    let channel = Channel::from_shared(format!("http://{}", sidecar.grpc))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    Ok(ClaimAndCommitClient::new(channel)
        .max_decoding_message_size(8 << 20)
        .max_encoding_message_size(8 << 20))
}

fn tally(model: &Arc<Mutex<Model>>, report: &mut PowerLoss) {
    let model = model.lock().expect("not poisoned");
    report.acknowledged += model.acknowledged;
    report.commits += model.commits;
    report.large_commits += model.large_commits;
}

/// `config.tasks` tasks of mixed calls for `duration`.
async fn load(
    sidecar: &Sidecar,
    config: &PowerLossConfig,
    model: &Arc<Mutex<Model>>,
    round: usize,
    duration: Duration,
) -> Result<(), String> {
    let mut tasks = start_load(
        sidecar,
        config,
        (Workload::Mixed, round),
        model,
        Instant::now() + duration,
    )
    .await?;
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// Starts `config.tasks` tasks of `workload`'s calls, to stop at `end`.
async fn start_load(
    sidecar: &Sidecar,
    config: &PowerLossConfig,
    (workload, round): (Workload, usize),
    model: &Arc<Mutex<Model>>,
    end: Instant,
) -> Result<JoinSet<()>, String> {
    let mut tasks = JoinSet::new();
    let stamp = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros();
    for index in 0..config.tasks {
        let client = connect(sidecar).await?;
        let model = Arc::clone(model);
        let sizes = config.answer_sizes.clone();
        let prefix = format!("p{stamp}-{round}-{index}");
        tasks.spawn(task(client, workload, (prefix, index), sizes, end, model));
    }
    Ok(tasks)
}

/// What a call returned that the model does not expect.
type Call<T> = Result<T, String>;

fn failed(method: &'static str) -> impl FnOnce(tonic::Status) -> String {
    move |status| format!("{method}: {:?} {}", status.code(), status.message())
}

async fn claim(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    lease: Option<Duration>,
) -> Call<pb::ClaimResponse> {
    client
        .claim(pb::ClaimRequest {
            correlation_id: id.to_owned(),
            lease_ttl: lease.map(seconds),
            ..Default::default()
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(failed("Claim"))
}

/// One client's calls: fresh keys named after `prefix`; the segment-reuse
/// load's fixed keys after the task's `index`, the same across restarts.
async fn task(
    mut client: ClaimAndCommitClient<Channel>,
    workload: Workload,
    (prefix, index): (String, usize),
    sizes: Vec<usize>,
    end: Instant,
    model: Arc<Mutex<Model>>,
) {
    let mut i = 0usize;
    // No new call once the power is being cut: one that fails to reach the
    // killed sidecar would still make its key's state unknown (a Forget's
    // commit, for instance) and thin out what the check can check.
    while Instant::now() < end && !model.lock().expect("not poisoned").cutting {
        i += 1;
        let id = format!("{prefix}-{i}");
        let result = match (workload, i % 10) {
            (Workload::Reuse, 0) => commit(&mut client, &id, 100, SHORT_RETENTION, &model).await,
            (Workload::Reuse, _) => {
                let key = format!("reuse-{index}-{}", i % REUSE_KEYS);
                let size = REUSE_SIZES[(i / REUSE_KEYS) % REUSE_SIZES.len()];
                recommit(&mut client, &key, size, &model).await
            }
            (Workload::Mixed, 0..=4) => {
                let size = sizes[(i / 10 * 5 + i % 10) % sizes.len()];
                commit(&mut client, &id, size, LONG_RETENTION, &model).await
            }
            (Workload::Mixed, 5) => commit(&mut client, &id, 100, SHORT_RETENTION, &model).await,
            (Workload::Mixed, 6) => release(&mut client, &id, &model).await,
            (Workload::Mixed, 7) => hold(&mut client, &id, &model).await,
            (Workload::Mixed, 8) => forget(&mut client, &id, &model).await,
            (Workload::Mixed, _) => batch(&mut client, &id, &model).await,
        };
        if let Err(reason) = result {
            {
                let mut model = model.lock().expect("not poisoned");
                if !(model.cutting || model.any_failure_expected) {
                    *model.failed_before_cut.entry(reason).or_default() += 1;
                }
            }
            // The sidecar is being killed, or the file system crashed.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Claims a fresh key: CLAIMED, its fencing token recorded.
async fn claim_fresh(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    lease: Option<Duration>,
    model: &Arc<Mutex<Model>>,
) -> Call<pb::ClaimResponse> {
    let answer = claim(client, id, lease).await?;
    claimed(model, &answer)?;
    Ok(answer)
}

/// A fresh CLAIMED, its fencing token recorded.
fn claimed(model: &Arc<Mutex<Model>>, answer: &pb::ClaimResponse) -> Call<()> {
    if answer.outcome != pb::ClaimOutcome::Claimed as i32 {
        return Err(format!("Claim answered {}", answer.outcome));
    }
    // (Concurrent claims are answered in any order: tokens are compared
    // across restarts only, in `check`.)
    let mut model = model.lock().expect("not poisoned");
    model.acknowledged += 1;
    model.highest_fencing = model.highest_fencing.max(answer.fencing_token);
    Ok(())
}

async fn commit(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    size: usize,
    retention: Duration,
    model: &Arc<Mutex<Model>>,
) -> Call<()> {
    let claim_answer = claim_fresh(client, id, None, model).await?;
    commit_claimed(client, id, claim_answer, (size, retention), model).await
}

/// Commits `id`, claimed with `claim_answer`, with an answer of `size`
/// bytes kept for `retention`.
async fn commit_claimed(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    claim_answer: pb::ClaimResponse,
    (size, retention): (usize, Duration),
    model: &Arc<Mutex<Model>>,
) -> Call<()> {
    let sent = now_s();
    let answer = client
        .commit(pb::CommitRequest {
            correlation_id: id.to_owned(),
            lease_token: claim_answer.lease_token,
            response: answer(id, size),
            retention: Some(seconds(retention)),
            ..Default::default()
        })
        .await
        .map_err(failed("Commit"))?
        .into_inner();
    if answer.outcome != pb::CommitOutcome::Committed as i32 {
        return Err(format!("Commit answered {}", answer.outcome));
    }
    model.lock().expect("not poisoned").commit_acknowledged(
        id,
        size,
        claim_answer.fencing_token,
        sent,
        retention,
    );
    Ok(())
}

async fn release(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    model: &Arc<Mutex<Model>>,
) -> Call<()> {
    let claim_answer = claim_fresh(client, id, None, model).await?;
    let answer = client
        .release(pb::ReleaseRequest {
            correlation_id: id.to_owned(),
            lease_token: claim_answer.lease_token,
            ..Default::default()
        })
        .await
        .map_err(failed("Release"))?
        .into_inner();
    if answer.outcome != pb::ReleaseOutcome::Released as i32 {
        return Err(format!("Release answered {}", answer.outcome));
    }
    let mut model = model.lock().expect("not poisoned");
    model.acknowledged += 1;
    model.released.insert(id.to_owned());
    Ok(())
}

/// Claimed with a short lease, renewed to a long one, and kept.
async fn hold(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    model: &Arc<Mutex<Model>>,
) -> Call<()> {
    let claim_answer = claim_fresh(client, id, Some(Duration::from_secs(5)), model).await?;
    let sent = now_s();
    client
        .renew(pb::RenewRequest {
            correlation_id: id.to_owned(),
            lease_token: claim_answer.lease_token,
            lease_ttl: Some(seconds(Duration::from_secs(600))),
            ..Default::default()
        })
        .await
        .map_err(failed("Renew"))?;
    let mut model = model.lock().expect("not poisoned");
    model.acknowledged += 1;
    model.held.insert(id.to_owned(), sent + 600 - 5);
    Ok(())
}

/// A fresh key committed, then forgotten.
async fn forget(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    model: &Arc<Mutex<Model>>,
) -> Call<()> {
    commit(client, id, 1000, LONG_RETENTION, model).await?;
    if !send_forget(client, id, model).await? {
        let wrong = format!("Forget of {id}, committed a moment ago, answered existed=false");
        model.lock().expect("not poisoned").wrong.push(wrong);
    }
    Ok(())
}

/// A key used before (committed, or cut in the middle of a call, or new)
/// forgotten and committed again with an answer of `size` bytes.
async fn recommit(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    size: usize,
    model: &Arc<Mutex<Model>>,
) -> Call<()> {
    send_forget(client, id, model).await?;
    {
        let mut model = model.lock().expect("not poisoned");
        // From the Claim's sending on, the key is no longer known absent;
        // but no generation up to the one just forgotten may come back.
        model.forgotten.remove(id);
        if let Some(fencing) = model.reuse_claimed.get(id).copied() {
            model.forgotten_through.insert(id.to_owned(), fencing);
        }
    }
    let claim_answer = claim_fresh(client, id, None, model).await?;
    model
        .lock()
        .expect("not poisoned")
        .reuse_claimed
        .insert(id.to_owned(), claim_answer.fencing_token);
    commit_claimed(client, id, claim_answer, (size, LONG_RETENTION), model).await
}

/// Forgets `id`; whether it existed.
async fn send_forget(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    model: &Arc<Mutex<Model>>,
) -> Call<bool> {
    let answer = client
        .forget(pb::ForgetRequest {
            correlation_id: id.to_owned(),
            ..Default::default()
        })
        .await
        .map_err(|status| {
            // A failed Forget may have happened (its sync done, the answer
            // lost): the commit is no longer known to be there.
            let mut model = model.lock().expect("not poisoned");
            model.committed.remove(id);
            model.fresh.remove(id);
            failed("Forget")(status)
        })?
        .into_inner();
    let mut model = model.lock().expect("not poisoned");
    model.acknowledged += 1;
    model.committed.remove(id);
    model.fresh.remove(id);
    model.forgotten.insert(id.to_owned());
    Ok(answer.existed)
}

/// ClaimBatch then CommitBatch of 16 keys with 1 KiB answers.
async fn batch(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    model: &Arc<Mutex<Model>>,
) -> Call<()> {
    let ids: Vec<String> = (0..16).map(|n| format!("{id}-b{n}")).collect();
    let claims = client
        .claim_batch(pb::ClaimBatchRequest {
            items: ids
                .iter()
                .map(|id| pb::ClaimRequest {
                    correlation_id: id.clone(),
                    ..Default::default()
                })
                .collect(),
        })
        .await
        .map_err(failed("ClaimBatch"))?
        .into_inner()
        .results;
    for answer in &claims {
        claimed(model, answer)?;
    }
    let sent = now_s();
    let commits = client
        .commit_batch(pb::CommitBatchRequest {
            items: ids
                .iter()
                .zip(&claims)
                .map(|(id, claimed)| pb::CommitRequest {
                    correlation_id: id.clone(),
                    lease_token: claimed.lease_token.clone(),
                    response: answer(id, 1024),
                    retention: Some(seconds(LONG_RETENTION)),
                    ..Default::default()
                })
                .collect(),
        })
        .await
        .map_err(failed("CommitBatch"))?
        .into_inner()
        .results;
    let mut model = model.lock().expect("not poisoned");
    for ((id, claimed), answer) in ids.iter().zip(&claims).zip(&commits) {
        if answer.outcome != pb::CommitOutcome::Committed as i32 {
            let wrong = format!("CommitBatch of {id} answered {}", answer.outcome);
            model.wrong.push(wrong);
            continue;
        }
        model.commit_acknowledged(id, 1024, claimed.fencing_token, sent, LONG_RETENTION);
    }
    Ok(())
}

/// After a restart: everything acknowledged is as it was left, and a new
/// claim's fencing token is above every one acknowledged.
async fn check(
    client: &mut ClaimAndCommitClient<Channel>,
    model: &Arc<Mutex<Model>>,
    report: &mut PowerLoss,
    rng: &mut rand::rngs::StdRng,
) {
    let (to_check, forgotten, released, held, highest, wrong) = {
        let mut model = model.lock().expect("not poisoned");
        let mut ids: Vec<String> = std::mem::take(&mut model.fresh).into_iter().collect();
        let older: Vec<&String> = model.committed.keys().collect();
        for _ in 0..SAMPLED_OLDER.min(older.len()) {
            ids.push(older[rng.random_range(0..older.len())].clone());
        }
        let entries: Vec<(String, Committed)> = ids
            .into_iter()
            .filter_map(|id| model.committed.get(&id).map(|c| (id, *c)))
            .collect();
        (
            entries,
            model
                .forgotten
                .iter()
                .rev()
                .take(200)
                .cloned()
                .collect::<Vec<_>>(),
            model
                .released
                .iter()
                .rev()
                .take(200)
                .cloned()
                .collect::<Vec<_>>(),
            model
                .held
                .iter()
                .rev()
                .take(200)
                .map(|(id, until)| (id.clone(), *until))
                .collect::<Vec<_>>(),
            model.highest_fencing,
            std::mem::take(&mut model.wrong),
        )
    };
    let forgotten_through = model
        .lock()
        .expect("not poisoned")
        .forgotten_through
        .clone();
    report.failures.extend(wrong);
    let now = now_s();
    for (id, committed) in to_check {
        if committed.retained_until <= now {
            continue;
        }
        report.checks += 1;
        match lookup(client, &id).await {
            Ok(Some(record)) => {
                if record.state != pb::RecordState::Committed as i32
                    || record.fencing_token != committed.fencing
                    || record.response != answer(&id, committed.size)
                {
                    report.failures.push(format!(
                        "acknowledged commit of {id} ({} bytes, fencing {}) came back as state \
                         {}, fencing {}, {} bytes of answer{}",
                        committed.size,
                        committed.fencing,
                        record.state,
                        record.fencing_token,
                        record.response.len(),
                        if record.response.len() == committed.size {
                            " (different bytes)"
                        } else {
                            ""
                        }
                    ));
                }
            }
            Ok(None) => report.failures.push(format!(
                "acknowledged commit of {id} ({} bytes) lost",
                committed.size
            )),
            Err(error) => report
                .failures
                .push(format!("{CALL_FAILED}Lookup of {id}: {error}")),
        }
    }
    for id in forgotten {
        report.checks += 1;
        match lookup(client, &id).await {
            Ok(None) => {}
            Ok(Some(record)) => report.failures.push(format!(
                "acknowledged Forget of {id} undone: state {}",
                record.state
            )),
            Err(error) => report
                .failures
                .push(format!("{CALL_FAILED}Lookup of {id}: {error}")),
        }
    }
    for (id, through) in forgotten_through {
        report.checks += 1;
        match lookup(client, &id).await {
            Ok(Some(record)) if record.fencing_token <= through => report.failures.push(format!(
                "acknowledged Forget of {id} (fencing tokens up to {through}) undone: state \
                     {}, fencing {}",
                record.state, record.fencing_token
            )),
            Ok(_) => {}
            Err(error) => report
                .failures
                .push(format!("{CALL_FAILED}Lookup of {id}: {error}")),
        }
    }
    for id in released {
        report.checks += 1;
        match lookup(client, &id).await {
            Ok(None) => {}
            Ok(Some(record)) if record.state == pb::RecordState::Released as i32 => {}
            Ok(Some(record)) => report.failures.push(format!(
                "acknowledged Release of {id} undone: state {}",
                record.state
            )),
            Err(error) => report
                .failures
                .push(format!("{CALL_FAILED}Lookup of {id}: {error}")),
        }
    }
    for (id, until) in held {
        if until <= now {
            continue;
        }
        report.checks += 1;
        match lookup(client, &id).await {
            Ok(Some(record))
                if record.state == pb::RecordState::Claimed as i32
                    && record
                        .lease_expires_at
                        .is_some_and(|at| at.seconds as u64 >= until) => {}
            Ok(record) => report.failures.push(format!(
                "acknowledged Renew of {id} (lease to at least {until}) undone: {:?}",
                record.map(|record| (record.state, record.lease_expires_at))
            )),
            Err(error) => report
                .failures
                .push(format!("{CALL_FAILED}Lookup of {id}: {error}")),
        }
    }
    // Fencing tokens only go up: a claim now gets one above all before.
    report.checks += 1;
    let probe = format!("probe-{}", rng.random::<u64>());
    match claim(client, &probe, None).await {
        Ok(answer) if answer.fencing_token > highest => {
            let mut model = model.lock().expect("not poisoned");
            model.highest_fencing = model.highest_fencing.max(answer.fencing_token);
        }
        Ok(answer) => report.failures.push(format!(
            "after the restart a claim got fencing token {}, not above {highest} acknowledged \
             before the cut",
            answer.fencing_token
        )),
        Err(error) => report
            .failures
            .push(format!("{CALL_FAILED}Claim after the restart: {error}")),
    }
}

async fn lookup(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
) -> Result<Option<pb::Record>, String> {
    let answer = client
        .lookup(pb::LookupRequest {
            namespace: String::new(),
            correlation_id: id.to_owned(),
        })
        .await
        .map_err(|status| format!("{:?} {}", status.code(), status.message()))?
        .into_inner();
    Ok(answer.found.then_some(answer.record).flatten())
}
