//! The trivial HTTP service the proxy is measured in front of
//! (`dedupd-bench http-upstream`): HTTP/1.1 with keep-alive, it reads the
//! request body, spends `--work` of CPU and answers `201 {"call":N}` — or,
//! with `?bytes=N`, N bytes generated as they are sent (a large answer,
//! streamed). `GET /calls` answers how many other requests it has served,
//! so a benchmark can show which requests reached it (replays must not).

use std::{
    convert::Infallible,
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::{body::Bytes, server::conn::http1, service::service_fn, Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// Serves until `shutdown` completes; connections in progress are dropped.
pub async fn serve(
    listener: TcpListener,
    work: Duration,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let calls = Arc::new(AtomicU64::new(0));
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted?,
            () = &mut shutdown => return Ok(()),
        };
        stream.set_nodelay(true)?;
        let calls = Arc::clone(&calls);
        tokio::spawn(async move {
            let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                let calls = Arc::clone(&calls);
                async move {
                    if request.uri().path() == "/calls" {
                        let count = calls.load(Ordering::Relaxed);
                        return Ok::<_, Infallible>(json(200, format!("{{\"calls\":{count}}}")));
                    }
                    let call = calls.fetch_add(1, Ordering::Relaxed) + 1;
                    let large = request
                        .uri()
                        .query()
                        .and_then(|query| query.strip_prefix("bytes="))
                        .and_then(|bytes| bytes.parse::<usize>().ok());
                    // Read the body as a real service would.
                    let _ = request.into_body().collect().await;
                    let started = Instant::now();
                    while started.elapsed() < work {
                        std::hint::spin_loop();
                    }
                    Ok(match large {
                        Some(bytes) => generated(bytes),
                        None => json(201, format!("{{\"call\":{call}}}")),
                    })
                }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn json(status: u16, body: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)).boxed())
        .expect("a valid response")
}

/// `bytes` bytes in 64 KiB chunks, each made when it is sent.
fn generated(bytes: usize) -> Response<Body> {
    Response::builder()
        .status(201)
        .header("content-type", "application/octet-stream")
        .body(Generated { left: bytes }.boxed())
        .expect("a valid response")
}

/// A body of `left` more bytes, made a chunk at a time as hyper asks.
struct Generated {
    left: usize,
}

impl hyper::body::Body for Generated {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        const CHUNK: usize = 64 << 10;
        if self.left == 0 {
            return std::task::Poll::Ready(None);
        }
        let size = CHUNK.min(self.left);
        self.left -= size;
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from(vec![
            b'x';
            size
        ])))))
    }
}
