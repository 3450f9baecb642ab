//! Command-line and environment configuration. Every flag of the server is
//! also a `DEDUPD_*` variable; [`ServeArgs::validate`] checks the whole
//! configuration before anything is opened or bound.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{
    api::{
        check_namespace, Limits, HARD_MAX_LEASE_TTL, HARD_MAX_RESPONSE_BYTES, HARD_MAX_RETENTION,
    },
    bench::BenchArgs,
    cli::ClientCommand,
    clock::SystemClock,
    server::ServerConfig,
    store::sled::{SledConfig, SyncMode},
};

/// dedupd: a deduplication sidecar. Without a command it runs the server;
/// with one it is a client of a running server.
#[derive(Debug, Parser)]
#[command(name = "dedupd", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// Server settings (when no command is given).
    #[command(flatten)]
    pub serve: ServeArgs,
    /// A client command.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What to do.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the sidecar (the default when no command is given).
    Serve(ServeArgs),
    /// A client command against a running sidecar.
    #[command(flatten)]
    Client(ClientCommand),
    /// Load-test dedupd, the no-op server, Redis or PostgreSQL.
    Bench(BenchArgs),
    /// Run a gRPC server for benchmarks (`--noop`: answers without a store).
    BenchServer(BenchServerArgs),
}

/// Options of `dedupd bench-server`.
#[derive(Debug, Clone, Args)]
pub struct BenchServerArgs {
    /// Answer every call without touching a store (the only mode).
    #[arg(long, required = true)]
    pub noop: bool,
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// Tokio worker threads; 0 means one per CPU.
    #[arg(long, default_value_t = 0)]
    pub worker_threads: usize,
}

/// The store backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// Embedded sled database in --data-dir (one sidecar per pod).
    Sled,
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Server settings.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to serve gRPC on.
    #[arg(long, env = "DEDUPD_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Store backend.
    #[arg(long, env = "DEDUPD_STORE", value_enum, default_value_t = StoreKind::Sled)]
    pub store: StoreKind,
    /// Directory of the embedded store (created if missing).
    #[arg(long, env = "DEDUPD_DATA_DIR", default_value = "./dedupd-data")]
    pub data_dir: PathBuf,
    /// `always`: every answer waits until its change is on disk (group
    /// commit). `none`: faster, but a machine crash loses recent changes.
    #[arg(long, env = "DEDUPD_SYNC", value_enum, default_value_t = SyncMode::Always)]
    pub sync: SyncMode,
    /// Page cache of the embedded store, in MiB.
    #[arg(long, env = "DEDUPD_CACHE_MB", default_value_t = 64)]
    pub cache_mb: u64,
    /// Lease granted when a Claim does not give one.
    #[arg(long, env = "DEDUPD_DEFAULT_LEASE_TTL", default_value = "30s")]
    pub default_lease_ttl: humantime::Duration,
    /// Longest lease a Claim or Renew may ask for (at most 1h).
    #[arg(long, env = "DEDUPD_MAX_LEASE_TTL", default_value = "1h")]
    pub max_lease_ttl: humantime::Duration,
    /// Retention when neither the request nor its namespace gives one.
    #[arg(long, env = "DEDUPD_DEFAULT_RETENTION", default_value = "7days")]
    pub default_retention: humantime::Duration,
    /// Longest retention a request may ask for (at most 365days).
    #[arg(long, env = "DEDUPD_MAX_RETENTION", default_value = "365days")]
    pub max_retention: humantime::Duration,
    /// Default retention per namespace, as NAMESPACE=DURATION, comma-separated
    /// (e.g. `payments=30days,http=24h`).
    #[arg(long, env = "DEDUPD_NAMESPACE_RETENTION", value_delimiter = ',', value_parser = parse_namespace_retention)]
    pub namespace_retention: Vec<(String, Duration)>,
    /// Largest response Commit may cache, in bytes (at most 1048576).
    #[arg(long, env = "DEDUPD_MAX_RESPONSE_BYTES", default_value_t = 64 << 10)]
    pub max_response_bytes: usize,
    /// Most items in one batch call.
    #[arg(long, env = "DEDUPD_MAX_BATCH_SIZE", default_value_t = 1000)]
    pub max_batch_size: usize,
    /// Largest gRPC message accepted, in bytes.
    #[arg(long, env = "DEDUPD_MAX_MESSAGE_BYTES", default_value_t = 16 << 20)]
    pub max_message_bytes: usize,
    /// How often the reaper removes expired records.
    #[arg(long, env = "DEDUPD_REAPER_INTERVAL", default_value = "10s")]
    pub reaper_interval: humantime::Duration,
    /// How long in-flight calls may take to finish on SIGTERM/SIGINT.
    #[arg(long, env = "DEDUPD_SHUTDOWN_GRACE", default_value = "20s")]
    pub shutdown_grace: humantime::Duration,
    /// Log format.
    #[arg(long, env = "DEDUPD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log filter, in tracing's EnvFilter syntax (e.g. `info,dedupd=debug`).
    #[arg(long, env = "DEDUPD_LOG", default_value = "info")]
    pub log: String,
    /// Tokio worker threads; 0 means one per CPU.
    #[arg(long, env = "DEDUPD_WORKER_THREADS", default_value_t = 0)]
    pub worker_threads: usize,
}

/// A validated server configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The sled store's settings.
    pub sled: SledConfig,
    /// The server's settings.
    pub server: ServerConfig,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter.
    pub log_filter: tracing_subscriber::EnvFilter,
    /// Tokio worker threads (0: one per CPU).
    pub worker_threads: usize,
}

fn parse_namespace_retention(text: &str) -> Result<(String, Duration), String> {
    let (namespace, duration) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not NAMESPACE=DURATION"))?;
    check_namespace(namespace).map_err(|problem| format!("namespace {namespace:?} {problem}"))?;
    let duration = humantime::parse_duration(duration)
        .map_err(|e| format!("retention of {namespace:?}: {e}"))?;
    Ok((namespace.to_owned(), duration))
}

fn check_duration(name: &str, value: Duration, max: Duration) -> Result<(), String> {
    if value.is_zero() {
        return Err(format!("--{name} must be positive"));
    }
    if value > max {
        return Err(format!(
            "--{name} must be at most {}, got {}",
            humantime::format_duration(max),
            humantime::format_duration(value)
        ));
    }
    Ok(())
}

impl ServeArgs {
    /// Checks every setting and their relations; the error is one line.
    pub fn validate(&self) -> Result<Settings, String> {
        let max_lease_ttl: Duration = self.max_lease_ttl.into();
        let max_retention: Duration = self.max_retention.into();
        check_duration("max-lease-ttl", max_lease_ttl, HARD_MAX_LEASE_TTL)?;
        check_duration(
            "default-lease-ttl",
            self.default_lease_ttl.into(),
            max_lease_ttl,
        )?;
        check_duration("max-retention", max_retention, HARD_MAX_RETENTION)?;
        check_duration(
            "default-retention",
            self.default_retention.into(),
            max_retention,
        )?;
        for (namespace, retention) in &self.namespace_retention {
            check_duration(
                &format!("namespace-retention of {namespace}"),
                *retention,
                max_retention,
            )?;
        }
        check_duration(
            "reaper-interval",
            self.reaper_interval.into(),
            Duration::from_secs(24 * 3600),
        )?;
        if self.max_response_bytes > HARD_MAX_RESPONSE_BYTES {
            return Err(format!(
                "--max-response-bytes must be at most {HARD_MAX_RESPONSE_BYTES}, got {}",
                self.max_response_bytes
            ));
        }
        if !(1..=100_000).contains(&self.max_batch_size) {
            return Err(format!(
                "--max-batch-size must be between 1 and 100000, got {}",
                self.max_batch_size
            ));
        }
        let smallest_message = self.max_response_bytes + (64 << 10);
        if self.max_message_bytes < smallest_message {
            return Err(format!(
                "--max-message-bytes must be at least {smallest_message} (the largest response plus 64 KiB), got {}",
                self.max_message_bytes
            ));
        }
        if self.cache_mb == 0 {
            return Err("--cache-mb must be at least 1".into());
        }
        if self.data_dir.exists() && !self.data_dir.is_dir() {
            return Err(format!(
                "--data-dir {} exists and is not a directory",
                self.data_dir.display()
            ));
        }
        let log_filter = tracing_subscriber::EnvFilter::try_new(&self.log)
            .map_err(|e| format!("--log {:?} is not a valid filter: {e}", self.log))?;
        Ok(Settings {
            listen: self.listen,
            sled: SledConfig {
                path: self.data_dir.clone(),
                sync: self.sync,
                cache_capacity_bytes: self.cache_mb << 20,
            },
            server: ServerConfig {
                limits: Limits {
                    default_lease_ttl: self.default_lease_ttl.into(),
                    max_lease_ttl,
                    default_retention: self.default_retention.into(),
                    max_retention,
                    namespace_retention: self.namespace_retention.iter().cloned().collect(),
                    max_response_bytes: self.max_response_bytes,
                    max_batch_size: self.max_batch_size,
                },
                shutdown_grace: self.shutdown_grace.into(),
                reaper_interval: self.reaper_interval.into(),
                reaper_batch: 10_000,
                max_message_bytes: self.max_message_bytes,
                clock: Arc::new(SystemClock),
            },
            log_format: self.log_format,
            log_filter,
            worker_threads: self.worker_threads,
        })
    }
}
