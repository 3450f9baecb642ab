//! Forwarding to the upstream: the request as it goes out (hop-by-hop
//! headers stripped, HTTP/1.1 or HTTP/2 for gRPC), which failures prove it
//! never left, and the answer's body as it comes back — gathered to be
//! stored, or streamed on within its pauses.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http::{header, HeaderValue, Request, Response, Uri};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use tracing::Instrument;

use super::{
    answer::{client_response, BodyError, Protocol, ProxyBody, Rejection},
    budget::AnswerShare,
    idempotency::end_to_end,
    server::Proxy,
};
use crate::{store::Store, telemetry};

/// Why a forwarded request got no answer head.
pub(super) enum ForwardError {
    /// The request never left: no connection to the upstream could be made.
    Unsent(String),
    /// It may have reached the upstream.
    MaybeSent(String),
}

/// An upstream answer's body, read up to `--max-response-bytes`.
pub(super) enum Gathered {
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

/// Whether an HTTP/2 upstream reset the stream with REFUSED_STREAM, which
/// says the request was not processed at all (RFC 9113 §8.7): it may be
/// sent again. (A GOAWAY is not taken as such: the error a stream gets
/// does not say whether its ID was above the GOAWAY's last stream ID.)
pub(super) fn refused_stream(error: &hyper_util::client::legacy::Error) -> bool {
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

/// What was read of an answer, then the rest as it arrives; a pause longer
/// than `idle` ends it with an error (the client sees the answer cut off).
pub(super) fn read_then_rest(read: Bytes, rest: Incoming, idle: Duration) -> ProxyBody {
    let first = futures_util::stream::iter([Ok::<_, BodyError>(Frame::data(read))]);
    let more = within_pauses(rest, idle, BodyError::Paused);
    BodyExt::boxed(StreamBody::new(futures_util::StreamExt::chain(first, more)))
}

/// A request body streamed through (no key): a client that pauses longer
/// than `idle` between frames is cut off, as a keyed body past its deadline
/// is — it held a connection and an upstream request open for as long as
/// it liked. Its end and size still show (a request without a body must
/// not go upstream chunked). Not for gRPC calls: a streaming call may be
/// idle by design.
pub(super) fn streamed_request(body: Incoming, idle: Duration, protocol: Protocol) -> ProxyBody {
    match protocol {
        Protocol::Grpc => body.map_err(BodyError::from).boxed(),
        Protocol::Http => PausesBounded {
            body,
            idle,
            pause: Box::pin(tokio::time::sleep(idle)),
        }
        .boxed(),
    }
}

/// A client's body whose frames may not pause longer than `idle`.
struct PausesBounded {
    body: Incoming,
    idle: Duration,
    pause: Pin<Box<tokio::time::Sleep>>,
}

impl hyper::body::Body for PausesBounded {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match Pin::new(&mut self.body).poll_frame(context) {
            Poll::Ready(frame) => {
                let next = tokio::time::Instant::now() + self.idle;
                self.pause.as_mut().reset(next);
                Poll::Ready(frame.map(|frame| frame.map_err(BodyError::from)))
            }
            Poll::Pending => match self.pause.as_mut().poll(context) {
                Poll::Ready(()) => Poll::Ready(Some(Err(BodyError::ClientPaused))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// `body`'s frames as they arrive; a pause longer than `idle` ends it with
/// `paused`.
pub(super) fn within_pauses(
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

pub(super) fn strip_hop_by_hop(headers: &mut http::HeaderMap) {
    let kept = end_to_end(headers);
    headers.clear();
    for (name, value) in kept {
        headers.append(name, value);
    }
}

impl<S: Store> Proxy<S> {
    /// Forwards the request as it is, streaming both ways (trailers too).
    pub(super) async fn pass_through(
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

    pub(super) async fn forward(
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

    /// Reads an answer's body up to `--max-response-bytes`, by `deadline`,
    /// holding its bytes' share of the proxy's budget; when the budget is
    /// spent, what was read streams on like a long answer.
    pub(super) async fn gather(
        &self,
        mut body: Incoming,
        deadline: tokio::time::Instant,
    ) -> Gathered {
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
}
