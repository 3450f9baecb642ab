//! The operations HTTP server on its own port: Prometheus `/metrics`,
//! `/healthz` (the process and its store work: a failed store needs a
//! restart) and `/readyz` (serving: not draining, store healthy and taking
//! writes).

use std::{
    future::Future,
    io,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use axum::{
    extract::State,
    http::{HeaderMap, StatusCode},
    response::IntoResponse,
    routing::get,
    Router,
};
use tokio::net::TcpListener;

use crate::{engine::Engine, store::Store};

struct OpsState<S> {
    engine: Engine<S>,
    ready: Arc<AtomicBool>,
}

impl<S> Clone for OpsState<S> {
    fn clone(&self) -> Self {
        OpsState {
            engine: self.engine.clone(),
            ready: Arc::clone(&self.ready),
        }
    }
}

/// Serves the ops endpoints on `listener` until `shutdown` resolves.
pub async fn serve<S: Store>(
    listener: TcpListener,
    engine: Engine<S>,
    ready: Arc<AtomicBool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics::<S>))
        .route("/healthz", get(healthz::<S>))
        .route("/readyz", get(readyz::<S>))
        .with_state(OpsState { engine, ready });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn metrics<S: Store>(
    State(state): State<OpsState<S>>,
    request: HeaderMap,
) -> impl IntoResponse {
    let stats = state.engine.store().stats().await;
    let metrics = state.engine.metrics();
    metrics.store_size(stats.records, stats.disk_bytes);
    metrics.read_resident_memory();
    if let Some(report) = state.engine.clock().report() {
        metrics.store_clock(report);
    }
    let writable = state.engine.writable();
    metrics.store_state(
        state.ready.load(Ordering::SeqCst) && writable.is_ok(),
        state.engine.store().health().is_ok(),
        writable.as_ref().map(|_| ()),
        stats.local_tier_on,
    );
    crate::metrics::exposition(&request, metrics.render())
}

async fn healthz<S: Store>(State(state): State<OpsState<S>>) -> impl IntoResponse {
    match state.engine.store().health() {
        Ok(()) => (StatusCode::OK, "ok\n".to_owned()),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, format!("{error}\n")),
    }
}

async fn readyz<S: Store>(State(state): State<OpsState<S>>) -> impl IntoResponse {
    if !state.ready.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n".to_owned());
    }
    // Not writable (short of disk space) is not ready; it passes by itself.
    match state.engine.writable() {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, format!("{error}\n")),
    }
}
