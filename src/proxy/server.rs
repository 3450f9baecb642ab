//! The HTTP idempotency proxy's listener and configuration, and where a
//! request goes: requests with a deduplicated method and an
//! `Idempotency-Key` — and gRPC calls with an `idempotency-key` metadata
//! entry — go through the engine (`keyed`: claim, forward, commit the
//! response or release the key); everything else streams straight to the
//! upstream (`forward`); `answer` builds what the client gets. HTTP/1.1 and
//! HTTP/2 (prior knowledge) on one listener; the upstream is called over
//! HTTP/1.1, or HTTP/2 for gRPC.
//!
//! The rule that matters: once any byte of a keyed request may have reached
//! the upstream, the proxy never sends it again. The key is released only
//! when the request provably never left (the connection to the upstream
//! could not be made, or an HTTP/2 upstream refused the stream) or the
//! upstream's answer says it did not act (`--release-on-status`, by default
//! 408, 409, 425, 429). A timeout, a reset or an unreadable answer commits
//! an "outcome unknown" record instead, and so does a claim recovered from
//! a proxy that died mid-request: retries are told to reconcile, not
//! forwarded (`--after-unknown-outcome retry` opts out, for upstreams that
//! are idempotent themselves).
//!
//! Answers stream: up to `--max-response-bytes` is gathered (and, if the
//! answer ends there, committed before it is returned, so a retry always
//! finds it); a longer one is recorded as processed but not replayable and
//! passed on as it arrives.

use std::{
    convert::Infallible,
    future::Future,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use http::{HeaderName, Method, Request, Response, Uri};
use hyper::body::Incoming;
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::{TokioExecutor, TokioIo, TokioTimer},
};
use tokio::{net::TcpListener, sync::Semaphore};
use tonic::transport::server::Connected;
use tracing::Instrument;

use super::{
    answer::{Answer, Protocol, ProxyBody, Rejection},
    budget::Budgets,
    forward::streamed_request,
    idempotency::{CallerScope, IdempotencyKey, KeySyntax, ReleaseOn, RoutePattern},
    send_deadline::{watched, watched_request, StreamExecutor},
};
use crate::{
    engine::Engine,
    listen::{ConnectionLimits, MAX_LOCAL_ERROR_RESET_STREAMS, MAX_PENDING_RESET_STREAMS},
    store::Store,
    telemetry,
};

/// The header that marks a replayed response.
pub const REPLAYED: &str = "idempotent-replayed";

/// The header telling when a replayable key expires (an HTTP date).
pub const EXPIRES: &str = "idempotency-key-expires";

/// Set to `false` on an upstream answer that could not be stored (the
/// store did not answer in time): a retry will not get it replayed, but
/// will not be forwarded either (it is answered `outcome-unknown`).
pub const REPLAYABLE: &str = "idempotency-replayable";

/// The longest a connection to the upstream may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest request head (HTTP/1 request line and headers; HTTP/2
/// header list): generous for cookies and tokens, far below hyper's ~400 KB.
pub const MAX_HEAD_BYTES: usize = 64 << 10;

/// What to do when a keyed request's outcome is unknown: it may have
/// reached the upstream, but no complete answer came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AfterUnknownOutcome {
    /// Record "outcome unknown": the request is never sent again for this
    /// key, and retries are answered 502 `outcome-unknown` (at most once).
    #[default]
    Report,
    /// Release the key so a retry sends it again (at least once): only for
    /// upstreams that deduplicate themselves.
    Retry,
}

/// How the proxy treats requests.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where requests go (`http://host:port`).
    pub upstream: Uri,
    /// The records' namespace.
    pub namespace: String,
    /// Methods whose keyed requests are deduplicated.
    pub methods: Vec<Method>,
    /// Who a record belongs to besides method and route (by default a hash
    /// of the caller's credentials).
    pub scope: CallerScope,
    /// Request headers that join the payload fingerprint (an account
    /// selector such as `Stripe-Account`).
    pub fingerprint_headers: Vec<HeaderName>,
    /// Response headers never stored or replayed besides `Set-Cookie`.
    pub never_store: Vec<HeaderName>,
    /// Which spellings of `Idempotency-Key` are accepted.
    pub key_syntax: KeySyntax,
    /// The answers that say the service did not act (released; any other
    /// answer is the outcome, replayed).
    pub release_on: ReleaseOn,
    /// Where a deduplicated method without a key is refused (400).
    pub require_key: Vec<RoutePattern>,
    /// The lease taken while the upstream works (renewed at a third of it).
    pub lease_ttl: Duration,
    /// How long a replayable response is kept.
    pub retention: Duration,
    /// The largest response kept for replay; larger ones stream through and
    /// are recorded as not replayable.
    pub max_response_bytes: usize,
    /// The largest keyed request body (it is buffered to fingerprint it).
    pub max_request_bytes: usize,
    /// The longest the upstream may take to answer a keyed request (its
    /// head and up to `max_response_bytes` of its body), and the longest a
    /// streamed answer may pause.
    pub upstream_timeout: Duration,
    /// How long an idle upstream connection is kept for reuse.
    pub upstream_idle_timeout: Duration,
    /// How long a retry waits for the first request's result (then
    /// replays it) instead of answering 409 at once; zero: no wait.
    pub wait_in_flight: Duration,
    /// What a timeout, a reset or a dead proxy leaves behind.
    pub after_unknown_outcome: AfterUnknownOutcome,
    /// The longest a client may take to send a request head, the longest
    /// an HTTP/1 connection may sit idle between requests, and the longest
    /// an answer may wait for the client to read any of it.
    pub header_timeout: Duration,
    /// The longest a client may take to send a keyed request's body.
    pub body_timeout: Duration,
    /// The process's connection limits, shared with the gRPC listeners.
    pub connections: ConnectionLimits,
    /// Once shutdown begins, how long connections may finish and keyed
    /// requests still with the upstream may settle (`--shutdown-grace`:
    /// the process exits when it ends); also how long an HTTP/2 connection
    /// past `--max-connection-age` gives its requests in flight.
    pub shutdown_grace: Duration,
}

pub(super) struct Proxy<S> {
    pub(super) engine: Engine<S>,
    pub(super) config: ProxyConfig,
    /// HTTP/1.1 to the upstream.
    pub(super) http1: Client<HttpConnector, ProxyBody>,
    /// HTTP/2 (prior knowledge) to the upstream, for gRPC.
    pub(super) http2: Client<HttpConnector, ProxyBody>,
    /// The bytes of keyed request bodies and of answers gathered to be
    /// stored that may be held at once.
    pub(super) budgets: Budgets,
    /// Slots for the background tasks that give back claims whose answers
    /// were lost ([`super::keyed::ORPHANS`]).
    pub(super) orphans: Arc<Semaphore>,
    /// Every keyed request's detached task, so that shutdown lets them
    /// settle their records.
    pub(super) tasks: tokio_util::task::TaskTracker,
}

/// Serves the proxy on `listener` until `shutdown` resolves. Each
/// connection holds one of `connection_slots` (the process's
/// `--max-connections`, shared with the gRPC listeners).
pub async fn serve<S: Store>(
    listener: TcpListener,
    engine: Engine<S>,
    config: ProxyConfig,
    connection_slots: Arc<Semaphore>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    // A connect that fails is a request that never left (the key is
    // released); without its own deadline a black-holed upstream would run
    // into the upstream timeout instead, and be recorded outcome-unknown.
    connector.set_connect_timeout(Some((config.upstream_timeout / 2).min(CONNECT_TIMEOUT)));
    // Idle connections are dropped before the upstream's own keep-alive
    // timeout would close them under a request being written.
    // (HTTP/1's race: HTTP/2 closes with a GOAWAY that names the last
    // stream processed, and a refused stream counts as not sent.)
    let http1 = Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(config.upstream_idle_timeout)
        .build(connector.clone());
    let http2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(connector);
    let budgets = Budgets::new(
        config.max_request_bytes,
        config.scope != CallerScope::Shared,
    );
    if config.scope == CallerScope::Shared {
        tracing::warn!("--scope none: every caller shares the proxy's records, so anyone who sends a key gets the answer stored under it");
    }
    if config.after_unknown_outcome == AfterUnknownOutcome::Retry {
        tracing::warn!("--after-unknown-outcome retry: a request whose outcome is unknown may reach the upstream again");
    }
    let grace = config.shutdown_grace;
    if config.upstream_timeout > grace {
        // Not a warning: the defaults (60 s, 20 s) are such a pair, and
        // most requests take far less than the upstream timeout.
        tracing::info!(
            grace = %humantime::format_duration(grace),
            upstream_timeout = %humantime::format_duration(config.upstream_timeout),
            "a keyed request still with the service when the shutdown grace ends is \
             settled by its lease, as outcome unknown; raise --shutdown-grace (and the \
             pod's terminationGracePeriodSeconds) above the upstream timeout to let every \
             one finish"
        );
    }
    // When shutdown began: connections and the keyed requests' settling
    // share one grace, the one the process exits at.
    let began = Arc::new(std::sync::OnceLock::new());
    let shutdown = {
        let began = Arc::clone(&began);
        async move {
            shutdown.await;
            let _ = began.set(Instant::now());
        }
    };
    let first_bytes = config.header_timeout;
    let proxy = Arc::new(Proxy {
        engine,
        config,
        http1,
        http2,
        budgets,
        orphans: Arc::new(Semaphore::new(super::keyed::ORPHANS)),
        tasks: tokio_util::task::TaskTracker::new(),
    });
    crate::listen::serve_tcp_capped(
        listener,
        connection_slots,
        first_bytes,
        shutdown,
        grace,
        |stream, stopping| {
            let proxy = Arc::clone(&proxy);
            async move {
                let peer = stream.connect_info().remote_addr();
                let limits = proxy.config.connections;
                let header_timeout = proxy.config.header_timeout;
                let drain = proxy.config.shutdown_grace;
                // Whether the client has sent an HTTP/1 request: such a
                // connection is not closed for its age.
                let http1 = Arc::new(AtomicBool::new(false));
                let speaks_http1 = Arc::clone(&http1);
                let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                    if request.version() < http::Version::HTTP_2 {
                        speaks_http1.store(true, Ordering::Relaxed);
                    }
                    let proxy = Arc::clone(&proxy);
                    async move { Ok::<_, Infallible>(proxy.handle(request).await) }
                });
                // HTTP/2 streams run on an executor that resets one whose
                // client makes no room for its answer within the header
                // timeout (HTTP/1's socket write deadline, below).
                let mut builder = hyper_util::server::conn::auto::Builder::new(StreamExecutor {
                    stall: header_timeout,
                });
                // hyper's head deadline needs a timer to be active at all.
                builder
                    .http1()
                    .timer(TokioTimer::new())
                    .header_read_timeout(header_timeout)
                    .max_buf_size(MAX_HEAD_BYTES);
                builder
                    .http2()
                    .timer(TokioTimer::new())
                    .max_concurrent_streams(limits.max_streams_per_connection)
                    .max_header_list_size(MAX_HEAD_BYTES as u32)
                    .max_pending_accept_reset_streams(Some(MAX_PENDING_RESET_STREAMS))
                    .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
                    .keep_alive_interval(Some(limits.keepalive_interval))
                    .keep_alive_timeout(limits.keepalive_timeout);
                // A client that stops reading its answers is cut off after
                // the header timeout without progress.
                let stream = crate::listen::WriteDeadline::new(stream, header_timeout);
                let connection = builder.serve_connection(TokioIo::new(stream), service);
                let ended = crate::listen::until_stopped(
                    connection,
                    &stopping,
                    aged(limits, http1),
                    Some(drain),
                )
                .await;
                if let Err(error) = ended {
                    tracing::debug!(?peer, %error, "proxy connection ended with an error");
                }
            }
        },
    )
    .await;
    // Keyed requests whose clients are gone still settle their records:
    // cut short, they would be recovered claims (outcome unknown) later.
    proxy.tasks.close();
    let settle = grace.saturating_sub(began.get().map_or(Duration::ZERO, Instant::elapsed));
    if tokio::time::timeout(settle, proxy.tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            left = proxy.tasks.len(),
            "keyed requests still with the upstream when the shutdown grace ended; their keys \
             answer 409 until their leases end, then outcome-unknown"
        );
    }
    Ok(())
}

impl<S: Store> Proxy<S> {
    async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Response<ProxyBody> {
        let span = telemetry::proxy_span(&request);
        async move {
            let started = Instant::now();
            let keyed = request.headers().contains_key("idempotency-key");
            let answer = Arc::clone(&self).answer(request).await;
            let metrics = self.engine.metrics();
            metrics.proxy_request(answer.result);
            if keyed && answer.result != "passed_through" {
                metrics.proxy_added(started.elapsed().saturating_sub(answer.upstream));
            }
            telemetry::record_proxy_answer(answer.response.status(), answer.result);
            answer.response.map(watched)
        }
        .instrument(span)
        .await
    }

    async fn answer(self: Arc<Self>, request: Request<Incoming>) -> Answer {
        let protocol = Protocol::of(request.headers());
        // Only origin-form targets (a path) name something on the upstream:
        // CONNECT's authority-form and OPTIONS' asterisk-form do not.
        if request.method() == Method::CONNECT {
            return Answer::rejected(Rejection::NotProxied(Method::CONNECT), protocol);
        }
        if !request
            .uri()
            .path_and_query()
            .is_some_and(|target| target.as_str().starts_with('/'))
        {
            return Answer::rejected(Rejection::BadTarget, protocol);
        }
        let mut values = request.headers().get_all("idempotency-key").iter();
        let value = values.next().cloned();
        // Only where the key is used: a request of another method streams
        // through untouched, key lines and all.
        let deduplicated =
            protocol == Protocol::Grpc || self.config.methods.contains(request.method());
        if deduplicated && values.next().is_some() {
            // Two lines make one invalid combined value (RFC 9110 §5.3,
            // RFC 8941: an Item, not a List); forwarding both would hand
            // the service a key the proxy did not deduplicate by.
            return Answer::rejected(
                Rejection::InvalidKey(
                    "the Idempotency-Key header was given more than once; send it once".into(),
                ),
                protocol,
            );
        }
        let parsed = match (protocol, value) {
            // gRPC metadata is not a structured field: both spellings.
            (Protocol::Grpc, Some(value)) => {
                Some(IdempotencyKey::parse(&value, KeySyntax::Lenient))
            }
            (Protocol::Http, Some(value)) if self.config.methods.contains(request.method()) => {
                Some(IdempotencyKey::parse(&value, self.config.key_syntax))
            }
            (Protocol::Http, None) if self.requires_key(request.method(), request.uri().path()) => {
                return Answer::rejected(Rejection::MissingKey(request.method().clone()), protocol);
            }
            _ => None,
        };
        match parsed {
            Some(Ok(key)) => self.keyed(request, key, protocol).await,
            Some(Err(problem)) => {
                Answer::rejected(Rejection::InvalidKey(problem.to_string()), protocol)
            }
            None => {
                let (idle, grace) = (self.config.header_timeout, self.config.body_timeout);
                Answer::new(
                    self.pass_through(
                        request.map(|body| {
                            watched_request(streamed_request(body, idle, grace, protocol))
                        }),
                        protocol,
                    )
                    .await,
                    "passed_through",
                )
            }
        }
    }

    fn requires_key(&self, method: &Method, path: &str) -> bool {
        self.config.methods.contains(method)
            && self
                .config
                .require_key
                .iter()
                .any(|pattern| pattern.matches(method, path))
    }
}

/// Resolves when a connection is `--max-connection-age` old, give or take
/// a tenth (so that connections opened together do not all close
/// together), unless it carried an HTTP/1 request: closing one between
/// requests could race a request the client has just written (its answer
/// lost, though nothing was forwarded), and an idle HTTP/1 connection is
/// closed by the header timeout anyway. So an HTTP/2 connection is, with or
/// without requests (one that only answers PINGs would live for good).
async fn aged(limits: ConnectionLimits, http1: Arc<AtomicBool>) {
    let jitter = 0.9 + rand::random::<f64>() / 5.0;
    tokio::time::sleep(limits.max_connection_age.mul_f64(jitter)).await;
    if http1.load(Ordering::Relaxed) {
        std::future::pending::<()>().await;
    }
}
