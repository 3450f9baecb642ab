//! The HTTP idempotency proxy: requests with a deduplicated method and an
//! `Idempotency-Key` go through the engine (claim, forward, commit the
//! response or release the key); everything else streams straight to the
//! upstream. HTTP/1.1 and HTTP/2 (prior knowledge) on one listener.

use std::{convert::Infallible, future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{combinators::BoxBody, BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::{TokioExecutor, TokioIo},
};
use serde_json::json;
use tokio::net::TcpListener;

use super::idempotency::{
    end_to_end, fingerprint, is_replayable, IdempotencyKey, Scope, StoredResponse,
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
    /// Refuse deduplicated methods without a key (400).
    pub require_key: bool,
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
}

type ProxyBody = BoxBody<Bytes, hyper::Error>;

struct Proxy<S> {
    engine: Engine<S>,
    config: ProxyConfig,
    client: Client<HttpConnector, ProxyBody>,
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
    let client = Client::builder(TokioExecutor::new()).build(connector);
    let proxy = Arc::new(Proxy {
        engine,
        config,
        client,
    });
    let connections = tokio_util::task::TaskTracker::new();
    let stopping = tokio_util::sync::CancellationToken::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, _peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "proxy accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let proxy = Arc::clone(&proxy);
        let stopping = stopping.clone();
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let proxy = Arc::clone(&proxy);
                async move { Ok::<_, Infallible>(proxy.handle(request).await) }
            });
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            let ended = tokio::select! {
                ended = connection.as_mut() => ended,
                () = stopping.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(error) = ended {
                tracing::debug!(%error, "proxy connection ended with an error");
            }
        });
    }
    stopping.cancel();
    connections.close();
    connections.wait().await;
    Ok(())
}

impl<S: Store> Proxy<S> {
    async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Response<ProxyBody> {
        let deduplicated = self.config.methods.contains(request.method());
        let key = request.headers().get("idempotency-key").cloned();
        match (deduplicated, key) {
            (true, Some(value)) => match IdempotencyKey::parse(&value) {
                Ok(key) => self.keyed(request, key).await,
                Err(problem) => problem_response(
                    StatusCode::BAD_REQUEST,
                    "invalid-idempotency-key",
                    &problem.to_string(),
                ),
            },
            (true, None) if self.config.require_key => problem_response(
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                &format!(
                    "{} requests to this service need an Idempotency-Key header",
                    request.method()
                ),
            ),
            _ => self.pass_through(request.map(|body| body.boxed())).await,
        }
    }

    /// Forwards the request as it is, streaming both ways.
    async fn pass_through(&self, request: Request<ProxyBody>) -> Response<ProxyBody> {
        match self.forward(request).await {
            Ok(response) => client_response(response.map(|body| body.boxed())),
            Err(error) => upstream_unreachable(&error),
        }
    }

    async fn forward(
        &self,
        mut request: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
        let mut parts = self.config.upstream.clone().into_parts();
        parts.path_and_query = request.uri().path_and_query().cloned();
        *request.uri_mut() = Uri::from_parts(parts).expect("upstream URI with the request's path");
        // The upstream speaks HTTP/1.1 whatever the client spoke.
        *request.version_mut() = http::Version::HTTP_11;
        strip_hop_by_hop(request.headers_mut());
        self.client.request(request).await
    }

    async fn keyed(
        self: Arc<Self>,
        request: Request<Incoming>,
        key: IdempotencyKey,
    ) -> Response<ProxyBody> {
        let (parts, body) = request.into_parts();
        let body = match Limited::new(body, self.config.max_request_bytes)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(_) => {
                return problem_response(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "request-too-large",
                    &format!(
                        "a request with an Idempotency-Key may carry at most {} bytes",
                        self.config.max_request_bytes
                    ),
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
        let outcome = match self.engine.claim(&claim).await {
            Ok(outcome) => outcome,
            Err(error) => return store_unavailable(&error),
        };
        match outcome {
            ClaimOutcome::Claimed { record, .. } => {
                let request = Request::from_parts(parts, full(body));
                // Detached: a client that disconnects does not stop the
                // upstream call or its commit; its retry gets the replay.
                let proxy = Arc::clone(&self);
                let token = record.lease_token;
                let run = tokio::spawn(async move { proxy.first_request(record_key, token, request).await });
                match run.await {
                    Ok(response) => response,
                    Err(join) => {
                        tracing::error!(%join, "proxy request task failed");
                        problem_response(StatusCode::INTERNAL_SERVER_ERROR, "internal", "the proxy failed")
                    }
                }
            }
            ClaimOutcome::Duplicate { record } => replay(&record.response, record.retain_until.0),
            ClaimOutcome::InProgress { retry_after, .. } => {
                let mut response = problem_response(
                    StatusCode::CONFLICT,
                    "request-in-progress",
                    "a request with this Idempotency-Key is still being processed; retry later",
                );
                // The lease's end is the worst case; the first request
                // usually finishes much sooner, so suggest a short wait.
                let seconds = retry_after.min(IN_FLIGHT_RETRY).as_secs().max(1);
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
                response
            }
            ClaimOutcome::FingerprintMismatch { .. } => problem_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "this Idempotency-Key was used with a different request (method, path, query or body)",
            ),
            ClaimOutcome::Stale { .. } => problem_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "an ordering answer for a request without an ordering key",
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
    ) -> Response<ProxyBody> {
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
        let answered = tokio::time::timeout(self.config.upstream_timeout, async {
            let response = self.forward(request).await.map_err(|e| e.to_string())?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
            Ok::<_, String>((parts, body))
        })
        .await
        .unwrap_or_else(|_| Err("the upstream did not answer in time".into()));
        renewals.abort();
        match answered {
            Ok((parts, body)) if is_replayable(parts.status) => {
                let stored = StoredResponse {
                    status: parts.status,
                    headers: end_to_end(&parts.headers),
                    body: (body.len() <= self.config.max_response_bytes).then(|| body.to_vec()),
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
                client_response(Response::from_parts(parts, full(body)))
            }
            Ok((parts, body)) => {
                self.release(key, token).await;
                client_response(Response::from_parts(parts, full(body)))
            }
            Err(problem) => {
                self.release(key, token).await;
                tracing::warn!(%problem, "upstream failed; key released");
                problem_response(StatusCode::BAD_GATEWAY, "upstream-failed", &problem)
            }
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

fn replay(stored: &[u8], retain_until_ms: u64) -> Response<ProxyBody> {
    let stored = match StoredResponse::decode(stored) {
        Ok(stored) => stored,
        Err(error) => {
            tracing::error!(%error, "a stored response does not decode");
            return problem_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the stored response is damaged",
            );
        }
    };
    let Some(body) = stored.body else {
        return problem_response(
            StatusCode::CONFLICT,
            "response-not-replayable",
            "this Idempotency-Key's request was processed, but its response was too large to keep and cannot be replayed",
        );
    };
    let mut response = Response::new(full(body));
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
    response
}

fn full(body: impl Into<Bytes>) -> ProxyBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed()
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

fn upstream_unreachable(error: &hyper_util::client::legacy::Error) -> Response<ProxyBody> {
    tracing::warn!(%error, "upstream unreachable");
    problem_response(
        StatusCode::BAD_GATEWAY,
        "upstream-unreachable",
        "the upstream service did not answer",
    )
}

fn store_unavailable(error: &crate::Error) -> Response<ProxyBody> {
    tracing::warn!(%error, "the store did not answer; the request was not forwarded");
    let mut response = problem_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        "deduplication is unavailable, so the request was not forwarded; retry later",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}
