//! The `dedupd` binary: parse and validate configuration (exit 64 with one
//! line if it is bad, before anything is opened or bound), start logging,
//! open the store, bind, and hand over to [`dedupd::run`]. With a client
//! command it makes one call to a running sidecar instead.

use std::{io::IsTerminal, process::ExitCode, sync::Arc, time::Duration};

use clap::{error::ErrorKind, Parser};
use dedupd::{
    cli,
    clock::SystemClock,
    command::{Cli, Command},
    config::{LogFormat, ServeArgs, Settings, SharedBackend, StoreSettings},
    credentials::{read_pem_file, TlsFiles},
    hashed_ids::IdHasher,
    inject::{InjectArgs, InjectMetrics, ReloadingCert},
    sealing::Keyring,
    store::{
        postgres::{redact_url, PostgresStore},
        redis::RedisStore,
        shared::DeletionFeed,
        sled::SledStore,
        tiered::{LocalTierConfig, Tiered},
        Store, StoreObserver,
    },
    telemetry::TraceExport,
    time_policy::{StoreClock, TimeSource},
    GuardConfig, Listener, Listeners, Metrics, ServerConfig,
};
use tokio::net::TcpListener;

// sled copies tree nodes on every write and tonic allocates per call: the
// allocator is on the hot path. mimalloc measured faster than glibc's, and
// jemalloc as fast as mimalloc with 30 % less peak memory (BENCHMARKS.md),
// which a sidecar in every pod pays for.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

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
            eprintln!(
                "dedupd: {} (see dedupd --help)",
                dedupd::config::one_line_error(&error)
            );
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    match cli.command {
        Some(Command::Client(command)) => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime");
            exit_code(runtime.block_on(cli::run(command)))
        }
        Some(Command::Serve(args)) => serve(&args),
        Some(Command::HttpProxy(mut args)) => {
            args.http_proxy.standalone = true;
            serve(&args)
        }
        Some(Command::Inject(args)) => inject(&args),
        None => serve(&cli.serve),
    }
}

fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

fn runtime(worker_threads: usize) -> Result<tokio::runtime::Runtime, ExitCode> {
    dedupd::server::runtime(worker_threads).map_err(|error| {
        eprintln!("dedupd: cannot start the runtime: {error}");
        ExitCode::FAILURE
    })
}

/// Runs on a shared store, deciding by the store's clock, with this
/// sidecar's local tier in front unless it is turned off.
async fn serve_shared<S: Store + DeletionFeed + TimeSource + Clone>(
    store: S,
    local_tier: Option<&LocalTierConfig>,
    observer: Arc<dyn StoreObserver>,
    settings: &Settings,
    mut server: ServerConfig,
    clock: Arc<StoreClock>,
) -> ExitCode {
    let _measuring = AbortOnDrop(tokio::spawn(
        Arc::clone(&clock).keep_measured(store.clone()),
    ));
    server.clock = clock;
    let Some(config) = local_tier else {
        return serve_on(Arc::new(store), settings, server).await;
    };
    match Tiered::open(
        Arc::new(store),
        config,
        Arc::clone(&server.clock),
        Some(observer),
    ) {
        Ok(tiered) => {
            tracing::info!(path = %config.path.display(), max_bytes = config.max_bytes, max_age = ?config.max_age, "local tier");
            let _upkeep = tiered.keep_current();
            serve_on(Arc::new(tiered), settings, server).await
        }
        Err(error) => {
            tracing::error!(%error, path = %config.path.display(), "cannot open the local tier");
            ExitCode::FAILURE
        }
    }
}

/// Binds every listener and runs the server on `store` until shutdown.
async fn serve_on<S: Store>(store: Arc<S>, settings: &Settings, server: ServerConfig) -> ExitCode {
    if let Err(error) =
        dedupd::server::fail_stop_watchdog(Arc::clone(&store), server.shutdown_grace)
    {
        tracing::error!(%error, "cannot start the fail-stop watchdog");
        return ExitCode::FAILURE;
    }
    // Before binding: a key the store needs and this sidecar lacks is a
    // configuration error, not a stream of refused answers.
    let longest_retention = server
        .limits
        .namespace_retention
        .values()
        .fold(server.limits.max_retention, |longest, retention| {
            longest.max(*retention)
        });
    let checking = dedupd::engine::Engine::new(Arc::clone(&store), Arc::clone(&server.clock))
        .with_keyring(server.keyring.clone())
        .with_hashed_ids(server.hashed_ids.clone());
    let checked = match checking.check_sealing_keys(longest_retention).await {
        Ok(()) => checking.check_id_hashing().await,
        failed => failed,
    };
    if let Err(line) = checked {
        eprintln!("dedupd: invalid configuration: {line}");
        return ExitCode::from(EXIT_CONFIG);
    }
    let mut grpc = Vec::with_capacity(settings.listen.len());
    for address in &settings.listen {
        match Listener::bind(address).await {
            Ok(listener) => grpc.push(listener),
            Err(error) => {
                tracing::error!(%error, listen = %address, "cannot listen");
                return ExitCode::FAILURE;
            }
        }
    }
    let ops = match settings.metrics_listen {
        None => None,
        Some(address) => match TcpListener::bind(address).await {
            Ok(listener) => Some(listener),
            Err(error) => {
                tracing::error!(%error, listen = %address, "cannot listen for metrics");
                return ExitCode::FAILURE;
            }
        },
    };
    if settings.http_proxy.is_some()
        && matches!(settings.store, StoreSettings::Sled(_))
        && std::env::var_os("KUBERNETES_SERVICE_HOST").is_some_and(|host| !host.is_empty())
    {
        tracing::warn!(
            "the HTTP proxy keeps its records in this pod's embedded store: behind a Service \
             with more than one replica, a retry that reaches another pod is forwarded again; \
             give the replicas one shared store (--store postgres or redis)"
        );
    }
    let http_proxy = match &settings.http_proxy {
        None => None,
        Some((address, proxy_config)) => match TcpListener::bind(address).await {
            Ok(listener) => Some((listener, proxy_config.clone())),
            Err(error) => {
                tracing::error!(%error, listen = %address, "cannot listen for the HTTP proxy");
                return ExitCode::FAILURE;
            }
        },
    };
    let listeners = Listeners {
        grpc,
        ops,
        http_proxy,
    };
    match dedupd::run(listeners, store, server, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}

fn serve(args: &ServeArgs) -> ExitCode {
    let (settings, store, mut server) = match configure(args) {
        Ok(configured) => configured,
        Err(line) => {
            eprintln!("dedupd: invalid configuration: {line}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let runtime = match runtime(settings.worker_threads) {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    // The OTLP exporter's channel and the export queue live on the runtime.
    let traces = match &settings.traces {
        None => None,
        Some(traces) => {
            let _runtime = runtime.enter();
            match TraceExport::start(traces, Arc::clone(&server.metrics)) {
                Ok(export) => Some(export),
                Err(line) => {
                    eprintln!("dedupd: invalid configuration: {line}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            }
        }
    };
    init_logging(
        settings.log_filter.clone(),
        settings.log_format,
        traces.as_ref(),
    );
    let cache_bytes = match &store {
        StoreSettings::Sled(config) => config.cache_capacity_bytes,
        StoreSettings::Shared { local_tier, .. } => local_tier
            .as_ref()
            .map_or(0, LocalTierConfig::cache_capacity),
    };
    tracing::info!(
        budget = %dedupd::memory_budget::show(settings.memory.bytes),
        from = ?settings.memory.source,
        store_cache = %dedupd::memory_budget::show(cache_bytes),
        request_bytes = %dedupd::memory_budget::show(
            server.guard.read_budget_in_force(server.max_message_bytes) as u64
        ),
        "memory budget"
    );
    if server.hashed_ids.is_some() {
        tracing::info!("correlation IDs are stored as keyed hashes");
    }
    if let Some(keyring) = &server.keyring {
        // Each key's ID: what --erased-key-id takes once a key is destroyed.
        tracing::info!(keys = %keyring.describe(), "sealing keys");
        if !keyring.seals() {
            tracing::warn!(
                "no --encryption-key-file: new answers are stored unsealed (the keys given \
                 only open or erase what was sealed before)"
            );
        }
    }
    if let Some(traces) = &settings.traces {
        tracing::info!(endpoint = %traces.endpoint, protocol = ?traces.protocol, sampler = ?traces.sampler, "exporting traces with OTLP");
    }
    server.connections.max_connections =
        connections_within_file_limit(settings.connections.max_connections);
    let code = runtime.block_on(async move {
        let observer: Arc<dyn StoreObserver> = Arc::clone(&server.metrics) as _;
        match &store {
            StoreSettings::Sled(config) => match SledStore::open_observed(config, Some(observer)) {
                Ok(store) => serve_on(Arc::new(store), &settings, server).await,
                Err(error) => {
                    tracing::error!(%error, data_dir = %config.path.display(), "cannot open the store");
                    ExitCode::FAILURE
                }
            },
            StoreSettings::Shared {
                backend: SharedBackend::Postgres(config),
                local_tier,
                max_clock_uncertainty,
                ..
            } => match PostgresStore::new(config) {
                Ok(store) => {
                    tracing::info!(url = %redact_url(&config.url), schema = %config.schema, "shared store: PostgreSQL");
                    let _upkeep = AbortOnDrop(store.keep_connected());
                    let clock = Arc::new(StoreClock::new(
                        *max_clock_uncertainty,
                        server.limits.max_lease_ttl,
                    ));
                    serve_shared(store, local_tier.as_ref(), observer, &settings, server, clock)
                        .await
                }
                Err(error) => {
                    tracing::error!(%error, "cannot set up the PostgreSQL store");
                    ExitCode::FAILURE
                }
            },
            StoreSettings::Shared {
                backend: SharedBackend::Redis(config),
                local_tier,
                max_clock_uncertainty,
                ..
            } => {
                let clock = Arc::new(StoreClock::new(
                        *max_clock_uncertainty,
                        server.limits.max_lease_ttl,
                    ));
                match RedisStore::new(config, Arc::clone(&clock) as _) {
                    Ok(store) => {
                        tracing::info!(url = %redact_url(&config.url), prefix = %config.prefix, replicas = config.replicas, "shared store: Redis");
                        // A Redis that may evict records is a configuration
                        // error: said at once if Redis answers now (later, and
                        // on every change, by NOT_SERVING).
                        let first_look = tokio::time::timeout(
                            config.timeout,
                            store.eviction_refusal(),
                        )
                        .await;
                        match first_look {
                            Ok(Ok(Some(refusal))) => {
                                eprintln!("dedupd: invalid configuration: {refusal}");
                                return ExitCode::from(EXIT_CONFIG);
                            }
                            // Redis answered with a refusal (NOPERM): said once.
                            Ok(Err(error @ dedupd::Error::Store(_))) => {
                                eprintln!(
                                    "dedupd: invalid configuration: cannot read Redis's eviction policy (INFO memory): {error}; grant the user INFO, or pass --allow-redis-eviction"
                                );
                                return ExitCode::from(EXIT_CONFIG);
                            }
                            // Unreachable for now: checked again once it answers.
                            _ => {}
                        }
                        let _upkeep = AbortOnDrop(store.keep_connected());
                        serve_shared(store, local_tier.as_ref(), observer, &settings, server, clock)
                            .await
                    }
                    Err(error) => {
                        tracing::error!(%error, "cannot set up the Redis store");
                        ExitCode::FAILURE
                    }
                }
            }
        }
    });
    if let Some(traces) = traces {
        // The last calls' spans, within a bound: a collector that is down
        // does not hold the exit up.
        runtime.block_on(traces.finish(Duration::from_secs(5)));
    }
    // A wedged store may hold a blocking thread forever: do not wait for it.
    runtime.shutdown_timeout(Duration::from_secs(1));
    code
}

/// Flags → settings → the server's runtime configuration: secrets and
/// certificates are read here, still before anything is opened or bound, so
/// a bad one is a configuration error too.
fn configure(args: &ServeArgs) -> Result<(Settings, StoreSettings, ServerConfig), String> {
    let settings = args.validate()?;
    let store = match &settings.store {
        StoreSettings::Sled(config) => StoreSettings::Sled(config.clone()),
        StoreSettings::Shared {
            url,
            ca_file,
            backend,
            local_tier,
            max_clock_uncertainty,
        } => StoreSettings::Shared {
            url: url.clone(),
            ca_file: ca_file.clone(),
            backend: backend.with_secrets(
                url.load(|url| backend.check_url(url))?,
                ca_file
                    .as_deref()
                    .map(|file| read_pem_file("store-ca-file", file))
                    .transpose()?,
            ),
            local_tier: local_tier.clone(),
            max_clock_uncertainty: *max_clock_uncertainty,
        },
    };
    let tokens = settings.auth.load()?;
    let tls = settings.tls.as_ref().map(TlsFiles::load).transpose()?;
    let server = ServerConfig {
        limits: settings.limits.clone(),
        shutdown_grace: settings.shutdown_grace,
        reaper_interval: settings.reaper_interval,
        max_message_bytes: settings.max_message_bytes,
        guard: GuardConfig {
            tokens,
            max_concurrent_requests: settings.max_concurrent_requests,
            request_timeout: settings.request_timeout,
            request_read_timeout: settings.request_read_timeout,
            read_budget_bytes: settings.memory.read_budget_bytes(),
        },
        tls,
        metrics: Arc::new(Metrics::new()),
        clock: Arc::new(SystemClock),
        ready_file: settings.ready_file.clone(),
        keyring: load_keyring(&settings)?,
        key_reload: Some((settings.key_files.clone(), settings.key_reload_interval)),
        hashed_ids: settings
            .hash_correlation_ids
            .as_deref()
            .map(IdHasher::load)
            .transpose()?
            .map(Arc::new),
        connections: settings.connections,
        ..ServerConfig::default()
    };
    Ok((settings, store, server))
}

/// The sealing keys, when any key flag is given.
fn load_keyring(settings: &Settings) -> Result<Option<Arc<Keyring>>, String> {
    Ok(Keyring::load(&settings.key_files)?.map(Arc::new))
}

/// Descriptors kept for the store, the listeners and the ops port.
const RESERVED_DESCRIPTORS: u64 = 128;

/// Raises the soft open-file limit to the hard one (every connection is a
/// descriptor, and the store needs some too), and returns the connection cap
/// that fits within it.
fn connections_within_file_limit(wanted: usize) -> usize {
    let before = rlimit::Resource::NOFILE.get().map(|(soft, _)| soft);
    let limit = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "cannot read or raise the open-file limit");
            return wanted;
        }
    };
    match before {
        Ok(before) if before < limit => {
            tracing::info!(from = before, to = limit, "raised the open-file limit")
        }
        _ => tracing::info!(limit, "open-file limit"),
    }
    let fits =
        usize::try_from(limit.saturating_sub(RESERVED_DESCRIPTORS).max(1)).unwrap_or(usize::MAX);
    if wanted > fits {
        tracing::warn!(
            wanted,
            allowed = fits,
            open_file_limit = limit,
            "--max-connections lowered to fit the open-file limit"
        );
        fits
    } else {
        wanted
    }
}

/// Logs to stderr through `filter`; with `traces`, dedupd's spans also go
/// to OpenTelemetry (each layer has its own filter, so the log filter does
/// not decide what is traced, nor the other way round).
fn init_logging(
    filter: tracing_subscriber::EnvFilter,
    format: LogFormat,
    traces: Option<&TraceExport>,
) {
    use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt, Layer};
    // `log` records (sled's) are built only up to what is logged: the trace
    // layer's DEBUG spans must not turn on sled's debug records.
    let log_level = match filter.max_level_hint() {
        Some(level) if level == tracing_subscriber::filter::LevelFilter::OFF => {
            log::LevelFilter::Off
        }
        Some(level) if level == tracing_subscriber::filter::LevelFilter::ERROR => {
            log::LevelFilter::Error
        }
        Some(level) if level == tracing_subscriber::filter::LevelFilter::WARN => {
            log::LevelFilter::Warn
        }
        Some(level) if level == tracing_subscriber::filter::LevelFilter::INFO => {
            log::LevelFilter::Info
        }
        Some(level) if level == tracing_subscriber::filter::LevelFilter::DEBUG => {
            log::LevelFilter::Debug
        }
        _ => log::LevelFilter::Trace,
    };
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let logs = match format {
        LogFormat::Text => logs.boxed(),
        LogFormat::Json => logs.json().flatten_event(true).boxed(),
    };
    tracing_subscriber::registry()
        .with(logs.with_filter(filter))
        .with(traces.map(TraceExport::layer))
        .init();
    log::set_max_level(log_level);
}

/// `dedupd inject`: check the flags and the certificate (exit 64 if
/// either is wrong), bind, and serve until SIGTERM.
fn inject(args: &InjectArgs) -> ExitCode {
    let configured = args.validate().and_then(|settings| {
        let cert = ReloadingCert::load(settings.tls_cert.clone(), settings.tls_key.clone())?;
        Ok((settings, Arc::new(cert)))
    });
    let (settings, cert) = match configured {
        Ok(configured) => configured,
        Err(line) => {
            eprintln!("dedupd inject: invalid configuration: {line}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    init_logging(settings.log_filter.clone(), settings.log_format, None);
    let runtime = match runtime(0) {
        Ok(runtime) => runtime,
        Err(code) => return code,
    };
    runtime.block_on(async move {
        let listener = match TcpListener::bind(settings.listen).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::error!(%error, listen = %settings.listen, "cannot listen");
                return ExitCode::FAILURE;
            }
        };
        tracing::info!(listen = %settings.listen, image = %settings.defaults.image, native_sidecar = settings.defaults.native_sidecar, "injector serving");
        let _reload = tokio::spawn(Arc::clone(&cert).watch(settings.tls_reload_interval));
        let metrics = Arc::new(InjectMetrics::default());
        match dedupd::inject::serve(listener, cert, settings.defaults, metrics, shutdown_signal())
            .await
        {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                tracing::error!(%error, "the injector stopped");
                ExitCode::FAILURE
            }
        }
    })
}

/// Aborts a background task when dropped (the serving scope ends).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
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
