//! The HTTP idempotency proxy: requests with a deduplicated method and an
//! `Idempotency-Key` — and gRPC calls with an `idempotency-key` metadata
//! entry — go through the engine (claim, forward, commit the response or
//! release the key); everything else streams straight to the upstream.
//! HTTP/1.1 and HTTP/2 (prior knowledge) on one listener; the upstream is
//! called over HTTP/1.1, or HTTP/2 for gRPC.

use std::{convert::Infallible, future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{combinators::BoxBody, BodyExt, Full, Limited, StreamBody};
use hyper::body::Frame;
use hyper::body::Incoming;
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::{TokioExecutor, TokioIo},
};
use serde_json::json;
use tokio::net::TcpListener;

use super::idempotency::{
    end_to_end, fingerprint, is_replayable, is_replayable_grpc, IdempotencyKey, RoutePattern,
    Scope, StoredResponse,
};
use crate::{
    domain::{
        ClaimOutcome, ClaimRequest, CommitRequest, Key, LeaseToken, ReleaseRequest, RenewRequest,
    },
    engine::Engine,
    store::Store,
};

/// The header that marks a replayed response.
pub const REPLAYED: &str = "idempotent-replayed";
/// The header telling when a replayable key expires (an HTTP date).
pub const EXPIRES: &str = "idempotency-key-expires";

/// How long requests in progress may take to finish once shutdown begins.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The longest `Retry-After` suggested while a key's first request runs.
const IN_FLIGHT_RETRY: Duration = Duration::from_secs(1);

/// How the proxy treats requests.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where requests go (`http://host:port`).
    pub upstream: Uri,
    /// The records' namespace.
    pub namespace: String,
    /// Methods whose keyed requests are deduplicated.
    pub methods: Vec<Method>,
    /// A header identifying the caller, hashed into the key's scope.
    pub scope_header: Option<HeaderName>,
    /// Where a deduplicated method without a key is refused (400).
    pub require_key: Vec<RoutePattern>,
    /// The lease taken while the upstream works (renewed at a third of it).
    pub lease_ttl: Duration,
    /// How long a replayable response is kept.
    pub retention: Duration,
    /// The largest response kept for replay; larger ones are returned but
    /// not replayable.
    pub max_response_bytes: usize,
    /// The largest keyed request body (it is buffered to fingerprint it).
    pub max_request_bytes: usize,
    /// The longest the upstream may take to answer a keyed request.
    pub upstream_timeout: Duration,
    /// How long a retry waits for the first request's result (then
    /// replays it) instead of answering 409 at once; zero: no wait.
    pub wait_in_flight: Duration,
}

/// How often a waiting retry looks again while the first request runs.
const IN_FLIGHT_POLL: Duration = Duration::from_millis(20);

type ProxyBody = BoxBody<Bytes, hyper::Error>;

struct Proxy<S> {
    engine: Engine<S>,
    config: ProxyConfig,
    /// HTTP/1.1 to the upstream.
    http1: Client<HttpConnector, ProxyBody>,
    /// HTTP/2 (prior knowledge) to the upstream, for gRPC.
    http2: Client<HttpConnector, ProxyBody>,
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
    RequestTooLarge(usize),
    InProgress,
    PayloadMismatch,
    NotReplayable,
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
            Rejection::RequestTooLarge(_) => "too_large",
            Rejection::InProgress => "in_progress",
            Rejection::PayloadMismatch => "mismatch",
            Rejection::NotReplayable => "not_replayable",
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
        // before its lease ends; a store outage is usually brief.
        let retry_after = match self {
            Rejection::InProgress => Some(IN_FLIGHT_RETRY),
            Rejection::StoreUnavailable => Some(Duration::from_secs(1)),
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
            Rejection::RequestTooLarge(limit) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "request-too-large",
                Code::ResourceExhausted,
                format!("a request with an Idempotency-Key may carry at most {limit} bytes"),
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

/// Serves the proxy on `listener` until `shutdown` resolves.
pub async fn serve<S: Store>(
    listener: TcpListener,
    engine: Engine<S>,
    config: ProxyConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let http1 = Client::builder(TokioExecutor::new()).build(connector.clone());
    let http2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(connector);
    let proxy = Arc::new(Proxy {
        engine,
        config,
        http1,
        http2,
    });
    crate::listen::serve_tcp(
        listener,
        shutdown,
        SHUTDOWN_GRACE,
        |stream, peer, stopping| {
            let proxy = Arc::clone(&proxy);
            async move {
                let service = hyper::service::service_fn(move |request| {
                    let proxy = Arc::clone(&proxy);
                    async move { Ok::<_, Infallible>(proxy.handle(request).await) }
                });
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                let connection = builder.serve_connection(TokioIo::new(stream), service);
                let ended = crate::listen::until_stopped(connection, &stopping).await;
                if let Err(error) = ended {
                    tracing::debug!(%peer, %error, "proxy connection ended with an error");
                }
            }
        },
    )
    .await;
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

impl<S: Store> Proxy<S> {
    async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Response<ProxyBody> {
        let started = std::time::Instant::now();
        let keyed = request.headers().contains_key("idempotency-key");
        let answer = Arc::clone(&self).answer(request).await;
        let metrics = self.engine.metrics();
        metrics.proxy_request(answer.result);
        if keyed && answer.result != "passed_through" {
            metrics.proxy_added(started.elapsed().saturating_sub(answer.upstream));
        }
        answer.response
    }

    async fn answer(self: Arc<Self>, request: Request<Incoming>) -> Answer {
        let protocol = Protocol::of(request.headers());
        let value = request.headers().get("idempotency-key").cloned();
        let parsed = match (protocol, value) {
            (Protocol::Grpc, Some(value)) => Some(IdempotencyKey::parse_metadata(&value)),
            (Protocol::Http, Some(value)) if self.config.methods.contains(request.method()) => {
                Some(IdempotencyKey::parse(&value))
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
            None => Answer::new(
                self.pass_through(request.map(|body| body.boxed()), protocol)
                    .await,
                "passed_through",
            ),
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
            Ok(response) => client_response(response.map(|body| body.boxed())),
            Err(error) => {
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
    ) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
        let mut parts = self.config.upstream.clone().into_parts();
        parts.path_and_query = request.uri().path_and_query().cloned();
        *request.uri_mut() = Uri::from_parts(parts).expect("upstream URI with the request's path");
        strip_hop_by_hop(request.headers_mut());
        match protocol {
            Protocol::Http => {
                *request.version_mut() = http::Version::HTTP_11;
                self.http1.request(request).await
            }
            Protocol::Grpc => {
                *request.version_mut() = http::Version::HTTP_2;
                // gRPC servers require it; it is hop-by-hop, so it was
                // stripped above.
                request
                    .headers_mut()
                    .insert(header::TE, HeaderValue::from_static("trailers"));
                self.http2.request(request).await
            }
        }
    }

    async fn keyed(
        self: Arc<Self>,
        request: Request<Incoming>,
        key: IdempotencyKey,
        protocol: Protocol,
    ) -> Answer {
        let (parts, body) = request.into_parts();
        let body = match Limited::new(body, self.config.max_request_bytes)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(_) => {
                return Answer::rejected(
                    Rejection::RequestTooLarge(self.config.max_request_bytes),
                    protocol,
                )
            }
        };
        let caller = self
            .config
            .scope_header
            .as_ref()
            .and_then(|name| parts.headers.get(name))
            .map(HeaderValue::as_bytes);
        let scope = Scope {
            method: &parts.method,
            route: parts.uri.path(),
            caller,
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
        );
        // With --http-proxy-wait-in-flight, a retry that finds the first
        // request running looks again until it ends (replayed, or released
        // and so ours to run) or the wait is over.
        let waiting_until = std::time::Instant::now() + self.config.wait_in_flight;
        let outcome = loop {
            let outcome = match self.engine.claim(&claim).await {
                Ok(outcome) => outcome,
                Err(error) => {
                    tracing::warn!(%error, "the store did not answer; the request was not forwarded");
                    return Answer::rejected(Rejection::StoreUnavailable, protocol);
                }
            };
            let left = waiting_until.saturating_duration_since(std::time::Instant::now());
            match outcome {
                ClaimOutcome::InProgress { .. } if !left.is_zero() => {
                    tokio::time::sleep(left.min(IN_FLIGHT_POLL)).await;
                }
                outcome => break outcome,
            }
        };
        match outcome {
            ClaimOutcome::Claimed { record, .. } => {
                let request = Request::from_parts(parts, full(body));
                // Detached: a client that disconnects does not stop the
                // upstream call or its commit; its retry gets the replay.
                let proxy = Arc::clone(&self);
                let token = record.lease_token;
                let run = tokio::spawn(async move {
                    proxy
                        .first_request(record_key, token, request, protocol)
                        .await
                });
                match run.await {
                    Ok(answer) => answer,
                    Err(join) => {
                        tracing::error!(%join, "proxy request task failed");
                        Answer::rejected(Rejection::Internal("the proxy failed"), protocol)
                    }
                }
            }
            ClaimOutcome::Duplicate { record } => {
                replay(&record.response, record.retain_until.0, protocol)
            }
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

    /// Forwards the first request of a key, renewing its lease meanwhile,
    /// then commits the response (or releases the key for a retry).
    async fn first_request(
        self: Arc<Self>,
        key: Key,
        token: LeaseToken,
        request: Request<ProxyBody>,
        protocol: Protocol,
    ) -> Answer {
        let renewals = {
            let proxy = Arc::clone(&self);
            let key = key.clone();
            tokio::spawn(async move {
                let every = proxy.config.lease_ttl / 3;
                loop {
                    tokio::time::sleep(every).await;
                    let renew = RenewRequest {
                        key: key.clone(),
                        lease_token: token,
                        lease_ttl: proxy.config.lease_ttl,
                    };
                    if let Err(error) = proxy.engine.renew(&renew).await {
                        tracing::warn!(%error, "lease renewal failed");
                    }
                }
            })
        };
        let upstream_started = std::time::Instant::now();
        let answered = tokio::time::timeout(self.config.upstream_timeout, async {
            let response = self
                .forward(request, protocol)
                .await
                .map_err(|e| e.to_string())?;
            let (parts, body) = response.into_parts();
            let collected = body.collect().await.map_err(|e| e.to_string())?;
            let trailers = collected.trailers().cloned();
            Ok::<_, String>((parts, collected.to_bytes(), trailers))
        })
        .await
        .unwrap_or_else(|_| Err("the upstream did not answer in time".into()));
        renewals.abort();
        let upstream = upstream_started.elapsed();
        let (parts, body, trailers) = match answered {
            Ok(answered) => answered,
            Err(problem) => {
                self.release(key, token).await;
                tracing::warn!(%problem, "upstream failed; key released");
                return Answer {
                    upstream,
                    ..Answer::rejected(Rejection::UpstreamFailed(problem), protocol)
                };
            }
        };
        let replayable = match protocol {
            Protocol::Http => is_replayable(parts.status),
            // A unary call answers one message; a streaming one is passed
            // on but not kept.
            Protocol::Grpc => {
                grpc_status(&parts.headers, trailers.as_ref()).is_some_and(is_replayable_grpc)
                    && grpc_messages(&body) <= 1
            }
        };
        let result = if replayable {
            let stored = StoredResponse {
                status: parts.status,
                headers: end_to_end(&parts.headers),
                body: (body.len() <= self.config.max_response_bytes).then(|| body.to_vec()),
                trailers: trailers.as_ref().map(end_to_end).unwrap_or_default(),
            };
            let commit = CommitRequest {
                key,
                lease_token: token,
                response: stored.encode(),
                retention: None,
            };
            if let Err(error) = self.engine.commit(&commit).await {
                tracing::warn!(%error, "commit of a proxied response failed; a retry runs again");
            }
            "forwarded"
        } else {
            self.release(key, token).await;
            "released"
        };
        Answer {
            response: client_response(Response::from_parts(
                parts,
                body_with_trailers(body, trailers),
            )),
            result,
            upstream,
        }
    }

    async fn release(&self, key: Key, token: LeaseToken) {
        let release = ReleaseRequest {
            key,
            lease_token: token,
        };
        if let Err(error) = self.engine.release(&release).await {
            tracing::warn!(%error, "release failed; the key frees when its lease ends");
        }
    }
}

fn replay(stored: &[u8], retain_until_ms: u64, protocol: Protocol) -> Answer {
    let stored = match StoredResponse::decode(stored) {
        Ok(stored) => stored,
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
    let trailers = (!stored.trailers.is_empty()).then(|| {
        let mut map = http::HeaderMap::new();
        for (name, value) in stored.trailers {
            map.append(name, value);
        }
        map
    });
    let mut response = Response::new(body_with_trailers(Bytes::from(body), trailers));
    *response.status_mut() = stored.status;
    for (name, value) in stored.headers {
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
