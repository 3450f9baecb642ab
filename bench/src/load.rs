//! `dedupd-bench load`: a load generator for dedupd and its alternatives. It
//! drives a workload from many tasks over a few connections, measures each
//! call's latency, counts outcomes, and checks its own results (fresh IDs
//! must never be DUPLICATE), printing a table or JSON.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use serde_json::{json, Value};

use crate::target::{Connection, Outcome, Target};

/// What each benchmark task does in a loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// Claim a fresh ID (one op = one Claim).
    Claim,
    /// Claim a fresh ID, then commit it (one op = the pair).
    ClaimCommit,
    /// Like claim-commit, but a share of the IDs repeat already committed
    /// ones (see --duplicate-share), which must come back DUPLICATE.
    DuplicateHeavy,
    /// ClaimBatch of --batch-size fresh IDs (one op = one item).
    Batch,
    /// ClaimBatch then CommitBatch of --batch-size fresh IDs (one op = one
    /// item claimed and committed).
    BatchCommit,
}

/// Options of `dedupd-bench load`.
#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// dedupd://HOST:PORT, noop://HOST:PORT, redis://HOST:PORT or postgres://…
    #[arg(long, default_value = "dedupd://127.0.0.1:50051")]
    pub target: Target,
    /// Tasks issuing calls at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// How long to run (ignored with --requests).
    #[arg(long, default_value = "10s")]
    pub duration: humantime::Duration,
    /// Stop after this many ops instead of after --duration.
    #[arg(long)]
    pub requests: Option<u64>,
    /// Connections to the target (tasks share them round-robin).
    #[arg(long, default_value_t = 4)]
    pub channels: usize,
    /// What each task does.
    #[arg(long, value_enum, default_value_t = Workload::Claim)]
    pub workload: Workload,
    /// duplicate-heavy: share of ops that repeat a committed ID.
    #[arg(long, default_value_t = 0.9)]
    pub duplicate_share: f64,
    /// batch workloads: items per call.
    #[arg(long, default_value_t = 500)]
    pub batch_size: usize,
    /// Namespace the IDs are claimed in.
    #[arg(long, default_value = "bench")]
    pub namespace: String,
    /// The answer each Commit stores, in bytes, and so the one each of
    /// duplicate-heavy's repeats gets back (dedupd and the no-op server
    /// only: the Redis and PostgreSQL baselines store none).
    #[arg(long, default_value_t = 0)]
    pub response_bytes: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Tokio worker threads of the load generator (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    pub worker_threads: usize,
}

/// What one task saw.
struct TaskReport {
    latency_us: Histogram<u64>,
    outcomes: BTreeMap<Outcome, u64>,
    ops: u64,
    calls: u64,
    errors: u64,
    first_error: Option<String>,
    claims: u64,
    expected_duplicates: u64,
}

impl TaskReport {
    fn new() -> Self {
        TaskReport {
            latency_us: Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds"),
            outcomes: BTreeMap::new(),
            ops: 0,
            calls: 0,
            errors: 0,
            first_error: None,
            claims: 0,
            expected_duplicates: 0,
        }
    }

    fn count(&mut self, outcome: Outcome) {
        *self.outcomes.entry(outcome).or_default() += 1;
    }

    fn error(&mut self, error: String) {
        self.errors += 1;
        self.first_error.get_or_insert(error);
    }

    fn merge(&mut self, other: TaskReport) {
        self.latency_us.add(&other.latency_us).expect("same bounds");
        for (outcome, count) in other.outcomes {
            *self.outcomes.entry(outcome).or_default() += count;
        }
        self.ops += other.ops;
        self.calls += other.calls;
        self.errors += other.errors;
        self.claims += other.claims;
        self.expected_duplicates += other.expected_duplicates;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

/// Shared by every task.
struct Plan {
    args: LoadArgs,
    run_id: String,
    deadline: Instant,
    issued: AtomicU64,
    pool: Vec<String>,
}

impl Plan {
    /// Reserves `units` ops; false once the run is over.
    fn take(&self, units: u64) -> bool {
        match self.args.requests {
            Some(limit) => self.issued.fetch_add(units, Ordering::Relaxed) < limit,
            None => Instant::now() < self.deadline,
        }
    }
}

/// Runs the benchmark; returns the process exit code (1 when a check
/// failed or nothing could be measured).
pub async fn run(args: LoadArgs) -> i32 {
    if args.concurrency == 0 || args.channels == 0 || args.batch_size == 0 {
        eprintln!("dedupd-bench: --concurrency, --channels and --batch-size must be at least 1");
        return 64;
    }
    if !(0.0..=1.0).contains(&args.duplicate_share) {
        eprintln!("dedupd-bench: --duplicate-share must be between 0 and 1");
        return 64;
    }
    if args.response_bytes > 0 && matches!(args.target, Target::Redis(_) | Target::Postgres(_)) {
        eprintln!("dedupd-bench: --response-bytes is for dedupd:// and noop:// targets only");
        return 64;
    }
    let connections = match args.target.connect(args.channels).await {
        Ok(connections) => connections,
        Err(error) => {
            eprintln!("dedupd-bench: {error}");
            return 1;
        }
    };
    let run_id = format!("{:08x}", rand::random::<u32>());
    let pool = match args.workload {
        Workload::DuplicateHeavy => match seed_pool(&args, &run_id, connections[0].clone()).await {
            Ok(pool) => pool,
            Err(error) => {
                eprintln!("dedupd-bench: seeding committed IDs failed: {error}");
                return 1;
            }
        },
        _ => Vec::new(),
    };
    let started = Instant::now();
    let plan = Arc::new(Plan {
        deadline: started + Duration::from(args.duration),
        args: args.clone(),
        run_id,
        issued: AtomicU64::new(0),
        pool,
    });
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|task| {
            let connection = connections[task % connections.len()].clone();
            tokio::spawn(drive(Arc::clone(&plan), task, connection))
        })
        .collect();
    let mut total = TaskReport::new();
    for task in tasks {
        match task.await {
            Ok(report) => total.merge(report),
            Err(join) => total.error(format!("task failed: {join}")),
        }
    }
    let elapsed = started.elapsed();
    let checks = check(&args, &total);
    let report = report_json(&args, &total, elapsed, &checks);
    if args.json {
        println!("{report}");
    } else {
        print_table(&report, total.first_error.as_deref());
    }
    if checks.is_empty() {
        0
    } else {
        1
    }
}

/// Claims and commits the IDs duplicate-heavy repeats, before timing.
async fn seed_pool(
    args: &LoadArgs,
    run_id: &str,
    mut connection: Connection,
) -> Result<Vec<String>, String> {
    let pool: Vec<String> = (0..1000).map(|i| format!("{run_id}-pool-{i}")).collect();
    // The answers their replays carry: --response-bytes each, committed in
    // batches of at most ~2 MiB (under any gRPC message limit).
    let response = vec![b'r'; args.response_bytes];
    let per_batch = ((2 << 20) / args.response_bytes.max(1)).clamp(1, args.batch_size.min(500));
    for chunk in pool.chunks(per_batch) {
        let claimed = connection.claim_batch(&args.namespace, chunk).await?;
        let to_commit: Vec<(String, String)> = chunk
            .iter()
            .cloned()
            .zip(claimed.into_iter().map(|(_, token)| token))
            .collect();
        connection
            .commit_batch(&args.namespace, &to_commit, &response)
            .await?;
    }
    Ok(pool)
}

async fn drive(plan: Arc<Plan>, task: usize, mut connection: Connection) -> TaskReport {
    let args = &plan.args;
    let namespace = args.namespace.as_str();
    let response = vec![b'r'; args.response_bytes];
    let mut report = TaskReport::new();
    let mut sequence = 0u64;
    let mut fresh_id = || {
        sequence += 1;
        format!("{}-{task}-{sequence}", plan.run_id)
    };
    let units = match args.workload {
        Workload::Batch | Workload::BatchCommit => args.batch_size as u64,
        _ => 1,
    };
    while plan.take(units) {
        let started = Instant::now();
        let result: Result<(), String> = async {
            match args.workload {
                Workload::Claim => {
                    let (outcome, _) = connection.claim(namespace, &fresh_id()).await?;
                    report.claims += 1;
                    report.calls += 1;
                    report.count(outcome);
                }
                Workload::ClaimCommit | Workload::DuplicateHeavy => {
                    let repeat = args.workload == Workload::DuplicateHeavy
                        && !plan.pool.is_empty()
                        && rand::random::<f64>() < args.duplicate_share;
                    let id = if repeat {
                        report.expected_duplicates += 1;
                        plan.pool[rand::random_range(0..plan.pool.len())].clone()
                    } else {
                        fresh_id()
                    };
                    let (outcome, lease_token) = connection.claim(namespace, &id).await?;
                    report.calls += 1;
                    report.count(outcome);
                    if !repeat {
                        report.claims += 1;
                    }
                    if outcome == Outcome::Claimed {
                        let committed = connection
                            .commit(namespace, &id, &lease_token, &response)
                            .await?;
                        report.calls += 1;
                        report.count(committed);
                    }
                }
                Workload::Batch | Workload::BatchCommit => {
                    let ids: Vec<String> = (0..args.batch_size).map(|_| fresh_id()).collect();
                    let claimed = connection.claim_batch(namespace, &ids).await?;
                    report.calls += 1;
                    report.claims += ids.len() as u64;
                    for (outcome, _) in &claimed {
                        report.count(*outcome);
                    }
                    if args.workload == Workload::BatchCommit {
                        let to_commit: Vec<(String, String)> = ids
                            .into_iter()
                            .zip(claimed.into_iter().map(|(_, token)| token))
                            .collect();
                        for outcome in connection
                            .commit_batch(namespace, &to_commit, &response)
                            .await?
                        {
                            report.count(outcome);
                        }
                        report.calls += 1;
                    }
                }
            }
            Ok(())
        }
        .await;
        match result {
            Ok(()) => {
                report.ops += units;
                let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                report.latency_us.saturating_record(micros.max(1));
            }
            Err(error) => {
                report.error(error);
                // A dead target would otherwise spin; pace the retries.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    report
}

/// The benchmark checks its own results; returns what failed.
fn check(args: &LoadArgs, total: &TaskReport) -> Vec<String> {
    let count = |outcome| total.outcomes.get(&outcome).copied().unwrap_or(0);
    let mut failures = Vec::new();
    if total.errors > 0 {
        failures.push(format!("{} calls failed", total.errors));
    }
    if total.ops == 0 {
        failures.push("no op completed".into());
    }
    // The no-op server claims everything, repeated IDs included.
    let noop = matches!(args.target, Target::Noop(_));
    let expected_claims = if noop {
        total.claims + total.expected_duplicates
    } else {
        total.claims
    };
    if count(Outcome::Claimed) != expected_claims {
        failures.push(format!(
            "{expected_claims} claims expected to succeed, but {} CLAIMED",
            count(Outcome::Claimed)
        ));
    }
    if !noop && count(Outcome::Duplicate) != total.expected_duplicates {
        failures.push(format!(
            "{} repeated IDs, but {} DUPLICATE",
            total.expected_duplicates,
            count(Outcome::Duplicate)
        ));
    }
    let commits_expected = matches!(
        args.workload,
        Workload::ClaimCommit | Workload::DuplicateHeavy | Workload::BatchCommit
    );
    if commits_expected && count(Outcome::Committed) != count(Outcome::Claimed) {
        failures.push(format!(
            "{} CLAIMED but {} COMMITTED",
            count(Outcome::Claimed),
            count(Outcome::Committed)
        ));
    }
    if count(Outcome::InProgress) + count(Outcome::LeaseLost) + count(Outcome::Other) > 0 {
        failures.push("unexpected IN_PROGRESS, LEASE_LOST or other outcomes".into());
    }
    failures
}

fn report_json(
    args: &LoadArgs,
    total: &TaskReport,
    elapsed: Duration,
    failures: &[String],
) -> Value {
    let seconds = elapsed.as_secs_f64();
    let latency = &total.latency_us;
    let outcomes: serde_json::Map<String, Value> = total
        .outcomes
        .iter()
        .map(|(outcome, count)| (outcome.name().to_owned(), json!(count)))
        .collect();
    let workers = if args.worker_threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        args.worker_threads
    };
    json!({
        "target": args.target.to_string(),
        "workload": args.workload.to_possible_value().map(|v| v.get_name().to_owned()),
        "batch_size": matches!(args.workload, Workload::Batch | Workload::BatchCommit).then_some(args.batch_size),
        "response_bytes": args.response_bytes,
        "concurrency": args.concurrency,
        "channels": args.channels,
        "client_worker_threads": workers,
        "seconds": (seconds * 1000.0).round() / 1000.0,
        "ops": total.ops,
        "ops_per_sec": (total.ops as f64 / seconds).round(),
        "calls": total.calls,
        "calls_per_sec": (total.calls as f64 / seconds).round(),
        "latency_us": {
            "p50": latency.value_at_quantile(0.50),
            "p90": latency.value_at_quantile(0.90),
            "p99": latency.value_at_quantile(0.99),
            "p999": latency.value_at_quantile(0.999),
            "max": latency.max(),
        },
        "errors": total.errors,
        "outcomes": outcomes,
        "checks_passed": failures.is_empty(),
        "check_failures": failures,
    })
}

fn print_table(report: &Value, first_error: Option<&str>) {
    let latency = &report["latency_us"];
    println!(
        "target      {}",
        report["target"].as_str().unwrap_or_default()
    );
    println!(
        "workload    {} (concurrency {}, channels {}, client workers {})",
        report["workload"].as_str().unwrap_or_default(),
        report["concurrency"],
        report["channels"],
        report["client_worker_threads"]
    );
    println!(
        "throughput  {} ops/s ({} ops in {} s; {} calls/s)",
        report["ops_per_sec"], report["ops"], report["seconds"], report["calls_per_sec"]
    );
    println!(
        "latency µs  p50 {}  p90 {}  p99 {}  p99.9 {}  max {}",
        latency["p50"], latency["p90"], latency["p99"], latency["p999"], latency["max"]
    );
    let outcomes: Vec<String> = report["outcomes"]
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(name, count)| format!("{name} {count}"))
                .collect()
        })
        .unwrap_or_default();
    println!("outcomes    {}", outcomes.join(", "));
    println!("errors      {}", report["errors"]);
    if let Some(error) = first_error {
        println!("first error {error}");
    }
    match report["check_failures"].as_array() {
        Some(failures) if !failures.is_empty() => {
            for failure in failures {
                println!("CHECK FAILED {}", failure.as_str().unwrap_or_default());
            }
        }
        _ => println!("checks      passed"),
    }
}
