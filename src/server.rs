//! Assembles and runs the servers: the gRPC API (dedup service, health and
//! reflection) on every listener behind the guard layer, the ops HTTP server,
//! the maintenance task (reaper and health watch), and the shutdown sequence
//! of protocol §7 (docs/protocol.md).

use std::{
    future::Future,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, OnceLock,
    },
    time::{Duration, Instant},
};

use tokio::{
    net::TcpListener,
    sync::{watch, Semaphore},
    task::JoinSet,
};
use tonic::transport::{Server, ServerTlsConfig};
use tonic_health::{server::HealthReporter, ServingStatus};

use crate::{
    api::Limits,
    clock::{Clock, SystemClock},
    engine::Engine,
    error::Error,
    guard::{self, GuardConfig},
    hashed_ids::IdHasher,
    listen::{accept_capped, Listener},
    metrics::Metrics,
    ops,
    proto::{
        v1::claim_and_commit_server::{ClaimAndCommitServer, SERVICE_NAME},
        FILE_DESCRIPTOR_SET,
    },
    proxy::{self, server::ProxyConfig},
    sealing::{KeyFiles, Keyring, KeyringSlot},
    service::DedupService,
    store::Store,
};

/// Everything `run` needs besides the listeners and the store.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Request limits and defaults.
    pub limits: Limits,
    /// How long in-flight calls may take to finish after shutdown begins.
    pub shutdown_grace: Duration,
    /// How often the reaper looks for expired records.
    pub reaper_interval: Duration,
    /// Most records one reaper pass removes before yielding.
    pub reaper_batch: usize,
    /// Largest gRPC message accepted or sent, in bytes.
    pub max_message_bytes: usize,
    /// Tokens, admission and timeout.
    pub guard: GuardConfig,
    /// TLS (and mTLS) for the TCP listeners; Unix sockets stay plaintext.
    pub tls: Option<ServerTlsConfig>,
    /// Where the metrics are counted.
    pub metrics: Arc<Metrics>,
    /// The time source.
    pub clock: Arc<dyn Clock>,
    /// Written once serving (the bound addresses, as JSON); removed on exit.
    pub ready_file: Option<PathBuf>,
    /// Seals every stored answer, when set.
    pub keyring: Option<Arc<Keyring>>,
    /// Hashes every stored correlation ID, when set.
    pub hashed_ids: Option<Arc<IdHasher>>,
    /// The key files `keyring` came from and how often to read them again
    /// (a rotated Secret needs no restart); `None`: never.
    pub key_reload: Option<(KeyFiles, Duration)>,
    /// What one connection may hold, and how many there may be.
    pub connections: ConnectionLimits,
}

pub use crate::listen::{
    ConnectionLimits, MAX_HEADER_LIST_BYTES, MAX_LOCAL_ERROR_RESET_STREAMS,
    MAX_PENDING_RESET_STREAMS,
};

impl ConnectionLimits {
    fn apply(&self, builder: Server) -> Server {
        builder
            .max_concurrent_streams(self.max_streams_per_connection)
            .max_connection_age(self.max_connection_age)
            .http2_keepalive_interval(Some(self.keepalive_interval))
            .http2_keepalive_timeout(Some(self.keepalive_timeout))
            // Set here rather than left to hyper's and h2's defaults, which
            // have changed between versions (README, "HTTP/2 limits"; each
            // is exercised by `dedupd-reliability hostile`).
            .http2_max_header_list_size(MAX_HEADER_LIST_BYTES)
            .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_RESET_STREAMS))
            .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            shutdown_grace: Duration::from_secs(20),
            reaper_interval: Duration::from_secs(10),
            reaper_batch: 10_000,
            max_message_bytes: 16 << 20,
            guard: GuardConfig {
                tokens: None,
                max_concurrent_requests: 1024,
                request_timeout: Duration::from_secs(10),
                request_read_timeout: Duration::from_secs(5),
                read_budget_bytes: crate::guard::DEFAULT_READ_BUDGET_BYTES,
            },
            tls: None,
            metrics: Arc::new(Metrics::new()),
            clock: Arc::new(SystemClock),
            ready_file: None,
            keyring: None,
            hashed_ids: None,
            key_reload: None,
            connections: ConnectionLimits::default(),
        }
    }
}

/// A multi-threaded tokio runtime with `worker_threads` workers (0: one per
/// CPU), I/O and time enabled: what the sidecar and the benchmark run on.
pub fn runtime(worker_threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if worker_threads > 0 {
        runtime.worker_threads(worker_threads);
    }
    runtime.enable_all().build()
}

/// The bound sockets `run` serves on.
#[derive(Debug)]
pub struct Listeners {
    /// gRPC listeners (TCP and Unix sockets), all serving the same API.
    pub grpc: Vec<Listener>,
    /// The ops HTTP listener (`/metrics`, `/healthz`, `/readyz`), if any.
    pub ops: Option<TcpListener>,
    /// The HTTP idempotency proxy's listener and settings, if it is on.
    pub http_proxy: Option<(TcpListener, ProxyConfig)>,
}

impl From<TcpListener> for Listeners {
    fn from(listener: TcpListener) -> Self {
        Listeners {
            grpc: vec![Listener::Tcp(listener)],
            ops: None,
            http_proxy: None,
        }
    }
}

/// Serves the API on every listener until `shutdown` resolves, then reports
/// NOT_SERVING, stops accepting, lets in-flight calls finish within the grace
/// period, and makes the store durable one last time.
pub async fn run<S: Store>(
    listeners: impl Into<Listeners>,
    store: Arc<S>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let listeners = listeners.into();
    if let Some(path) = &config.ready_file {
        // A file left by a process that was killed names its old ports.
        let _ = std::fs::remove_file(path);
    }
    let keyring = config
        .keyring
        .clone()
        .map(|keyring| Arc::new(KeyringSlot::new(keyring)));
    let _key_reload = match (&keyring, &config.key_reload) {
        (Some(slot), Some((files, interval))) => Some(AbortOnDrop(tokio::spawn(
            Arc::clone(slot).watch(files.clone(), *interval),
        ))),
        _ => None,
    };
    let engine = Engine::new(Arc::clone(&store), Arc::clone(&config.clock))
        .with_metrics(Arc::clone(&config.metrics))
        .with_keyring_slot(keyring)
        .with_hashed_ids(config.hashed_ids.clone());
    let limits = Arc::new(config.limits.clone());
    let (health, health_service) = tonic_health::server::health_reporter();
    // SERVING only once calls can be answered: a shared store's schema in
    // place and its clock measured (the health watch follows from here).
    let serving_at_start = engine.writable().is_ok();
    set_health(
        &health,
        if serving_at_start {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        },
    )
    .await;
    let ready = Arc::new(AtomicBool::new(true));

    // One signal fans out to every server: first NOT_SERVING, then stop.
    let (stopping, stop) = watch::channel(false);
    let (store_failed, store_failure) = watch::channel::<Option<String>>(None);
    let stop_began = Arc::new(OnceLock::new());
    let _signal_watch = {
        let health = health.clone();
        let ready = Arc::clone(&ready);
        let stop_began = Arc::clone(&stop_began);
        let mut store_failure = store_failure.clone();
        AbortOnDrop(tokio::spawn(async move {
            tokio::select! {
                () = shutdown => {
                    tracing::info!("shutdown requested: NOT_SERVING, draining in-flight calls");
                }
                failure = store_failure.wait_for(Option::is_some) => {
                    let reason = failure.map(|reason| reason.clone()).unwrap_or_default();
                    tracing::error!(
                        reason = reason.as_deref().unwrap_or("unknown"),
                        "the store failed: NOT_SERVING, stopping so the process is restarted"
                    );
                }
            }
            let _ = stop_began.set(Instant::now());
            ready.store(false, Ordering::SeqCst);
            set_health(&health, ServingStatus::NotServing).await;
            let _ = stopping.send(true);
        }))
    };
    let stopped = move || {
        let mut stop = stop.clone();
        async move {
            let _ = stop.wait_for(|stopping| *stopping).await;
        }
    };

    // Built once: every listener shares one concurrency limit.
    let dedup = guard::guard(
        ClaimAndCommitServer::new(DedupService::new(engine.clone(), Arc::clone(&limits)))
            .max_decoding_message_size(config.max_message_bytes)
            .max_encoding_message_size(config.max_message_bytes),
        &config.guard,
        config.max_message_bytes,
        Arc::clone(&config.metrics),
    );
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| Error::Server(format!("reflection: {e}")))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| Error::Server(format!("reflection: {e}")))?;

    // One cap for the process, over every listener.
    let connection_slots = Arc::new(Semaphore::new(config.connections.max_connections));
    let mut announced = ReadyAnnouncement::default();
    let mut servers = JoinSet::new();
    for listener in listeners.grpc {
        announced.grpc.push(listener.describe());
        tracing::info!(address = %listener.describe(), "dedupd serving");
        let builder = config.connections.apply(Server::builder());
        let builder = match (&config.tls, &listener) {
            (Some(tls), Listener::Tcp(_)) => builder
                .tls_config(tls.clone().timeout(config.connections.handshake_timeout))
                .map_err(|e| Error::Server(format!("TLS: {e}")))?,
            _ => builder,
        };
        let router = builder
            .trace_fn(crate::telemetry::grpc_call_span)
            .add_service(health_service.clone())
            .add_service(reflection_v1.clone())
            .add_service(reflection_v1alpha.clone())
            .add_service(dedup.clone());
        let signal = stopped();
        match listener {
            Listener::Tcp(tcp) => {
                let incoming = accept_capped(
                    tcp,
                    Arc::clone(&connection_slots),
                    config.connections.handshake_timeout,
                );
                servers.spawn(async move {
                    router
                        .serve_with_incoming_shutdown(incoming, signal)
                        .await
                        .map_err(|e| Error::Server(e.to_string()))
                });
            }
            Listener::Unix(unix, socket_file) => {
                let incoming = accept_capped(
                    unix,
                    Arc::clone(&connection_slots),
                    config.connections.handshake_timeout,
                );
                servers.spawn(async move {
                    let served = router
                        .serve_with_incoming_shutdown(incoming, signal)
                        .await
                        .map_err(|e| Error::Server(e.to_string()));
                    drop(socket_file);
                    served
                });
            }
        }
    }
    if let Some(listener) = listeners.ops {
        match listener.local_addr() {
            Ok(address) => {
                tracing::info!(%address, "ops endpoints (/metrics, /healthz, /readyz) serving");
                announced.metrics = Some(address.to_string());
            }
            Err(error) => tracing::warn!(%error, "ops endpoints serving on an unknown address"),
        }
        let (engine, ready, signal) = (engine.clone(), Arc::clone(&ready), stopped());
        servers.spawn(async move {
            ops::serve(listener, engine, ready, signal)
                .await
                .map_err(|e| Error::Server(format!("ops server: {e}")))
        });
    }

    if let Some((listener, proxy_config)) = listeners.http_proxy {
        match listener.local_addr() {
            Ok(address) => {
                tracing::info!(%address, upstream = %proxy_config.upstream, "HTTP idempotency proxy serving");
                announced.http_proxy = Some(address.to_string());
            }
            Err(error) => tracing::warn!(%error, "HTTP proxy serving on an unknown address"),
        }
        let (engine, signal) = (engine.clone(), stopped());
        let slots = Arc::clone(&connection_slots);
        servers.spawn(async move {
            proxy::server::serve(listener, engine, proxy_config, slots, signal)
                .await
                .map_err(|e| Error::Server(format!("HTTP proxy: {e}")))
        });
    }

    let _ready_file =
        match &config.ready_file {
            Some(path) => Some(announced.write(path).map_err(|error| {
                Error::Server(format!("--ready-file {}: {error}", path.display()))
            })?),
            None => None,
        };

    // Started last: nothing above may fail and leave it running.
    let health_watch = AbortOnDrop(tokio::spawn(watch_health(
        engine.clone(),
        health.clone(),
        serving_at_start,
        store_failed,
        stopped(),
    )));
    let reaper = AbortOnDrop(tokio::spawn(reap(
        engine.clone(),
        config.reaper_interval,
        config.reaper_batch,
        stopped(),
    )));

    // Wait for the servers; once shutdown began, for at most the grace period.
    let grace = config.shutdown_grace;
    let grace_over = {
        let signal = stopped();
        async move {
            signal.await;
            tokio::time::sleep(grace).await;
        }
    };
    tokio::pin!(grace_over);
    let mut served = Ok(());
    loop {
        tokio::select! {
            next = servers.join_next() => match next {
                None => break,
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(error))) => {
                    tracing::error!(%error, "a server failed; shutting down");
                    served = Err(error);
                    break;
                }
                Some(Err(join)) => {
                    served = Err(Error::Server(format!("server task failed: {join}")));
                    break;
                }
            },
            () = &mut grace_over => {
                tracing::warn!(?grace, "grace period over: dropping calls still in flight");
                break;
            }
        }
    }
    servers.abort_all();
    while servers.join_next().await.is_some() {}

    drop((health_watch, reaper));
    if let Some(reason) = store_failure.borrow().clone() {
        served = Err(Error::Unavailable(reason));
    }
    // Whatever the store does, shutdown ends: the final sync gets what is
    // left of the grace period (at least FINAL_SYNC_MIN).
    let left = stop_began
        .get()
        .map_or(grace, |began| grace.saturating_sub(began.elapsed()))
        .max(FINAL_SYNC_MIN);
    let closed = match tokio::time::timeout(left, store.close()).await {
        Ok(closed) => closed,
        Err(_) => Err(Error::Unavailable(format!(
            "the final store sync did not finish within {}; exiting without it",
            crate::api::human_duration(Duration::from_secs(left.as_secs_f64().ceil() as u64))
        ))),
    };
    match (&served, &closed) {
        (Ok(()), Ok(())) => tracing::info!("dedupd stopped; store synced"),
        (_, Err(error)) => tracing::error!(%error, "final store sync failed"),
        (Err(_), Ok(())) => tracing::info!("dedupd stopped after a server failure; store synced"),
    }
    served.and(closed)
}

/// What the ready file says: where dedupd serves.
#[derive(Debug, Default)]
struct ReadyAnnouncement {
    grpc: Vec<String>,
    metrics: Option<String>,
    http_proxy: Option<String>,
}

impl ReadyAnnouncement {
    /// Writes the file whole (temporary file, then rename), so a reader
    /// never sees half of it; it is removed again when the guard drops.
    fn write(&self, path: &Path) -> std::io::Result<RemoveOnDrop> {
        let text = serde_json::json!({
            "pid": std::process::id(),
            "grpc": self.grpc,
            "metrics": self.metrics,
            "http_proxy": self.http_proxy,
        })
        .to_string();
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        std::fs::write(&partial, text + "\n")?;
        std::fs::rename(&partial, path)?;
        Ok(RemoveOnDrop(path.to_owned()))
    }
}

/// Removes a file when dropped.
#[derive(Debug)]
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The least time the final sync gets, even when the grace period is spent.
const FINAL_SYNC_MIN: Duration = Duration::from_secs(2);

/// How often the fail-stop watchdog asks the store for its health.
const WATCHDOG_INTERVAL: Duration = Duration::from_millis(250);

/// Ends the process (exit code 1) if it still runs `grace` plus the final
/// sync's time plus a second after `store` reported a permanent failure.
///
/// [`run`] stops by itself when the store fails, but only while the runtime
/// runs: a store call that never returns (sled on a failing disk) can hold
/// every worker thread, and then neither the health check nor the shutdown
/// ever runs. This watchdog is a plain thread asking [`Store::health`]
/// (which notices such a call itself), so a failed store always ends the
/// process and Kubernetes restarts it. For the binary only: it ends the
/// process it runs in.
pub fn fail_stop_watchdog<S: Store>(store: Arc<S>, grace: Duration) -> std::io::Result<()> {
    let deadline = grace + FINAL_SYNC_MIN + Duration::from_secs(1);
    std::thread::Builder::new()
        .name("dedupd-fail-stop".into())
        .spawn(move || loop {
            std::thread::sleep(WATCHDOG_INTERVAL);
            if let Err(error) = store.health() {
                std::thread::sleep(deadline);
                tracing::error!(
                    %error,
                    waited = ?deadline,
                    "the store failed and dedupd did not stop by itself (a store call holds the runtime): exiting now"
                );
                std::process::exit(1);
            }
        })
        .map(drop)
}

/// Aborts a task when dropped, so no task outlives `run`, whichever way it
/// returns.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reflection describes the dedup API and the health service.
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

async fn set_health(health: &HealthReporter, status: ServingStatus) {
    health.set_service_status("", status).await;
    health.set_service_status(SERVICE_NAME, status).await;
}

/// How often health follows the store.
const HEALTH_INTERVAL: Duration = Duration::from_secs(1);

/// Keeps the health status in step with the store every second: not
/// writable (short of disk space) is NOT_SERVING until it passes; a failed
/// or stalled store is reported on `failed`, which stops the process so it
/// restarts (fail-stop: never a silent hang).
async fn watch_health<S: Store>(
    engine: Engine<S>,
    health: HealthReporter,
    mut serving: bool,
    failed: watch::Sender<Option<String>>,
    stop: impl Future<Output = ()>,
) {
    let mut ticker = tokio::time::interval(HEALTH_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = &mut stop => return,
        }
        if let Err(error) = engine.store().health() {
            failed.send_replace(Some(error.to_string()));
            return;
        }
        let writable = engine.writable();
        if writable.is_ok() != serving {
            serving = writable.is_ok();
            match &writable {
                Ok(()) => tracing::info!("the store takes writes: SERVING"),
                Err(error) => tracing::warn!(%error, "the store refuses writes: NOT_SERVING"),
            }
            let status = if serving {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            set_health(&health, status).await;
        }
    }
}

/// Runs the reaper every `interval`.
async fn reap<S: Store>(
    engine: Engine<S>,
    interval: Duration,
    batch: usize,
    stop: impl Future<Output = ()>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = &mut stop => return,
        }
        // A pass that removed a full batch means more may be waiting: go on,
        // yielding in between.
        loop {
            // No decision on a clock that cannot be trusted (a shared
            // store's clock not measured lately): skip the pass.
            if let Err(reason) = engine.clock().verify() {
                tracing::debug!(%reason, "reaper pass skipped");
                break;
            }
            match engine.store().reap(engine.now(), batch).await {
                Ok(report) => {
                    engine
                        .metrics()
                        .reaper_pass(report.removed, report.examined);
                    if report.examined > 0 {
                        tracing::debug!(
                            removed = report.removed,
                            examined = report.examined,
                            "reaper pass"
                        );
                    }
                    if report.removed < batch {
                        break;
                    }
                }
                Err(error) => {
                    tracing::error!(%error, "reaper pass failed");
                    break;
                }
            }
        }
    }
}
