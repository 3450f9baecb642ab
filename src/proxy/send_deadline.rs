//! HTTP/2 answers under the deadline HTTP/1 answers get from
//! [`crate::listen::WriteDeadline`]: a stream whose client makes no room for
//! its answer is reset.
//!
//! Over HTTP/2 the socket never blocks for one stream — flow control holds
//! it back instead. A client that grants no window (an initial window of 0
//! and never a WINDOW_UPDATE) left hyper holding the stream's task, the
//! answer's next chunk and the rest of the answer for good: 128 streams a
//! connection, each with up to `--http-proxy-max-response-bytes` gathered,
//! and a graceful close that waited for them forever.
//!
//! hyper runs each HTTP/2 stream as a task spawned on the connection's
//! executor ([`StreamExecutor`]). The answer's body ([`watched`]) tells that
//! task when it handed hyper a frame and when hyper came back for the next
//! one: hyper comes back only once the client made room for what it holds.
//! The time frames wait for room is held to a pace, as an unkeyed request
//! body's is: the header timeout, plus a second for every
//! [`MIN_BODY_RATE`] bytes the client made room for. Past it the task is
//! dropped, and h2 resets the stream (CANCEL) and frees what it had queued
//! — once the request's body is let go of too, which is why a request body
//! streamed upstream ([`watched_request`]) fails at the same moment.
//!
//! Frames are handed in slices of at most [`SLICE`] bytes, and the last
//! byte of each chunk on its own: hyper asks for the next frame only when
//! the client made room for all it holds, so the stream's task ends only
//! once the whole answer fits the client's window — never with a chunk left
//! queued in h2 for a client that opened its window by a byte.
//!
//! A client reading slowly but at the pace keeps its stream, however long
//! the answer; one that stops reading altogether is cut after the header
//! timeout, as over HTTP/1.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Buf, Bytes};
use futures_util::task::AtomicWaker;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use super::{
    answer::{BodyError, ProxyBody},
    forward::MIN_BODY_RATE,
};

/// The largest frame handed to hyper at once: HTTP/2's default frame size.
const SLICE: usize = 16 << 10;

tokio::task_local! {
    /// The progress of the HTTP/2 stream whose task this is.
    static STREAM: Arc<SendProgress>;
}

/// How an HTTP/2 stream's answer is taken by its client, and whether the
/// stream was given up on.
#[derive(Debug, Default)]
struct SendProgress {
    pace: Mutex<Pace>,
    /// Set when the stream is given up on: its request body fails.
    cancelled: AtomicBool,
    /// The request body's reader, woken when the stream is given up on.
    request_reader: AtomicWaker,
}

#[derive(Debug, Default, Clone, Copy)]
struct Pace {
    /// When the frame hyper holds was handed to it (`None`: hyper is
    /// waiting for the body, whose own deadlines bound that, or the body
    /// has not started).
    handed_at: Option<Instant>,
    /// Its size.
    handed: u64,
    /// The bytes the client made room for so far.
    taken: u64,
    /// The time frames waited for room so far.
    waited: Duration,
}

impl Pace {
    /// When the frame hyper holds has waited too long, if it holds one.
    fn deadline(&self, stall: Duration) -> Option<Instant> {
        let earned = Duration::from_secs_f64(self.taken as f64 / MIN_BODY_RATE as f64);
        let allowance = (stall + earned).saturating_sub(self.waited);
        self.handed_at.map(|handed_at| handed_at + allowance)
    }
}

impl SendProgress {
    fn pace(&self) -> std::sync::MutexGuard<'_, Pace> {
        // Poisoning is impossible (nothing panics while holding it), and
        // the value is plain counters either way.
        self.pace
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// hyper asks for a frame: the one it held was made room for.
    fn asked(&self) {
        let mut pace = self.pace();
        if let Some(handed_at) = pace.handed_at.take() {
            pace.waited += handed_at.elapsed();
            pace.taken = pace.taken.saturating_add(pace.handed);
        }
    }

    fn handed(&self, bytes: usize) {
        let mut pace = self.pace();
        pace.handed_at = Some(Instant::now());
        pace.handed = bytes as u64;
    }

    fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.request_reader.wake();
    }
}

/// The proxy listener's executor: runs each HTTP/2 stream's task, and
/// drops one whose client makes no room for its answer at the pace, with
/// `stall` to start with.
#[derive(Debug, Clone, Copy)]
pub(super) struct StreamExecutor {
    pub(super) stall: Duration,
}

impl<F> hyper::rt::Executor<F> for StreamExecutor
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, stream: F) {
        tokio::spawn(watch(stream, self.stall));
    }
}

/// Runs `stream` until it ends, or until a frame it handed has waited for
/// the client past the pace.
async fn watch(stream: impl Future<Output = ()>, stall: Duration) {
    let progress = Arc::new(SendProgress::default());
    let stream = STREAM.scope(Arc::clone(&progress), stream);
    tokio::pin!(stream);
    let check = tokio::time::sleep(stall);
    tokio::pin!(check);
    loop {
        tokio::select! {
            () = &mut stream => return,
            () = &mut check => {
                let now = Instant::now();
                let deadline = progress.pace().deadline(stall);
                match deadline {
                    Some(deadline) if deadline <= now => {
                        tracing::debug!(
                            stall = %humantime::format_duration(stall),
                            "an HTTP/2 client made no room for its answer in time; resetting the stream"
                        );
                        progress.cancel();
                        return;
                    }
                    Some(deadline) => check.as_mut().reset(deadline),
                    None => check.as_mut().reset(now + stall),
                }
            }
        }
    }
}

/// `body`, reporting its progress to the HTTP/2 stream it is the answer of,
/// in slices; as it is elsewhere (HTTP/1 connections have their socket's
/// write deadline).
pub(super) fn watched(body: ProxyBody) -> ProxyBody {
    match STREAM.try_with(Arc::clone) {
        Ok(progress) => Watched {
            body,
            rest: Bytes::new(),
            progress,
        }
        .boxed(),
        Err(_) => body,
    }
}

/// A request body streamed upstream, failing once its HTTP/2 stream is
/// given up on (the client made no room for the answer): until it is let
/// go of, h2 keeps the stream, and the upstream call goes on.
pub(super) fn watched_request(body: ProxyBody) -> ProxyBody {
    match STREAM.try_with(Arc::clone) {
        Ok(progress) => GivenUp { body, progress }.boxed(),
        Err(_) => body,
    }
}

struct Watched {
    body: ProxyBody,
    /// What is left of the chunk being handed on.
    rest: Bytes,
    progress: Arc<SendProgress>,
}

impl Watched {
    /// The next slice of `rest`: at most [`SLICE`], and the chunk's last
    /// byte alone.
    fn slice(&mut self) -> Bytes {
        let take = match self.rest.len() {
            len if len > SLICE => SLICE,
            len if len > 1 => len - 1,
            len => len,
        };
        self.rest.split_to(take)
    }
}

impl Body for Watched {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.progress.asked();
        if self.rest.is_empty() {
            match Pin::new(&mut self.body).poll_frame(context) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => self.rest = data,
                    Ok(empty) => return Poll::Ready(Some(Ok(Frame::data(empty)))),
                    Err(trailers) => {
                        self.progress.handed(0);
                        return Poll::Ready(Some(Ok(trailers)));
                    }
                },
                Poll::Ready(ended) => return Poll::Ready(ended),
            }
        }
        let slice = self.slice();
        self.progress.handed(slice.len());
        Poll::Ready(Some(Ok(Frame::data(slice))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.body.size_hint();
        let rest = self.rest.remaining() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(rest));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint
    }
}

struct GivenUp {
    body: ProxyBody,
    progress: Arc<SendProgress>,
}

impl Body for GivenUp {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.progress.request_reader.register(context.waker());
        if self.progress.cancelled.load(Ordering::SeqCst) {
            return Poll::Ready(Some(Err(BodyError::AnswerUntaken)));
        }
        Pin::new(&mut self.body).poll_frame(context)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    /// Slices of at most [`SLICE`], the last byte alone, in order, all of
    /// it; the size hint counts what is left.
    #[tokio::test]
    async fn large_frames_are_handed_in_slices_and_the_last_byte_alone() {
        let whole: Vec<u8> = (0..(SLICE * 2 + 100)).map(|i| i as u8).collect();
        let body = Full::new(Bytes::from(whole.clone()))
            .map_err(|never| match never {})
            .boxed();
        let progress = Arc::new(SendProgress::default());
        let mut sizes = Vec::new();
        let mut read = Vec::new();
        STREAM
            .scope(Arc::clone(&progress), async {
                let mut body = watched(body);
                assert_eq!(body.size_hint().exact(), Some(whole.len() as u64));
                while let Some(frame) = body.frame().await {
                    let data = frame.unwrap().into_data().unwrap();
                    sizes.push(data.len());
                    read.extend_from_slice(&data);
                    // Handed, not yet come back for.
                    assert!(progress.pace().handed_at.is_some());
                }
            })
            .await;
        assert_eq!(sizes, [SLICE, SLICE, 99, 1]);
        assert_eq!(read, whole);
    }

    /// A reader that makes room at the pace (8 KiB every 8 s: 1 KiB/s)
    /// keeps its stream well past the stall; once it stops, the stream's
    /// task ends when the frame it holds has waited what the pace allows,
    /// and a request body streamed upstream fails with it.
    #[tokio::test(start_paused = true)]
    async fn a_stream_is_held_to_the_pace_and_dropped_when_its_client_stops() {
        let stall = Duration::from_secs(10);
        let (frames, receive) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BodyError>>(8);
        let source =
            http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(receive));
        for _ in 0..4 {
            frames
                .send(Ok(Frame::data(Bytes::from(vec![b'x'; 8 << 10]))))
                .await
                .unwrap();
        }
        let (_keep_open, request) =
            tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BodyError>>(1);
        let request =
            http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(request));
        let (taken, mut count) = tokio::sync::mpsc::unbounded_channel();
        let (request_failed, failed) = tokio::sync::oneshot::channel();
        let started = Instant::now();
        let stream = async move {
            let mut request = watched_request(request.boxed());
            tokio::spawn(async move {
                let _ = request_failed.send(request.frame().await.map(|frame| frame.is_err()));
            });
            let mut body = watched(source.boxed());
            for _ in 0..6 {
                body.frame().await.unwrap().unwrap();
                taken.send(()).unwrap();
                tokio::time::sleep(Duration::from_secs(4)).await;
            }
            body.frame().await.unwrap().unwrap();
            taken.send(()).unwrap();
            std::future::pending::<()>().await;
        };
        watch(stream, stall).await;
        let mut frames_taken = 0;
        while count.try_recv().is_ok() {
            frames_taken += 1;
        }
        assert_eq!(frames_taken, 7);
        // The seventh frame, handed at 24 s after 24 s of waiting for 24 KiB
        // of room, had the stall left: 10 s.
        assert_eq!(started.elapsed(), Duration::from_secs(34));
        assert_eq!(failed.await.unwrap(), Some(true), "the request body failed");
    }
}
