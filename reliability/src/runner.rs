//! Records a history against the real `dedupd` binary: many clients on a
//! few keys (so they contend), short leases (so they run out mid-run and
//! get taken over), stale tokens (so refusals are exercised), and the
//! sidecar killed with SIGKILL and restarted on the same store mid-run.
//!
//! A call that fails with UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, UNKNOWN
//! or CANCELLED is an unknown outcome in the history, and also a
//! [`CallError`]: near a SIGKILL of the sidecar (a call overlapping one of
//! [`Run::kill_windows`]) or a failover of the store (one of
//! [`Run::failover_windows`]) it is what a dying connection or a store
//! briefly away gives; anywhere else it is the sidecar (or its store)
//! failing, and [`Run::errors_outside_windows`] names it so the run fails.
//! A store that answered UNAVAILABLE to everything would otherwise pass:
//! an unknown outcome is linearizable whatever happened.

use std::{
    io::Write,
    path::PathBuf,
    process::Stdio,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst},
        Arc, Mutex,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use dedupd::proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient};
use rand::{rngs::StdRng, Rng, SeedableRng};
use tokio::process::{Child, Command};
use tonic::{transport::Channel, Code};

use crate::history::{Answer, Call, Operation, Released, State, Token};

/// A call answered UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, UNKNOWN or
/// CANCELLED (recorded in the history as an unknown outcome).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallError {
    /// Which client made it.
    pub client: usize,
    /// Which key.
    pub key: u32,
    /// What was asked.
    pub call: Call,
    /// When it was sent (floor, wall-clock ms).
    pub invoked_ms: u64,
    /// When the error came (ceil, wall-clock ms).
    pub completed_ms: u64,
    /// The status code.
    pub code: Code,
    /// The status message.
    pub message: String,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} on key {} (client {}, {}..{} ms): {:?}: {}",
            self.call,
            self.key,
            self.client,
            self.invoked_ms,
            self.completed_ms,
            self.code,
            self.message
        )
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The `dedupd` binary.
    pub binary: PathBuf,
    /// Extra flags: the store (`--store postgres --store-url …`).
    pub store_flags: Vec<String>,
    /// Where sled (or the local tier) keeps its files.
    pub data_dir: PathBuf,
    /// Concurrent clients.
    pub clients: usize,
    /// Keys they share at any moment (a fresh set every `generation`, so
    /// committed keys do not leave nothing but duplicates to answer).
    pub keys: u32,
    /// How long one set of keys is in use.
    pub generation: Duration,
    /// How long the clients run at least.
    pub duration: Duration,
    /// They go on past `duration` until the history holds this many
    /// operations (a slow store or a busy machine), for at most three
    /// times `duration` in all.
    pub min_operations: usize,
    /// SIGKILLs of the sidecar, spread over the run.
    pub kills: usize,
    /// Leases are drawn from this range (ms).
    pub lease_ms: (u64, u64),
    /// Seed of the clients' choices.
    pub seed: u64,
    /// One sidecar per entry over the one shared store, each with its wall
    /// clock set off by that much by libfaketime (`+40s`, `-25s`, `+0s`);
    /// empty: one sidecar with the machine's clock. Clients are spread over
    /// the sidecars; the SIGKILLs take them in turn.
    pub clock_skews: Vec<String>,
    /// libfaketime's `libfaketimeMT.so.1`, for `clock_skews`.
    pub libfaketime: Option<PathBuf>,
    /// Where to fail a Redis primary over (a cluster's, or Sentinel's) and
    /// how many times during the run ([`crate::failover`]), spaced between
    /// the sidecars' SIGKILLs.
    pub store_failovers: Option<(crate::failover::Target, usize)>,
    /// Per sidecar (by index, as `clock_skews`): delays on its way to the
    /// shared store and back ([`crate::delay`]), through a forwarder of
    /// its own; empty: none.
    pub store_delays: Vec<crate::delay::Delays>,
}

/// A recorded run.
#[derive(Debug)]
pub struct Run {
    /// Every operation.
    pub history: Vec<Operation>,
    /// How long the clients ran.
    pub elapsed: Duration,
    /// SIGKILLs done.
    pub kills: usize,
    /// How long the sidecar was down in all.
    pub downtime: Duration,
    /// Around each SIGKILL, [from, to] in wall-clock ms: from just before
    /// the kill until [`KILL_SETTLE`] after the restarted sidecar was ready.
    pub kill_windows: Vec<(u64, u64)>,
    /// Every failed call (see [`CallError`]), in or out of a window.
    pub errors: Vec<CallError>,
    /// The store's primaries failed over (a cluster's), in order. Each
    /// opens a window for UNAVAILABLE and DEADLINE_EXCEEDED only (the
    /// sidecar must never answer INTERNAL for a store that is away):
    /// [`Run::failover_windows`].
    pub failovers: Vec<crate::failover::Failover>,
}

/// What a failed call is excused by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Excuse {
    /// It overlaps a SIGKILL of the sidecar (any code).
    Kill,
    /// It overlaps a failover of the store (UNAVAILABLE or
    /// DEADLINE_EXCEEDED).
    Failover,
}

impl Run {
    /// COMMITTED answers (not ALREADY_COMMITTED).
    pub fn committed(&self) -> usize {
        self.count(|answer| matches!(answer, Answer::Committed { already: false }))
    }

    /// CLAIMED answers, takeovers (`recovered`) included.
    pub fn claimed(&self) -> usize {
        self.count(|answer| matches!(answer, Answer::Claimed { .. }))
    }

    fn count(&self, which: impl Fn(&Answer) -> bool) -> usize {
        self.history.iter().filter(|op| which(&op.answer)).count()
    }

    /// Why the run is too thin to show anything, if it is: fewer COMMITTED
    /// or CLAIMED answers than the floors for `generations` key generations.
    pub fn below_floor(&self, generations: u64) -> Option<String> {
        let min_committed = (generations as f64 * MIN_COMMITTED_PER_GENERATION).ceil() as usize;
        let min_claimed = (generations as f64 * MIN_CLAIMED_PER_GENERATION).ceil() as usize;
        let (committed, claimed) = (self.committed(), self.claimed());
        (committed < min_committed || claimed < min_claimed).then(|| {
            format!(
                "too few answered calls for {generations} key generations: {committed} COMMITTED (at least {min_committed}), {claimed} CLAIMED (at least {min_claimed})"
            )
        })
    }

    /// Around each failover of the store, [from, to] in wall-clock ms: from
    /// the SIGKILL of its primary until [`FAILOVER_SETTLE`] after the
    /// cluster said it had settled.
    pub fn failover_windows(&self) -> Vec<(u64, u64)> {
        self.failovers
            .iter()
            .map(|failover| {
                (
                    failover.killed_at_ms,
                    failover.settled_at_ms() + FAILOVER_SETTLE.as_millis() as u64,
                )
            })
            .collect()
    }

    /// Why `error` is excused, if it is.
    pub fn excuse(&self, error: &CallError) -> Option<Excuse> {
        let overlaps = |windows: &[(u64, u64)]| {
            windows
                .iter()
                .any(|&(from, to)| error.invoked_ms <= to && error.completed_ms >= from)
        };
        if overlaps(&self.kill_windows) {
            Some(Excuse::Kill)
        } else if matches!(error.code, Code::Unavailable | Code::DeadlineExceeded)
            && overlaps(&self.failover_windows())
        {
            Some(Excuse::Failover)
        } else {
            None
        }
    }

    /// The errors no window excuses: a healthy sidecar on a healthy store
    /// has none, and each one fails the run.
    pub fn errors_outside_windows(&self) -> Vec<&CallError> {
        self.errors
            .iter()
            .filter(|error| self.excuse(error).is_none())
            .collect()
    }

    /// COMMITTED answers to calls sent after the last failover's window
    /// closed (all of them when there was none): a store that came back
    /// answering nothing but UNAVAILABLE has none.
    pub fn committed_after_failovers(&self) -> usize {
        let after = self
            .failover_windows()
            .iter()
            .map(|&(_, to)| to)
            .max()
            .unwrap_or(0);
        self.history
            .iter()
            .filter(|op| {
                op.invoked_ms > after && matches!(op.answer, Answer::Committed { already: false })
            })
            .count()
    }
}

/// The fewest CLAIMED answers a run must have per key generation, on
/// average. Each generation brings 4 fresh keys, whose first Claim a
/// healthy sidecar grants: measured in `--quick` runs (debug build, one
/// SIGKILL, this 2-core machine, often with other builds running) 3.5–4.9
/// per generation at `--generation 30ms` on sled, PostgreSQL and Redis, and
/// 6.6–8.4 at 500 ms. 1 leaves a margin of 3.5× even on a starved machine,
/// while a sidecar that claims (almost) nothing fails.
pub const MIN_CLAIMED_PER_GENERATION: f64 = 1.0;
/// The fewest COMMITTED answers a run must have per key generation, on
/// average: 1 per 20. At 30 ms a generation lasts about two calls of each
/// client, so most holders never come back to their key before it is
/// retired, and commits fall faster than calls when the machine is slow:
/// measured 0.1–1.2 per generation (28–319 in 267 generations; at least
/// 0.5 in every run that reached 10 000 operations), and 3–4 at 500 ms. A
/// twentieth is 2× below the most starved run seen (4 494 operations, which
/// fails the run anyway) and 10× below any run of 10 000, while a sidecar
/// whose commits all fail (INTERNAL, or UNAVAILABLE all along) has none.
pub const MIN_COMMITTED_PER_GENERATION: f64 = 0.05;

/// How many key generations a run of `duration` goes through.
pub fn generations(duration: Duration, generation: Duration) -> u64 {
    duration
        .as_millis()
        .div_ceil(generation.as_millis().max(1))
        .max(1) as u64
}

/// No answer within this is an unknown outcome.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The sidecar's own request timeout: a call it received may still take
/// effect this long after the client gave up.
const SERVER_REQUEST_TIMEOUT_MS: u64 = 10_000;
/// Records are kept far longer than the run: retention never ends one.
const RETENTION: &str = "1h";
/// How long after a restarted sidecar is ready a kill window lasts: each
/// client's first call on its dead connection may still fail then.
pub const KILL_SETTLE: Duration = Duration::from_secs(1);
/// How long after the cluster settled a failover window lasts: the
/// sidecar's cluster client learns the new slot map on its next refresh.
pub const FAILOVER_SETTLE: Duration = Duration::from_secs(2);
/// The clients go on at least this long after the last failover window
/// closed, so that the run shows the store serving again.
pub const AFTER_FAILOVER: Duration = Duration::from_secs(5);

fn now_floor_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970");
    since.as_millis() as u64
}

fn now_ceil_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970");
    since.as_millis() as u64 + u64::from(!since.subsec_nanos().is_multiple_of(1_000_000))
}

struct Sidecar {
    child: Child,
}

/// Starts sidecar number `index` (its own files, its clock skew if any).
async fn start(
    config: &RunConfig,
    store_flags: &[String],
    index: usize,
    port: u16,
) -> Result<Sidecar, String> {
    let home = config.data_dir.join(format!("sidecar-{index}"));
    std::fs::create_dir_all(&home).map_err(|e| e.to_string())?;
    let ready = home.join("ready.json");
    let _ = std::fs::remove_file(&ready);
    // Every start's log kept, one after another: a failed run says why.
    let log = home.join("log");
    let mut log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    writeln!(
        log_file,
        "=== dedupd-reliability: sidecar {index} started at {} ms since the epoch ===",
        now_floor_ms()
    )
    .map_err(|e| format!("{}: {e}", log.display()))?;
    let mut command = Command::new(&config.binary);
    if let Some(skew) = config.clock_skews.get(index) {
        let library = config
            .libfaketime
            .as_ref()
            .ok_or("--clock-skews needs libfaketime (apt-get install faketime)")?;
        command
            .env("LD_PRELOAD", library)
            .env("FAKETIME", skew)
            .env("DONT_FAKE_MONOTONIC", "1");
    }
    let child = command
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            // (Its /readyz says when the store is ready: see below.)
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(["--default-retention", RETENTION, "--log", "warn"])
        .arg("--data-dir")
        .arg(home.join("data"))
        .arg("--ready-file")
        .arg(&ready)
        .args(store_flags)
        .stdout(Stdio::null())
        .stderr(log_file)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", config.binary.display()))?;
    let mut sidecar = Sidecar { child };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        if let Ok(Some(status)) = sidecar.child.try_wait() {
            return Err(format!("dedupd exited at start: {status}"));
        }
        if Instant::now() > deadline {
            return Err("dedupd was not ready within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Serving is not ready: a shared store's connection and schema come
    // after the listener (a sidecar whose store is down still starts, and
    // says NOT_SERVING). Calls start once /readyz says so, as a Kubernetes
    // readiness probe would let them; until then this is the start's time.
    loop {
        if readyz_ok(&ready).await {
            return Ok(sidecar);
        }
        if let Ok(Some(status)) = sidecar.child.try_wait() {
            return Err(format!("dedupd exited at start: {status}"));
        }
        if Instant::now() > deadline {
            return Err("dedupd's /readyz did not answer 200 within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether the sidecar whose ready file is `ready` answers `/readyz` 200.
async fn readyz_ok(ready: &std::path::Path) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(ops) = std::fs::read_to_string(ready)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|value| value["metrics"].as_str().map(str::to_owned))
    else {
        return false;
    };
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(&ops).await?;
        let request = format!("GET /readyz HTTP/1.1\r\nHost: {ops}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), exchange).await,
        Ok(Ok(answer)) if answer.starts_with(b"HTTP/1.1 200")
    )
}

/// Runs the clients and the killer; returns the history.
pub async fn run(config: RunConfig) -> Result<Run, String> {
    std::fs::create_dir_all(&config.data_dir).map_err(|e| e.to_string())?;
    let count = config
        .clock_skews
        .len()
        .max(config.store_delays.len())
        .max(1);
    // Each sidecar's store flags: its --store-url through its delaying
    // forwarder, if it has delays.
    let mut forwarders = Vec::new();
    let mut flags = Vec::with_capacity(count);
    for index in 0..count {
        let mut own = config.store_flags.clone();
        if let Some(delays) = config.store_delays.get(index) {
            let url = own
                .iter()
                .position(|flag| flag == "--store-url")
                .map(|at| at + 1)
                .filter(|at| *at < own.len())
                .ok_or("--store-delays needs a shared store")?;
            let (before, port, after) = loopback_port(&own[url])?;
            let (through, task) = crate::delay::start(port, *delays).await?;
            own[url] = format!("{before}127.0.0.1:{through}{after}");
            forwarders.push(task);
        }
        flags.push(own);
    }
    let mut ports = Vec::with_capacity(count);
    let mut sidecars = Vec::with_capacity(count);
    for (index, own) in flags.iter().enumerate() {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            probe.local_addr().map_err(|e| e.to_string())?.port()
        };
        sidecars.push(start(&config, own, index, port).await?);
        ports.push(port);
    }
    let history = Arc::new(Mutex::new(Vec::new()));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let recorded = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let (deadline, latest) = (started + config.duration, started + config.duration * 3);
    // While failovers are due, and for AFTER_FAILOVER past the last one's
    // window, the clients go on (up to `latest`).
    let hold_until_ms = Arc::new(AtomicU64::new(if config.store_failovers.is_some() {
        u64::MAX
    } else {
        0
    }));
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..config.clients {
        let (history, errors, recorded, hold_until_ms, config) = (
            Arc::clone(&history),
            Arc::clone(&errors),
            Arc::clone(&recorded),
            Arc::clone(&hold_until_ms),
            config.clone(),
        );
        let port = ports[client % count];
        clients.spawn(async move {
            let channel = Channel::from_shared(format!("http://127.0.0.1:{port}"))
                .expect("a valid URI")
                .connect_timeout(Duration::from_secs(1))
                .timeout(CALL_TIMEOUT)
                .connect_lazy();
            let mut worker = Client {
                id: client,
                rpc: ClaimAndCommitClient::new(channel),
                rng: StdRng::seed_from_u64(config.seed ^ (client as u64).wrapping_mul(0x9e37_79b9)),
                held: Vec::new(),
                config,
            };
            let min_operations = worker.config.min_operations;
            loop {
                let now = Instant::now();
                let short = recorded.load(SeqCst) < min_operations
                    || now_floor_ms() < hold_until_ms.load(SeqCst);
                if now >= latest || (now >= deadline && !short) {
                    break;
                }
                let (operation, error) = worker.step(started).await?;
                let failed = operation.answer == Answer::Unknown;
                history.lock().expect("history lock").push(operation);
                recorded.fetch_add(1, SeqCst);
                if let Some(error) = error {
                    errors.lock().expect("errors lock").push(error);
                }
                if failed {
                    tokio::time::sleep(Duration::from_millis(20)).await; // the sidecar is away
                }
            }
            Ok::<(), String>(())
        });
    }
    let failovers = config.store_failovers.clone().map(|(target, count)| {
        let duration = config.duration;
        let hold_until_ms = Arc::clone(&hold_until_ms);
        tokio::spawn(async move {
            let mut done = Vec::with_capacity(count);
            for failover in 1..=count {
                let at = started + duration.mul_f64((failover as f64 - 0.5) / (count + 1) as f64);
                tokio::time::sleep_until(at.into()).await;
                let outcome = target.fail_over(Duration::from_secs(60)).await;
                let Ok(failover) = outcome else {
                    hold_until_ms.store(0, SeqCst);
                    return outcome.map(|_| done);
                };
                done.push(failover);
            }
            let last = done.last().map_or(0, |failover| {
                failover.settled_at_ms() + (FAILOVER_SETTLE + AFTER_FAILOVER).as_millis() as u64
            });
            hold_until_ms.store(last, SeqCst);
            Ok::<_, String>(done)
        })
    });
    let mut kills = 0;
    let mut downtime = Duration::ZERO;
    let mut kill_windows = Vec::new();
    for kill in 1..=config.kills {
        let at = started
            + config
                .duration
                .mul_f64(kill as f64 / (config.kills + 1) as f64);
        tokio::time::sleep_until(at.into()).await;
        let window_from = now_floor_ms();
        let victim = (kill - 1) % count;
        let sidecar = &mut sidecars[victim];
        sidecar
            .child
            .start_kill()
            .map_err(|e| format!("SIGKILL: {e}"))?;
        let _ = sidecar.child.wait().await;
        let down = Instant::now();
        *sidecar = start(&config, &flags[victim], victim, ports[victim]).await?;
        downtime += down.elapsed();
        kill_windows.push((window_from, now_ceil_ms() + KILL_SETTLE.as_millis() as u64));
        kills += 1;
    }
    while let Some(result) = clients.join_next().await {
        result.map_err(|e| format!("a client panicked: {e}"))??;
    }
    let elapsed = started.elapsed();
    let failovers = match failovers {
        Some(task) => task
            .await
            .map_err(|e| format!("the failover task panicked: {e}"))??,
        None => Vec::new(),
    };
    drop(sidecars);
    for forwarder in forwarders {
        forwarder.abort();
    }
    let history = std::mem::take(&mut *history.lock().expect("history lock"));
    let errors = std::mem::take(&mut *errors.lock().expect("errors lock"));
    Ok(Run {
        history,
        elapsed,
        kills,
        downtime,
        kill_windows,
        errors,
        failovers,
    })
}

enum Exchange {
    Status(tonic::Status),
    Surprise(String),
}

struct Client {
    id: usize,
    rpc: ClaimAndCommitClient<Channel>,
    rng: StdRng,
    /// Tokens this client was granted, newest last (older ones go stale).
    held: Vec<(u32, Token)>,
    config: RunConfig,
}

fn correlation_id(key: u32) -> String {
    format!("key-{key}")
}

fn duration(ms: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

fn millis(duration: Option<&prost_types::Duration>) -> u64 {
    duration.map_or(0, |d| d.seconds as u64 * 1000 + d.nanos as u64 / 1_000_000)
}

fn timestamp_ms(timestamp: Option<&prost_types::Timestamp>) -> u64 {
    timestamp.map_or(0, |t| t.seconds as u64 * 1000 + t.nanos as u64 / 1_000_000)
}

fn token_of(text: &str) -> Result<Token, String> {
    Token::from_str_radix(text, 16).map_err(|_| format!("lease token {text:?} is not hex"))
}

impl Client {
    /// One random call, recorded; with it, the error it got if it failed
    /// (see [`CallError`]).
    async fn step(&mut self, started: Instant) -> Result<(Operation, Option<CallError>), String> {
        let generation =
            (started.elapsed().as_millis() / self.config.generation.as_millis().max(1)) as u32;
        let key = generation * self.config.keys + self.rng.random_range(0..self.config.keys);
        let mine: Vec<Token> = self
            .held
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, t)| *t)
            .collect();
        let lease_ms = self
            .rng
            .random_range(self.config.lease_ms.0..=self.config.lease_ms.1);
        let roll = self.rng.random_range(0..100);
        let call = match mine.last() {
            // No token for this key: mostly claim it.
            None if roll < 75 => Call::Claim { lease_ms },
            None => Call::Lookup,
            Some(&token) => {
                // Sometimes an older token: it should be refused.
                let token = if roll % 7 == 0 { mine[0] } else { token };
                match roll {
                    0..=29 => Call::Commit { token },
                    30..=44 => Call::Release { token },
                    45..=69 => Call::Renew { token, lease_ms },
                    70..=84 => Call::Lookup,
                    _ => Call::Claim { lease_ms },
                }
            }
        };
        // Now and then a holder stalls past its lease, so others take over.
        if !mine.is_empty() && roll >= 90 {
            tokio::time::sleep(Duration::from_millis(self.config.lease_ms.1)).await;
        }
        let invoked_ms = now_floor_ms();
        let answer = self.send(key, &call).await?;
        let mut completed_ms = now_ceil_ms();
        let mut error = None;
        let answer = match answer {
            Ok(answer) => answer,
            Err(status) if status.code() == Code::FailedPrecondition => Answer::LeaseLost,
            // Unknown in the history; the run judges them by when they came
            // (Run::errors_outside_windows).
            Err(status) => {
                let code = status.code();
                if !matches!(
                    code,
                    Code::Unavailable
                        | Code::DeadlineExceeded
                        | Code::Unknown
                        | Code::Cancelled
                        | Code::Internal
                ) {
                    return Err(format!(
                        "{call:?} on key {key}: unexpected {code:?}: {}",
                        status.message()
                    ));
                }
                error = Some(CallError {
                    client: self.id,
                    key,
                    call: call.clone(),
                    invoked_ms,
                    completed_ms,
                    code,
                    message: status.message().to_owned(),
                });
                // The sidecar may still act on a call the client gave up on
                // until its own request timeout: it lasts that long in the
                // history.
                if code == Code::DeadlineExceeded {
                    completed_ms += SERVER_REQUEST_TIMEOUT_MS;
                }
                Answer::Unknown
            }
        };
        match &answer {
            Answer::Claimed { token, .. } => {
                self.held.push((key, *token));
                // Keep a few: old ones are the stale tokens.
                if self.held.len() > 8 {
                    self.held.remove(0);
                }
            }
            Answer::Committed { .. } | Answer::Release(_) => {
                if let Call::Commit { token } | Call::Release { token } = call {
                    self.held.retain(|(_, t)| *t != token);
                }
            }
            _ => {}
        }
        let operation = Operation {
            client: self.id,
            key,
            call,
            invoked_ms,
            completed_ms,
            answer,
        };
        Ok((operation, error))
    }

    /// The answer; Err(status) when the call failed; a protocol surprise
    /// (an outcome this call cannot have) ends the run.
    async fn send(
        &mut self,
        key: u32,
        call: &Call,
    ) -> Result<Result<Answer, tonic::Status>, String> {
        match self.exchange(key, call).await {
            Ok(answer) => Ok(Ok(answer)),
            Err(Exchange::Status(status)) => Ok(Err(status)),
            Err(Exchange::Surprise(surprise)) => Err(format!("{call:?} on key {key}: {surprise}")),
        }
    }

    async fn exchange(&mut self, key: u32, call: &Call) -> Result<Answer, Exchange> {
        let correlation_id = correlation_id(key);
        let bad = Exchange::Surprise;
        Ok(match call {
            Call::Claim { lease_ms } => {
                let answer = self
                    .rpc
                    .claim(pb::ClaimRequest {
                        correlation_id,
                        lease_ttl: Some(duration(*lease_ms)),
                        ..Default::default()
                    })
                    .await
                    .map_err(Exchange::Status)?
                    .into_inner();
                let record = answer.record.unwrap_or_default();
                match pb::ClaimOutcome::try_from(answer.outcome) {
                    Ok(pb::ClaimOutcome::Claimed) => Answer::Claimed {
                        token: token_of(&answer.lease_token).map_err(Exchange::Surprise)?,
                        fencing: answer.fencing_token,
                        attempt: answer.attempt,
                        recovered: answer.recovered,
                        lease_expires_ms: timestamp_ms(answer.lease_expires_at.as_ref()),
                    },
                    Ok(pb::ClaimOutcome::Duplicate) => Answer::Duplicate {
                        fencing: answer.fencing_token,
                        attempt: record.attempt,
                    },
                    Ok(pb::ClaimOutcome::InProgress) => Answer::InProgress {
                        retry_after_ms: millis(answer.retry_after.as_ref()),
                    },
                    other => return Err(bad(format!("unexpected claim outcome {other:?}"))),
                }
            }
            Call::Commit { token } => {
                let answer = self
                    .rpc
                    .commit(pb::CommitRequest {
                        correlation_id,
                        lease_token: format!("{token:032x}"),
                        response: b"done".to_vec(),
                        ..Default::default()
                    })
                    .await
                    .map_err(Exchange::Status)?
                    .into_inner();
                match pb::CommitOutcome::try_from(answer.outcome) {
                    Ok(pb::CommitOutcome::Committed) => Answer::Committed { already: false },
                    Ok(pb::CommitOutcome::AlreadyCommitted) => Answer::Committed { already: true },
                    other => return Err(bad(format!("unexpected commit outcome {other:?}"))),
                }
            }
            Call::Release { token } => {
                let answer = self
                    .rpc
                    .release(pb::ReleaseRequest {
                        correlation_id,
                        lease_token: format!("{token:032x}"),
                        ..Default::default()
                    })
                    .await
                    .map_err(Exchange::Status)?
                    .into_inner();
                match pb::ReleaseOutcome::try_from(answer.outcome) {
                    Ok(pb::ReleaseOutcome::Released) => Answer::Release(Released::Released),
                    Ok(pb::ReleaseOutcome::AlreadyReleased) => {
                        Answer::Release(Released::AlreadyReleased)
                    }
                    Ok(pb::ReleaseOutcome::NotFound) => Answer::Release(Released::NotFound),
                    other => return Err(bad(format!("unexpected release outcome {other:?}"))),
                }
            }
            Call::Renew { token, lease_ms } => {
                let answer = self
                    .rpc
                    .renew(pb::RenewRequest {
                        correlation_id,
                        lease_token: format!("{token:032x}"),
                        lease_ttl: Some(duration(*lease_ms)),
                        ..Default::default()
                    })
                    .await
                    .map_err(Exchange::Status)?
                    .into_inner();
                Answer::Renewed {
                    lease_expires_ms: timestamp_ms(answer.lease_expires_at.as_ref()),
                }
            }
            Call::Lookup => {
                let answer = self
                    .rpc
                    .lookup(pb::LookupRequest {
                        correlation_id,
                        ..Default::default()
                    })
                    .await
                    .map_err(Exchange::Status)?
                    .into_inner();
                match (answer.found, answer.record) {
                    (true, Some(record)) => Answer::Found {
                        state: match pb::RecordState::try_from(record.state) {
                            Ok(pb::RecordState::Claimed) => State::Claimed,
                            Ok(pb::RecordState::Committed) => State::Committed,
                            Ok(pb::RecordState::Released) => State::Released,
                            other => return Err(bad(format!("unexpected record state {other:?}"))),
                        },
                        fencing: record.fencing_token,
                        attempt: record.attempt,
                    },
                    _ => Answer::Absent,
                }
            }
        })
    }
}

/// A store URL that names `127.0.0.1:<port>` split around it: what comes
/// before the host, the port, and what follows it.
fn loopback_port(url: &str) -> Result<(&str, u16, &str), String> {
    let at = url
        .find("127.0.0.1:")
        .ok_or_else(|| format!("--store-delays needs a store at 127.0.0.1, not {url}"))?;
    let from = at + "127.0.0.1:".len();
    let digits = url[from..]
        .find(|c: char| !c.is_ascii_digit())
        .map_or(url.len(), |end| from + end);
    let port = url[from..digits]
        .parse()
        .map_err(|_| format!("no port after 127.0.0.1 in {url}"))?;
    Ok((&url[..at], port, &url[digits..]))
}
