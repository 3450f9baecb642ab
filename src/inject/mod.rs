//! `dedupd inject`: a Kubernetes mutating admission webhook that adds the
//! dedupd sidecar to pods labelled `dedupd.io/inject=enabled`.
//!
//! - [`pod`]: the decision and the JSON patch for one pod (pure).
//! - [`tls`]: the serving certificate, reloaded when its files change.
//! - here: the `AdmissionReview` exchange, the flags, and the HTTPS server
//!   (`POST /mutate`, `/healthz`, `/readyz`, `/metrics`).

pub mod pod;
pub mod tls;

use std::{
    future::Future,
    net::SocketAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{
    body::Bytes,
    extract::{DefaultBodyLimit, State},
    http::{header, StatusCode},
    response::IntoResponse,
    routing::{get, post},
    Router,
};
use clap::Args;
use k8s_openapi::api::core::v1::Pod;
use kube_core::{
    admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation},
    DynamicObject,
};
use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use tokio::net::TcpListener;

pub use pod::{decide, Decision, SidecarDefaults};
pub use tls::ReloadingCert;

/// The largest AdmissionReview accepted (the API server's own request limit
/// is 3 MiB; a pod is far smaller).
const MAX_REVIEW_BYTES: usize = 4 << 20;
/// How long open requests may take to finish once shutdown begins.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How long a client has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// `dedupd inject` flags.
#[derive(Debug, Clone, Args)]
pub struct InjectArgs {
    /// Where to serve HTTPS.
    #[arg(long, env = "DEDUPD_INJECT_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,
    /// PEM certificate chain the API server verifies (the webhook's caBundle
    /// must have signed it). Reloaded when the file changes.
    #[arg(long, env = "DEDUPD_INJECT_TLS_CERT")]
    pub tls_cert: PathBuf,
    /// PEM private key of --tls-cert. Reloaded when the file changes.
    #[arg(long, env = "DEDUPD_INJECT_TLS_KEY")]
    pub tls_key: PathBuf,
    /// How often to look for a renewed certificate.
    #[arg(long, env = "DEDUPD_INJECT_TLS_RELOAD_INTERVAL", default_value = "10s")]
    pub tls_reload_interval: humantime::Duration,
    /// The dedupd image to inject (annotation dedupd.io/image overrides it).
    #[arg(long, env = "DEDUPD_INJECT_IMAGE", default_value = concat!("ghcr.io/dedupd/dedupd:", env!("CARGO_PKG_VERSION")))]
    pub image: String,
    /// Inject a native sidecar (an init container with restartPolicy
    /// Always, Kubernetes >= 1.29); false: a regular container
    /// (annotation dedupd.io/native-sidecar overrides it).
    #[arg(long, env = "DEDUPD_INJECT_NATIVE_SIDECAR", default_value_t = true, action = clap::ArgAction::Set)]
    pub native_sidecar: bool,
    /// The sidecar's CPU request (annotation dedupd.io/cpu).
    #[arg(long, env = "DEDUPD_INJECT_CPU", default_value = "50m")]
    pub cpu: String,
    /// The sidecar's memory request (annotation dedupd.io/memory sets request
    /// and limit).
    #[arg(long, env = "DEDUPD_INJECT_MEMORY", default_value = "64Mi")]
    pub memory: String,
    /// The sidecar's memory limit.
    #[arg(long, env = "DEDUPD_INJECT_MEMORY_LIMIT", default_value = "256Mi")]
    pub memory_limit: String,
    /// The sidecar's --shutdown-grace; pods get a
    /// terminationGracePeriodSeconds at least 10 s longer.
    #[arg(long, env = "DEDUPD_INJECT_SHUTDOWN_GRACE", default_value = "20s")]
    pub shutdown_grace: humantime::Duration,
    /// The sidecar's gRPC port on the pod's loopback.
    #[arg(long, env = "DEDUPD_INJECT_GRPC_PORT", default_value_t = 50051)]
    pub grpc_port: u16,
    /// The sidecar's ops port (/metrics, /healthz, /readyz) on the pod IP.
    #[arg(long, env = "DEDUPD_INJECT_OPS_PORT", default_value_t = 9090)]
    pub ops_port: u16,
    /// Log filter.
    #[arg(long, env = "DEDUPD_LOG", default_value = "info")]
    pub log: String,
    /// Log format.
    #[arg(long, env = "DEDUPD_LOG_FORMAT", value_enum, default_value_t = crate::config::LogFormat::Text)]
    pub log_format: crate::config::LogFormat,
}

/// Checked `dedupd inject` settings.
#[derive(Debug)]
pub struct InjectSettings {
    /// Where to serve.
    pub listen: SocketAddr,
    /// The certificate files.
    pub tls_cert: PathBuf,
    /// The key file.
    pub tls_key: PathBuf,
    /// How often to reload them.
    pub tls_reload_interval: Duration,
    /// What each pod gets unless its annotations say otherwise.
    pub defaults: SidecarDefaults,
    /// The injector's own log filter.
    pub log_filter: tracing_subscriber::EnvFilter,
    /// And its format.
    pub log_format: crate::config::LogFormat,
}

impl InjectArgs {
    /// Checks every setting; the error is one line.
    pub fn validate(&self) -> Result<InjectSettings, String> {
        let reload: Duration = self.tls_reload_interval.into();
        if reload < Duration::from_secs(1) {
            return Err("--tls-reload-interval must be at least 1s".into());
        }
        let grace: Duration = self.shutdown_grace.into();
        if grace.is_zero() || grace > Duration::from_secs(3600) {
            return Err("--shutdown-grace must be between 1s and 1h".into());
        }
        if self.grpc_port == 0 || self.ops_port == 0 || self.grpc_port == self.ops_port {
            return Err("--grpc-port and --ops-port must be two different ports above 0".into());
        }
        let defaults = SidecarDefaults {
            image: self.image.clone(),
            native_sidecar: self.native_sidecar,
            cpu: self.cpu.clone(),
            memory: self.memory.clone(),
            memory_limit: self.memory_limit.clone(),
            shutdown_grace: grace,
            grpc_port: self.grpc_port,
            ops_port: self.ops_port,
        };
        // The defaults go through the same checks as a pod's annotations.
        pod::check_defaults(&defaults)?;
        let log_filter = tracing_subscriber::EnvFilter::try_new(&self.log)
            .map_err(|e| format!("--log {:?} is not a valid filter: {e}", self.log))?;
        Ok(InjectSettings {
            listen: self.listen,
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            tls_reload_interval: reload,
            defaults,
            log_filter,
            log_format: self.log_format,
        })
    }
}

/// What became of one review, for the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// The injector's counters.
#[derive(Debug)]
pub struct InjectMetrics {
    registry: Registry,
    reviews: Family<ResultLabel, Counter>,
}

impl Default for InjectMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("dedupd_injector");
        let reviews = Family::<ResultLabel, Counter>::default();
        registry.register(
            "reviews",
            "Admission reviews answered, by result: injected, skipped, denied, invalid",
            reviews.clone(),
        );
        InjectMetrics { registry, reviews }
    }
}

impl InjectMetrics {
    fn count(&self, result: &'static str) {
        self.reviews.get_or_create(&ResultLabel { result }).inc();
    }

    /// How many reviews ended with `result`.
    pub fn reviews(&self, result: &'static str) -> u64 {
        self.reviews.get_or_create(&ResultLabel { result }).get()
    }

    fn render(&self) -> String {
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }
}

/// Answers one `AdmissionReview` with the JSON the API server reads: the
/// response carries the request's uid, and a patch when the sidecar is
/// added.
pub fn review(
    review: AdmissionReview<DynamicObject>,
    defaults: &SidecarDefaults,
    metrics: &InjectMetrics,
) -> Result<serde_json::Value, String> {
    let request: AdmissionRequest<DynamicObject> = review
        .try_into()
        .map_err(|e| format!("not an AdmissionReview request: {e}"))?;
    let response = AdmissionResponse::from(&request);
    let (result, response) = answer(&request, response, defaults);
    metrics.count(result);
    to_wire(&response.into_review()).map_err(|e| format!("cannot encode the answer: {e}"))
}

/// The review as JSON, with the patch base64-encoded: Kubernetes' `[]byte`
/// fields are base64 strings in JSON, but kube-core serializes its
/// `Vec<u8>` as an array of numbers (kube-rs/kube#1781).
fn to_wire(
    review: &AdmissionReview<DynamicObject>,
) -> Result<serde_json::Value, serde_json::Error> {
    use base64::Engine as _;
    let mut wire = serde_json::to_value(review)?;
    if let Some(patch) = wire.pointer_mut("/response/patch") {
        let bytes: Vec<u8> = serde_json::from_value(patch.take())?;
        *patch = serde_json::Value::String(base64::engine::general_purpose::STANDARD.encode(bytes));
    }
    Ok(wire)
}

fn answer(
    request: &AdmissionRequest<DynamicObject>,
    response: AdmissionResponse,
    defaults: &SidecarDefaults,
) -> (&'static str, AdmissionResponse) {
    let subject = format!(
        "{}/{}",
        request.namespace.as_deref().unwrap_or("-"),
        if request.name.is_empty() {
            "(generated name)"
        } else {
            &request.name
        }
    );
    let is_pod = request.kind.group.is_empty() && request.kind.kind == "Pod";
    let object = match (&request.object, is_pod, &request.operation) {
        (Some(object), true, Operation::Create) => object,
        _ => {
            tracing::debug!(%subject, kind = %request.kind.kind, "not a pod being created: admitted unchanged");
            return ("skipped", response);
        }
    };
    let pod: Pod = match serde_json::to_value(object).and_then(serde_json::from_value) {
        Ok(pod) => pod,
        Err(error) => {
            let reason = format!("dedupd injector: the pod does not parse: {error}");
            tracing::warn!(%subject, %reason, "denied");
            return ("invalid", response.deny(reason));
        }
    };
    match decide(&pod, defaults) {
        Decision::Skip(reason) => {
            tracing::info!(%subject, reason, "skipped");
            ("skipped", response)
        }
        Decision::Deny(reason) => {
            tracing::info!(%subject, %reason, "denied");
            (
                "denied",
                response.deny(format!("dedupd injector: {reason}")),
            )
        }
        Decision::Inject { patch, warnings } => match response.with_patch(patch) {
            Ok(mut response) => {
                tracing::info!(%subject, "sidecar injected");
                if !warnings.is_empty() {
                    response.warnings = Some(warnings);
                }
                ("injected", response)
            }
            Err(error) => {
                let reason = format!("dedupd injector: cannot encode the patch: {error}");
                tracing::error!(%subject, %reason);
                ("invalid", AdmissionResponse::from(request).deny(reason))
            }
        },
    }
}

#[derive(Clone)]
struct AppState {
    defaults: Arc<SidecarDefaults>,
    metrics: Arc<InjectMetrics>,
    ready: Arc<AtomicBool>,
}

/// The injector's routes: `POST /mutate`, `/healthz`, `/readyz`, `/metrics`.
pub fn router(
    defaults: SidecarDefaults,
    metrics: Arc<InjectMetrics>,
    ready: Arc<AtomicBool>,
) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .layer(DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state(AppState {
            defaults: Arc::new(defaults),
            metrics,
            ready,
        })
}

async fn mutate(State(state): State<AppState>, body: Bytes) -> axum::response::Response {
    let parsed: AdmissionReview<DynamicObject> = match serde_json::from_slice(&body) {
        Ok(parsed) => parsed,
        Err(error) => {
            state.metrics.count("invalid");
            return (
                StatusCode::BAD_REQUEST,
                format!("the body is not an AdmissionReview: {error}\n"),
            )
                .into_response();
        }
    };
    match review(parsed, &state.defaults, &state.metrics) {
        Ok(answer) => match serde_json::to_vec(&answer) {
            Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
            Err(error) => {
                tracing::error!(%error, "cannot encode the AdmissionReview answer");
                StatusCode::INTERNAL_SERVER_ERROR.into_response()
            }
        },
        Err(problem) => {
            state.metrics.count("invalid");
            (StatusCode::BAD_REQUEST, format!("{problem}\n")).into_response()
        }
    }
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    if state.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    }
}

async fn render_metrics(
    State(state): State<AppState>,
    request: axum::http::HeaderMap,
) -> impl IntoResponse {
    crate::metrics::exposition(&request, state.metrics.render())
}

/// Serves HTTPS on `listener` with `cert` until `shutdown` resolves, then
/// stops accepting (readiness turns false first) and lets open requests
/// finish.
pub async fn serve(
    listener: TcpListener,
    cert: Arc<ReloadingCert>,
    defaults: SidecarDefaults,
    metrics: Arc<InjectMetrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let ready = Arc::new(AtomicBool::new(true));
    let app = router(defaults, metrics, Arc::clone(&ready));
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cert.server_config()));
    let stop_ready = Arc::clone(&ready);
    let shutdown = async move {
        shutdown.await;
        stop_ready.store(false, Ordering::SeqCst);
    };
    crate::listen::serve_tcp(
        listener,
        shutdown,
        SHUTDOWN_GRACE,
        |stream, peer, stopping| {
            let (acceptor, app) = (acceptor.clone(), app.clone());
            async move {
                let stream =
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(error)) => {
                            tracing::debug!(%peer, %error, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                let service = hyper_util::service::TowerToHyperService::new(app);
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HANDSHAKE_TIMEOUT)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                let ended = crate::listen::until_stopped(
                    connection,
                    &stopping,
                    std::future::pending(),
                    None,
                )
                .await;
                if let Err(error) = ended {
                    tracing::debug!(%peer, %error, "connection ended with an error");
                }
            }
        },
    )
    .await;
    Ok(())
}
