//! The `dedupd` binary: parse and validate configuration (exit 64 with one
//! line if it is bad, before anything is opened or bound), start logging,
//! open the store, bind, and hand over to [`dedupd::run`]. With a client
//! command it makes one call to a running sidecar instead.

use std::{io::IsTerminal, process::ExitCode, sync::Arc};

use clap::{error::ErrorKind, Parser};
use dedupd::{
    cli,
    config::{Cli, Command, LogFormat, ServeArgs, Settings},
    store::sled::SledStore,
};
use tokio::net::TcpListener;

/// sysexits.h EX_USAGE: the configuration is wrong.
const EXIT_CONFIG: u8 = 64;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            if matches!(
                error.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = error.print();
                return ExitCode::SUCCESS;
            }
            let rendered = error.render().to_string();
            let line = rendered.lines().next().unwrap_or("invalid arguments");
            eprintln!("dedupd: {line} (see dedupd --help)");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    match cli.command {
        Some(Command::Client(command)) => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime");
            let code = runtime.block_on(cli::run(command));
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
        Some(Command::Serve(args)) => serve(&args),
        None => serve(&cli.serve),
    }
}

fn serve(args: &ServeArgs) -> ExitCode {
    let settings = match args.validate() {
        Ok(settings) => settings,
        Err(line) => {
            eprintln!("dedupd: invalid configuration: {line}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    init_tracing(&settings);
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if settings.worker_threads > 0 {
        runtime.worker_threads(settings.worker_threads);
    }
    let runtime = match runtime.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let store = match SledStore::open(&settings.sled) {
            Ok(store) => Arc::new(store),
            Err(error) => {
                tracing::error!(%error, data_dir = %settings.sled.path.display(), "cannot open the store");
                return ExitCode::FAILURE;
            }
        };
        let listener = match TcpListener::bind(settings.listen).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::error!(%error, listen = %settings.listen, "cannot listen");
                return ExitCode::FAILURE;
            }
        };
        match dedupd::run(listener, store, settings.server, shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(_) => ExitCode::FAILURE,
        }
    })
}

fn init_tracing(settings: &Settings) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(settings.log_filter.clone())
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match settings.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// Resolves on SIGTERM (Kubernetes) or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let sigterm = async {
        match terminate.as_mut() {
            Some(signal) => {
                signal.recv().await;
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
        () = sigterm => tracing::info!("SIGTERM received"),
    }
}
