//! `dedupd-reliability`: the long runs of the reliability suite, each with
//! a bounded run time, printing its figures (see RELIABILITY.md).

use std::{path::PathBuf, process::ExitCode, time::Instant};

use clap::{Parser, Subcommand, ValueEnum};
use dedupd_reliability::{
    checker, failover, history, hostile, powerloss, runner, sidecar::Sidecar, soak,
};

#[derive(Debug, Parser)]
#[command(name = "dedupd-reliability", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Record a history of concurrent calls (with SIGKILLs of the sidecar)
    /// and check it is linearizable; INTERNAL, UNKNOWN or CANCELLED away
    /// from a SIGKILL, or too few COMMITTED or CLAIMED answers, fail it too.
    Lincheck(LincheckArgs),
    /// Hostile clients (idle connections, slowloris, RST_STREAM flood, 10 MB
    /// metadata, a client that never reads) against a well-behaved client's
    /// latency and the sidecar's memory; on the gRPC listener, or on the HTTP
    /// proxy (`--target proxy`).
    Hostile(HostileArgs),
    /// Mixed load with churn on a short retention for a long time, sampling
    /// memory, open files, disk and p99; then SIGKILL, restart, and a check
    /// of every acknowledged commit.
    Soak(SoakArgs),
    /// Power cuts on LazyFS: load, SIGKILL and every unsynced write dropped,
    /// restart, and a check of everything acknowledged; then cuts LazyFS
    /// makes itself at chosen syncs, creations and removals, and torn log
    /// writes.
    Powerloss(PowerlossArgs),
}

#[derive(Debug, clap::Args)]
struct PowerlossArgs {
    /// The dedupd binary.
    #[arg(long, default_value = "target/release/dedupd")]
    dedupd: PathBuf,
    /// The LazyFS binary (`../shared/tools/lazyfs/build.sh` prints it).
    #[arg(long, env = "DEDUPD_LAZYFS")]
    lazyfs: PathBuf,
    /// Power cuts at random moments of the load, on one data directory.
    #[arg(long, default_value_t = 200)]
    cuts: usize,
    /// Power cuts of the segment-reuse stage (a fixed set of keys forgotten
    /// and committed again and again on a store of its own, so sled frees
    /// and rewrites its log's segments).
    #[arg(long, default_value_t = 50)]
    reuse_cuts: usize,
    /// Client tasks.
    #[arg(long, default_value_t = 8)]
    tasks: usize,
    /// The answer sizes of commits, in turn (bytes, at most 1048576).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0,200,2048,40000,65536,300000,1048576"
    )]
    answer_sizes: Vec<usize>,
    /// Only the random cuts.
    #[arg(long)]
    no_targeted: bool,
    /// One more flag for the sidecar (repeatable), after the suite's own:
    /// `--dedupd-arg=--disk-reserve-mb=0`.
    #[arg(long, allow_hyphen_values = true)]
    dedupd_arg: Vec<String>,
    /// CI's bounded run: 10 random cuts after 1-2 s of load each, 5 of the
    /// segment-reuse stage, and the targeted cuts.
    #[arg(long)]
    quick: bool,
}

#[derive(Debug, clap::Args)]
struct SoakArgs {
    /// The dedupd binary.
    #[arg(long, default_value = "target/release/dedupd")]
    dedupd: PathBuf,
    /// How long the load runs.
    #[arg(long, default_value = "30m")]
    duration: humantime::Duration,
    /// How often the sidecar is sampled.
    #[arg(long, default_value = "10s")]
    sample: humantime::Duration,
    /// The sidecar's retention: short, so the reaper works all along.
    #[arg(long, default_value = "60s")]
    retention: humantime::Duration,
    /// Samples before this are not judged.
    #[arg(long, default_value = "3m")]
    warm_up: humantime::Duration,
    /// Client tasks.
    #[arg(long, default_value_t = 8)]
    tasks: usize,
    /// CI's bounded run: 60 s, 2 s samples, 10 s retention, 20 s warm-up; the
    /// p99 is reported, not judged (CI's machine may be loaded), the CPU a
    /// call costs the sidecar is.
    #[arg(long)]
    quick: bool,
}

#[derive(Debug, clap::Args)]
struct HostileArgs {
    /// The dedupd binary.
    #[arg(long, default_value = "target/release/dedupd")]
    dedupd: PathBuf,
    /// How long the baseline, each attack and the recovery last.
    #[arg(long, default_value = "10s")]
    phase: humantime::Duration,
    /// Connections of the idle attacks.
    #[arg(long, default_value_t = 10_000)]
    idle_connections: usize,
    /// Connections of the other attacks.
    #[arg(long, default_value_t = 50)]
    attack_connections: usize,
    /// The sidecar's --max-connections (its default): the idle attacks must
    /// see that many of theirs closed (90 %), or all of them if fewer.
    #[arg(long, default_value_t = 1000)]
    max_connections: usize,
    /// Fail when the well-behaved client's p99 under an attack exceeds this
    /// multiple of its quiet p99.
    #[arg(long, default_value_t = 10.0)]
    max_p99_ratio: f64,
    /// Fail when the sidecar's resident memory exceeds this, MiB (plus, in
    /// the non-reading attack, over gRPC 96 KiB for each stream its clients
    /// may hold: connections × 128; at the proxy 2 MiB a connection).
    #[arg(long, default_value_t = 256)]
    max_rss_mib: u64,
    /// What is attacked: the gRPC listener, or the HTTP idempotency proxy
    /// (started in front of an upstream the runner serves, with 3 s head and
    /// body deadlines and a 4 s maximum connection age).
    #[arg(long, value_enum, default_value_t = hostile::Target::Grpc)]
    target: hostile::Target,
    /// Run only these attacks (default: all of the target's; grpc: idle-tcp,
    /// idle-h2, slowloris, rst-flood, big-metadata, non-reading; proxy:
    /// idle-tcp, idle-h2, slowloris, slow-body, slow-unkeyed-body,
    /// big-headers, non-reading, zero-window-h2, tiny-window-h2).
    #[arg(long = "attack", value_parser = clap::builder::PossibleValuesParser::new(hostile::all_attacks()))]
    attacks: Vec<String>,
    /// CI's bounded run: 6 s phases (past the sidecar's 5 s deadline for a
    /// connection's first bytes), or 4 s at the proxy (past its 3 s
    /// deadlines).
    #[arg(long)]
    quick: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum StoreKind {
    Sled,
    Postgres,
    Redis,
}

#[derive(Debug, clap::Args)]
struct LincheckArgs {
    /// The dedupd binary.
    #[arg(long, default_value = "target/release/dedupd")]
    dedupd: PathBuf,
    /// The store the sidecar runs on.
    #[arg(long, value_enum, default_value = "sled")]
    store: StoreKind,
    /// PostgreSQL URL (the store's schema is made fresh and dropped after).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
    postgres_url: String,
    /// Redis URL (keys go under a fresh prefix); `redis+cluster://h1:p1,…`
    /// for a Redis Cluster, `redis+sentinel://s1:p1,…/<name>` for the
    /// primary Sentinel names.
    #[arg(long, default_value = "redis://127.0.0.1:6379/0")]
    redis_url: String,
    /// Redis: the sidecars' --store-replicas (each answer waits for that
    /// many replicas of the primaries it touched).
    #[arg(long, default_value_t = 0)]
    store_replicas: u32,
    /// Redis Cluster: primaries to SIGKILL and fail over during the run
    /// (its replica promoted, the old primary started again as a replica);
    /// the nodes must run on this machine, redis-cli and redis-server on
    /// PATH.
    #[arg(long, default_value_t = 0)]
    cluster_failovers: usize,
    /// Redis Sentinel: primaries to SIGKILL and fail over during the run
    /// (a replica promoted by the sentinels, the old primary started again
    /// as its replica); the servers must run on this machine, redis-cli and
    /// redis-server on PATH.
    #[arg(long, default_value_t = 0)]
    sentinel_failovers: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Keys they share at any moment.
    #[arg(long, default_value_t = 4)]
    keys: u32,
    /// How long one set of keys is in use before the clients move on to a
    /// fresh one.
    #[arg(long, default_value = "500ms")]
    generation: humantime::Duration,
    /// How long the clients run at least: longer (up to three times as
    /// long) while the history is short of 10 000 operations.
    #[arg(long, default_value = "20s")]
    duration: humantime::Duration,
    /// SIGKILLs of the sidecar during the run.
    #[arg(long, default_value_t = 2)]
    kills: usize,
    /// The sidecar's --sync (`none` loses the last acknowledged changes on
    /// SIGKILL: the checker should say so).
    #[arg(long, default_value = "always")]
    sync: String,
    /// Seed of the clients' choices (random when unset).
    #[arg(long)]
    seed: Option<u64>,
    /// Shared stores: one sidecar per entry, comma-separated, its wall clock
    /// set off by that much with libfaketime (e.g. `+0s,+40s,-25s`: three
    /// sidecars whose clocks disagree by more than any lease). Clients are
    /// spread over them.
    #[arg(long, value_delimiter = ',')]
    clock_skews: Vec<String>,
    /// Shared stores: the sidecars' --max-clock-uncertainty, and how far the
    /// checker lets a sidecar's moment lie outside its call (their clock is
    /// the store's as measured, ours the machine's).
    #[arg(long, default_value = "10ms")]
    clock_uncertainty: humantime::Duration,
    /// Shared stores: per sidecar (as --clock-skews), the delay on its way
    /// to the store and back, `<to>/<back>` (e.g. `--store-delays
    /// 40ms/0ms,0ms/40ms`): its reading of the store's clock leans one way
    /// by half their difference, within the uncertainty its round trip
    /// shows, so two sidecars decide near opposite ends of the bound.
    #[arg(long, value_delimiter = ',')]
    store_delays: Vec<dedupd_reliability::delay::Delays>,
    /// libfaketime, for --clock-skews (Debian's `faketime` package).
    #[arg(
        long,
        default_value = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"
    )]
    libfaketime: PathBuf,
    /// Write the operations of keys found not linearizable here (one per
    /// line, Rust debug form) for a look at what happened.
    #[arg(long)]
    dump: Option<PathBuf>,
    /// CI's bounded run: 8 s (up to 24 s while short of 10 000 operations)
    /// and one SIGKILL (overrides --duration and --kills); still fails
    /// under 10 000 operations, or under the floors
    /// of COMMITTED and CLAIMED answers per generation.
    #[arg(long)]
    quick: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    match cli.command {
        Command::Lincheck(args) => runtime.block_on(lincheck(args)),
        Command::Hostile(args) => runtime.block_on(hostile(args)),
        Command::Soak(args) => runtime.block_on(soak(args)),
        Command::Powerloss(args) => runtime.block_on(powerloss(args)),
    }
}

async fn powerloss(args: PowerlossArgs) -> ExitCode {
    if let Some(size) = args
        .answer_sizes
        .iter()
        .find(|size| **size > powerloss::MAX_ANSWER)
    {
        eprintln!(
            "dedupd-reliability: --answer-sizes: {size} is above the largest answer ({})",
            powerloss::MAX_ANSWER
        );
        return ExitCode::from(64);
    }
    if args.answer_sizes.is_empty() || args.tasks == 0 {
        eprintln!("dedupd-reliability: --answer-sizes and --tasks must not be empty or 0");
        return ExitCode::from(64);
    }
    let second = std::time::Duration::from_secs(1);
    let config = powerloss::PowerLossConfig {
        lazyfs: args.lazyfs,
        cuts: if args.quick { 10 } else { args.cuts },
        reuse_cuts: if args.quick { 5 } else { args.reuse_cuts },
        load: if args.quick {
            (second, 2 * second)
        } else {
            (2 * second, 5 * second)
        },
        targeted: !args.no_targeted,
        answer_sizes: args.answer_sizes,
        tasks: args.tasks,
        extra_flags: args.dedupd_arg,
    };
    let work = match tempfile_dir("powerloss") {
        Ok(dir) => dir,
        Err(error) => {
            eprintln!("dedupd-reliability: {error}");
            return ExitCode::FAILURE;
        }
    };
    let started = Instant::now();
    let report = powerloss::run(&args.dedupd, &work, &config).await;
    println!(
        "{}",
        serde_json::json!({
            "summary": true,
            "random_cuts": report.random.cuts,
            "reuse_cuts": report.reuse.cuts,
            "targeted_cuts": report.targeted,
            "targeted_not_fired": report.not_fired,
            "calls_acknowledged": report.acknowledged,
            "commits_acknowledged": report.commits,
            "large_commits_acknowledged": report.large_commits,
            "checks_after_restarts": report.checks,
            "slowest_restart_ms": report.slowest_restart.as_millis() as u64,
            "lazyfs_crashes": report.lazyfs_crashes,
            "random": cycles_json(&report.random),
            "reuse": cycles_json(&report.reuse),
            "elapsed_s": started.elapsed().as_secs(),
            "failures": report.failures,
        })
    );
    // A targeted cut that never fired tested nothing: most must fire.
    let mut failed = !report.failures.is_empty();
    if config.targeted && report.not_fired.len() * 4 > report.targeted + report.not_fired.len() {
        eprintln!(
            "dedupd-reliability: {} of the targeted cuts never fired: {:?}",
            report.not_fired.len(),
            report.not_fired
        );
        failed = true;
    }
    for (made, asked) in [
        (report.random.cuts, config.cuts),
        (report.reuse.cuts, config.reuse_cuts),
    ] {
        if made < asked && report.failures.is_empty() {
            eprintln!("dedupd-reliability: only {made} of {asked} cuts made");
            failed = true;
        }
    }
    if failed {
        keep_for_inspection(
            &work,
            "random/, reuse/: the stores and their logs; target-N/: a targeted cut's",
            &["random/log".to_owned(), "reuse/log".to_owned()],
        );
        for failure in &report.failures {
            eprintln!("dedupd-reliability: {failure}");
        }
        ExitCode::FAILURE
    } else {
        let _ = std::fs::remove_dir_all(&work);
        ExitCode::SUCCESS
    }
}

/// One power-loss stage's figures.
fn cycles_json(cycles: &powerloss::Cycles) -> serde_json::Value {
    serde_json::json!({
        "load_s": cycles.load_seconds.round() as u64,
        "small_answer_bytes_committed": cycles.small_answer_bytes,
        "sled_log_bytes_at_end": cycles.sled_log_bytes,
        "log_segments_created": cycles.log_segments,
    })
}

async fn soak(args: SoakArgs) -> ExitCode {
    let config = if args.quick {
        soak::SoakConfig {
            duration: std::time::Duration::from_secs(60),
            sample_every: std::time::Duration::from_secs(2),
            retention: std::time::Duration::from_secs(10),
            warm_up: std::time::Duration::from_secs(20),
            tasks: args.tasks,
            judge_latency: false,
        }
    } else {
        soak::SoakConfig {
            duration: args.duration.into(),
            sample_every: args.sample.into(),
            retention: args.retention.into(),
            warm_up: args.warm_up.into(),
            tasks: args.tasks,
            judge_latency: true,
        }
    };
    let data = match tempfile_dir("soak") {
        Ok(dir) => dir,
        Err(error) => {
            eprintln!("dedupd-reliability: {error}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = soak::run(&args.dedupd, &data, &config).await;
    let soak = match outcome {
        Ok(soak) if soak.failures.is_empty() => {
            let _ = std::fs::remove_dir_all(&data);
            soak
        }
        // Kept, with what explains it: the log of every start, the samples,
        // the metrics before the SIGKILL.
        failed => {
            keep_for_inspection(
                &data,
                "log: every start of the sidecar; samples.jsonl; metrics-before-kill.txt; data/",
                &["log".to_owned()],
            );
            match failed {
                Ok(soak) => soak,
                Err(error) => {
                    eprintln!("dedupd-reliability: {error}");
                    return ExitCode::FAILURE;
                }
            }
        }
    };
    let judged: Vec<&soak::Sample> = soak
        .samples
        .iter()
        .filter(|s| s.at_s >= config.warm_up.as_secs())
        .collect();
    let range = |value: fn(&soak::Sample) -> u64| {
        let values = judged.iter().map(|s| value(s));
        serde_json::json!([values.clone().min(), values.max()])
    };
    println!(
        "{}",
        serde_json::json!({
            "summary": true,
            "duration_s": config.duration.as_secs(),
            "retention_s": config.retention.as_secs(),
            "samples": soak.samples.len(),
            "after_warm_up": {
                "rss_kib": range(|s| s.rss_kib),
                "open_files": range(|s| s.open_files),
                "disk_bytes": range(|s| s.disk_bytes),
                "p99_us": range(|s| u64::from(s.p99_us)),
                "cpu_us_per_call": range(|s| s.cpu_us_per_call),
                "calls_per_s": range(|s| s.calls_per_s),
            },
            "longest_call_us": soak.samples.iter().map(|s| s.longest_us).max(),
            "reclaimed_after_their_retention": soak.reclaimed,
            "commits_acknowledged": soak.committed,
            "checked_present_after_sigkill": soak.checked_present,
            "checked_expired": soak.checked_expired,
            "failures": soak.failures,
        })
    );
    if soak.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        for failure in &soak.failures {
            eprintln!("dedupd-reliability: {failure}");
        }
        ExitCode::FAILURE
    }
}

async fn hostile(args: HostileArgs) -> ExitCode {
    let known = args.target.attacks();
    if let Some(unknown) = args
        .attacks
        .iter()
        .find(|attack| !known.contains(&attack.as_str()))
    {
        eprintln!(
            "dedupd-reliability: --attack {unknown} is not an attack on --target {} (its attacks: {})",
            args.target.name(),
            known.join(", ")
        );
        return ExitCode::FAILURE;
    }
    // 10 000 idle connections are 10 000 descriptors here too.
    if let Err(error) = rlimit::increase_nofile_limit(u64::MAX) {
        eprintln!("dedupd-reliability: cannot raise the open-file limit: {error}");
    }
    let data = match tempfile_dir("hostile") {
        Ok(dir) => dir,
        Err(error) => {
            eprintln!("dedupd-reliability: {error}");
            return ExitCode::FAILURE;
        }
    };
    let config = hostile::HostileConfig {
        target: args.target,
        phase: match (args.quick, args.target) {
            (true, hostile::Target::Grpc) => std::time::Duration::from_secs(6),
            (true, hostile::Target::Proxy) => std::time::Duration::from_secs(4),
            (false, _) => args.phase.into(),
        },
        idle_connections: args.idle_connections,
        attack_connections: args.attack_connections,
        max_p99_ratio: args.max_p99_ratio,
        max_rss_kib: args.max_rss_mib << 10,
        max_connections: args.max_connections,
    };
    let attacks: Vec<&str> = if args.attacks.is_empty() {
        known.to_vec()
    } else {
        args.attacks.iter().map(String::as_str).collect()
    };
    let outcome = async {
        // The proxy forwards to an upstream of the runner's own, which
        // serves until the run ends.
        let upstream = match args.target {
            hostile::Target::Grpc => None,
            hostile::Target::Proxy => Some(hostile::proxy::Upstream::start().await?),
        };
        let mut flags = upstream
            .as_ref()
            .map(hostile::proxy::Upstream::sidecar_flags)
            .unwrap_or_default();
        flags.extend([
            "--max-connections".to_owned(),
            config.max_connections.to_string(),
        ]);
        let sidecar = Sidecar::start(&args.dedupd, &data, &flags).await?;
        let reports = hostile::run(&sidecar, &config, &attacks).await;
        let alive = sidecar.sample().rss_kib > 0;
        let log = sidecar.log();
        let stopped = sidecar.stop(std::time::Duration::from_secs(20)).await;
        let reports = reports?;
        if !alive {
            return Err(format!("the sidecar died: {log}"));
        }
        if stopped.is_none_or(|status| !status.success()) {
            return Err(format!(
                "the sidecar did not stop cleanly ({stopped:?}): {log}"
            ));
        }
        Ok(reports)
    }
    .await;
    let passed = outcome
        .as_ref()
        .is_ok_and(|reports| reports.iter().all(|report| report.passed));
    if passed {
        let _ = std::fs::remove_dir_all(&data);
    } else {
        keep_for_inspection(&data, "log; data/", &["log".to_owned()]);
    }
    match outcome {
        Ok(reports) => {
            for report in &reports {
                println!("{}", report.json());
            }
            let failed: Vec<&str> = reports
                .iter()
                .filter(|report| !report.passed)
                .map(|report| report.phase.as_str())
                .collect();
            if failed.is_empty() {
                ExitCode::SUCCESS
            } else {
                eprintln!(
                    "dedupd-reliability: out of bounds (errors, p99 over {}x the baseline's, RSS over its bound, or silent, slow or oversized connections kept) in: {}",
                    args.max_p99_ratio,
                    failed.join(", ")
                );
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("dedupd-reliability: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The fewest operations a history must have to count (issue 16).
const MIN_OPERATIONS: usize = 10_000;
/// The fewest COMMITTED answers after the last failover's window: the run
/// goes on for `runner::AFTER_FAILOVER` (5 s, 10 key generations of 500 ms)
/// past it, where a healthy store gives 3–4 commits per generation.
const MIN_COMMITTED_AFTER_FAILOVERS: usize = 5;

async fn lincheck(mut args: LincheckArgs) -> ExitCode {
    if args.quick {
        args.duration = std::time::Duration::from_secs(8).into();
        args.kills = 1;
    }
    if !args.store_delays.is_empty() && matches!(args.store, StoreKind::Sled) {
        eprintln!(
            "dedupd-reliability: --store-delays needs a shared store (--store postgres or redis)"
        );
        return ExitCode::FAILURE;
    }
    if !args.clock_skews.is_empty() {
        if matches!(args.store, StoreKind::Sled) {
            eprintln!("dedupd-reliability: --clock-skews needs a shared store (--store postgres or redis)");
            return ExitCode::FAILURE;
        }
        if !args.libfaketime.exists() {
            eprintln!(
                "dedupd-reliability: --clock-skews needs libfaketime at {} (apt-get install faketime)",
                args.libfaketime.display()
            );
            return ExitCode::FAILURE;
        }
    }
    let data = match tempfile_dir("lincheck") {
        Ok(dir) => dir,
        Err(error) => {
            eprintln!("dedupd-reliability: {error}");
            return ExitCode::FAILURE;
        }
    };
    let seed = args.seed.unwrap_or_else(rand::random);
    let scope = format!("lincheck_{seed:016x}");
    let mut store_flags: Vec<String> = match args.store {
        StoreKind::Sled => vec![],
        StoreKind::Postgres => vec![
            "--store".into(),
            "postgres".into(),
            "--store-url".into(),
            args.postgres_url.clone(),
            "--store-schema".into(),
            scope.clone(),
        ],
        StoreKind::Redis => vec![
            "--store".into(),
            "redis".into(),
            "--store-url".into(),
            args.redis_url.clone(),
            "--store-schema".into(),
            scope.clone(),
            "--store-replicas".into(),
            args.store_replicas.to_string(),
        ],
    };
    let cluster_seed = args
        .redis_url
        .strip_prefix("redis+cluster://")
        .and_then(|hosts| hosts.split(',').next())
        .map(|seed| seed.trim_end_matches('/').to_owned());
    if args.cluster_failovers > 0
        && (cluster_seed.is_none() || !matches!(args.store, StoreKind::Redis))
    {
        eprintln!("dedupd-reliability: --cluster-failovers needs --store redis and a redis+cluster:// --redis-url");
        return ExitCode::FAILURE;
    }
    // The first sentinel and the primary's name.
    let sentinel = args
        .redis_url
        .strip_prefix("redis+sentinel://")
        .and_then(|rest| rest.split_once('/'))
        .and_then(|(hosts, path)| {
            let first = hosts.rsplit('@').next()?.split(',').next()?;
            let name = path.split('/').next().filter(|name| !name.is_empty())?;
            Some((first.to_owned(), name.to_owned()))
        });
    if args.sentinel_failovers > 0
        && (sentinel.is_none() || !matches!(args.store, StoreKind::Redis))
    {
        eprintln!("dedupd-reliability: --sentinel-failovers needs --store redis and a redis+sentinel://…/<name> --redis-url");
        return ExitCode::FAILURE;
    }
    let store_failovers = match (cluster_seed, sentinel) {
        (Some(seed), _) if args.cluster_failovers > 0 => {
            Some((failover::Target::Cluster { seed }, args.cluster_failovers))
        }
        (_, Some((sentinel, name))) if args.sentinel_failovers > 0 => Some((
            failover::Target::Sentinel { sentinel, name },
            args.sentinel_failovers,
        )),
        _ => None,
    };
    let failovers_asked = store_failovers.as_ref().map_or(0, |(_, count)| *count);
    if store_failovers.is_some() {
        // As the README asks: a store call shorter than the failover's
        // detection (cluster-node-timeout, 5 s in .ci/redis-cluster;
        // down-after-milliseconds, 1 s in .ci/redis-sentinel),
        // so a call that meets a failover is answered UNAVAILABLE well within
        // the clients' 5 s, not left to their deadline.
        store_flags.extend(["--store-timeout".to_owned(), "1500ms".to_owned()]);
    }
    store_flags.extend(["--sync".to_owned(), args.sync.clone()]);
    let clock_tolerance_ms = match args.store {
        StoreKind::Sled => 0,
        StoreKind::Postgres | StoreKind::Redis => {
            store_flags.extend([
                "--max-clock-uncertainty".to_owned(),
                args.clock_uncertainty.to_string(),
            ]);
            // A sidecar's time is an interval [earliest, latest] around the
            // store's, each side up to the uncertainty from its estimate:
            // so a moment it reports (a lease's end from `latest`, the
            // time left from `earliest`) lies up to twice the uncertainty
            // from the true one, plus a millisecond of rounding. (With the
            // uncertainty alone, a debug run with slow round trips found
            // IN_PROGRESS answers whose time left ran 11 ms past the lease.)
            u64::try_from(
                std::time::Duration::from(args.clock_uncertainty)
                    .as_micros()
                    .div_ceil(1000),
            )
            .unwrap_or(u64::MAX / 4)
            .saturating_mul(2)
            .saturating_add(1)
        }
    };
    let config = runner::RunConfig {
        binary: args.dedupd.clone(),
        store_flags,
        data_dir: data.clone(),
        clients: args.clients,
        keys: args.keys,
        generation: args.generation.into(),
        duration: args.duration.into(),
        min_operations: MIN_OPERATIONS,
        kills: args.kills,
        lease_ms: (50, 400),
        seed,
        clock_skews: args.clock_skews.clone(),
        libfaketime: Some(args.libfaketime.clone()),
        store_failovers,
        store_delays: args.store_delays.clone(),
    };
    let run = runner::run(config).await;
    drop_shared_records(&args, &scope);
    let sidecar_logs: Vec<String> = (0..args.clock_skews.len().max(args.store_delays.len()).max(1))
        .map(|index| format!("sidecar-{index}/log"))
        .collect();
    let contents = "sidecar-N/log: every start of sidecar N; sidecar-N/data/";
    let run = match run {
        Ok(run) => run,
        Err(error) => {
            eprintln!("dedupd-reliability: the run failed: {error}");
            keep_for_inspection(&data, contents, &sidecar_logs);
            return ExitCode::FAILURE;
        }
    };
    let checking = Instant::now();
    let report = checker::check_tolerating(&run.history, clock_tolerance_ms);
    let generations = runner::generations(run.elapsed, args.generation.into());
    let errors_outside = run.errors_outside_windows();
    let committed_after_failovers = run.committed_after_failovers();
    let figures = serde_json::json!({
        "store": format!("{:?}", args.store).to_lowercase(),
        "sidecars": args.clock_skews.len().max(args.store_delays.len()).max(1),
        "clock_skews": args.clock_skews,
        "store_delays": args.store_delays.iter().map(|delays| format!("{:?}/{:?}", delays.to_store, delays.from_store)).collect::<Vec<_>>(),
        "clock_tolerance_ms": clock_tolerance_ms,
        "seed": seed,
        "clients": args.clients,
        "keys": args.keys,
        "duration_s": run.elapsed.as_secs_f64(),
        "generations": generations,
        "operations": report.operations,
        "answered": report.answered,
        "unknown": report.operations - report.answered,
        "committed": run.committed(),
        "claimed": run.claimed(),
        "kills": run.kills,
        "store_replicas": args.store_replicas,
        "failovers": run.failovers.iter().map(|failover| serde_json::json!({
            "killed": failover.killed,
            "promoted": failover.promoted,
            "promotion_ms": failover.promotion.as_millis() as u64,
            "settled_ms": failover.settled.as_millis() as u64,
        })).collect::<Vec<_>>(),
        "downtime_ms": run.downtime.as_millis() as u64,
        "errors_in_kill_windows": run.errors.iter().filter(|e| run.excuse(e) == Some(runner::Excuse::Kill)).count(),
        "errors_in_failover_windows": run.errors.iter().filter(|e| run.excuse(e) == Some(runner::Excuse::Failover)).count(),
        "errors_outside_windows": errors_outside.len(),
        "committed_after_failovers": committed_after_failovers,
        "errors_by_code": run.errors.iter().fold(
            std::collections::BTreeMap::<String, usize>::new(),
            |mut counts, error| {
                *counts.entry(format!("{:?}", error.code)).or_default() += 1;
                counts
            },
        ),
        "states_explored": report.states_explored,
        "check_ms": checking.elapsed().as_millis() as u64,
        "violations": report.violations.iter().filter(|v| !v.undecided).count(),
        "undecided": report.violations.iter().filter(|v| v.undecided).count(),
        "answers": history::answer_counts(&run.history),
    });
    println!("{figures}");
    let mut failed = false;
    // A failed call away from a SIGKILL (any code) and from a failover
    // (UNAVAILABLE, DEADLINE_EXCEEDED): the sidecar or its store failed.
    for error in errors_outside.iter().take(20) {
        eprintln!(
            "dedupd-reliability: a failed call outside the kill and failover windows: {error}"
        );
        failed = true;
    }
    if errors_outside.len() > 20 {
        eprintln!(
            "dedupd-reliability: … and {} more failed calls outside the windows",
            errors_outside.len() - 20
        );
    }
    // After the last failover the store must serve again: commits go
    // through (a store answering UNAVAILABLE to all would have none).
    if !run.failovers.is_empty() && committed_after_failovers < MIN_COMMITTED_AFTER_FAILOVERS {
        eprintln!(
            "dedupd-reliability: {committed_after_failovers} COMMITTED answers after the last failover's window closed (at least {MIN_COMMITTED_AFTER_FAILOVERS})"
        );
        failed = true;
    }
    if run.failovers.len() != failovers_asked {
        eprintln!(
            "dedupd-reliability: {} of {} failovers done",
            run.failovers.len(),
            failovers_asked
        );
        failed = true;
    }
    if report.operations < MIN_OPERATIONS || run.kills != args.kills {
        eprintln!(
            "dedupd-reliability: too small a history: {} operations (at least {MIN_OPERATIONS}), {} of {} kills",
            report.operations, run.kills, args.kills
        );
        failed = true;
    }
    if let Some(reason) = run.below_floor(generations) {
        eprintln!("dedupd-reliability: {reason}");
        failed = true;
    }
    if !report.violations.is_empty() {
        for violation in &report.violations {
            eprintln!("not linearizable: {violation:?}");
        }
        if let Some(path) = &args.dump {
            let bad: std::collections::HashSet<u32> =
                report.violations.iter().map(|v| v.key).collect();
            let mut lines: Vec<&history::Operation> = run
                .history
                .iter()
                .filter(|op| bad.contains(&op.key))
                .collect();
            lines.sort_by_key(|op| (op.key, op.invoked_ms, op.completed_ms));
            let text: String = lines.iter().map(|op| format!("{op:?}\n")).collect();
            if let Err(error) = std::fs::write(path, text) {
                eprintln!("dedupd-reliability: {}: {error}", path.display());
            }
        }
        failed = true;
    }
    if failed {
        keep_for_inspection(&data, contents, &sidecar_logs);
        ExitCode::FAILURE
    } else {
        let _ = std::fs::remove_dir_all(&data);
        ExitCode::SUCCESS
    }
}

/// Says where a failed run's directory is kept (`contents` says what is
/// in it) and prints what each sidecar log in it (`logs`, relative to it)
/// warned about: the sidecars log at `--log warn`, so every line is one.
fn keep_for_inspection(dir: &std::path::Path, contents: &str, logs: &[String]) {
    eprintln!(
        "dedupd-reliability: the run's files are kept in {} ({contents})",
        dir.display()
    );
    for name in logs {
        let log = std::fs::read_to_string(dir.join(name)).unwrap_or_default();
        let warnings = dedupd_reliability::sidecar::warnings(&log);
        eprintln!(
            "dedupd-reliability: {name}: the sidecar's warnings and errors ({} lines{}):",
            warnings.len(),
            if warnings.len() > 60 {
                ", the first 60"
            } else {
                ""
            }
        );
        for line in warnings.iter().take(60) {
            eprintln!("  {line}");
        }
    }
}

fn tempfile_dir(run: &str) -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("dedupd-{run}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}

/// Removes what the run left in a shared store (best effort: psql and
/// redis-cli, as the benchmark scripts do).
fn drop_shared_records(args: &LincheckArgs, scope: &str) {
    let outcome = match args.store {
        StoreKind::Sled => return,
        StoreKind::Postgres => std::process::Command::new("psql")
            .args([args.postgres_url.as_str(), "-qc"])
            .arg(format!("DROP SCHEMA IF EXISTS {scope} CASCADE"))
            .output(),
        // A cluster's keys are in many slots, which one script may not
        // touch together: they expire by themselves (the records at the
        // end of their retention, the fence keys 10 s after use).
        StoreKind::Redis if args.redis_url.starts_with("redis+cluster://") => return,
        // Through Sentinel the primary moved during the run: the records
        // expire by themselves.
        StoreKind::Redis if args.redis_url.starts_with("redis+sentinel://") => return,
        StoreKind::Redis => std::process::Command::new("redis-cli")
            .args(["-u", args.redis_url.as_str(), "EVAL"])
            .arg("for _, key in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('DEL', key) end")
            .args(["0", &format!("{scope}:*")])
            .output(),
    };
    match outcome {
        Ok(output) if output.status.success() => {}
        Ok(output) => eprintln!(
            "dedupd-reliability: could not remove {scope}: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Err(error) => eprintln!("dedupd-reliability: could not remove {scope}: {error}"),
    }
}
