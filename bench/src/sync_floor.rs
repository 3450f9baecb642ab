//! The device's floor under a durable answer: one small append to a
//! preallocated file and its `fdatasync`, timed call by call — what the
//! write-ahead log's group commit does for a lone caller, with no engine,
//! no sled and no gRPC around it. `benches/compare.sh` adds its p50 to the
//! no-op server's c=1 p50: the floor for any durable gRPC answer on the
//! machine, which Claim c=1 is measured against (issue 39).

use std::{
    fs::OpenOptions,
    io::Write,
    os::unix::fs::FileExt,
    path::PathBuf,
    time::{Duration, Instant},
};

use clap::Args;
use hdrhistogram::Histogram;

/// Options of `dedupd-bench sync-floor`.
#[derive(Debug, Clone, Args)]
pub struct SyncFloorArgs {
    /// Directory on the device to measure (a file is created and removed).
    #[arg(long)]
    pub dir: PathBuf,
    /// Appends (each followed by its `fdatasync`) to time.
    #[arg(long, default_value_t = 2000)]
    pub count: usize,
    /// Bytes per append: about one Claim's group (group header and frame).
    #[arg(long, default_value_t = 128)]
    pub bytes: usize,
}

/// Runs the measurement and prints one JSON line of latencies in µs.
pub fn run(args: &SyncFloorArgs) -> Result<(), String> {
    if args.count == 0 || args.bytes == 0 {
        return Err("--count and --bytes must be at least 1".into());
    }
    let path = args
        .dir
        .join(format!("sync-floor-{}.bin", std::process::id()));
    let result = measure(&path, args);
    let _ = std::fs::remove_file(&path);
    let latency = result?;
    let quantile = |q: f64| latency.value_at_quantile(q);
    println!(
        "{}",
        serde_json::json!({
            "count": args.count,
            "bytes": args.bytes,
            "latency_us": {
                "p50": quantile(0.5),
                "p90": quantile(0.9),
                "p99": quantile(0.99),
                "max": latency.max(),
            },
        })
    );
    Ok(())
}

fn measure(path: &std::path::Path, args: &SyncFloorArgs) -> Result<Histogram<u64>, String> {
    let failed = |what: &str, error: std::io::Error| format!("{what} {}: {error}", path.display());
    let total = args.count.saturating_mul(args.bytes);
    let mut file = OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| failed("cannot create", e))?;
    // Preallocated and synced first, as the log preallocates a segment
    // (`fallocate`, unwritten extents; written zeros where the filesystem
    // has no fallocate): each timed sync then writes data, not the size.
    if rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, total as u64).is_err() {
        let zeros = vec![0u8; 1 << 20];
        let mut written = 0;
        while written < total {
            let chunk = zeros.len().min(total - written);
            file.write_all(&zeros[..chunk])
                .map_err(|e| failed("cannot preallocate", e))?;
            written += chunk;
        }
    }
    file.sync_all().map_err(|e| failed("cannot sync", e))?;
    let frame = vec![0xa5u8; args.bytes];
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
        .map_err(|e| format!("histogram: {e}"))?;
    for i in 0..args.count {
        let started = Instant::now();
        file.write_all_at(&frame, (i * args.bytes) as u64)
            .map_err(|e| failed("cannot write", e))?;
        file.sync_data().map_err(|e| failed("cannot sync", e))?;
        let micros = started.elapsed().max(Duration::from_micros(1)).as_micros();
        latency.saturating_record(u64::try_from(micros).unwrap_or(u64::MAX));
    }
    Ok(latency)
}
