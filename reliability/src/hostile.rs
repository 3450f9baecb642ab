//! Hostile clients against the real sidecar while a well-behaved one keeps
//! working (issue 16, item 4). Each attack runs for a phase; meanwhile the
//! well-behaved client — connected before any attack, as an application's
//! pooled channel is — claims and commits fresh keys one after another and
//! times every call. The run passes when, in every phase, that client gets
//! every answer, its p99 stays within 10× the quiet baseline's (a phase slow
//! and nothing else is measured once more, against a fresh quiet baseline
//! too: another process may have loaded the machine), and the sidecar's
//! memory stays under a bound (and, in `idle-tcp`, the sidecar closes the
//! silent connections it holds, 90 % of them at least; at the proxy, also
//! the slow and oversized ones).
//!
//! Two targets: the gRPC listener ([`Target::Grpc`], below) and the HTTP
//! idempotency proxy ([`Target::Proxy`], in [`proxy`]).
//!
//! Against the gRPC listener, the attacks write HTTP/2 by hand
//! ([`crate::h2raw`]) on raw sockets:
//! - `idle-tcp`: connections that send nothing;
//! - `idle-h2`: connections that send the preface and SETTINGS, then nothing;
//! - `slowloris`: connections that open every stream they may (HEADERS of a
//!   Claim) and never send the body;
//! - `rst-flood`: HEADERS then RST_STREAM, again and again (CVE-2023-44487);
//! - `big-metadata`: a 10 MB header (HEADERS + CONTINUATION frames);
//! - `non-reading`: connections that send Lookups of a key holding a 60 KiB
//!   answer and never read a byte.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
        Arc,
    },
    time::{Duration, Instant},
};

use dedupd::proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient};
use prost::Message;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    task::JoinSet,
};
use tonic::transport::Channel;

use crate::{h2raw, sidecar::Sidecar};

pub mod proxy;

pub use proxy::PROXY_ATTACKS;

/// The attacks on the gRPC listener, in the order they run.
pub const ATTACKS: [&str; 6] = [
    "idle-tcp",
    "idle-h2",
    "slowloris",
    "rst-flood",
    "big-metadata",
    "non-reading",
];

/// What the attacks and the well-behaved client talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// The sidecar's gRPC listener.
    Grpc,
    /// Its HTTP idempotency proxy (`--http-proxy-listen`), in front of an
    /// upstream the runner serves itself.
    Proxy,
}

impl Target {
    /// Its attacks, in the order they run.
    pub fn attacks(self) -> &'static [&'static str] {
        match self {
            Target::Grpc => &ATTACKS,
            Target::Proxy => &PROXY_ATTACKS,
        }
    }

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Target::Grpc => "grpc",
            Target::Proxy => "proxy",
        }
    }

    /// How long a connection may stay silent before the sidecar closes it:
    /// the gRPC listener's handshake timeout (its default, 5 s), the
    /// proxy's header timeout (the runner starts it with 3 s).
    pub fn first_bytes_deadline(self) -> Duration {
        match self {
            Target::Grpc => Duration::from_secs(5),
            Target::Proxy => proxy::DEADLINE,
        }
    }
}

/// Every attack name of every target (for `--attack`'s help; which ones a
/// target has is [`Target::attacks`]).
pub fn all_attacks() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = ATTACKS.to_vec();
    for name in PROXY_ATTACKS {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// What a run does.
#[derive(Debug, Clone)]
pub struct HostileConfig {
    /// What is attacked.
    pub target: Target,
    /// How long each phase (the baseline, each attack, the recovery) lasts.
    pub phase: Duration,
    /// Connections of the idle attacks.
    pub idle_connections: usize,
    /// Connections of the other attacks.
    pub attack_connections: usize,
    /// The p99 bound, as a multiple of the baseline's.
    pub max_p99_ratio: f64,
    /// The sidecar's resident memory bound, KiB (plus, for clients that
    /// never read, what their streams may pin).
    pub max_rss_kib: u64,
    /// The sidecar's `--max-connections` (the runner starts it with this):
    /// how many idle connections it holds, and so must close, at once.
    pub max_connections: usize,
}

/// How long past an attack's deadline the runner waits for the sidecar's
/// closes to be seen before it counts them short (a loaded machine).
const CLOSE_SLACK: Duration = Duration::from_secs(5);
/// The share of the connections a deadline must end that must be seen
/// ended: all of them but the odd one still connecting when counted.
const CLOSED_SHARE: f64 = 0.9;

/// Latencies of one phase, in microseconds.
#[derive(Debug, Default, Clone)]
pub struct Latencies {
    samples: Vec<u32>,
    /// Calls that failed.
    pub errors: u64,
    /// Why they failed (the status, or no answer in time), counted: a
    /// failed phase says what the client got.
    pub error_reasons: std::collections::BTreeMap<String, u64>,
}

impl Latencies {
    /// Counts a failed call, for `reason`.
    pub fn failed(&mut self, reason: String) {
        self.errors += 1;
        *self.error_reasons.entry(reason).or_default() += 1;
    }

    /// Calls answered.
    pub fn count(&self) -> usize {
        self.samples.len()
    }

    /// The `q` quantile (0–1), microseconds.
    pub fn quantile(&self, q: f64) -> u32 {
        let mut sorted = self.samples.clone();
        sorted.sort_unstable();
        sorted
            .get(((sorted.len() as f64 * q).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0)
    }
}

/// A well-behaved client, connected before any attack.
trait WellBehaved {
    /// Works for `duration` (keys named after `prefix`, which no other
    /// phase uses), timing every call.
    async fn work(&mut self, prefix: &str, duration: Duration) -> Latencies;
}

impl WellBehaved for ClaimAndCommitClient<Channel> {
    async fn work(&mut self, prefix: &str, duration: Duration) -> Latencies {
        well_behaved(self, prefix, duration).await
    }
}

/// The well-behaved client: claims and commits fresh keys one after
/// another for `duration`, timing every call.
pub async fn well_behaved(
    client: &mut ClaimAndCommitClient<Channel>,
    prefix: &str,
    duration: Duration,
) -> Latencies {
    let mut latencies = Latencies::default();
    let end = Instant::now() + duration;
    let mut i = 0u64;
    while Instant::now() < end {
        i += 1;
        let id = format!("{prefix}-{i}");
        let started = Instant::now();
        let claimed = tokio::time::timeout(
            Duration::from_secs(5),
            client.claim(pb::ClaimRequest {
                correlation_id: id.clone(),
                ..Default::default()
            }),
        )
        .await;
        let token = match claimed {
            Ok(Ok(answer)) if answer.get_ref().outcome == pb::ClaimOutcome::Claimed as i32 => {
                answer.into_inner().lease_token
            }
            Ok(Ok(answer)) => {
                latencies.failed(format!(
                    "Claim of a fresh key answered {:?}",
                    pb::ClaimOutcome::try_from(answer.get_ref().outcome)
                ));
                continue;
            }
            Ok(Err(status)) => {
                latencies.failed(format!("Claim: {:?} {}", status.code(), status.message()));
                continue;
            }
            Err(_) => {
                latencies.failed("Claim: no answer within 5 s".into());
                continue;
            }
        };
        latencies.samples.push(started.elapsed().as_micros() as u32);
        let started = Instant::now();
        let committed = tokio::time::timeout(
            Duration::from_secs(5),
            client.commit(pb::CommitRequest {
                correlation_id: id,
                lease_token: token,
                ..Default::default()
            }),
        )
        .await;
        match committed {
            Ok(Ok(_)) => latencies.samples.push(started.elapsed().as_micros() as u32),
            Ok(Err(status)) => {
                latencies.failed(format!("Commit: {:?} {}", status.code(), status.message()))
            }
            Err(_) => latencies.failed("Commit: no answer within 5 s".into()),
        }
    }
    latencies
}

/// What an attack did.
#[derive(Debug, Default)]
pub struct AttackCounters {
    /// Connections opened.
    pub connections: AtomicU64,
    /// Connections the sidecar closed (read end or write error).
    pub closed_by_server: AtomicU64,
    /// Streams opened (HTTP/2: HEADERS sent; HTTP/1.1: request heads
    /// begun).
    pub streams: AtomicU64,
    /// Bytes written.
    pub bytes: AtomicU64,
}

impl AttackCounters {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "connections": self.connections.load(Relaxed),
            "closed_by_server": self.closed_by_server.load(Relaxed),
            "streams": self.streams.load(Relaxed),
            "bytes": self.bytes.load(Relaxed),
        })
    }
}

/// One phase's figures.
#[derive(Debug)]
pub struct PhaseReport {
    /// `baseline`, an attack's name, or `recovery`.
    pub phase: String,
    /// The well-behaved client's calls.
    pub latencies: Latencies,
    /// The p99 it was held to a multiple of, microseconds.
    pub baseline_p99_us: u32,
    /// Its p99 over the baseline's.
    pub p99_ratio: f64,
    /// The sidecar's resident memory at the phase's end, KiB.
    pub rss_kib: u64,
    /// The bound it was held to, KiB.
    pub rss_bound_kib: u64,
    /// Its open files at the phase's end.
    pub open_files: u64,
    /// What the attack did.
    pub attack: serde_json::Value,
    /// Whether the phase met the bounds.
    pub passed: bool,
    /// Whether it met every bound but the p99's.
    pub slow_only: bool,
    /// How many times it was measured (a second time when it was only
    /// slow: see [`run`]).
    pub attempts: u32,
}

impl PhaseReport {
    /// One JSON line.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "phase": self.phase,
            "calls": self.latencies.count(),
            "errors": self.latencies.errors,
            "error_reasons": self.latencies.error_reasons,
            "p50_us": self.latencies.quantile(0.5),
            "p99_us": self.latencies.quantile(0.99),
            "max_us": self.latencies.quantile(1.0),
            "baseline_p99_us": self.baseline_p99_us,
            "p99_ratio": (self.p99_ratio * 100.0).round() / 100.0,
            "rss_kib": self.rss_kib,
            "rss_bound_kib": self.rss_bound_kib,
            "open_files": self.open_files,
            "attack": self.attack,
            "passed": self.passed,
            "attempts": self.attempts,
        })
    }
}

/// Runs the baseline, every attack in `attacks`, and a recovery phase
/// against `sidecar`'s `config.target`; one report per phase. A phase that
/// met every bound but its p99's is measured once more (an attack against
/// a fresh quiet baseline as well): the bound is about what the attack
/// does, not about another process that loaded the machine meanwhile.
pub async fn run(
    sidecar: &Sidecar,
    config: &HostileConfig,
    attacks: &[&str],
) -> Result<Vec<PhaseReport>, String> {
    if let Some(unknown) = attacks
        .iter()
        .find(|attack| !config.target.attacks().contains(attack))
    {
        return Err(format!(
            "no attack named {unknown:?} for --target {} (known: {:?})",
            config.target.name(),
            config.target.attacks()
        ));
    }
    match config.target {
        Target::Grpc => run_grpc(sidecar, config, attacks).await,
        Target::Proxy => proxy::run(sidecar, config, attacks).await,
    }
}

async fn run_grpc(
    sidecar: &Sidecar,
    config: &HostileConfig,
    attacks: &[&str],
) -> Result<Vec<PhaseReport>, String> {
    let channel = Channel::from_shared(format!("http://{}", sidecar.grpc))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("the well-behaved client cannot connect: {e}"))?;
    let mut client = ClaimAndCommitClient::new(channel);
    // The key the non-reading clients look up: its answer is 60 KiB.
    let claimed = client
        .claim(pb::ClaimRequest {
            correlation_id: "big-answer".into(),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    client
        .commit(pb::CommitRequest {
            correlation_id: "big-answer".into(),
            lease_token: claimed.lease_token,
            response: vec![7u8; 60 << 10],
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    phases(sidecar, config, attacks, sidecar.grpc, &mut client).await
}

/// The warm-up, the baseline, each attack on `target` and the recovery,
/// with `client` working all along.
async fn phases(
    sidecar: &Sidecar,
    config: &HostileConfig,
    attacks: &[&str],
    target: SocketAddr,
    client: &mut impl WellBehaved,
) -> Result<Vec<PhaseReport>, String> {
    // Warm-up, not counted.
    client.work("warm-up", Duration::from_millis(500)).await;

    let mut reports = Vec::new();
    let baseline = client.work("baseline", config.phase).await;
    let baseline_p99 = f64::from(baseline.quantile(0.99).max(1));
    reports.push(report(
        "baseline",
        baseline,
        baseline_p99,
        sidecar,
        config,
        None,
    ));
    for (index, &attack) in attacks.iter().enumerate() {
        // Each phase's keys its own: an attack given twice, or measured
        // again, claims fresh keys.
        let prefix = format!("{attack}-{index}");
        let mut sampled = attack_phase(
            sidecar,
            config,
            (attack, &prefix),
            target,
            client,
            baseline_p99,
        )
        .await?;
        // Slower than its bound and nothing else wrong: measured again once,
        // against the higher of the first baseline and a quiet phase taken
        // just before. A build that loads the machine now and not during
        // the first baseline passes the second time; an attack that really
        // starves the client fails it as well.
        if sampled.slow_only {
            let quiet = client.work(&format!("quiet-{prefix}"), config.phase).await;
            let quiet_p99 = f64::from(quiet.quantile(0.99).max(1));
            sampled = attack_phase(
                sidecar,
                config,
                (attack, &format!("{prefix}-again")),
                target,
                client,
                baseline_p99.max(quiet_p99),
            )
            .await?;
            sampled.attempts = 2;
        }
        reports.push(sampled);
    }
    let mut recovery = report(
        "recovery",
        client.work("recovery", config.phase).await,
        baseline_p99,
        sidecar,
        config,
        None,
    );
    if recovery.slow_only {
        recovery = report(
            "recovery",
            client.work("recovery-again", config.phase).await,
            baseline_p99,
            sidecar,
            config,
            None,
        );
        recovery.attempts = 2;
    }
    reports.push(recovery);
    Ok(reports)
}

/// One attack for a phase while `client` works; its report, the p99 held
/// to `baseline_p99`'s multiple.
async fn attack_phase(
    sidecar: &Sidecar,
    config: &HostileConfig,
    (attack, prefix): (&str, &str),
    target: SocketAddr,
    client: &mut impl WellBehaved,
    baseline_p99: f64,
) -> Result<PhaseReport, String> {
    let counters = Arc::new(AttackCounters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut attackers = JoinSet::new();
    let attack_started = Instant::now();
    start_attack(attack, target, config, &counters, &stop, &mut attackers)?;
    // Let the attack take hold before measuring.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let latencies = client.work(prefix, config.phase).await;
    // Connections the sidecar must end are counted until they are all seen
    // ended, or CLOSE_SLACK past their deadline: never skipped, however
    // short the phase.
    let closes = must_close(config, attack).map(|(deadline, required)| {
        let until = attack_started + deadline + CLOSE_SLACK;
        (until, required)
    });
    if let Some((until, required)) = closes {
        while counters.closed_by_server.load(Relaxed) < required && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let sampled = report(
        attack,
        latencies,
        baseline_p99,
        sidecar,
        config,
        Some((&counters, closes.map(|(_, required)| required))),
    );
    stop.store(true, Relaxed);
    attackers.shutdown().await;
    // The sidecar sees the attackers' sockets close.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(sampled)
}

/// The connections an attack's deadline must end, if it has one: by when
/// (from the attack's start) and how many at least.
///
/// Connections that never send their first bytes are closed after the
/// target's deadline (gRPC: the 5 s handshake timeout; the proxy: its 3 s
/// header timeout): as many as the sidecar holds at once, the lesser of
/// the idle connections and its `--max-connections` (less the well-behaved
/// client's). At the proxy, so are those that never end their head or body
/// or trickle an unkeyed one (each attacker's), that send one too large (at
/// once), that make no room for their HTTP/2 answers (their streams reset:
/// each attacker's), and idle HTTP/2 ones at their maximum age.
fn must_close(config: &HostileConfig, attack: &str) -> Option<(Duration, u64)> {
    let share = |connections: usize| (connections as f64 * CLOSED_SHARE).floor().max(1.0) as u64;
    match (config.target, attack) {
        (target, "idle-tcp") => Some((
            target.first_bytes_deadline(),
            share(
                config
                    .idle_connections
                    .min(config.max_connections.saturating_sub(1)),
            ),
        )),
        (Target::Proxy, "idle-h2") => Some((
            proxy::MAX_AGE.mul_f64(1.1),
            share(
                config
                    .idle_connections
                    .min(config.max_connections.saturating_sub(1)),
            ),
        )),
        (
            Target::Proxy,
            "slowloris" | "slow-body" | "slow-unkeyed-body" | "zero-window-h2" | "tiny-window-h2",
        ) => Some((proxy::DEADLINE, share(config.attack_connections))),
        (Target::Proxy, "big-headers") => Some((Duration::ZERO, share(config.attack_connections))),
        _ => None,
    }
}

fn report(
    phase: &str,
    latencies: Latencies,
    baseline_p99: f64,
    sidecar: &Sidecar,
    config: &HostileConfig,
    attack: Option<(&AttackCounters, Option<u64>)>,
) -> PhaseReport {
    let sample = sidecar.sample();
    let p99_ratio = f64::from(latencies.quantile(0.99)) / baseline_p99;
    let silent_ones_closed = attack.is_none_or(|(counters, required)| {
        required.is_none_or(|required| counters.closed_by_server.load(Relaxed) >= required)
    });
    let rss_bound_kib = rss_bound_kib(phase, config);
    let fast_enough = p99_ratio <= config.max_p99_ratio;
    let otherwise_passed = latencies.errors == 0
        && latencies.count() > 0
        && sample.rss_kib > 0
        && sample.rss_kib <= rss_bound_kib
        && silent_ones_closed;
    PhaseReport {
        phase: phase.to_owned(),
        latencies,
        baseline_p99_us: baseline_p99 as u32,
        p99_ratio,
        rss_kib: sample.rss_kib,
        rss_bound_kib,
        open_files: sample.open_files,
        attack: attack.map_or(serde_json::Value::Null, |(counters, required)| {
            let mut figures = counters.json();
            figures["closes_required"] = serde_json::json!(required);
            figures
        }),
        passed: otherwise_passed && fast_enough,
        slow_only: otherwise_passed && !fast_enough,
        attempts: 1,
    }
}

/// Streams per connection the sidecar allows (its default).
const STREAMS_PER_CONNECTION: u64 = 128;
/// What one unread Lookup of the 60 KiB answer holds in the sidecar, KiB:
/// the answer, its encoding and HTTP/2 framing (measured: 79 KiB).
const UNREAD_ANSWER_KIB: u64 = 96;

/// The memory bound of a phase: the configured one, plus, for clients that
/// never read, what they may pin: over gRPC, what HTTP/2 flow control lets
/// them — every stream's answer (README, "HTTP/2 limits"); at the proxy,
/// [`proxy::UNREAD_CONNECTION_KIB`] a connection.
fn rss_bound_kib(phase: &str, config: &HostileConfig) -> u64 {
    let pinned = match (config.target, phase) {
        (Target::Grpc, "non-reading") => {
            config.attack_connections as u64 * STREAMS_PER_CONNECTION * UNREAD_ANSWER_KIB
        }
        (Target::Proxy, "non-reading") => {
            config.attack_connections as u64 * proxy::UNREAD_CONNECTION_KIB
        }
        // Until the deadline resets them, each stream holds its answer
        // (60 KiB) and a slice; what decides the phase is that they are
        // reset (the closes), not this bound.
        (Target::Proxy, "zero-window-h2") => {
            config.attack_connections as u64 * u64::from(proxy::WINDOW_STREAMS) * UNREAD_ANSWER_KIB
        }
        _ => 0,
    };
    config.max_rss_kib + pinned
}

fn start_attack(
    attack: &str,
    addr: SocketAddr,
    config: &HostileConfig,
    counters: &Arc<AttackCounters>,
    stop: &Arc<AtomicBool>,
    attackers: &mut JoinSet<()>,
) -> Result<(), String> {
    let target = config.target;
    let connections = match (target, attack) {
        (_, "idle-tcp" | "idle-h2") => config.idle_connections,
        (Target::Grpc, "slowloris" | "rst-flood" | "big-metadata" | "non-reading")
        | (
            Target::Proxy,
            "slowloris" | "slow-body" | "slow-unkeyed-body" | "big-headers" | "non-reading"
            | "zero-window-h2" | "tiny-window-h2",
        ) => config.attack_connections,
        (target, other) => {
            return Err(format!(
                "no attack named {other:?} for --target {} (known: {:?})",
                target.name(),
                target.attacks()
            ))
        }
    };
    for index in 0..connections {
        let (counters, stop, attack) = (Arc::clone(counters), Arc::clone(stop), attack.to_owned());
        attackers.spawn(async move {
            // Spread the connects a little so the idle attacks do not all
            // land in the same millisecond.
            tokio::time::sleep(Duration::from_micros((index as u64 % 1000) * 200)).await;
            while !stop.load(Relaxed) {
                let Ok(Ok(mut socket)) =
                    tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await
                else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let _ = socket.set_nodelay(true);
                counters.connections.fetch_add(1, Relaxed);
                let outcome = match (target, attack.as_str()) {
                    (_, "idle-tcp") => hold(&mut socket, &[], &stop).await,
                    (Target::Grpc, "idle-h2") => hold(&mut socket, &h2raw::open(), &stop).await,
                    (Target::Grpc, "slowloris") => slowloris(socket, &counters, &stop).await,
                    (Target::Grpc, "rst-flood") => rst_flood(socket, &counters, &stop).await,
                    (Target::Grpc, "big-metadata") => big_metadata(&mut socket, &counters).await,
                    (Target::Grpc, _) => non_reading(&mut socket, &counters, &stop).await,
                    (Target::Proxy, "slowloris") => {
                        proxy::slowloris(socket, &counters, &stop).await
                    }
                    (Target::Proxy, "slow-body") => {
                        proxy::slow_body(socket, &counters, &stop).await
                    }
                    (Target::Proxy, "slow-unkeyed-body") => {
                        proxy::slow_unkeyed_body(socket, &counters, &stop).await
                    }
                    (Target::Proxy, "idle-h2") => proxy::idle_h2(&mut socket, &stop).await,
                    (Target::Proxy, "zero-window-h2") => {
                        proxy::small_window_h2(&mut socket, &counters, &stop, (0, "/big")).await
                    }
                    (Target::Proxy, "tiny-window-h2") => {
                        proxy::small_window_h2(&mut socket, &counters, &stop, (1, "/orders")).await
                    }
                    (Target::Proxy, "big-headers") => {
                        proxy::big_headers(&mut socket, &counters).await
                    }
                    (Target::Proxy, _) => proxy::non_reading(&mut socket, &counters, &stop).await,
                };
                if outcome.is_err() {
                    counters.closed_by_server.fetch_add(1, Relaxed);
                }
                // An attacker whose connection was closed comes back.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
    Ok(())
}

/// Writes `opening`, then holds the connection without a word until
/// stopped; `Err` when the sidecar closes it.
async fn hold(socket: &mut TcpStream, opening: &[u8], stop: &AtomicBool) -> Result<(), ()> {
    socket.write_all(opening).await.map_err(drop)?;
    let mut buf = [0u8; 4096];
    while !stop.load(Relaxed) {
        // Whatever the sidecar sends (its SETTINGS, a GOAWAY) is read and
        // ignored; the end of the stream means it closed the connection.
        let read = tokio::time::timeout(Duration::from_millis(200), socket.read(&mut buf)).await;
        if let Ok(Ok(0) | Err(_)) = read {
            return Err(());
        }
    }
    Ok(())
}

/// Reads and drops everything the sidecar sends, so that its writes never
/// block; flags `closed` at the end of the stream.
fn drain(mut reader: tokio::net::tcp::OwnedReadHalf, closed: Arc<AtomicBool>) {
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n) = reader.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
        closed.store(true, Relaxed);
    });
}

fn claim_message(id: &str) -> Vec<u8> {
    pb::ClaimRequest {
        correlation_id: id.to_owned(),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Opens streams (a Claim's HEADERS, no body) 128 at a time every second,
/// never finishing one.
async fn slowloris(
    socket: TcpStream,
    counters: &AttackCounters,
    stop: &AtomicBool,
) -> Result<(), ()> {
    stream_bursts(socket, counters, stop, 128, false, Duration::from_secs(1)).await
}

/// HEADERS then RST_STREAM(CANCEL), 100 pairs a write, as fast as the
/// socket takes them.
async fn rst_flood(
    socket: TcpStream,
    counters: &AttackCounters,
    stop: &AtomicBool,
) -> Result<(), ()> {
    stream_bursts(socket, counters, stop, 100, true, Duration::ZERO).await
}

/// Opens `per_burst` Claim streams (HEADERS, no body) a write, each reset
/// at once when `reset`, pausing `pause` between writes (none: only a
/// yield), until stopped; `Err` when the sidecar closed the connection.
async fn stream_bursts(
    socket: TcpStream,
    counters: &AttackCounters,
    stop: &AtomicBool,
    per_burst: u64,
    reset: bool,
    pause: Duration,
) -> Result<(), ()> {
    let (reader, mut writer) = socket.into_split();
    let closed = Arc::new(AtomicBool::new(false));
    drain(reader, Arc::clone(&closed));
    writer.write_all(&h2raw::open()).await.map_err(drop)?;
    let block = h2raw::grpc_request_block("Claim", &[]);
    let mut stream = 1u32;
    while !stop.load(Relaxed) && !closed.load(Relaxed) && stream < (1 << 30) {
        let mut burst = Vec::new();
        for _ in 0..per_burst {
            burst.extend(h2raw::headers(stream, &block, false));
            if reset {
                burst.extend(h2raw::rst_stream(stream, h2raw::CANCEL));
            }
            stream += 2;
        }
        writer.write_all(&burst).await.map_err(drop)?;
        counters.streams.fetch_add(per_burst, Relaxed);
        counters.bytes.fetch_add(burst.len() as u64, Relaxed);
        if pause.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(pause).await;
        }
    }
    if closed.load(Relaxed) {
        Err(())
    } else {
        Ok(())
    }
}

/// One Claim carrying a 10 MB header, then a read until the sidecar ends
/// the connection (or 5 s pass); `Err` when it did.
async fn big_metadata(socket: &mut TcpStream, counters: &AttackCounters) -> Result<(), ()> {
    // Built once for every attacker: building it is the attacker's work,
    // and it shares the CPUs with the sidecar.
    static REQUEST: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let request = REQUEST.get_or_init(|| {
        let value = vec![b'x'; 10 << 20];
        let block = h2raw::grpc_request_block("Claim", &[("x-big", &value)]);
        let mut request = h2raw::open();
        request.extend(h2raw::headers(1, &block, false));
        request.extend(h2raw::grpc_data(1, &claim_message("big-metadata")));
        request
    });
    send_whole_until_closed(socket, request, counters).await
}

/// Writes `request` (one oversized request) in 64 KiB pieces while reading
/// and dropping whatever comes back, until the server ends the connection
/// (`Err`) or 5 s pass.
pub(crate) async fn send_whole_until_closed(
    socket: &mut TcpStream,
    request: &[u8],
    counters: &AttackCounters,
) -> Result<(), ()> {
    counters.streams.fetch_add(1, Relaxed);
    let (mut reader, mut writer) = socket.split();
    let sent = AtomicU64::new(0);
    let write = async {
        for chunk in request.chunks(64 << 10) {
            if writer.write_all(chunk).await.is_err() {
                break;
            }
            sent.fetch_add(chunk.len() as u64, Relaxed);
        }
    };
    let read = async {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => return Err(()),
                Ok(_) => {}
            }
        }
    };
    let outcome = tokio::time::timeout(Duration::from_secs(5), async {
        tokio::join!(write, read).1
    })
    .await
    .unwrap_or(Ok(()));
    counters.bytes.fetch_add(sent.load(Relaxed), Relaxed);
    outcome
}

/// Lookups of the 60 KiB answer, 128 streams at a time every second, and
/// not one byte read.
async fn non_reading(
    socket: &mut TcpStream,
    counters: &AttackCounters,
    stop: &AtomicBool,
) -> Result<(), ()> {
    socket.write_all(&h2raw::open()).await.map_err(drop)?;
    let block = h2raw::grpc_request_block("Lookup", &[]);
    let lookup = pb::LookupRequest {
        namespace: String::new(),
        correlation_id: "big-answer".into(),
    }
    .encode_to_vec();
    let mut stream = 1u32;
    while !stop.load(Relaxed) {
        let mut burst = Vec::new();
        for _ in 0..128 {
            burst.extend(h2raw::headers(stream, &block, false));
            burst.extend(h2raw::grpc_data(stream, &lookup));
            stream += 2;
        }
        // The sidecar's answers are never read: once the socket's buffers
        // fill, only flow control stands between it and unbounded memory.
        match tokio::time::timeout(Duration::from_secs(1), socket.write_all(&burst)).await {
            Ok(Err(_)) => return Err(()),
            Ok(Ok(())) => {
                counters.streams.fetch_add(128, Relaxed);
                counters.bytes.fetch_add(burst.len() as u64, Relaxed);
            }
            // The sidecar stopped reading us (a frame may be cut short, so
            // nothing more is written): hold the connection as it is.
            Err(_) => break,
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    while !stop.load(Relaxed) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}
