//! What the local tier saves, without the gRPC hop around it: DUPLICATE
//! answers from the engine over Redis with the local tier in front, and over
//! Redis alone, one call at a time, latencies printed.

use std::{sync::Arc, time::Instant};

use clap::Args;
use dedupd::{
    api::Limits,
    clock::{Clock, SystemClock},
    domain::{ClaimOutcome, ClaimRequest, CommitRequest},
    engine::Engine,
    store::{
        redis::{RedisConfig, RedisStore},
        tiered::{LocalTierConfig, Tiered},
        Store,
    },
};
use hdrhistogram::Histogram;

/// Options of `dedupd-bench tier`.
#[derive(Debug, Clone, Args)]
pub struct TierArgs {
    /// The Redis to use (keys under a fresh prefix, deleted after).
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    pub redis: String,
    /// DUPLICATE answers timed on each path.
    #[arg(long, default_value_t = 20_000)]
    pub requests: usize,
    /// Committed IDs the duplicates are drawn from.
    #[arg(long, default_value_t = 1000)]
    pub ids: usize,
}

/// Runs the comparison; the process exit code.
pub async fn run(args: TierArgs) -> i32 {
    match compare(&args).await {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("dedupd-bench tier: {error}");
            1
        }
    }
}

async fn compare(args: &TierArgs) -> Result<(), String> {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let prefix = format!("dedupd_bench_{:08x}", rand::random::<u32>());
    let config = RedisConfig {
        url: args.redis.clone(),
        prefix: prefix.clone(),
        connections: 1,
        timeout: std::time::Duration::from_secs(5),
        ca_pem: None,
        replicas: 0,
        allow_eviction: false,
        cluster: false,
    };
    let shared = Arc::new(RedisStore::new(&config, Arc::clone(&clock)).map_err(|e| e.to_string())?);
    shared.ping().await.map_err(|e| e.to_string())?;
    let dir = tempfile_dir()?;
    let tiered = Tiered::open(
        Arc::clone(&shared),
        &LocalTierConfig {
            path: dir.join("local-tier"),
            max_bytes: 64 << 20,
            cache_bytes: 64 << 20,
            max_age: std::time::Duration::from_secs(600),
        },
        Arc::clone(&clock),
        None,
    )
    .map_err(|e| e.to_string())?;
    let upkeep = tiered.keep_current();
    while !tiered.tier_enabled() {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let with_tier = Engine::new(Arc::new(tiered), Arc::clone(&clock));
    let without = Engine::new(Arc::clone(&shared), Arc::clone(&clock));
    let requests: Vec<ClaimRequest> = (0..args.ids)
        .map(|i| claim_request(&format!("dup-{i}")))
        .collect::<Result<_, _>>()?;
    for request in &requests {
        let ClaimOutcome::Claimed { record, .. } =
            with_tier.claim(request).await.map_err(|e| e.to_string())?
        else {
            return Err("seeding: the ID was not fresh".into());
        };
        with_tier
            .commit(&CommitRequest {
                key: request.key.clone(),
                lease_token: record.lease_token,
                response: b"done".to_vec(),
                retention: None,
            })
            .await
            .map_err(|e| e.to_string())?;
    }
    println!("DUPLICATE answers, one at a time, {} each:", args.requests);
    for (name, time_one) in [("local tier", true), ("Redis only", false)] {
        let mut histogram = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
        for i in 0..args.requests {
            let request = &requests[i % requests.len()];
            let started = Instant::now();
            let outcome = if time_one {
                with_tier.claim(request).await
            } else {
                without.claim(request).await
            }
            .map_err(|e| e.to_string())?;
            let elapsed = started.elapsed();
            if !matches!(outcome, ClaimOutcome::Duplicate { .. }) {
                return Err(format!("{name}: expected DUPLICATE, got {outcome:?}"));
            }
            histogram
                .record(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX))
                .map_err(|e| e.to_string())?;
        }
        println!(
            "  {name:<10}  p50 {:>7.1} µs  p99 {:>7.1} µs",
            histogram.value_at_quantile(0.5) as f64 / 1000.0,
            histogram.value_at_quantile(0.99) as f64 / 1000.0
        );
    }
    upkeep.abort();
    for request in &requests {
        let _ = shared
            .update(&request.key, |current, _| {
                Ok((dedupd::machine::forget(current, clock.now()).0, ()))
            })
            .await;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn claim_request(id: &str) -> Result<ClaimRequest, String> {
    let limits = Limits::default();
    Ok(ClaimRequest::plain(
        limits.key("bench", id).map_err(|e| e.to_string())?,
        limits.default_lease_ttl,
        limits.default_retention,
    ))
}

fn tempfile_dir() -> Result<std::path::PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("dedupd-bench-tier-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    Ok(dir)
}
