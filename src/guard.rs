//! The tower layer in front of every gRPC call: the bearer-token check,
//! admission (a concurrency limit that sheds load instead of queueing), the
//! request timeout, and per-RPC latency metrics. Rejections are answered as
//! gRPC statuses a client can act on.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;
use tonic::Status;
use tower::{Layer, Service};

use crate::metrics::Metrics;

const SERVICE_PREFIX: &str = "/dedup.v1.ClaimAndCommit/";
const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";
const FORGET_PATH: &str = "/dedup.v1.ClaimAndCommit/Forget";

/// The bearer tokens clients must present. Never logged.
#[derive(Clone)]
pub struct Tokens {
    client: Arc<[u8]>,
    admin: Option<Arc<[u8]>>,
}

impl Tokens {
    /// `client` opens every call; `admin` also opens `Forget` (without it,
    /// nobody may call `Forget`).
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

/// What the guard enforces.
#[derive(Debug, Clone)]
pub struct GuardConfig {
    /// Tokens, when calls must be authenticated.
    pub tokens: Option<Tokens>,
    /// Calls in progress at once; more are refused with RESOURCE_EXHAUSTED.
    pub max_concurrent_requests: usize,
    /// Longest a call may take; longer ones are answered UNAVAILABLE.
    pub request_timeout: Duration,
}

/// The guard layer.
#[derive(Debug, Clone)]
pub struct GuardLayer {
    shared: Arc<Shared>,
}

struct Shared {
    tokens: Option<Tokens>,
    permits: Arc<Semaphore>,
    max_concurrent_requests: usize,
    request_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("tokens", &self.tokens)
            .field("max_concurrent_requests", &self.max_concurrent_requests)
            .field("request_timeout", &self.request_timeout)
            .finish()
    }
}

impl GuardLayer {
    /// A guard enforcing `config`, timing calls into `metrics`.
    pub fn new(config: &GuardConfig, metrics: Arc<Metrics>) -> Self {
        GuardLayer {
            shared: Arc::new(Shared {
                tokens: config.tokens.clone(),
                permits: Arc::new(Semaphore::new(config.max_concurrent_requests)),
                max_concurrent_requests: config.max_concurrent_requests,
                request_timeout: config.request_timeout,
                metrics,
            }),
        }
    }
}

impl<S> Layer<S> for GuardLayer {
    type Service = Guard<S>;

    fn layer(&self, inner: S) -> Guard<S> {
        Guard {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// The guard around one service.
#[derive(Debug, Clone)]
pub struct Guard<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl Shared {
    fn authorize<B>(&self, request: &http::Request<B>) -> Result<(), Status> {
        let Some(tokens) = &self.tokens else {
            return Ok(());
        };
        let path = request.uri().path();
        if path.starts_with(HEALTH_PREFIX) {
            return Ok(()); // probes carry no token
        }
        let presented = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .map(str::as_bytes);
        let Some(presented) = presented else {
            return Err(Status::unauthenticated(
                "missing bearer token: send `authorization: Bearer <token>`",
            ));
        };
        let admin = tokens
            .admin
            .as_ref()
            .is_some_and(|admin| matches(presented, admin));
        if path == FORGET_PATH && !admin {
            return Err(Status::permission_denied("Forget needs the admin token"));
        }
        if admin || matches(presented, &tokens.client) {
            Ok(())
        } else {
            Err(Status::unauthenticated("invalid bearer token"))
        }
    }
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B> Service<http::Request<B>> for Guard<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        // The service that was polled ready handles this call.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            if let Err(status) = shared.authorize(&request) {
                return Ok(status.into_http());
            }
            let Ok(_permit) = Arc::clone(&shared.permits).try_acquire_owned() else {
                return Ok(Status::resource_exhausted(format!(
                    "overloaded: {} calls in progress (--max-concurrent-requests); retry with backoff",
                    shared.max_concurrent_requests
                ))
                .into_http());
            };
            let rpc = request
                .uri()
                .path()
                .strip_prefix(SERVICE_PREFIX)
                .map(str::to_owned);
            let started = Instant::now();
            let answer = match tokio::time::timeout(shared.request_timeout, inner.call(request)).await {
                Ok(answer) => answer,
                Err(_) => Ok(Status::unavailable(format!(
                    "no answer within {} (--request-timeout); the change may or may not have been applied: retry",
                    humantime::format_duration(shared.request_timeout)
                ))
                .into_http()),
            };
            if let Some(rpc) = rpc {
                shared.metrics.rpc(&rpc, started.elapsed());
            }
            answer
        })
    }
}
