//! The guard stack in front of the dedup API, built once per process from
//! tower's own layers: RPC timing (its own layer, labelled from the fixed
//! method list), load shedding over one process-wide concurrency limit, the
//! request timeout, and the bearer-token check as an interceptor. Only the
//! `dedup.v1.ClaimAndCommit` service sits behind it: health and reflection
//! are never shed, never time out and never need a token, so Kubernetes
//! probes keep working at saturation.

use std::{
    convert::Infallible,
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;
use tonic::{
    body::Body,
    server::NamedService,
    service::{
        interceptor::{InterceptedService, ResponseBody},
        Interceptor,
    },
    Status,
};
use tower::{
    limit::GlobalConcurrencyLimitLayer, load_shed::LoadShedLayer, timeout::TimeoutLayer,
    util::BoxCloneSyncService, BoxError, Service, ServiceBuilder, ServiceExt,
};

use crate::{metrics::Metrics, proto::v1::claim_and_commit_server::SERVICE_NAME, telemetry};

/// The methods of `dedup.v1.ClaimAndCommit`: the only `rpc` metric labels
/// besides [`OTHER_RPC`]. A unit test checks the list against the proto.
pub(crate) const METHODS: [&str; 10] = [
    "Claim",
    "Commit",
    "Release",
    "Renew",
    "Lookup",
    "Forget",
    "ClaimBatch",
    "CommitBatch",
    "ReleaseBatch",
    "Rekey",
];

/// The `rpc` label of every path that is not one of [`METHODS`].
pub(crate) const OTHER_RPC: &str = "other";

/// The metric label of a request path: a method name, or [`OTHER_RPC`], so a
/// client cannot grow the label set.
pub(crate) fn rpc_label(path: &str) -> &'static str {
    path.strip_prefix('/')
        .and_then(|path| path.strip_prefix(SERVICE_NAME))
        .and_then(|path| path.strip_prefix('/'))
        .and_then(|method| METHODS.iter().find(|known| **known == method))
        .copied()
        .unwrap_or(OTHER_RPC)
}

/// The bearer tokens clients must present. Never logged.
#[derive(Clone)]
pub struct Tokens {
    client: Arc<[u8]>,
    admin: Option<Arc<[u8]>>,
}

impl Tokens {
    /// `client` opens every call; `admin` also opens `Forget` and `Rekey`
    /// (without it, nobody may call them).
    pub fn new(client: &str, admin: Option<&str>) -> Tokens {
        Tokens {
            client: client.as_bytes().into(),
            admin: admin.map(|admin| admin.as_bytes().into()),
        }
    }
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Tokens(redacted)")
    }
}

fn matches(presented: &[u8], expected: &[u8]) -> bool {
    bool::from(presented.ct_eq(expected))
}

/// What an authenticated caller may do; put in the request's extensions by
/// [`Authenticate`] and read by the handlers that need more than a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Every call but `Forget`.
    Client,
    /// Every call. Without tokens (the sidecar on its loopback or a private
    /// socket), every caller is this.
    Admin,
}

impl Role {
    /// `PERMISSION_DENIED` unless the request was authenticated as admin; a
    /// request that never went through [`Authenticate`] is denied too.
    pub(crate) fn require_admin<T>(request: &tonic::Request<T>) -> Result<(), Status> {
        match request.extensions().get::<Role>() {
            Some(Role::Admin) => Ok(()),
            Some(Role::Client) | None => Err(Status::permission_denied(
                "Forget and Rekey need the admin token",
            )),
        }
    }
}

/// The token check, as a tonic interceptor on the dedup service.
#[derive(Debug, Clone)]
pub(crate) struct Authenticate {
    tokens: Option<Tokens>,
}

impl Interceptor for Authenticate {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        let role = match &self.tokens {
            None => Role::Admin,
            Some(tokens) => {
                let presented = request
                    .metadata()
                    .get("authorization")
                    .and_then(|value| value.to_str().ok())
                    .and_then(|value| value.strip_prefix("Bearer "))
                    .map(str::as_bytes)
                    .ok_or_else(|| {
                        Status::unauthenticated(
                            "missing bearer token: send `authorization: Bearer <token>`",
                        )
                    })?;
                if tokens
                    .admin
                    .as_ref()
                    .is_some_and(|admin| matches(presented, admin))
                {
                    Role::Admin
                } else if matches(presented, &tokens.client) {
                    Role::Client
                } else {
                    return Err(Status::unauthenticated("invalid bearer token"));
                }
            }
        };
        request.extensions_mut().insert(role);
        Ok(request)
    }
}

/// What the guard enforces.
#[derive(Debug, Clone)]
pub struct GuardConfig {
    /// Tokens, when calls must be authenticated.
    pub tokens: Option<Tokens>,
    /// Calls in progress at once, over every listener; more are refused with
    /// RESOURCE_EXHAUSTED.
    pub max_concurrent_requests: usize,
    /// Longest a call may take once admitted; longer ones are answered
    /// UNAVAILABLE.
    pub request_timeout: Duration,
    /// Longest the request message may take to arrive, before admission: a
    /// client that sends headers and stalls holds no admission slot, and is
    /// answered DEADLINE_EXCEEDED after this long.
    pub request_read_timeout: Duration,
    /// Bytes of request messages held at once, from their first byte until
    /// their call is answered, over every connection and stream: what bounds
    /// the memory of requests (not connections × streams × message size). A
    /// message that would go past it is refused with RESOURCE_EXHAUSTED as
    /// it arrives, before admission. At least one largest message fits.
    pub read_budget_bytes: usize,
}

/// The default [`GuardConfig::read_budget_bytes`] (raised to the largest
/// message allowed, if that is more).
pub const DEFAULT_READ_BUDGET_BYTES: usize = 64 << 20;

impl GuardConfig {
    /// The request bytes held at once, as enforced: the configured budget
    /// raised to one largest message (and its 5-byte frame header).
    pub fn read_budget_in_force(&self, max_message_bytes: usize) -> usize {
        self.read_budget_bytes
            .max(max_message_bytes.saturating_add(5))
            .min(Semaphore::MAX_PERMITS)
    }

    fn authenticate(&self) -> Authenticate {
        Authenticate {
            tokens: self.tokens.clone(),
        }
    }
}

type HttpService = BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>;

/// The dedup service behind the guard stack, still named as the dedup
/// service so the router sends it the dedup paths. Clones share the one
/// concurrency limit: build it once and hand a clone to every listener.
#[derive(Clone)]
pub(crate) struct Guarded(HttpService);

impl fmt::Debug for Guarded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Guarded")
    }
}

impl NamedService for Guarded {
    const NAME: &'static str = SERVICE_NAME;
}

impl Service<http::Request<Body>> for Guarded {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = <HttpService as Service<http::Request<Body>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        self.0.call(request)
    }
}

/// Puts `dedup` behind timing, reading the whole request (bounded in time
/// and size), load shedding, the process-wide concurrency limit, the timeout
/// and the token check, in that order: a call takes an admission slot only
/// once its message has arrived.
pub(crate) fn guard<S>(
    dedup: S,
    config: &GuardConfig,
    max_message_bytes: usize,
    metrics: Arc<Metrics>,
) -> Guarded
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let limit = config.max_concurrent_requests;
    let timeout = config.request_timeout;
    let read_budget_bytes = config.read_budget_in_force(max_message_bytes);
    let read_budget = Arc::new(Semaphore::new(read_budget_bytes));
    let stack = ServiceBuilder::new()
        .layer_fn(|inner| RpcTimer {
            inner,
            metrics: Arc::clone(&metrics),
        })
        .layer_fn(|inner| Refuse {
            inner,
            metrics: Arc::clone(&metrics),
            limits: Limits {
                limit,
                timeout,
                read_timeout: config.request_read_timeout,
                max_message_bytes,
                read_budget_bytes,
            },
            not_ready: None,
        })
        .layer_fn(|inner| ReadBody {
            inner,
            read_timeout: config.request_read_timeout,
            // The gRPC frame header: a flag byte and a 4-byte length.
            max_bytes: max_message_bytes.saturating_add(5),
            budget: Arc::clone(&read_budget),
        })
        .layer(LoadShedLayer::new())
        .layer(GlobalConcurrencyLimitLayer::with_semaphore(Arc::new(
            Semaphore::new(limit),
        )))
        .layer(TimeoutLayer::new(timeout))
        .map_response(|response: http::Response<ResponseBody<Body>>| response.map(Body::new))
        .service(InterceptedService::new(dedup, config.authenticate()));
    Guarded(BoxCloneSyncService::new(stack))
}

type AnswerFuture = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

/// The metrics layer: times every call of the dedup service, refusals
/// included, under a label from the fixed method list.
#[derive(Clone)]
struct RpcTimer<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> Service<http::Request<Body>> for RpcTimer<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = AnswerFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> AnswerFuture {
        let rpc = rpc_label(request.uri().path());
        let metrics = Arc::clone(&self.metrics);
        let started = Instant::now();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let answer = answer.await;
            metrics.rpc(rpc, started.elapsed());
            if let Ok(response) = &answer {
                telemetry::record_grpc_status(response.headers());
            }
            answer
        })
    }
}

/// The limits a refusal names, so the client learns which one it hit.
#[derive(Debug, Clone, Copy)]
struct Limits {
    limit: usize,
    timeout: Duration,
    read_timeout: Duration,
    max_message_bytes: usize,
    read_budget_bytes: usize,
}

impl Limits {
    /// The answer to a refused call, and the reason it is counted under
    /// (`dedupd_refusals_total{reason}`).
    fn refusal(self, error: &BoxError) -> (&'static str, http::Response<Body>) {
        let (reason, status) = if let Some(unread) = error.downcast_ref::<Unread>() {
            match unread {
                Unread::TooSlow => (
                    "read_timeout",
                    Status::deadline_exceeded(format!(
                        "the request message did not arrive within {} (--request-read-timeout)",
                        crate::api::human_duration(self.read_timeout)
                    )),
                ),
                Unread::TooLarge => (
                    "too_large",
                    Status::out_of_range(format!(
                        "request message too large: over {} bytes (--max-message-bytes)",
                        self.max_message_bytes
                    )),
                ),
                Unread::Broken(error) => (
                    "stream_broken",
                    Status::cancelled(format!("the request stream broke: {error}")),
                ),
                Unread::OverBudget => (
                    "read_budget",
                    Status::resource_exhausted(format!(
                        "overloaded: request messages in progress hold {} bytes; retry with backoff",
                        self.read_budget_bytes
                    )),
                ),
            }
        } else if error.is::<tower::load_shed::error::Overloaded>() {
            (
                "overloaded",
                Status::resource_exhausted(format!(
                    "overloaded: {} calls in progress (--max-concurrent-requests); retry with backoff",
                    self.limit
                )),
            )
        } else if error.is::<tower::timeout::error::Elapsed>() {
            (
                "request_timeout",
                Status::unavailable(format!(
                    "no answer within {} (--request-timeout); the change may or may not have been applied: retry",
                    crate::api::human_duration(self.timeout)
                )),
            )
        } else {
            tracing::error!(%error, "guard stack failed");
            (
                "internal",
                Status::internal("internal error (logged by the sidecar)"),
            )
        };
        (reason, status.into_http())
    }
}

/// Answers the refusals of tower's layers (load shed, timeout) as gRPC
/// statuses a client can act on; the dedup service itself never fails (its
/// errors are already statuses), so nothing reaches the connection.
#[derive(Clone)]
struct Refuse<S> {
    inner: S,
    metrics: Arc<Metrics>,
    limits: Limits,
    /// A readiness error, answered to the next call instead of failing the
    /// connection.
    not_ready: Option<Arc<BoxError>>,
}

impl<S> Service<http::Request<Body>> for Refuse<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = AnswerFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        match self.inner.poll_ready(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
            Poll::Ready(Err(error)) => {
                self.not_ready = Some(Arc::new(error));
                Poll::Ready(Ok(()))
            }
        }
    }

    fn call(&mut self, request: http::Request<Body>) -> AnswerFuture {
        let (limits, metrics) = (self.limits, Arc::clone(&self.metrics));
        let refuse = move |error: &BoxError| {
            let (reason, answer) = limits.refusal(error);
            metrics.refusal(reason);
            answer
        };
        if let Some(error) = self.not_ready.take() {
            return Box::pin(std::future::ready(Ok(refuse(&error))));
        }
        let answer = self.inner.call(request);
        Box::pin(async move { Ok(answer.await.unwrap_or_else(|error| refuse(&error))) })
    }
}

/// Why a request message was not read.
#[derive(Debug, thiserror::Error)]
enum Unread {
    #[error("the request message did not arrive in time")]
    TooSlow,
    #[error("the request message is too large")]
    TooLarge,
    #[error("the request stream broke: {0}")]
    Broken(BoxError),
    /// Every byte of the read budget is held by other requests.
    #[error("the request messages in progress hold the whole read budget")]
    OverBudget,
}

/// Reads the whole request message before the call goes on to admission,
/// within a time and size bound, so that a stalled or slow client holds no
/// admission slot (a unary call's message is small; buffering it costs
/// nothing the handler would not allocate anyway).
#[derive(Clone)]
struct ReadBody<S> {
    inner: S,
    read_timeout: Duration,
    max_bytes: usize,
    /// One permit per byte of request messages held (see
    /// [`GuardConfig::read_budget_bytes`]).
    budget: Arc<Semaphore>,
}

type ReadFuture = Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send>>;

impl<S> Service<http::Request<Body>> for ReadBody<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = BoxError>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = ReadFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Readiness of the layers below (admission) is asked only once the
        // message is in, by `oneshot`.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> ReadFuture {
        let inner = self.inner.clone();
        let (read_timeout, max_bytes) = (self.read_timeout, self.max_bytes);
        let budget = Arc::clone(&self.budget);
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let mut held = budget.clone().try_acquire_many_owned(0).ok();
            let read = tokio::time::timeout(read_timeout, async {
                let mut body = Limited::new(body, max_bytes);
                let mut message = bytes::BytesMut::new();
                while let Some(frame) = body.frame().await {
                    let Ok(chunk) = frame?.into_data() else {
                        continue; // trailers: a unary request has none to keep
                    };
                    // Taken as the bytes arrive, never waited for: a full
                    // budget is an overload to shed, not a queue.
                    let bytes = u32::try_from(chunk.len()).unwrap_or(u32::MAX);
                    let more = budget
                        .clone()
                        .try_acquire_many_owned(bytes)
                        .map_err(|_| BoxError::from(Unread::OverBudget))?;
                    match held.as_mut() {
                        Some(permit) => permit.merge(more),
                        None => held = Some(more),
                    }
                    message.extend_from_slice(&chunk);
                }
                Ok::<_, BoxError>(message.freeze())
            });
            let message = match read.await {
                Err(_) => return Err(Unread::TooSlow.into()),
                Ok(Err(error)) if error.is::<LengthLimitError>() => {
                    return Err(Unread::TooLarge.into())
                }
                Ok(Err(error)) if error.is::<Unread>() => return Err(error),
                Ok(Err(error)) => return Err(Unread::Broken(error).into()),
                Ok(Ok(message)) => message,
            };
            let request = http::Request::from_parts(parts, Body::new(Full::new(message)));
            let answer = inner.oneshot(request).await;
            drop(held);
            answer
        })
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    #[test]
    fn method_list_is_the_protos() {
        let set = prost_types::FileDescriptorSet::decode(crate::proto::FILE_DESCRIPTOR_SET)
            .expect("descriptor set");
        let methods: Vec<String> = set
            .file
            .iter()
            .flat_map(|file| &file.service)
            .filter(|service| service.name() == "ClaimAndCommit")
            .flat_map(|service| &service.method)
            .map(|method| method.name().to_owned())
            .collect();
        assert_eq!(methods, METHODS);
    }

    #[test]
    fn only_known_methods_become_labels() {
        assert_eq!(rpc_label("/dedup.v1.ClaimAndCommit/Claim"), "Claim");
        assert_eq!(
            rpc_label("/dedup.v1.ClaimAndCommit/ReleaseBatch"),
            "ReleaseBatch"
        );
        for path in [
            "/dedup.v1.ClaimAndCommit/Claim2",
            "/dedup.v1.ClaimAndCommit/x9f3",
            "/dedup.v1.ClaimAndCommit/",
            "/dedup.v1.ClaimAndCommitX/Claim",
            "/grpc.health.v1.Health/Check",
        ] {
            assert_eq!(rpc_label(path), OTHER_RPC, "{path}");
        }
    }
}
