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
use http_body_util::BodyExt;
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
    PausesBounded::new(Some(read), rest, idle, || BodyError::Paused).boxed()
}

/// The least pace an unkeyed request body must keep once its first
/// `--http-proxy-body-timeout` has passed: each KiB received buys another
/// second (Apache's `mod_reqtimeout` MinRate, 500 B/s by default).
pub(super) const MIN_BODY_RATE: u64 = 1 << 10;

/// A request body streamed through (no key): a client that pauses longer
/// than `idle` between frames, or whose body falls below [`MIN_BODY_RATE`]
/// once `grace` has passed, is cut off, as a keyed body past its deadline
/// is — a pause of a second now and then held its connection and the
/// upstream's request open for as long as it liked. An upload at any
/// reasonable pace, however large, goes through. Its end and size still
/// show (a request without a body must not go upstream chunked). Not for
/// gRPC calls: a streaming call may be idle by design.
pub(super) fn streamed_request(
    body: Incoming,
    idle: Duration,
    grace: Duration,
    protocol: Protocol,
) -> ProxyBody {
    match protocol {
        Protocol::Grpc => body.map_err(BodyError::from).boxed(),
        Protocol::Http => PausesBounded::new(
            None,
            PaceBounded::new(body, grace, MIN_BODY_RATE),
            idle,
            || BodyError::ClientPaused,
        )
        .boxed(),
    }
}

/// A body whose source may take `grace`, plus a second for every `rate`
/// bytes it gave, counting only the time it was asked for a frame it had
/// not given yet: a reader that is itself slow (an upstream reading an
/// upload at its own pace) does not count against the client.
struct PaceBounded<B> {
    body: B,
    grace: Duration,
    rate: u64,
    received: u64,
    /// The time spent waiting for the source so far.
    waited: Duration,
    /// When the frame being waited for was asked for.
    asked_at: Option<tokio::time::Instant>,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl<B> PaceBounded<B> {
    fn new(body: B, grace: Duration, rate: u64) -> Self {
        PaceBounded {
            body,
            grace,
            rate,
            received: 0,
            waited: Duration::ZERO,
            asked_at: None,
            deadline: Box::pin(tokio::time::sleep(grace)),
        }
    }

    /// The waiting the source has left.
    fn allowance(&self) -> Duration {
        let earned = Duration::from_secs_f64(self.received as f64 / self.rate as f64);
        (self.grace + earned).saturating_sub(self.waited)
    }
}

impl<B> hyper::body::Body for PaceBounded<B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BodyError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let asked_at = match self.asked_at {
            Some(asked_at) => asked_at,
            None => {
                let now = tokio::time::Instant::now();
                let until = now + self.allowance();
                self.deadline.as_mut().reset(until);
                self.asked_at = Some(now);
                now
            }
        };
        match Pin::new(&mut self.body).poll_frame(context) {
            Poll::Ready(frame) => {
                self.waited += asked_at.elapsed();
                self.asked_at = None;
                if let Some(data) = frame.as_ref().and_then(|f| f.as_ref().ok()?.data_ref()) {
                    self.received = self.received.saturating_add(data.len() as u64);
                }
                Poll::Ready(frame.map(|frame| frame.map_err(Into::into)))
            }
            Poll::Pending => match self.deadline.as_mut().poll(context) {
                Poll::Ready(()) => Poll::Ready(Some(Err(BodyError::ClientTooSlow(self.rate)))),
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

/// A body (after `first`, if any) whose source may not pause longer than
/// `idle` while it is asked for its next frame: the time counts from when
/// it is asked, so a reader that is itself slow (a client not reading, an
/// upstream pushing back) is not taken for a pause of the source.
struct PausesBounded<B> {
    first: Option<Bytes>,
    body: B,
    idle: Duration,
    pause: Pin<Box<tokio::time::Sleep>>,
    /// Asked for a frame the source has not given yet: `pause` runs.
    waiting: bool,
    paused: fn() -> BodyError,
}

impl<B> PausesBounded<B> {
    fn new(first: Option<Bytes>, body: B, idle: Duration, paused: fn() -> BodyError) -> Self {
        PausesBounded {
            first,
            body,
            idle,
            pause: Box::pin(tokio::time::sleep(idle)),
            waiting: false,
            paused,
        }
    }
}

impl<B> hyper::body::Body for PausesBounded<B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BodyError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        if !self.waiting {
            self.waiting = true;
            let until = tokio::time::Instant::now() + self.idle;
            self.pause.as_mut().reset(until);
        }
        match Pin::new(&mut self.body).poll_frame(context) {
            Poll::Ready(frame) => {
                self.waiting = false;
                Poll::Ready(frame.map(|frame| frame.map_err(Into::into)))
            }
            Poll::Pending => match self.pause.as_mut().poll(context) {
                Poll::Ready(()) => Poll::Ready(Some(Err((self.paused)()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match &self.first {
            // As a streamed answer's always was: unknown (the answer keeps
            // its own Content-Length).
            Some(_) => hyper::body::SizeHint::default(),
            None => self.body.size_hint(),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The pause counts from when the next frame is asked for: a reader
    /// that stayed away longer than `idle` is not answered "paused" by a
    /// source that then takes a moment.
    #[tokio::test(start_paused = true)]
    async fn a_pause_counts_from_when_the_next_frame_is_asked_for() {
        let (send, receive) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BodyError>>(4);
        let source =
            http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(receive));
        let idle = Duration::from_millis(500);
        let mut body = PausesBounded::new(Some(Bytes::from_static(b"a")), source, idle, || {
            BodyError::Paused
        });
        assert_eq!(
            body.frame().await.unwrap().unwrap().into_data().unwrap(),
            "a"
        );
        send.send(Ok(Frame::data(Bytes::from_static(b"b"))))
            .await
            .unwrap();
        assert_eq!(
            body.frame().await.unwrap().unwrap().into_data().unwrap(),
            "b"
        );
        // The reader is away for four times `idle`; the source answers
        // 100 ms after it asks again.
        tokio::time::sleep(idle * 4).await;
        let late = send.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            late.send(Ok(Frame::data(Bytes::from_static(b"c"))))
                .await
                .unwrap();
        });
        assert_eq!(
            body.frame().await.unwrap().unwrap().into_data().unwrap(),
            "c"
        );
        // A source that pauses longer than `idle` while asked is cut off.
        let asked = tokio::time::Instant::now();
        assert!(matches!(body.frame().await, Some(Err(BodyError::Paused))));
        assert_eq!(asked.elapsed(), idle);
        drop(send);
    }

    /// A body that trickles (pauses shorter than any idle bound) is cut off
    /// once it falls below the pace after the grace; one at a steady 20 KiB/s
    /// goes on however long it takes.
    #[tokio::test(start_paused = true)]
    async fn a_trickling_body_is_cut_off_and_a_steady_one_is_not() {
        async fn run(chunk: usize, for_how_long: Duration) -> (Option<BodyError>, Duration) {
            let (send, receive) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BodyError>>(1);
            tokio::spawn(async move {
                let started = tokio::time::Instant::now();
                while started.elapsed() < for_how_long {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if send
                        .send(Ok(Frame::data(Bytes::from(vec![b'x'; chunk]))))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
            let source = http_body_util::StreamBody::new(
                tokio_stream::wrappers::ReceiverStream::new(receive),
            );
            let mut body = PaceBounded::new(source, Duration::from_secs(2), MIN_BODY_RATE);
            let started = tokio::time::Instant::now();
            while let Some(frame) = body.frame().await {
                if let Err(error) = frame {
                    return (Some(error), started.elapsed());
                }
            }
            (None, started.elapsed())
        }
        // 200 B/s: 2 s, then what 400-odd bytes bought.
        let (error, at) = run(100, Duration::from_secs(60)).await;
        assert!(
            matches!(error, Some(BodyError::ClientTooSlow(_))),
            "{error:?}"
        );
        assert!(
            at > Duration::from_secs(2) && at < Duration::from_secs(3),
            "{at:?}"
        );
        let (error, at) = run(10 << 10, Duration::from_secs(30)).await;
        assert!(error.is_none(), "{error:?}");
        assert!(at >= Duration::from_secs(30));
        // A source always ready, read by a slow reader (100 bytes every
        // 5 s): the reader's time is not the client's.
        let source = http_body_util::StreamBody::new(futures_util::stream::iter(
            (0..10).map(|_| Ok::<_, BodyError>(Frame::data(Bytes::from(vec![b'x'; 100])))),
        ));
        let mut body = PaceBounded::new(source, Duration::from_secs(2), MIN_BODY_RATE);
        while let Some(frame) = body.frame().await {
            assert!(frame.is_ok(), "a slow reader was taken for a slow client");
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    }
}
