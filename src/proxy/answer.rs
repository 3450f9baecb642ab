//! What the proxy answers: its own refusals (RFC 9457 problems for HTTP
//! clients, trailers-only statuses for gRPC ones), replays of stored
//! answers, and the bodies and headers every answer is built from.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Method, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::Frame;
use serde_json::json;

use super::{
    forward::strip_hop_by_hop,
    idempotency::{may_store, Stored},
    server::{EXPIRES, REPLAYABLE, REPLAYED},
};

/// Why a body broke off (a concrete type: hyper's server bounds are not
/// met by a boxed `dyn Error` inside a spawned connection).
#[derive(Debug, thiserror::Error)]
pub(super) enum BodyError {
    #[error(transparent)]
    Hyper(#[from] hyper::Error),
    #[error("the upstream paused longer than the upstream timeout")]
    Paused,
    #[error("the client paused its request body longer than the header timeout")]
    ClientPaused,
    #[error("the client sent its request body slower than {0} bytes a second")]
    ClientTooSlow(u64),
    #[error("the client made no room for its answer in time")]
    AnswerUntaken,
}

pub(super) type ProxyBody = BoxBody<Bytes, BodyError>;

/// What a request speaks, which decides how the proxy answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Protocol {
    Http,
    Grpc,
}

impl Protocol {
    pub(super) fn of(headers: &http::HeaderMap) -> Protocol {
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

/// The longest `Retry-After` suggested while a key's first request runs.
pub(super) const IN_FLIGHT_RETRY: Duration = Duration::from_secs(1);

/// Every answer the proxy gives itself, instead of the upstream's.
#[derive(Debug)]
pub(super) enum Rejection {
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
    pub(super) fn result(&self) -> &'static str {
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
    pub(super) fn response(self, protocol: Protocol) -> Response<ProxyBody> {
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

/// A response and what it was, for the metrics.
pub(super) struct Answer {
    pub(super) response: Response<ProxyBody>,
    pub(super) result: &'static str,
    /// Time spent waiting for the upstream (not added by the proxy).
    pub(super) upstream: Duration,
}

impl Answer {
    pub(super) fn new(response: Response<ProxyBody>, result: &'static str) -> Answer {
        Answer {
            response,
            result,
            upstream: Duration::ZERO,
        }
    }

    pub(super) fn rejected(rejection: Rejection, protocol: Protocol) -> Answer {
        let result = rejection.result();
        Answer::new(rejection.response(protocol), result)
    }
}

/// `idempotency-replayable: false` on an answer whose record could not be
/// stored.
pub(super) fn mark_unstored(response: &mut Response<ProxyBody>, stored: bool) {
    if !stored {
        response
            .headers_mut()
            .insert(REPLAYABLE, HeaderValue::from_static("false"));
    }
}

pub(super) fn replay(
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
pub(super) fn grpc_status(
    headers: &http::HeaderMap,
    trailers: Option<&http::HeaderMap>,
) -> Option<u32> {
    trailers
        .and_then(|trailers| trailers.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"))
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok())
}

/// How many length-prefixed gRPC messages `body` holds.
pub(super) fn grpc_messages(body: &[u8]) -> usize {
    let mut rest = body;
    let mut count = 0;
    while rest.len() >= 5 {
        let length = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        rest = rest.get(5 + length..).unwrap_or_default();
        count += 1;
    }
    count
}

pub(super) fn full(body: impl Into<Bytes>) -> ProxyBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A body of `data`, then `trailers` if any.
pub(super) fn body_with_trailers(data: Bytes, trailers: Option<http::HeaderMap>) -> ProxyBody {
    let Some(trailers) = trailers else {
        return full(data);
    };
    let frames = [Ok(Frame::data(data)), Ok(Frame::trailers(trailers))];
    StreamBody::new(futures_util::stream::iter(frames)).boxed()
}

/// The upstream's response as the client's: hyper writes an HTTP/1 status
/// line with the response's version, and the upstream's (say HTTP/1.0) is
/// not the client connection's; connection headers are the proxy's own.
pub(super) fn client_response(mut response: Response<ProxyBody>) -> Response<ProxyBody> {
    *response.version_mut() = http::Version::default();
    strip_hop_by_hop(response.headers_mut());
    response
}

/// An RFC 9457 problem document.
pub(super) fn problem_response(
    status: StatusCode,
    kind: &str,
    detail: &str,
) -> Response<ProxyBody> {
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
pub(super) fn grpc_status_response(code: tonic::Code, message: &str) -> Response<ProxyBody> {
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
