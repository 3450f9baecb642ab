//! HTTP/2 answers under the deadline HTTP/1 answers get from
//! [`crate::listen::WriteDeadline`]: a stream whose client makes no room
//! for its answer within `--http-proxy-header-timeout` is reset.
//!
//! Over HTTP/2 the socket never blocks for one stream — flow control holds
//! it back instead. A client that grants no window (an initial window of 0
//! and never a WINDOW_UPDATE) leaves hyper holding the stream's task, the
//! answer's next chunk and the rest of the answer for good: 128 streams a
//! connection, each with up to `--http-proxy-max-response-bytes` gathered,
//! and a graceful close that waits for them forever.
//!
//! hyper runs each HTTP/2 stream as a task spawned on the connection's
//! executor ([`StreamExecutor`]). The answer's body ([`watched`]) tells that
//! task when it handed hyper a frame and when hyper came back for the next
//! one; hyper comes back only once the client made room for the frame it
//! holds. A frame not followed by a request for the next within the
//! deadline is a client that made no progress: the task is dropped, and h2
//! resets the stream (CANCEL) and frees what it had queued for it. Frames
//! are handed in slices of at most [`SLICE`] bytes, so that "no room for a
//! frame" means no progress, not a large answer read at a modest pace.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Buf, Bytes};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use super::answer::{BodyError, ProxyBody};

/// The largest frame handed to hyper at once: HTTP/2's default frame size.
const SLICE: usize = 16 << 10;

tokio::task_local! {
    /// The progress of the HTTP/2 stream whose task this is.
    static STREAM: Arc<SendProgress>;
}

/// When the stream's body last handed hyper a frame that hyper has not
/// come back after (`None`: hyper is waiting for the body, whose own
/// deadlines bound that, or the body has not started).
#[derive(Debug, Default)]
struct SendProgress(Mutex<Option<Instant>>);

impl SendProgress {
    fn set(&self, handed_at: Option<Instant>) {
        // Poisoning is impossible (no code panics while holding it), and
        // the value is a plain timestamp either way.
        *self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = handed_at;
    }

    fn handed_at(&self) -> Option<Instant> {
        *self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The proxy listener's executor: runs each HTTP/2 stream's task, and
/// drops one whose client made no room for its answer within `stall`.
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

/// Runs `stream` until it ends, or until a frame it handed has waited
/// longer than `stall` for the client.
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
                match progress.handed_at() {
                    Some(handed_at) if now.duration_since(handed_at) >= stall => {
                        tracing::debug!(
                            stall = %humantime::format_duration(stall),
                            "an HTTP/2 client made no room for its answer in time; resetting the stream"
                        );
                        return;
                    }
                    Some(handed_at) => check.as_mut().reset(handed_at + stall),
                    None => check.as_mut().reset(now + stall),
                }
            }
        }
    }
}

/// `body`, reporting its progress to the HTTP/2 stream it is the answer of
/// and sliced to [`SLICE`]; as it is elsewhere (HTTP/1 connections have
/// their socket's write deadline).
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

struct Watched {
    body: ProxyBody,
    /// What is left of a frame larger than [`SLICE`].
    rest: Bytes,
    progress: Arc<SendProgress>,
}

impl Body for Watched {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        // hyper asks: the frame handed before has been made room for.
        self.progress.set(None);
        let frame = if self.rest.is_empty() {
            match Pin::new(&mut self.body).poll_frame(context) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(mut data) if data.len() > SLICE => {
                        self.rest = data.split_off(SLICE);
                        Frame::data(data)
                    }
                    Ok(data) => Frame::data(data),
                    Err(frame) => frame,
                },
                Poll::Ready(ended) => return Poll::Ready(ended),
            }
        } else {
            let take = self.rest.len().min(SLICE);
            Frame::data(self.rest.split_to(take))
        };
        self.progress.set(Some(Instant::now()));
        Poll::Ready(Some(Ok(frame)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    /// Slices of at most [`SLICE`], in order, all of it; the size hint
    /// counts what is left.
    #[tokio::test]
    async fn large_frames_are_handed_in_slices() {
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
                    assert!(progress.handed_at().is_some());
                }
            })
            .await;
        assert_eq!(sizes, [SLICE, SLICE, 100]);
        assert_eq!(read, whole);
    }

    /// A frame hyper never comes back after ends the stream's task at
    /// `stall`; one it comes back after in time does not.
    #[tokio::test(start_paused = true)]
    async fn a_stream_whose_frame_is_not_taken_is_dropped_at_the_stall() {
        let stall = Duration::from_secs(10);
        let (frames, receive) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BodyError>>(4);
        let source =
            http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(receive));
        let (taken, mut count) = tokio::sync::mpsc::unbounded_channel();
        let started = Instant::now();
        let stream = async move {
            let mut body = watched(source.boxed());
            // A reader that takes a frame every 8 s, twice, then stops.
            for _ in 0..2 {
                body.frame().await.unwrap().unwrap();
                taken.send(()).unwrap();
                tokio::time::sleep(Duration::from_secs(8)).await;
            }
            body.frame().await.unwrap().unwrap();
            taken.send(()).unwrap();
            std::future::pending::<()>().await;
        };
        for _ in 0..3 {
            frames
                .send(Ok(Frame::data(Bytes::from_static(b"x"))))
                .await
                .unwrap();
        }
        watch(stream, stall).await;
        let mut frames_taken = 0;
        while count.try_recv().is_ok() {
            frames_taken += 1;
        }
        assert_eq!(frames_taken, 3);
        // The third frame, handed at 16 s, waited the whole stall.
        assert_eq!(started.elapsed(), Duration::from_secs(26));
    }
}
