//! The soak (issue 16, item 5): mixed load with churn for a long time on a
//! short retention, so the reaper works throughout, sampling the sidecar
//! every interval — resident memory, open files, the data directory's size,
//! the calls' p99 and throughput. After the warm-up everything must stay
//! flat, and at the end, after a SIGKILL and a restart, every commit
//! acknowledged within the retention must still be there while the ones
//! past it (an even sample of them) must be gone (the reaper and expiry did
//! their work).
//!
//! The load: tasks that claim and commit fresh keys (a 200-byte answer),
//! claim a key committed a moment ago (a duplicate), claim and release, and
//! look keys up, in turn.

use std::{
    collections::{BTreeMap, HashSet, VecDeque},
    io::Write,
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use dedupd::proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient};
use tokio::task::JoinSet;
use tonic::transport::Channel;

use crate::sidecar::{directory_bytes, Sidecar};

/// Most records past their retention looked up at the end.
const MAX_EXPIRED_CHECKS: usize = 20_000;
/// A record this far past its retention is sampled for the check that it
/// is gone; a load that outlasts the retention by more has such records,
/// and a run that checked none of them fails.
const EXPIRED_MARGIN: Duration = Duration::from_secs(2);

/// What a soak does.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// How long the load runs.
    pub duration: Duration,
    /// How often the sidecar is sampled.
    pub sample_every: Duration,
    /// The sidecar's --default-retention.
    pub retention: Duration,
    /// Samples before this are the warm-up, not judged.
    pub warm_up: Duration,
    /// Client tasks.
    pub tasks: usize,
    /// Whether the p99's growth is judged: only where the machine does
    /// nothing else (the long runs); a build started beside CI's bounded
    /// run doubles it. The CPU a call costs the sidecar is judged always.
    pub judge_latency: bool,
}

/// One sample.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sample {
    /// Seconds since the load started.
    pub at_s: u64,
    /// Resident memory, KiB.
    pub rss_kib: u64,
    /// Open files.
    pub open_files: u64,
    /// The data directory's bytes.
    pub disk_bytes: u64,
    /// p99 of the calls since the last sample, microseconds.
    pub p99_us: u32,
    /// The longest call since the last sample, microseconds.
    pub longest_us: u32,
    /// Calls per second since the last sample.
    pub calls_per_s: u64,
    /// Failed calls since the last sample.
    pub errors: u64,
    /// The sidecar's CPU time per answered call since the last sample,
    /// microseconds: what a call costs it, whatever else loads the machine.
    pub cpu_us_per_call: u64,
}

impl Sample {
    /// One JSON line.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "at_s": self.at_s,
            "rss_kib": self.rss_kib,
            "open_files": self.open_files,
            "disk_bytes": self.disk_bytes,
            "p99_us": self.p99_us,
            "longest_us": self.longest_us,
            "calls_per_s": self.calls_per_s,
            "errors": self.errors,
            "cpu_us_per_call": self.cpu_us_per_call,
        })
    }
}

/// Whatever the tasks share: the latencies since the last sample, the
/// failures, and every commit acknowledged (ID, when).
#[derive(Debug, Default)]
struct Shared {
    latencies_us: Vec<u32>,
    errors: u64,
    /// Why calls failed (gRPC code and message, or the unexpected outcome),
    /// counted over the run: a failed soak says what failed.
    error_reasons: BTreeMap<String, u64>,
    committed: Vec<Committed>,
    /// The longest call since the last sample, answered or not: a pause
    /// of the sidecar (or of the machine) shows here.
    longest_us: u32,
    /// Keys whose redelivery came after their retention could have ended
    /// and was CLAIMED afresh, as it should be: none unless calls paused
    /// for about a retention. The check after the restart leaves them out.
    reclaimed: HashSet<String>,
}

/// A commit acknowledged: when its Commit was sent and when COMMITTED came
/// back. The sidecar started its retention between the two, so it lives at
/// least until `sent + retention` and at most until `answered + retention`
/// — however long a pause of the machine made the call.
#[derive(Debug, Clone)]
struct Committed {
    id: String,
    sent: Instant,
    answered: Instant,
}

/// How far the sidecar's millisecond clock may round a retention's end.
const CLOCK_MARGIN: Duration = Duration::from_secs(1);

/// The run's outcome.
#[derive(Debug)]
pub struct Soak {
    /// Every sample, in order.
    pub samples: Vec<Sample>,
    /// Commits acknowledged over the run.
    pub committed: usize,
    /// Redeliveries answered CLAIMED afresh because they came after the
    /// key's retention could have ended (see [`task`]): none unless the
    /// calls paused for about a retention.
    pub reclaimed: usize,
    /// Of those, the ones checked after the restart to still be there (none
    /// fails the run).
    pub checked_present: usize,
    /// And the ones checked to be gone (past their retention; a sample;
    /// none fails a run whose load outlasted the retention).
    pub checked_expired: usize,
    /// What is wrong, if anything (empty: passed).
    pub failures: Vec<String>,
}

/// The load's calls from one task, until `end`. A redelivery must be
/// answered DUPLICATE while its key's retention surely runs; once it may
/// have ended (a pause of the machine as long as the retention, say), a
/// fresh CLAIMED is right too.
async fn task(
    mut client: ClaimAndCommitClient<Channel>,
    index: usize,
    end: Instant,
    retention: Duration,
    shared: Arc<Mutex<Shared>>,
) {
    let mut recent: VecDeque<Committed> = VecDeque::new();
    let mut i = 0u64;
    while Instant::now() < end {
        i += 1;
        let id = format!("soak-{index}-{i}");
        let started = Instant::now();
        let mut committed = None;
        let outcome = match i % 4 {
            // A fresh key claimed and committed.
            0 | 1 => commit(&mut client, &id).await.map(|done| {
                recent.push_back(done.clone());
                if recent.len() > 16 {
                    recent.pop_front();
                }
                committed = Some(done);
            }),
            // A redelivery of a key committed a moment ago.
            2 => match recent.front() {
                Some(done) => match redeliver(&mut client, done, retention).await {
                    Ok(Redelivered::Duplicate) => Ok(()),
                    Ok(Redelivered::Reclaimed) => {
                        let id = done.id.clone();
                        recent.pop_front();
                        shared.lock().expect("not poisoned").reclaimed.insert(id);
                        Ok(())
                    }
                    Err(reason) => Err(reason),
                },
                None => Ok(()),
            },
            // Claimed, then released (the consumer failed), then looked up.
            _ => release_and_lookup(&mut client, &id).await,
        };
        let elapsed = started.elapsed().as_micros() as u32;
        let mut shared = shared.lock().expect("not poisoned");
        shared.longest_us = shared.longest_us.max(elapsed);
        match outcome {
            Ok(()) => {
                shared.latencies_us.push(elapsed);
                shared.committed.extend(committed);
            }
            Err(reason) => {
                shared.errors += 1;
                *shared.error_reasons.entry(reason).or_default() += 1;
            }
        }
    }
}

/// A failed call, as the soak's report names it.
fn call_failed(method: &str) -> impl FnOnce(tonic::Status) -> String + '_ {
    move |status| format!("{method}: {:?} {}", status.code(), status.message())
}

/// Claims `id`; `Err` on a failed call or an outcome other than `expected`.
async fn claim(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    expected: pb::ClaimOutcome,
) -> Result<pb::ClaimResponse, String> {
    let answer = client
        .claim(pb::ClaimRequest {
            correlation_id: id.to_owned(),
            ..Default::default()
        })
        .await
        .map_err(call_failed("Claim"))?
        .into_inner();
    if answer.outcome == expected as i32 {
        Ok(answer)
    } else {
        Err(format!(
            "Claim answered {:?}, expected {expected:?}",
            pb::ClaimOutcome::try_from(answer.outcome)
        ))
    }
}

async fn commit(client: &mut ClaimAndCommitClient<Channel>, id: &str) -> Result<Committed, String> {
    let claimed = claim(client, id, pb::ClaimOutcome::Claimed).await?;
    let sent = Instant::now();
    let committed = client
        .commit(pb::CommitRequest {
            correlation_id: id.to_owned(),
            lease_token: claimed.lease_token,
            response: vec![b'r'; 200],
            ..Default::default()
        })
        .await
        .map_err(call_failed("Commit"))?
        .into_inner();
    if committed.outcome == pb::CommitOutcome::Committed as i32 {
        Ok(Committed {
            id: id.to_owned(),
            sent,
            answered: Instant::now(),
        })
    } else {
        Err(format!(
            "Commit answered {:?}",
            pb::CommitOutcome::try_from(committed.outcome)
        ))
    }
}

/// What a redelivery of a committed key was answered.
enum Redelivered {
    /// DUPLICATE, as it must be while the retention surely runs.
    Duplicate,
    /// CLAIMED afresh: right only once the retention may have ended.
    Reclaimed,
}

async fn redeliver(
    client: &mut ClaimAndCommitClient<Channel>,
    done: &Committed,
    retention: Duration,
) -> Result<Redelivered, String> {
    let answer = client
        .claim(pb::ClaimRequest {
            correlation_id: done.id.clone(),
            ..Default::default()
        })
        .await
        .map_err(call_failed("Claim"))?
        .into_inner();
    let may_have_ended = Instant::now() + CLOCK_MARGIN >= done.sent + retention;
    match pb::ClaimOutcome::try_from(answer.outcome) {
        Ok(pb::ClaimOutcome::Duplicate) => Ok(Redelivered::Duplicate),
        Ok(pb::ClaimOutcome::Claimed) if may_have_ended => Ok(Redelivered::Reclaimed),
        other => Err(format!(
            "Claim of a key committed {:?} before answered {other:?}, expected Duplicate",
            done.answered.elapsed()
        )),
    }
}

async fn release_and_lookup(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
) -> Result<(), String> {
    let claimed = claim(client, id, pb::ClaimOutcome::Claimed).await?;
    client
        .release(pb::ReleaseRequest {
            correlation_id: id.to_owned(),
            lease_token: claimed.lease_token,
            ..Default::default()
        })
        .await
        .map_err(call_failed("Release"))?;
    client
        .lookup(pb::LookupRequest {
            namespace: String::new(),
            correlation_id: id.to_owned(),
        })
        .await
        .map(drop)
        .map_err(call_failed("Lookup"))
}

fn p99(latencies: &mut [u32]) -> u32 {
    latencies.sort_unstable();
    latencies
        .get((latencies.len() * 99).div_ceil(100).saturating_sub(1))
        .copied()
        .unwrap_or(0)
}

/// Runs the soak against `binary` in `data_dir`, printing each sample as a
/// JSON line as it is taken. What a failed run needs to be explained stays
/// in `data_dir`: the sidecar's log (every start), `samples.jsonl`, and the
/// `/metrics` page scraped just before the SIGKILL.
pub async fn run(binary: &Path, data_dir: &Path, config: &SoakConfig) -> Result<Soak, String> {
    let retention = humantime::format_duration(config.retention).to_string();
    let flags = vec![
        "--default-retention".to_owned(),
        retention,
        "--reaper-interval".to_owned(),
        "2s".to_owned(),
    ];
    let sidecar = Sidecar::start(binary, data_dir, &flags).await?;
    let shared = Arc::new(Mutex::new(Shared::default()));
    let started = Instant::now();
    let end = started + config.duration;
    let mut tasks = JoinSet::new();
    // A channel per two tasks: one channel is one buffer worker.
    let mut channel = None;
    for index in 0..config.tasks {
        if index % 2 == 0 {
            channel = Some(
                Channel::from_shared(format!("http://{}", sidecar.grpc))
                    .map_err(|e| e.to_string())?
                    .connect()
                    .await
                    .map_err(|e| format!("cannot connect: {e}"))?,
            );
        }
        let client = ClaimAndCommitClient::new(channel.clone().expect("made above"));
        tasks.spawn(task(
            client,
            index,
            end,
            config.retention,
            Arc::clone(&shared),
        ));
    }

    let data = data_dir.join("data");
    let samples_path = data_dir.join("samples.jsonl");
    let mut samples_file = std::fs::File::create(&samples_path)
        .map_err(|e| format!("{}: {e}", samples_path.display()))?;
    let mut samples = Vec::new();
    let mut last = Instant::now();
    let mut last_cpu_us = sidecar.sample().cpu_us;
    while Instant::now() < end {
        tokio::time::sleep(
            config
                .sample_every
                .min(end.saturating_duration_since(Instant::now())),
        )
        .await;
        let (mut latencies, errors, longest_us) = {
            let mut shared = shared.lock().expect("not poisoned");
            (
                std::mem::take(&mut shared.latencies_us),
                std::mem::take(&mut shared.errors),
                std::mem::take(&mut shared.longest_us),
            )
        };
        let process = sidecar.sample();
        let elapsed = last.elapsed().as_secs_f64().max(0.001);
        last = Instant::now();
        let calls = latencies.len() as u64;
        let sample = Sample {
            at_s: started.elapsed().as_secs(),
            rss_kib: process.rss_kib,
            open_files: process.open_files,
            disk_bytes: directory_bytes(&data),
            p99_us: p99(&mut latencies),
            longest_us,
            calls_per_s: (calls as f64 / elapsed) as u64,
            errors,
            cpu_us_per_call: process.cpu_us.saturating_sub(last_cpu_us) / calls.max(1),
        };
        last_cpu_us = process.cpu_us;
        println!("{}", sample.json());
        writeln!(samples_file, "{}", sample.json())
            .map_err(|e| format!("{}: {e}", samples_path.display()))?;
        samples.push(sample);
    }
    while let Some(joined) = tasks.join_next().await {
        joined.map_err(|e| format!("a load task failed: {e}"))?;
    }
    let (committed, error_reasons, reclaimed) = {
        let mut shared = shared.lock().expect("not poisoned");
        (
            std::mem::take(&mut shared.committed),
            std::mem::take(&mut shared.error_reasons),
            std::mem::take(&mut shared.reclaimed),
        )
    };
    let mut failures = judge(&samples, config);
    if !error_reasons.is_empty() {
        let reasons: Vec<String> = error_reasons
            .iter()
            .map(|(reason, count)| format!("{count} × {reason}"))
            .collect();
        failures.push(format!("why calls failed: {}", reasons.join("; ")));
    }

    // What the sidecar counted (its refusals, its syncs) before the kill
    // takes it away.
    let scraped = data_dir.join("metrics-before-kill.txt");
    let page = sidecar
        .scrape()
        .await
        .unwrap_or_else(|error| format!("# {error}\n"));
    std::fs::write(&scraped, page).map_err(|e| format!("{}: {e}", scraped.display()))?;
    // Nothing acknowledged lost, even by a SIGKILL: restart and check.
    let killed = Instant::now();
    sidecar.kill_9().await;
    let restarted = Sidecar::start(binary, data_dir, &flags).await?;
    let restart_took = killed.elapsed();
    let mut client = ClaimAndCommitClient::connect(format!("http://{}", restarted.grpc))
        .await
        .map_err(|e| format!("cannot connect after the restart: {e}"))?;
    // Newest first, so the check reaches them well inside their retention.
    // A record must be there if its retention surely runs when the lookup
    // is answered (from the Commit's sending, less the clock's margin), and
    // be gone if it surely ended when the lookup was sent (from COMMITTED's
    // arrival, plus the margin); between the two, either is right. Keys
    // redelivered after their retention and claimed afresh are left out.
    let mut committed: Vec<Committed> = committed
        .into_iter()
        .filter(|done| !reclaimed.contains(&done.id))
        .collect();
    committed.sort_by_key(|done| std::cmp::Reverse(done.answered));
    // Every record inside its retention is checked; of the (millions) past
    // it, an even sample of at most 20 000.
    let past = committed
        .iter()
        .filter(|done| done.answered.elapsed() > config.retention + EXPIRED_MARGIN)
        .count();
    let stride = past.div_ceil(MAX_EXPIRED_CHECKS).max(1);
    let (mut checked_present, mut checked_expired) = (0, 0);
    for (index, done) in committed.iter().enumerate() {
        let ended_before_sent = done.answered.elapsed() > config.retention + CLOCK_MARGIN;
        if done.answered.elapsed() > config.retention + EXPIRED_MARGIN && index % stride != 0 {
            continue;
        }
        let found = client
            .lookup(pb::LookupRequest {
                namespace: String::new(),
                correlation_id: done.id.clone(),
            })
            .await
            .map_err(|e| format!("lookup after the restart: {e}"))?
            .into_inner()
            .found;
        let id = &done.id;
        if done.sent.elapsed() + CLOCK_MARGIN < config.retention {
            checked_present += 1;
            if !found {
                failures.push(format!(
                    "{id}, committed {:?} before it was looked up after the restart, is lost",
                    done.answered.elapsed()
                ));
            }
        } else if ended_before_sent {
            checked_expired += 1;
            if found {
                failures.push(format!(
                    "{id}, committed {:?} ago, outlived its retention",
                    done.answered.elapsed()
                ));
            }
        }
    }
    if restarted
        .stop(Duration::from_secs(20))
        .await
        .is_none_or(|status| !status.success())
    {
        failures.push("the restarted sidecar did not stop cleanly".into());
    }
    failures.truncate(20);
    // A check of nothing passes whatever the sidecar did: the run must have
    // looked up some commit inside its retention after the SIGKILL (none
    // if, say, the restart took longer than the retention), and, when the
    // load outlasted the retention, some commit past it.
    if checked_present == 0 {
        failures.push(format!(
            "no commit was checked present after the SIGKILL ({} acknowledged, {restart_took:?} to restart, retention {:?}): nothing shows that acknowledged commits survive it",
            committed.len(),
            config.retention
        ));
    }
    if checked_expired == 0 && config.duration > config.retention + EXPIRED_MARGIN {
        failures.push(format!(
            "no commit past its retention was checked gone ({} acknowledged over {:?}, retention {:?}): nothing shows that expiry and the reaper work",
            committed.len(),
            config.duration,
            config.retention
        ));
    }
    Ok(Soak {
        samples,
        reclaimed: reclaimed.len(),
        committed: committed.len(),
        checked_present,
        checked_expired,
        failures,
    })
}

/// What is not flat after the warm-up: the last third of the samples
/// against the first third (medians), with some slack for noise.
fn judge(samples: &[Sample], config: &SoakConfig) -> Vec<String> {
    let mut failures = Vec::new();
    let errors: u64 = samples.iter().map(|s| s.errors).sum();
    if errors > 0 {
        failures.push(format!("{errors} calls failed"));
    }
    let judged: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.at_s >= config.warm_up.as_secs())
        .collect();
    if judged.len() < 6 {
        failures.push(format!(
            "only {} samples after the warm-up (at least 6)",
            judged.len()
        ));
        return failures;
    }
    let third = judged.len() / 3;
    let median = |part: &[&Sample], value: fn(&Sample) -> u64| {
        let mut values: Vec<u64> = part.iter().map(|s| value(s)).collect();
        values.sort_unstable();
        values[values.len() / 2]
    };
    let (first, last) = (&judged[..third], &judged[judged.len() - third..]);
    /// A figure, how much it may grow (times, plus), for noise.
    type Check = (&'static str, fn(&Sample) -> u64, f64, u64);
    let checks: [Check; 5] = [
        ("resident memory (KiB)", |s| s.rss_kib, 1.25, 16 << 10),
        ("open files", |s| s.open_files, 1.0, 8),
        ("data directory (bytes)", |s| s.disk_bytes, 1.5, 16 << 20),
        // Work per call that grows with what is stored (a sweep of
        // everything, say) shows here, load or no load.
        ("CPU per call (µs)", |s| s.cpu_us_per_call, 1.5, 50),
        ("p99 (µs)", |s| u64::from(s.p99_us), 2.0, 2_000),
    ];
    for (what, value, factor, slack) in checks {
        if what.starts_with("p99") && !config.judge_latency {
            continue;
        }
        let (before, after) = (median(first, value), median(last, value));
        if after as f64 > before as f64 * factor + slack as f64 {
            failures.push(format!(
                "{what} grew: median {before} in the first third after the warm-up, {after} in the last"
            ));
        }
    }
    failures
}
