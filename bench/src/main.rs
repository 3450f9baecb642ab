//! The `dedupd-bench` binary: parses its command and runs it (see the
//! library's module map).

use std::{future::Future, io::IsTerminal, net::SocketAddr, process::ExitCode};

use clap::{Args, Parser, Subcommand};
use dedupd_bench::{load, noop, otlp_sink, sync_floor, tier, upstream};
use tokio::net::TcpListener;

/// Load generator for dedupd and the obvious alternatives.
#[derive(Debug, Parser)]
#[command(name = "dedupd-bench", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Load-test dedupd, the no-op server, Redis or PostgreSQL.
    Load(load::LoadArgs),
    /// Serve the dedup API without a store: the gRPC ceiling.
    NoopServer(ServerArgs),
    /// Serve a trivial HTTP service (201 to everything, GET /calls counts):
    /// what the HTTP proxy is measured in front of.
    HttpUpstream(HttpUpstreamArgs),
    /// Accept OTLP/gRPC spans and count them: a collector for the trace
    /// export benchmark.
    OtlpSink(ServerArgs),
    /// Time DUPLICATE answers from the local tier and from Redis alone,
    /// through the engine without gRPC.
    Tier(tier::TierArgs),
    /// Time a small append to a preallocated file and its `fdatasync`: the
    /// device's share of the floor under a durable answer.
    SyncFloor(sync_floor::SyncFloorArgs),
}

/// Options of `dedupd-bench noop-server` and `http-upstream`.
#[derive(Debug, Clone, Args)]
struct ServerArgs {
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1:50052")]
    listen: SocketAddr,
    /// Tokio worker threads; 0 means one per CPU.
    #[arg(long, default_value_t = 0)]
    worker_threads: usize,
}

/// Options of `dedupd-bench http-upstream`.
#[derive(Debug, Clone, Args)]
struct HttpUpstreamArgs {
    #[command(flatten)]
    server: ServerArgs,
    /// CPU time each request costs (busy, like a real service's work).
    #[arg(long, default_value = "0s")]
    work: humantime::Duration,
}

/// sysexits.h EX_USAGE.
const EXIT_USAGE: u8 = 64;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) if !error.use_stderr() => {
            let _ = error.print();
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            let _ = error.print();
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match cli.command {
        Command::Load(args) => match runtime(args.worker_threads) {
            Ok(runtime) => {
                let code = runtime.block_on(load::run(args));
                ExitCode::from(u8::try_from(code).unwrap_or(1))
            }
            Err(code) => code,
        },
        Command::NoopServer(args) => serve_until_interrupted(&args, "no-op server", noop::serve),
        Command::OtlpSink(args) => serve_until_interrupted(&args, "OTLP sink", otlp_sink::serve),
        Command::HttpUpstream(args) => {
            let work = args.work.into();
            serve_until_interrupted(&args.server, "HTTP upstream", |listener, shutdown| {
                upstream::serve(listener, work, shutdown)
            })
        }
        Command::Tier(args) => match runtime(1) {
            Ok(runtime) => {
                ExitCode::from(u8::try_from(runtime.block_on(tier::run(args))).unwrap_or(1))
            }
            Err(code) => code,
        },
        Command::SyncFloor(args) => match sync_floor::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("dedupd-bench sync-floor: {error}");
                ExitCode::FAILURE
            }
        },
    }
}

fn runtime(worker_threads: usize) -> Result<tokio::runtime::Runtime, ExitCode> {
    dedupd::server::runtime(worker_threads).map_err(|error| {
        eprintln!("dedupd-bench: cannot start the runtime: {error}");
        ExitCode::FAILURE
    })
}

/// Runs one of the servers until Ctrl-C (or SIGINT from a script).
fn serve_until_interrupted<F, E>(
    args: &ServerArgs,
    name: &str,
    serve: impl FnOnce(TcpListener, std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> F,
) -> ExitCode
where
    F: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    tracing_subscriber::fmt()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let runtime = match runtime(args.worker_threads) {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    runtime.block_on(async {
        let listener = match TcpListener::bind(args.listen).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::error!(%error, listen = %args.listen, "cannot listen");
                return ExitCode::FAILURE;
            }
        };
        let shutdown = Box::pin(async {
            let _ = tokio::signal::ctrl_c().await;
        });
        match serve(listener, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                tracing::error!(%error, "{name} failed");
                ExitCode::FAILURE
            }
        }
    })
}
