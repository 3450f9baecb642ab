//! The trivial HTTP service the proxy is measured in front of
//! (`dedupd-bench http-upstream`): HTTP/1.1 with keep-alive, it reads the
//! request body, spends `--work` of CPU and answers `201 {"call":N}`. `GET /calls` answers how many
//! other requests it has served, so a benchmark can show which requests
//! reached it (replays must not).

use std::{
    convert::Infallible,
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use http_body_util::{BodyExt, Full};
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
                    // Read the body as a real service would.
                    let _ = request.into_body().collect().await;
                    let started = Instant::now();
                    while started.elapsed() < work {
                        std::hint::spin_loop();
                    }
                    Ok(json(201, format!("{{\"call\":{call}}}")))
                }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn json(status: u16, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("a valid response")
}
