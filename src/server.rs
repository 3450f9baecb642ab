//! Assembles and runs the gRPC server: the dedup service, gRPC health and
//! reflection on one listener, the maintenance task (reaper and health
//! watch), and the shutdown sequence of SPEC §7.

use std::{future::Future, sync::Arc, time::Duration};

use tokio::{net::TcpListener, sync::watch};
use tonic::transport::{server::TcpIncoming, Server};
use tonic_health::{server::HealthReporter, ServingStatus};

use crate::{
    api::Limits,
    clock::{Clock, SystemClock},
    engine::Engine,
    error::Error,
    proto::{v1::claim_and_commit_server::ClaimAndCommitServer, FILE_DESCRIPTOR_SET},
    service::DedupService,
    store::Store,
};

/// The name health checks use for the dedup service.
pub const SERVICE_NAME: &str = "dedup.v1.ClaimAndCommit";

/// Everything `run` needs besides the listener and the store.
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
    /// The time source.
    pub clock: Arc<dyn Clock>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            shutdown_grace: Duration::from_secs(20),
            reaper_interval: Duration::from_secs(10),
            reaper_batch: 10_000,
            max_message_bytes: 16 << 20,
            clock: Arc::new(SystemClock),
        }
    }
}

/// Serves the API on `listener` until `shutdown` resolves, then reports
/// NOT_SERVING, stops accepting, lets in-flight calls finish within the grace
/// period, and makes the store durable one last time.
pub async fn run<S: Store>(
    listener: TcpListener,
    store: Arc<S>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let engine = Engine::new(Arc::clone(&store), Arc::clone(&config.clock));
    let limits = Arc::new(config.limits.clone());
    let service = ClaimAndCommitServer::new(DedupService::new(engine.clone(), limits))
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);

    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, ServingStatus::Serving).await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| Error::Server(format!("reflection: {e}")))?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| Error::Server(format!("reflection: {e}")))?;

    let (stop_maintenance, maintenance_stopped) = watch::channel(false);
    let maintenance = tokio::spawn(maintain(
        engine,
        health.clone(),
        config.reaper_interval,
        config.reaper_batch,
        maintenance_stopped,
    ));

    match listener.local_addr() {
        Ok(address) => tracing::info!(%address, "dedupd serving"),
        Err(error) => tracing::warn!(%error, "dedupd serving on an unknown address"),
    }
    let (drain_began, drain_begun) = tokio::sync::oneshot::channel::<()>();
    let health_on_shutdown = health.clone();
    let serve = Server::builder()
        .trace_fn(|request| tracing::info_span!("rpc", path = %request.uri().path()))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service)
        .serve_with_incoming_shutdown(
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            async move {
                shutdown.await;
                tracing::info!("shutdown requested: NOT_SERVING, draining in-flight calls");
                set_health(&health_on_shutdown, ServingStatus::NotServing).await;
                let _ = drain_began.send(());
            },
        );
    let grace = config.shutdown_grace;
    let grace_over = async move {
        if drain_begun.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let served = tokio::select! {
        served = serve => served.map_err(|e| Error::Server(e.to_string())),
        () = grace_over => {
            tracing::warn!(?grace, "grace period over: dropping calls still in flight");
            Ok(())
        }
    };

    let _ = stop_maintenance.send(true);
    let _ = maintenance.await;
    let closed = store.close().await;
    match (&served, &closed) {
        (Ok(()), Ok(())) => tracing::info!("dedupd stopped; store synced"),
        (_, Err(error)) => tracing::error!(%error, "final store sync failed"),
        (Err(error), _) => tracing::error!(%error, "server failed"),
    }
    served.and(closed)
}

async fn set_health(health: &HealthReporter, status: ServingStatus) {
    health.set_service_status("", status).await;
    health.set_service_status(SERVICE_NAME, status).await;
}

/// Runs the reaper every `interval` and keeps the health status in step with
/// the store (a store that failed a sync is NOT_SERVING).
async fn maintain<S: Store>(
    engine: Engine<S>,
    health: HealthReporter,
    interval: Duration,
    batch: usize,
    mut stop: watch::Receiver<bool>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut serving = true;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.changed() => return,
        }
        let healthy = engine.store().health().is_ok();
        if healthy != serving {
            serving = healthy;
            let status = if healthy {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            set_health(&health, status).await;
        }
        // A full batch means more may be waiting: go on, yielding in between.
        loop {
            match engine.store().reap(engine.now(), batch).await {
                Ok(report) => {
                    if report.examined > 0 {
                        tracing::debug!(
                            removed = report.removed,
                            examined = report.examined,
                            "reaper pass"
                        );
                    }
                    if report.examined < batch || *stop.borrow() {
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
