//! The HTTP idempotency proxy: requests with a deduplicated method and an
//! `Idempotency-Key` — and gRPC calls with an `idempotency-key` metadata
//! entry — go through the engine (claim, forward, commit the response or
//! release the key); everything else streams straight to the upstream.
//! HTTP/1.1 and HTTP/2 (prior knowledge) on one listener; the upstream is
//! called over HTTP/1.1, or HTTP/2 for gRPC.
//!
//! The rule that matters: once any byte of a keyed request may have reached
//! the upstream, the proxy never sends it again. The key is released only
//! when the request provably never left (the connection to the upstream
//! could not be made) or the upstream's answer says it did not act (5xx,
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

use bytes::{Bytes, BytesMut};
use http::{header, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::{TokioExecutor, TokioIo, TokioTimer},
};
use serde_json::json;
use tokio::{net::TcpListener, sync::Semaphore};
use tonic::transport::server::Connected;
use tracing::Instrument;

use super::budget::{AnswerShare, Budgets, RequestShare, Spent};
use super::idempotency::{
    end_to_end, fingerprint, may_store, storable, CallerScope, Disposition, IdempotencyKey,
    KeySyntax, ReleaseOn, RoutePattern, Scope, Stored, StoredResponse,
};
use crate::{
    domain::{
        ClaimOutcome, ClaimRequest, CommitRequest, Key, LeaseToken, ReleaseRequest, RenewRequest,
    },
    engine::Engine,
    error::Error,
    server::{ConnectionLimits, MAX_LOCAL_ERROR_RESET_STREAMS, MAX_PENDING_RESET_STREAMS},
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

/// The longest `Retry-After` suggested while a key's first request runs.
const IN_FLIGHT_RETRY: Duration = Duration::from_secs(1);

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
    /// the process exits when it ends).
    pub shutdown_grace: Duration,
}

/// How often a waiting retry looks again while the first request runs.
const IN_FLIGHT_POLL: Duration = Duration::from_millis(20);

/// How long a claim the store failed to answer is retried before the
/// client is told 503 (nothing forwarded).
const CLAIM_RETRIES_FOR: Duration = Duration::from_secs(2);

/// Why a body broke off (a concrete type: hyper's server bounds are not
/// met by a boxed `dyn Error` inside a spawned connection).
#[derive(Debug, thiserror::Error)]
enum BodyError {
    #[error(transparent)]
    Hyper(#[from] hyper::Error),
    #[error("the upstream paused longer than the upstream timeout")]
    Paused,
    #[error("the client paused its request body longer than the header timeout")]
    ClientPaused,
}

type ProxyBody = BoxBody<Bytes, BodyError>;

struct Proxy<S> {
    engine: Engine<S>,
    config: ProxyConfig,
    /// HTTP/1.1 to the upstream.
    http1: Client<HttpConnector, ProxyBody>,
    /// HTTP/2 (prior knowledge) to the upstream, for gRPC.
    http2: Client<HttpConnector, ProxyBody>,
    /// The bytes of keyed request bodies and of answers gathered to be
    /// stored that may be held at once.
    budgets: Budgets,
    /// Every keyed request's detached task, so that shutdown lets them
    /// settle their records.
    tasks: tokio_util::task::TaskTracker,
}

/// What a request speaks, which decides how the proxy answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http,
    Grpc,
}

impl Protocol {
    fn of(headers: &http::HeaderMap) -> Protocol {
        let grpc = headers
            .get(header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.starts_with("application/grpc"));
        if grpc {
            Protocol::Grpc
        } else {
            Protocol::Http
        }
    }
}

/// Every answer the proxy gives itself, instead of the upstream's.
#[derive(Debug)]
enum Rejection {
    InvalidKey(String),
    MissingKey(Method),
    /// A keyed request that says nothing of who sends it: what it must
    /// carry.
    CallerUnidentified(String),
    NotProxied(Method),
    BadTarget,
    RequestTooLarge(usize),
    BodyTimeout(Duration),
    BodyUnreadable,
    Overloaded,
    /// One caller's bodies fill its share of the budget.
    CallerOverloaded,
    InProgress,
    PayloadMismatch,
    NotReplayable,
    OutcomeUnknown(String),
    StoreUnavailable,
    UpstreamFailed(String),
    Internal(&'static str),
}

impl Rejection {
    /// The metrics label.
    fn result(&self) -> &'static str {
        match self {
            Rejection::InvalidKey(_) => "invalid_key",
            Rejection::MissingKey(_) => "missing_key",
            Rejection::CallerUnidentified(_) => "caller_unidentified",
            Rejection::NotProxied(_) | Rejection::BadTarget => "bad_target",
            Rejection::RequestTooLarge(_) => "too_large",
            Rejection::BodyTimeout(_) | Rejection::BodyUnreadable => "body_incomplete",
            Rejection::Overloaded => "overloaded",
            Rejection::CallerOverloaded => "caller_overloaded",
            Rejection::InProgress => "in_progress",
            Rejection::PayloadMismatch => "mismatch",
            Rejection::NotReplayable => "not_replayable",
            Rejection::OutcomeUnknown(_) => "outcome_unknown",
            Rejection::StoreUnavailable => "store_unavailable",
            Rejection::UpstreamFailed(_) => "upstream_failed",
            Rejection::Internal(_) => "internal",
        }
    }

    /// As an RFC 9457 problem for HTTP clients, or a trailers-only gRPC
    /// status for gRPC ones.
    fn response(self, protocol: Protocol) -> Response<ProxyBody> {
        use tonic::Code;
        // Worth retrying soon: the first request usually finishes well
        // before its lease ends; a store outage or an overload is usually
        // brief.
        let retry_after = match self {
            Rejection::InProgress => Some(IN_FLIGHT_RETRY),
            Rejection::StoreUnavailable | Rejection::Overloaded | Rejection::CallerOverloaded => {
                Some(Duration::from_secs(1))
            }
            _ => None,
        };
        let (status, kind, code, detail) = match self {
            Rejection::InvalidKey(problem) => (
                StatusCode::BAD_REQUEST,
                "invalid-idempotency-key",
                Code::InvalidArgument,
                problem,
            ),
            Rejection::MissingKey(method) => (
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                Code::InvalidArgument,
                format!("{method} requests to this service need an Idempotency-Key header"),
            ),
            Rejection::CallerUnidentified(expected) => (
                StatusCode::BAD_REQUEST,
                "caller-unidentified",
                Code::Unauthenticated,
                format!(
                    "a request with an Idempotency-Key must say who sends it ({expected}): its \
                     stored answer is given only to the same caller; it was not forwarded"
                ),
            ),
            Rejection::NotProxied(method) => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-proxied",
                Code::Unimplemented,
                format!("{method} is not proxied: dedupd is a reverse proxy for one service"),
            ),
            Rejection::BadTarget => (
                StatusCode::BAD_REQUEST,
                "bad-request-target",
                Code::InvalidArgument,
                "the request target must be a path (origin-form, e.g. /orders)".into(),
            ),
            Rejection::RequestTooLarge(limit) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "request-too-large",
                Code::ResourceExhausted,
                format!("a request with an Idempotency-Key may carry at most {limit} bytes"),
            ),
            Rejection::BodyTimeout(limit) => (
                StatusCode::REQUEST_TIMEOUT,
                "request-body-timeout",
                Code::DeadlineExceeded,
                format!(
                    "the body of a request with an Idempotency-Key must arrive within {}; it was not forwarded",
                    humantime::format_duration(limit)
                ),
            ),
            Rejection::BodyUnreadable => (
                StatusCode::BAD_REQUEST,
                "request-body-incomplete",
                Code::InvalidArgument,
                "the request body ended early; it was not forwarded".into(),
            ),
            Rejection::Overloaded => (
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                Code::ResourceExhausted,
                "the proxy is holding as many request bodies as it may; the request was not forwarded; retry later".into(),
            ),
            Rejection::CallerOverloaded => (
                StatusCode::TOO_MANY_REQUESTS,
                "caller-overloaded",
                Code::ResourceExhausted,
                "this caller's requests with an Idempotency-Key hold as many body bytes as one \
                 caller may; the request was not forwarded; retry later"
                    .into(),
            ),
            Rejection::InProgress => (
                StatusCode::CONFLICT,
                "request-in-progress",
                Code::Aborted,
                "a request with this Idempotency-Key is still being processed; retry later".into(),
            ),
            Rejection::PayloadMismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                Code::InvalidArgument,
                "this Idempotency-Key was used with a different request (method, path, query or body)".into(),
            ),
            Rejection::NotReplayable => (
                StatusCode::CONFLICT,
                "response-not-replayable",
                Code::FailedPrecondition,
                "this Idempotency-Key's request was processed, but its response was too large to keep and cannot be replayed".into(),
            ),
            Rejection::OutcomeUnknown(reason) => (
                StatusCode::BAD_GATEWAY,
                "outcome-unknown",
                Code::Unknown,
                format!(
                    "this Idempotency-Key's request may have reached the service, but no complete answer came back ({reason}); it will not be sent again with this key: check whether it took effect, then retry with a new key if it did not"
                ),
            ),
            Rejection::StoreUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                Code::Unavailable,
                "deduplication is unavailable, so the request was not forwarded; retry later".into(),
            ),
            Rejection::UpstreamFailed(problem) => (
                StatusCode::BAD_GATEWAY,
                "upstream-failed",
                Code::Unavailable,
                problem,
            ),
            Rejection::Internal(problem) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                Code::Internal,
                problem.into(),
            ),
        };
        let mut response = match protocol {
            Protocol::Http => problem_response(status, kind, &detail),
            Protocol::Grpc => grpc_status_response(code, &detail),
        };
        if let (Some(wait), Protocol::Http) = (retry_after, protocol) {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(wait.as_secs().max(1)),
            );
        }
        response
    }
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
    let client = || {
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(config.upstream_idle_timeout);
        builder
    };
    let http1 = client().build(connector.clone());
    let http2 = client().http2_only(true).build(connector);
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
                // Whether the client speaks HTTP/2 (seen on its first
                // request): only such a connection is closed for its age.
                let http2 = Arc::new(AtomicBool::new(false));
                let speaks_http2 = Arc::clone(&http2);
                let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                    if request.version() == http::Version::HTTP_2 {
                        speaks_http2.store(true, Ordering::Relaxed);
                    }
                    let proxy = Arc::clone(&proxy);
                    async move { Ok::<_, Infallible>(proxy.handle(request).await) }
                });
                let mut builder =
                    hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
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
                let ended =
                    crate::listen::until_stopped(connection, &stopping, aged(limits, http2)).await;
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

/// A response and what it was, for the metrics.
struct Answer {
    response: Response<ProxyBody>,
    result: &'static str,
    /// Time spent waiting for the upstream (not added by the proxy).
    upstream: Duration,
}

impl Answer {
    fn new(response: Response<ProxyBody>, result: &'static str) -> Answer {
        Answer {
            response,
            result,
            upstream: Duration::ZERO,
        }
    }

    fn rejected(rejection: Rejection, protocol: Protocol) -> Answer {
        let result = rejection.result();
        Answer::new(rejection.response(protocol), result)
    }
}

/// Why a forwarded request got no answer head.
enum ForwardError {
    /// The request never left: no connection to the upstream could be made.
    Unsent(String),
    /// It may have reached the upstream.
    MaybeSent(String),
}

/// An upstream answer's body, read up to `--max-response-bytes`.
enum Gathered {
    /// All of it, and its share of the proxy's budget.
    Whole {
        data: Bytes,
        trailers: Option<http::HeaderMap>,
        share: AnswerShare,
    },
    /// More than the limit: what was read, and the rest still to come.
    Over { read: Bytes, rest: Incoming },
    /// It broke off or stalled.
    Failed(String),
}

/// A keyed request read whole, on its way to be claimed and forwarded.
struct Keyed {
    parts: http::request::Parts,
    body: Bytes,
    /// The body's share of the request budget, held until it is forwarded.
    budget: RequestShare,
    key: IdempotencyKey,
    /// The caller's identity hash (`None`: callers share records).
    caller: Option<[u8; 32]>,
}

/// Renews a lease at a third of its time until dropped.
struct Renewals(tokio::task::JoinHandle<()>);

impl Drop for Renewals {
    fn drop(&mut self) {
        self.0.abort();
    }
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
            answer.response
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
                let idle = self.config.header_timeout;
                Answer::new(
                    self.pass_through(request.map(|body| streamed_request(body, idle)), protocol)
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

    /// Forwards the request as it is, streaming both ways (trailers too).
    async fn pass_through(
        &self,
        request: Request<ProxyBody>,
        protocol: Protocol,
    ) -> Response<ProxyBody> {
        match self.forward(request, protocol).await {
            Ok(response) => {
                client_response(response.map(|body| body.map_err(BodyError::from).boxed()))
            }
            Err(ForwardError::Unsent(error) | ForwardError::MaybeSent(error)) => {
                tracing::warn!(%error, "upstream unreachable");
                Rejection::UpstreamFailed("the upstream service did not answer".into())
                    .response(protocol)
            }
        }
    }

    async fn forward(
        &self,
        mut request: Request<ProxyBody>,
        protocol: Protocol,
    ) -> Result<Response<Incoming>, ForwardError> {
        let mut parts = self.config.upstream.clone().into_parts();
        parts.path_and_query = request.uri().path_and_query().cloned();
        *request.uri_mut() = Uri::from_parts(parts)
            .map_err(|error| ForwardError::Unsent(format!("no upstream URI: {error}")))?;
        strip_hop_by_hop(request.headers_mut());
        // The upstream's spans hang under this call's, not the caller's.
        let upstream = telemetry::UpstreamCall::start(request.method());
        telemetry::inject_into(upstream.span(), request.headers_mut());
        let sent = match protocol {
            Protocol::Http => {
                *request.version_mut() = http::Version::HTTP_11;
                self.http1
                    .request(request)
                    .instrument(upstream.span().clone())
                    .await
            }
            Protocol::Grpc => {
                *request.version_mut() = http::Version::HTTP_2;
                // gRPC servers require it; it is hop-by-hop, so it was
                // stripped above.
                request
                    .headers_mut()
                    .insert(header::TE, HeaderValue::from_static("trailers"));
                self.http2
                    .request(request)
                    .instrument(upstream.span().clone())
                    .await
            }
        };
        upstream.answered(sent.as_ref().ok().map(|response| response.status()));
        sent.map_err(|error| {
            // hyper-util says "connect" only when no connection was made
            // (refused, DNS, connect timeout): nothing was written.
            if error.is_connect() || refused_stream(&error) {
                ForwardError::Unsent(error.to_string())
            } else {
                ForwardError::MaybeSent(error.to_string())
            }
        })
    }

    /// Reads a keyed request's body (it is fingerprinted and may be sent
    /// again only as a whole): within `--max-request-bytes`, the body
    /// deadline, the proxy-wide request budget and `caller`'s share of it,
    /// whose bytes it holds until dropped.
    async fn read_keyed_body(
        &self,
        mut body: Incoming,
        caller: Option<[u8; 32]>,
    ) -> Result<(Bytes, RequestShare), Rejection> {
        let deadline = tokio::time::Instant::now() + self.config.body_timeout;
        let mut held = self
            .budgets
            .request_share(caller)
            .ok_or(Rejection::Overloaded)?;
        let mut data = BytesMut::new();
        loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => return Err(Rejection::BodyTimeout(self.config.body_timeout)),
                Ok(None) => break,
                Ok(Some(Err(_))) => return Err(Rejection::BodyUnreadable),
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(chunk) = frame.into_data() else {
                continue;
            };
            if data.len() + chunk.len() > self.config.max_request_bytes {
                return Err(Rejection::RequestTooLarge(self.config.max_request_bytes));
            }
            held.grow(chunk.len()).map_err(|spent| match spent {
                Spent::Total => Rejection::Overloaded,
                Spent::Caller => Rejection::CallerOverloaded,
            })?;
            data.extend_from_slice(&chunk);
        }
        Ok((data.freeze(), held))
    }

    async fn keyed(
        self: Arc<Self>,
        request: Request<Incoming>,
        key: IdempotencyKey,
        protocol: Protocol,
    ) -> Answer {
        let (parts, body) = request.into_parts();
        // Before the body is read: an anonymous client holds no budget.
        let caller = self.config.scope.identity(&parts.headers);
        if caller.is_none() && self.config.scope != CallerScope::Shared {
            return Answer::rejected(
                Rejection::CallerUnidentified(self.config.scope.expected()),
                protocol,
            );
        }
        let (body, budget) = match self.read_keyed_body(body, caller).await {
            Ok(read) => read,
            Err(rejection) => return Answer::rejected(rejection, protocol),
        };
        // Detached from here on: a client that disconnects (or an HTTP/2
        // stream reset) cancels neither the claim — which may already be
        // stored — nor the upstream call nor its commit, so its retry finds
        // a settled record rather than an orphaned claim. The body's share
        // of the budget is given back once it has been forwarded.
        let proxy = Arc::clone(&self);
        let run = self.tasks.spawn(
            async move {
                let keyed = Keyed {
                    parts,
                    body,
                    budget,
                    key,
                    caller,
                };
                proxy.claim_and_forward(keyed, protocol).await
            }
            // Still this request's work: its decision and the upstream call
            // belong to the request's span.
            .in_current_span(),
        );
        match run.await {
            Ok(answer) => answer,
            Err(join) => {
                tracing::error!(%join, "proxy request task failed");
                Answer::rejected(Rejection::Internal("the proxy failed"), protocol)
            }
        }
    }

    async fn claim_and_forward(self: Arc<Self>, keyed: Keyed, protocol: Protocol) -> Answer {
        let Keyed {
            parts,
            body,
            budget,
            key,
            caller,
        } = keyed;
        let scope = Scope {
            method: &parts.method,
            route: parts.uri.path(),
            caller: caller.as_ref().map(|identity| &identity[..]),
        };
        // The namespace was checked with the configuration; the ID is 64 hex
        // characters.
        let record_key = Key::new_unchecked(self.config.namespace.clone(), scope.record_id(&key));
        let mut claim = ClaimRequest::plain(
            record_key.clone(),
            self.config.lease_ttl,
            self.config.retention,
        );
        claim.payload_fingerprint = fingerprint(
            &parts.method,
            parts.uri.path(),
            parts.uri.query(),
            &parts.headers,
            &body,
            &self.config.fingerprint_headers,
        );
        // This attempt's own ID: a claim retried after an error the store
        // may have applied anyway gets the same claim back instead of
        // finding it held (and later recovered, as if it had been sent).
        claim.request_id = format!("{:032x}", rand::random::<u128>());
        // With --wait-in-flight, a retry that finds the first request
        // running looks again until it ends (replayed, or released and so
        // ours to run) or the wait is over.
        let waiting_until = Instant::now() + self.config.wait_in_flight;
        let outcome = loop {
            let Some(outcome) = self.claim(&claim).await else {
                self.release_orphan(claim);
                return Answer::rejected(Rejection::StoreUnavailable, protocol);
            };
            let left = waiting_until.saturating_duration_since(Instant::now());
            match outcome {
                ClaimOutcome::InProgress { .. } if !left.is_zero() => {
                    tokio::time::sleep(left.min(IN_FLIGHT_POLL)).await;
                }
                outcome => break outcome,
            }
        };
        match outcome {
            ClaimOutcome::Claimed { record, recovered } => {
                let token = record.lease_token;
                if recovered && self.config.after_unknown_outcome == AfterUnknownOutcome::Report {
                    // The previous holder died (or lost its lease) while it
                    // may have forwarded the request.
                    return self
                        .unknown_outcome(
                            record_key,
                            token,
                            "an earlier attempt's proxy stopped while the request may have been with the service".into(),
                            protocol,
                        )
                        .await;
                }
                let request = Request::from_parts(parts, full(body));
                self.first_request(record_key, token, (request, budget), protocol)
                    .await
            }
            ClaimOutcome::Duplicate { record } => replay(
                &record.response,
                record.retain_until.0,
                protocol,
                &self.config.never_store,
            ),
            ClaimOutcome::InProgress { .. } => Answer::rejected(Rejection::InProgress, protocol),
            ClaimOutcome::FingerprintMismatch { .. } => {
                Answer::rejected(Rejection::PayloadMismatch, protocol)
            }
            ClaimOutcome::Stale { .. } => Answer::rejected(
                Rejection::Internal("an ordering answer for a request without an ordering key"),
                protocol,
            ),
        }
    }

    /// Claims, retrying (with the claim's own request ID) while the store
    /// does not answer, for up to [`CLAIM_RETRIES_FOR`]; `None`: it never
    /// did, and nothing was forwarded.
    async fn claim(&self, claim: &ClaimRequest) -> Option<ClaimOutcome> {
        let give_up = Instant::now() + CLAIM_RETRIES_FOR.min(self.config.lease_ttl);
        let mut pause = Duration::from_millis(50);
        loop {
            let claimed = self
                .engine
                .claim(claim)
                .instrument(telemetry::step_span("dedup claim"))
                .await;
            match claimed {
                Ok(outcome) => return Some(outcome),
                Err(error) if error.may_pass() && Instant::now() + pause < give_up => {
                    tracing::debug!(%error, "claim failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                Err(error) => {
                    tracing::warn!(%error, "the store did not answer; the request was not forwarded");
                    return None;
                }
            }
        }
    }

    /// The store did not answer `claim`, which it may have applied all the
    /// same (its answer lost on the way). Nothing was forwarded, so a claim
    /// stored under this attempt's request ID is given back in the
    /// background: claimed again with the same ID (the same claim comes
    /// back while its lease lasts) and released, so that the client's retry
    /// is sent — left alone, it found the key held (409), then, once the
    /// lease ended, a recovered claim it had to call "outcome unknown".
    /// A claim that came back *recovered* had another holder before it,
    /// which may have sent the request: settled as any recovered claim is.
    fn release_orphan(self: &Arc<Self>, claim: ClaimRequest) {
        let proxy = Arc::clone(self);
        self.tasks.spawn(
            async move {
                let give_up = Instant::now() + claim.lease_ttl;
                let mut pause = Duration::from_millis(100);
                while Instant::now() + pause < give_up {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                    match proxy.engine.claim(&claim).await {
                        Ok(ClaimOutcome::Claimed { record, recovered }) => {
                            let (key, token) = (claim.key.clone(), record.lease_token);
                            if recovered {
                                let reason = "an earlier attempt's proxy stopped while the \
                                              request may have been with the service";
                                // The protocol only shapes an answer nobody reads.
                                proxy
                                    .unknown_outcome(key, token, reason.into(), Protocol::Http)
                                    .await;
                            } else if proxy.release(key, token).await {
                                tracing::info!(
                                    "a claim whose answer the store lost was released; \
                                     the request was never sent"
                                );
                            }
                            return;
                        }
                        // Another attempt holds it, or it is settled.
                        Ok(_) => return,
                        Err(error) if error.may_pass() => {
                            tracing::debug!(%error, "orphaned claim: the store still fails");
                        }
                        Err(error) => {
                            tracing::warn!(%error, "orphaned claim: not released");
                            return;
                        }
                    }
                }
                tracing::warn!(
                    "the store did not answer for a whole lease: a claim it may hold for a \
                     request never sent ends as a recovered claim (outcome unknown)"
                );
            }
            .in_current_span(),
        );
    }

    /// Keeps the lease of `key` alive until the returned guard is dropped.
    fn renew_lease(self: &Arc<Self>, key: Key, token: LeaseToken) -> Renewals {
        let proxy = Arc::clone(self);
        Renewals(tokio::spawn(
            async move {
                let every = proxy.config.lease_ttl / 3;
                loop {
                    tokio::time::sleep(every).await;
                    let renew = RenewRequest {
                        key: key.clone(),
                        lease_token: token,
                        lease_ttl: proxy.config.lease_ttl,
                    };
                    let renewed = proxy
                        .engine
                        .renew(&renew)
                        .instrument(telemetry::step_span("dedup renew"))
                        .await;
                    if let Err(error) = renewed {
                        tracing::warn!(%error, "lease renewal failed");
                    }
                }
            }
            // The request's work: its renewals belong to its trace.
            .in_current_span(),
        ))
    }

    /// Forwards the first request of a key, renewing its lease meanwhile,
    /// then commits the answer (or releases the key, or records that the
    /// outcome is unknown) — before the answer is returned, unless it is
    /// too long to gather and streams.
    async fn first_request(
        self: Arc<Self>,
        key: Key,
        token: LeaseToken,
        (request, budget): (Request<ProxyBody>, RequestShare),
        protocol: Protocol,
    ) -> Answer {
        let renewals = self.renew_lease(key.clone(), token);
        let upstream_started = Instant::now();
        let deadline = tokio::time::Instant::now() + self.config.upstream_timeout;
        let forwarded = tokio::time::timeout_at(deadline, self.forward(request, protocol)).await;
        // The body has been written (or never will be): its bytes go back
        // to the budget now, not when the answer is settled.
        drop(budget);
        let response = match forwarded {
            Ok(Ok(response)) => response,
            Ok(Err(ForwardError::Unsent(problem))) => {
                self.release(key, token).await;
                tracing::warn!(%problem, "upstream unreachable; the request was not sent and the key is released");
                return Answer {
                    upstream: upstream_started.elapsed(),
                    ..Answer::rejected(
                        Rejection::UpstreamFailed(
                            "the upstream service could not be reached; the request was not sent, retry later".into(),
                        ),
                        protocol,
                    )
                };
            }
            Ok(Err(ForwardError::MaybeSent(problem))) => {
                let answer = self
                    .unknown_outcome(
                        key,
                        token,
                        format!("the connection failed: {problem}"),
                        protocol,
                    )
                    .await;
                return Answer {
                    upstream: upstream_started.elapsed(),
                    ..answer
                };
            }
            Err(_) => {
                let reason = format!(
                    "the service did not answer within {}",
                    humantime::format_duration(self.config.upstream_timeout)
                );
                let answer = self.unknown_outcome(key, token, reason, protocol).await;
                return Answer {
                    upstream: upstream_started.elapsed(),
                    ..answer
                };
            }
        };
        let (parts, body) = response.into_parts();
        let gathered = self.gather(body, deadline).await;
        let upstream = upstream_started.elapsed();
        let (data, trailers, gathered_share) = match gathered {
            Gathered::Whole {
                data,
                trailers,
                share,
            } => (data, trailers, share),
            Gathered::Failed(problem) => {
                let reason = format!("its answer broke off: {problem}");
                let answer = self.unknown_outcome(key, token, reason, protocol).await;
                return Answer { upstream, ..answer };
            }
            Gathered::Over { read, rest } => {
                // The answer is long (or the gathering budget is spent): the
                // record says what it can before the answer streams on —
                // processed but not replayable, released, or unknown, by the
                // status (gRPC's comes last, in the trailers: processed).
                let disposition = match protocol {
                    Protocol::Http => self.config.release_on.http(parts.status),
                    Protocol::Grpc => Disposition::Keep,
                };
                let (result, stored) = self
                    .settle_answer(&key, token, disposition, parts.status, None, || {
                        self.stored_response(&parts, None, None)
                    })
                    .await;
                drop(renewals);
                let body = read_then_rest(read, rest, self.config.upstream_timeout);
                let mut response = client_response(Response::from_parts(parts, body));
                mark_unstored(&mut response, stored);
                return Answer {
                    response,
                    result,
                    upstream,
                };
            }
        };
        let grpc_code =
            (protocol == Protocol::Grpc).then(|| grpc_status(&parts.headers, trailers.as_ref()));
        let disposition = match grpc_code {
            None => self.config.release_on.http(parts.status),
            Some(code) => self.config.release_on.grpc(code),
        };
        let (result, stored) = self
            .settle_answer(&key, token, disposition, parts.status, grpc_code, || {
                // A unary call answers one message; a streaming one was
                // processed but is not kept.
                let kept =
                    (protocol == Protocol::Http || grpc_messages(&data) <= 1).then_some(&data);
                self.stored_response(&parts, kept, trailers.as_ref())
            })
            .await;
        drop(renewals);
        drop(gathered_share);
        let mut response = client_response(Response::from_parts(
            parts,
            body_with_trailers(data, trailers),
        ));
        mark_unstored(&mut response, stored);
        Answer {
            response,
            result,
            upstream,
        }
    }

    /// Settles the key after the upstream answered (`status`; for gRPC,
    /// `grpc_code` is `Some(grpc-status)`), by `disposition`: commits
    /// `kept()`, releases it, or records the outcome unknown (or, with
    /// `--after-unknown-outcome retry`, releases it). The metrics result,
    /// and whether the record could be stored.
    async fn settle_answer(
        &self,
        key: &Key,
        token: LeaseToken,
        disposition: Disposition,
        status: StatusCode,
        grpc_code: Option<Option<u32>>,
        kept: impl FnOnce() -> Stored,
    ) -> (&'static str, bool) {
        match (disposition, self.config.after_unknown_outcome) {
            (Disposition::Keep, _) => ("forwarded", self.settle(key, token, &kept()).await),
            (Disposition::Release, _) | (Disposition::Unknown, AfterUnknownOutcome::Retry) => {
                // Not stored, by design: a failed release only delays the
                // retry until the lease ends.
                self.release(key.clone(), token).await;
                ("released", true)
            }
            (Disposition::Unknown, AfterUnknownOutcome::Report) => {
                let reason = match grpc_code {
                    None => format!("a gateway in front of the service answered {status}"),
                    Some(None) => "the call ended without a grpc-status".to_owned(),
                    Some(Some(code)) => format!(
                        "the call was cut off ({}) while the service may have gone on",
                        tonic::Code::from_i32(code as i32).description()
                    ),
                };
                tracing::warn!(%reason, "outcome unknown; the key will not be forwarded again");
                let stored = Stored::OutcomeUnknown { reason };
                ("outcome_unknown", self.settle(key, token, &stored).await)
            }
        }
    }

    fn stored_response(
        &self,
        parts: &http::response::Parts,
        body: Option<&Bytes>,
        trailers: Option<&http::HeaderMap>,
    ) -> Stored {
        Stored::Response(StoredResponse {
            status: parts.status,
            headers: storable(&parts.headers, &self.config.never_store),
            body: body.map(|body| body.to_vec()),
            trailers: trailers
                .map(|trailers| storable(trailers, &self.config.never_store))
                .unwrap_or_default(),
        })
    }

    /// Reads an answer's body up to `--max-response-bytes`, by `deadline`,
    /// holding its bytes' share of the proxy's budget; when the budget is
    /// spent, what was read streams on like a long answer.
    async fn gather(&self, mut body: Incoming, deadline: tokio::time::Instant) -> Gathered {
        let mut data = BytesMut::new();
        let Some(mut share) = self.budgets.answer_share() else {
            return Gathered::Failed("the proxy is shutting down".into());
        };
        loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => {
                    return Gathered::Failed(format!(
                        "not complete within {}",
                        humantime::format_duration(self.config.upstream_timeout)
                    ))
                }
                Ok(None) => {
                    return Gathered::Whole {
                        data: data.freeze(),
                        trailers: None,
                        share,
                    }
                }
                Ok(Some(Err(error))) => return Gathered::Failed(error.to_string()),
                Ok(Some(Ok(frame))) => frame,
            };
            match frame.into_data() {
                Ok(chunk) => {
                    data.extend_from_slice(&chunk);
                    // An answer that fits waits a moment for budget rather
                    // than being stored "not replayable" at a peak.
                    if data.len() > self.config.max_response_bytes
                        || !share.grow(chunk.len(), deadline).await
                    {
                        return Gathered::Over {
                            read: data.freeze(),
                            rest: body,
                        };
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        return Gathered::Whole {
                            data: data.freeze(),
                            trailers: Some(trailers),
                            share,
                        };
                    }
                }
            }
        }
    }

    /// The request may have reached the upstream and no complete answer
    /// came back: record that (never forward it again) and tell the client
    /// — or, with `--after-unknown-outcome retry`, release the key.
    async fn unknown_outcome(
        &self,
        key: Key,
        token: LeaseToken,
        reason: String,
        protocol: Protocol,
    ) -> Answer {
        match self.config.after_unknown_outcome {
            AfterUnknownOutcome::Report => {
                tracing::warn!(%reason, "outcome unknown; the key will not be forwarded again");
                let stored = Stored::OutcomeUnknown {
                    reason: reason.clone(),
                };
                // If it cannot be stored, the claim stays: once its lease
                // ends the next attempt is a recovered claim, answered the
                // same way.
                self.settle(&key, token, &stored).await;
                Answer::rejected(Rejection::OutcomeUnknown(reason), protocol)
            }
            AfterUnknownOutcome::Retry => {
                tracing::warn!(%reason, "outcome unknown; key released (--after-unknown-outcome retry)");
                self.release(key, token).await;
                Answer::rejected(
                    Rejection::UpstreamFailed(format!(
                        "{reason}; the key was released, so a retry sends the request again"
                    )),
                    protocol,
                )
            }
        }
    }

    /// Commits `stored` for the key, retrying while the store does not
    /// answer, for up to one lease time (the lease is renewed meanwhile, and
    /// a holder's commit holds even after it ends unless another claimed
    /// it). False if it could not be stored.
    async fn settle(&self, key: &Key, token: LeaseToken, stored: &Stored) -> bool {
        let commit = CommitRequest {
            key: key.clone(),
            lease_token: token,
            response: stored.encode(),
            retention: None,
        };
        self.retrying("commit", || self.engine.commit(&commit))
            .instrument(telemetry::step_span("dedup commit"))
            .await
    }

    /// Releases the key (the request never left, or the upstream said it
    /// did not act), retrying like [`Proxy::settle`]; if that fails the
    /// key frees when its lease ends, and the next attempt is a recovered
    /// claim.
    async fn release(&self, key: Key, token: LeaseToken) -> bool {
        let release = ReleaseRequest {
            key,
            lease_token: token,
        };
        self.retrying("release", || self.engine.release(&release))
            .instrument(telemetry::step_span("dedup release"))
            .await
    }

    async fn retrying<T, Call, Answered>(&self, what: &str, mut call: Call) -> bool
    where
        Call: FnMut() -> Answered,
        Answered: Future<Output = Result<T, Error>>,
    {
        let give_up = Instant::now() + self.config.lease_ttl;
        let mut pause = Duration::from_millis(50);
        loop {
            match call().await {
                Ok(_) => return true,
                Err(error) if error.may_pass() && Instant::now() + pause < give_up => {
                    tracing::debug!(%error, what, "store call failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(error) => {
                    tracing::warn!(%error, what, "store call failed; giving up");
                    return false;
                }
            }
        }
    }
}

/// Resolves when an HTTP/2 connection is `--max-connection-age` old, give
/// or take a tenth (so that connections opened together do not all close
/// together); never for HTTP/1, whose idle connections the header timeout
/// closes, and where closing between requests could race one the client has
/// just written (its answer lost, though nothing was forwarded).
async fn aged(limits: ConnectionLimits, http2: Arc<AtomicBool>) {
    let jitter = 0.9 + rand::random::<f64>() / 5.0;
    tokio::time::sleep(limits.max_connection_age.mul_f64(jitter)).await;
    if !http2.load(Ordering::Relaxed) {
        std::future::pending::<()>().await;
    }
}

/// Whether an HTTP/2 upstream reset the stream with REFUSED_STREAM, which
/// says the request was not processed at all (RFC 9113 §8.7): it may be
/// sent again. (A GOAWAY is not taken as such: the error a stream gets
/// does not say whether its ID was above the GOAWAY's last stream ID.)
fn refused_stream(error: &hyper_util::client::legacy::Error) -> bool {
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(h2) = cause.downcast_ref::<h2::Error>() {
            return h2.is_reset()
                && h2.is_remote()
                && h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        source = cause.source();
    }
    false
}

/// `idempotency-replayable: false` on an answer whose record could not be
/// stored.
fn mark_unstored(response: &mut Response<ProxyBody>, stored: bool) {
    if !stored {
        response
            .headers_mut()
            .insert(REPLAYABLE, HeaderValue::from_static("false"));
    }
}

/// What was read of an answer, then the rest as it arrives; a pause longer
/// than `idle` ends it with an error (the client sees the answer cut off).
fn read_then_rest(read: Bytes, rest: Incoming, idle: Duration) -> ProxyBody {
    let first = futures_util::stream::iter([Ok::<_, BodyError>(Frame::data(read))]);
    let more = within_pauses(rest, idle, BodyError::Paused);
    BodyExt::boxed(StreamBody::new(futures_util::StreamExt::chain(first, more)))
}

/// A request body streamed through (no key): a client that pauses longer
/// than `idle` between frames is cut off, as a keyed body past its deadline
/// is — it held a connection and an upstream request open for as long as
/// it liked.
fn streamed_request(body: Incoming, idle: Duration) -> ProxyBody {
    BodyExt::boxed(StreamBody::new(within_pauses(
        body,
        idle,
        BodyError::ClientPaused,
    )))
}

/// `body`'s frames as they arrive; a pause longer than `idle` ends it with
/// `paused`.
fn within_pauses(
    body: Incoming,
    idle: Duration,
    paused: BodyError,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BodyError>> {
    futures_util::stream::unfold(Some((body, paused)), move |state| async move {
        let (mut body, paused) = state?;
        match tokio::time::timeout(idle, body.frame()).await {
            Ok(None) => None,
            Ok(Some(Ok(frame))) => Some((Ok(frame), Some((body, paused)))),
            Ok(Some(Err(error))) => Some((Err(BodyError::from(error)), None)),
            Err(_) => Some((Err(paused), None)),
        }
    })
}

fn replay(
    stored: &[u8],
    retain_until_ms: u64,
    protocol: Protocol,
    never_store: &[HeaderName],
) -> Answer {
    let stored = match Stored::decode(stored) {
        Ok(Stored::Response(stored)) => stored,
        Ok(Stored::OutcomeUnknown { reason }) => {
            return Answer::rejected(Rejection::OutcomeUnknown(reason), protocol)
        }
        Err(error) => {
            tracing::error!(%error, "a stored response does not decode");
            return Answer::rejected(
                Rejection::Internal("the stored response is damaged"),
                protocol,
            );
        }
    };
    let Some(body) = stored.body else {
        return Answer::rejected(Rejection::NotReplayable, protocol);
    };
    // Records stored before Set-Cookie was filtered may still hold one.
    let replayed = |fields: Vec<(HeaderName, HeaderValue)>| {
        fields
            .into_iter()
            .filter(|(name, _)| may_store(name, never_store))
    };
    let trailers = (!stored.trailers.is_empty()).then(|| {
        let mut map = http::HeaderMap::new();
        for (name, value) in replayed(stored.trailers) {
            map.append(name, value);
        }
        map
    });
    let mut response = Response::new(body_with_trailers(Bytes::from(body), trailers));
    *response.status_mut() = stored.status;
    for (name, value) in replayed(stored.headers) {
        response.headers_mut().append(name, value);
    }
    response
        .headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    let expires = std::time::UNIX_EPOCH + Duration::from_millis(retain_until_ms);
    if let Ok(value) = HeaderValue::from_str(&httpdate::fmt_http_date(expires)) {
        response.headers_mut().insert(EXPIRES, value);
    }
    Answer::new(response, "replayed")
}

/// `grpc-status` from the trailers, or the headers of a trailers-only
/// answer.
fn grpc_status(headers: &http::HeaderMap, trailers: Option<&http::HeaderMap>) -> Option<u32> {
    trailers
        .and_then(|trailers| trailers.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"))
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok())
}

/// How many length-prefixed gRPC messages `body` holds.
fn grpc_messages(body: &[u8]) -> usize {
    let mut rest = body;
    let mut count = 0;
    while rest.len() >= 5 {
        let length = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        rest = rest.get(5 + length..).unwrap_or_default();
        count += 1;
    }
    count
}

fn full(body: impl Into<Bytes>) -> ProxyBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A body of `data`, then `trailers` if any.
fn body_with_trailers(data: Bytes, trailers: Option<http::HeaderMap>) -> ProxyBody {
    let Some(trailers) = trailers else {
        return full(data);
    };
    let frames = [Ok(Frame::data(data)), Ok(Frame::trailers(trailers))];
    StreamBody::new(futures_util::stream::iter(frames)).boxed()
}

/// The upstream's response as the client's: hyper writes an HTTP/1 status
/// line with the response's version, and the upstream's (say HTTP/1.0) is
/// not the client connection's; connection headers are the proxy's own.
fn client_response(mut response: Response<ProxyBody>) -> Response<ProxyBody> {
    *response.version_mut() = http::Version::default();
    strip_hop_by_hop(response.headers_mut());
    response
}

fn strip_hop_by_hop(headers: &mut http::HeaderMap) {
    let kept = end_to_end(headers);
    headers.clear();
    for (name, value) in kept {
        headers.append(name, value);
    }
}

/// An RFC 9457 problem document.
fn problem_response(status: StatusCode, kind: &str, detail: &str) -> Response<ProxyBody> {
    let body = json!({
        "type": format!("https://dedupd.dev/problems/{kind}"),
        "title": status.canonical_reason().unwrap_or("error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(full(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// A trailers-only gRPC answer: HTTP 200, the status in the headers.
fn grpc_status_response(code: tonic::Code, message: &str) -> Response<ProxyBody> {
    let mut response = Response::new(full(Bytes::new()));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from(code as i32));
    // grpc-message is percent-encoded; ours are plain ASCII sentences.
    let encoded: String = message
        .bytes()
        .map(|byte| match byte {
            b' '..=b'~' if byte != b'%' => (byte as char).to_string(),
            _ => format!("%{byte:02X}"),
        })
        .collect();
    if let Ok(value) = HeaderValue::from_str(&encoded) {
        headers.insert("grpc-message", value);
    }
    response
}
