//! The HTTP idempotency proxy's connections, on both sides: the client
//! side's deadlines (heads, bodies, answers left unread, over HTTP/1.1 and
//! HTTP/2), its maximum connection age, the budgets that keep one caller's
//! slow bodies from starving another, shutdown within its grace; and the
//! upstream side's connection reuse and refusals. The proxy runs
//! in-process through the production `serve` (set-up in
//! `tests/common/proxy.rs`).

mod common;

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

use common::proxy::*;

/// Issue 40 item 7: an HTTP/2 connection that stays (answering PINGs,
/// sending nothing more, or nothing at all) is closed at the listener's
/// maximum connection age, as the gRPC listener's is; it was never closed.
#[tokio::test]
async fn an_idle_http2_connection_is_closed_at_its_maximum_age() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.connections.max_connection_age = Duration::from_millis(500);
    })
    .await;
    let stream = tokio::net::TcpStream::connect(proxy.address).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(Duration::from_millis(100))
        .keep_alive_while_idle(true)
        .handshake::<_, Full<Bytes>>(TokioIo::new(stream))
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    let request = Request::post(format!("http://{}/echo", proxy.address))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    assert_eq!(
        sender.send_request(request).await.unwrap().status(),
        StatusCode::OK
    );
    let closed = tokio::time::timeout(Duration::from_secs(5), connection).await;
    assert!(closed.is_ok(), "the connection was still open after 5 s");

    // One that never sends a request at all, only answering PINGs.
    let stream = tokio::net::TcpStream::connect(proxy.address).await.unwrap();
    let (_sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(Duration::from_millis(100))
        .keep_alive_while_idle(true)
        .handshake::<_, Full<Bytes>>(TokioIo::new(stream))
        .await
        .unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(5), connection).await;
    assert!(
        closed.is_ok(),
        "a connection without requests was still open after 5 s"
    );
}

/// A request without a key is streamed both ways, never buffered: each
/// chunk comes back before the next is sent, and the whole (10 MiB) is
/// ten times what a keyed request may carry here.
#[tokio::test]
async fn unkeyed_bodies_stream_through_whatever_their_size() {
    use tokio_stream::StreamExt as _;

    const CHUNK: usize = 64 << 10;
    const CHUNKS: usize = 160;
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let (chunks, receiver) = tokio::sync::mpsc::channel::<Bytes>(1);
    let request_body = http_body_util::StreamBody::new(
        tokio_stream::wrappers::ReceiverStream::new(receiver)
            .map(|chunk| Ok::<_, Infallible>(hyper::body::Frame::data(chunk))),
    );
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<http_body_util::StreamBody<_>>();
    let request = Request::post(format!("http://{}/stream", proxy.address))
        .body(request_body)
        .unwrap();
    let sending = tokio::spawn(client.request(request));
    chunks.send(Bytes::from(vec![0u8; CHUNK])).await.unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), sending)
        .await
        .expect("the response starts before the request body ends")
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut received = 0;
    for sent in 1..=CHUNKS {
        // The next chunk goes only once the last one has come back.
        while received < sent * CHUNK {
            let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
                .await
                .unwrap_or_else(|_| panic!("chunk {sent} did not come back"))
                .expect("more body")
                .unwrap();
            received += frame.data_ref().map_or(0, Bytes::len);
        }
        if sent < CHUNKS {
            chunks
                .send(Bytes::from(vec![sent as u8; CHUNK]))
                .await
                .unwrap();
        }
    }
    drop(chunks);
    assert!(
        body.frame().await.is_none(),
        "the body ends with the request's"
    );
    assert_eq!(received, CHUNK * CHUNKS);
    assert!(
        received > 8 << 20,
        "larger than --http-proxy-max-request-bytes"
    );
    assert_eq!(upstream.calls.get("/stream"), 1);
}

/// Issue 40 item 8: shutdown keeps to `--shutdown-grace`, the time the
/// process exits at — a keyed request still with the service within it
/// settles and is answered, and one that would take longer is not waited
/// for (the proxy used to wait 10 s for connections, then up to the
/// upstream timeout plus a lease, past the grace).
#[tokio::test]
async fn shutdown_keeps_to_the_grace() {
    let upstream = upstream().await;
    for (grace, settles) in [
        (Duration::from_millis(300), false),
        (Duration::from_secs(6), true),
    ] {
        let proxy = proxy_with(&upstream, |config| config.shutdown_grace = grace).await;
        let address = proxy.address;
        let calls_before = upstream.calls.get("/slow");
        // `/slow` answers after 2.5 s.
        let request = tokio::spawn(async move {
            post(address, "/slow", &format!("\"shutdown-{settles}\""), "{}").await
        });
        // Stopped once the service has the request (a loaded machine may
        // take a while to get it there).
        let arrived = Instant::now();
        while upstream.calls.get("/slow") < calls_before + 1
            && arrived.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let began = Instant::now();
        drop(proxy.stop);
        tokio::time::timeout(Duration::from_secs(10), proxy.served)
            .await
            .expect("the proxy stopped")
            .unwrap()
            .unwrap();
        let took = began.elapsed();
        if settles {
            assert!(
                took >= Duration::from_secs(2),
                "{took:?}: the request was not waited for"
            );
            assert!(took < Duration::from_millis(5500), "{took:?}");
            assert_eq!(request.await.unwrap().status, StatusCode::CREATED);
        } else {
            assert!(
                took < Duration::from_millis(1500),
                "{took:?}: waited past the grace"
            );
        }
    }
}

/// CONNECT and an asterisk-form target are answered, and the proxy goes on
/// serving (they used to panic a task).
#[tokio::test]
async fn connect_and_non_path_targets_are_answered() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for (request, status) in [
        (
            "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
            "405",
        ),
        ("OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", "400"),
    ] {
        let answer = raw_answer(proxy.address, request.as_bytes()).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{request:?}: {answer}"
        );
    }
    let after = post(proxy.address, "/echo", "after-connect", "{}").await;
    assert_eq!(after.status, StatusCode::OK);
    assert_eq!(upstream.calls.get("/echo"), 1);
}

/// Issue 40 item 3: one caller sending large keyed bodies slowly holds at
/// most its share of the proxy's body budget (429 past it), so another
/// caller's payment still goes through — eight such bodies used to take
/// the whole budget and every other keyed request got 503.
#[tokio::test]
async fn one_caller_with_slow_bodies_cannot_starve_another() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| config.max_request_bytes = 8 << 20).await;
    let (held, refused) = slow_bodies(proxy.address).await;
    // Mallory's share (16 MiB) holds two bodies: the other six are refused
    // once the proxy has read past it.
    let overloaded = "dedupd_http_proxy_requests_total{result=\"caller_overloaded\"} 6";
    let started = Instant::now();
    while !proxy.metrics.render().contains(overloaded)
        && started.elapsed() < Duration::from_secs(20)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let payment = payment(proxy.address).await;
    assert_eq!(payment.status, StatusCode::OK, "{}", payment.body);
    let text = proxy.metrics.render();
    assert!(
        text.contains(overloaded),
        "mallory's bodies past its share were refused ({refused} writes cut off):\n{text}"
    );
    drop(held);
}

/// Issue 40 item 6: an idle upstream connection is not kept past
/// `--upstream-idle-timeout` (shorter than the upstream's own keep-alive),
/// so a keyed request is never written into one the upstream is closing;
/// within it, the connection is reused.
#[tokio::test]
async fn idle_upstream_connections_are_dropped_before_the_upstream_drops_them() {
    for (idle_timeout, connections) in [
        (Duration::from_millis(200), 2),
        (Duration::from_secs(30), 1),
    ] {
        let upstream = upstream().await;
        let proxy = proxy_with(&upstream, |config| {
            config.upstream_idle_timeout = idle_timeout
        })
        .await;
        post(proxy.address, "/echo", "idle-1", "{}").await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        post(proxy.address, "/echo", "idle-2", "{}").await;
        assert_eq!(
            upstream.calls.get(CONNECTIONS),
            connections,
            "{idle_timeout:?}"
        );
    }
}

/// An HTTP/2 upstream that refuses its first stream (RST_STREAM with
/// REFUSED_STREAM: not processed, RFC 9113 §8.7) and answers gRPC OK
/// (trailers only) to the others; counts the streams.
async fn refusing_h2_upstream() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let streams = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&streams);
    tokio::spawn(async move {
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            let counted = Arc::clone(&counted);
            tokio::spawn(async move {
                let mut connection = h2::server::handshake(socket).await.unwrap();
                while let Some(Ok((_request, mut respond))) = connection.accept().await {
                    if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                        continue;
                    }
                    let response = http::Response::builder()
                        .header("content-type", "application/grpc")
                        .header("grpc-status", "0")
                        .body(())
                        .unwrap();
                    respond.send_response(response, true).unwrap();
                }
            });
        }
    });
    (address, streams)
}

/// Issue 40 item 6: a gRPC upstream that refuses the stream did not
/// process it: the key is released (UNAVAILABLE) and the retry is sent —
/// it was "outcome unknown" and never sent again.
#[tokio::test]
async fn a_refused_stream_was_not_sent_and_the_retry_is() {
    let (address, streams) = refusing_h2_upstream().await;
    let upstream = Upstream::elsewhere(address);
    let proxy = proxy(&upstream).await;
    let client = http2_client();
    let mut codes = Vec::new();
    for _ in 0..2 {
        let request = Request::post(format!("http://{}/shop.Orders/Create", proxy.address))
            .header("content-type", "application/grpc")
            .header("idempotency-key", "refused")
            .header("authorization", CALLER)
            .body(Full::new(Bytes::from_static(&[0, 0, 0, 0, 0])))
            .unwrap();
        let response = client.request(request).await.unwrap();
        let headers = response.headers().clone();
        let trailers = response
            .into_body()
            .collect()
            .await
            .unwrap()
            .trailers()
            .cloned();
        let code = headers
            .get("grpc-status")
            .or_else(|| trailers.as_ref().and_then(|t| t.get("grpc-status")))
            .map(|code| code.to_str().unwrap().to_owned());
        codes.push(code);
    }
    assert_eq!(
        codes,
        [Some("14".to_owned()), Some("0".to_owned())],
        "UNAVAILABLE (released), then the retry's OK"
    );
    assert_eq!(streams.load(Ordering::SeqCst), 2);
}

/// A 96 MiB answer to a keyed POST streams through the binary: the client
/// gets every byte while the process's peak resident memory grows by less
/// than 16 MiB (it held the whole answer before: +133 MiB), and a retry is
/// told the answer cannot be replayed (it is not sent again). The absolute
/// peak — under 64 MiB for the release binary — is in BENCHMARKS.md; this
/// debug binary alone maps ~30 MiB of code.
#[tokio::test]
async fn a_96_mib_keyed_answer_streams_in_bounded_memory() {
    let upstream = upstream().await;
    let data = tempfile::tempdir().unwrap();
    let upstream_url = format!("http://{}", upstream.address);
    let sidecar = common::sidecar::Sidecar::start_with(
        data.path(),
        &[
            "--http-proxy-listen",
            "127.0.0.1:0",
            "--http-proxy-upstream",
            &upstream_url,
        ],
    );
    let address = proxy_address(&sidecar);
    let peak = || sidecar.status_kib("VmHWM");
    let before_kib = peak();
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let request = Request::post(format!("http://{address}/big?mib=96"))
        .header("idempotency-key", "big-answer")
        .header("authorization", CALLER)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut received = 0usize;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            received += data.len();
        }
    }
    assert_eq!(received, 96 << 20);
    let peak_kib = peak();
    println!("peak RSS: {before_kib} KiB before, {peak_kib} KiB after streaming 96 MiB");
    assert!(
        peak_kib - before_kib < 16 << 10,
        "peak RSS grew from {before_kib} KiB to {peak_kib} KiB"
    );

    let retry = post(address, "/big?mib=96", "big-answer", "{}").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(problem_type(&retry), "response-not-replayable");
    assert_eq!(upstream.calls.get("/big"), 1);
}

/// A keyed body slower than the body deadline is answered 408 and never
/// forwarded; the key stays free. And (issue 40 item 7) an unkeyed body
/// streamed through is cut off once the client pauses longer than the
/// header timeout: it held its connection and the upstream's request open
/// for as long as it liked.
#[tokio::test]
async fn bodies_that_stop_coming_are_cut_off() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.body_timeout = Duration::from_millis(500);
        config.header_timeout = Duration::from_millis(500);
    })
    .await;
    let head = "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                Content-Length: 100\r\n";
    let keyed =
        format!("{head}Idempotency-Key: slow-body\r\nAuthorization: Bearer slow\r\n\r\n{{\"a\":");
    let answer = raw_answer(proxy.address, keyed.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request-body-timeout"), "{answer}");
    assert_eq!(upstream.calls.get("/echo"), 0);
    let whole = post(proxy.address, "/echo", "slow-body", "{}").await;
    assert_eq!(whole.status, StatusCode::OK, "the key was never claimed");
    assert_eq!(upstream.calls.get("/echo"), 1);

    let unkeyed = format!("{head}\r\n{{\"a\":");
    let answer = raw_answer(proxy.address, unkeyed.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
}

/// A client that never reads its (32 MiB) answer is cut off once the
/// proxy's writes have made no progress for the header timeout, instead of
/// holding its connection, buffers and upstream call for good.
#[tokio::test]
async fn a_client_that_never_reads_is_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.header_timeout = Duration::from_millis(500);
    })
    .await;
    let mut socket = tokio::net::TcpStream::connect(proxy.address).await.unwrap();
    socket
        .write_all(b"POST /big?mib=32 HTTP/1.1\r\nHost: x\r\nIdempotency-Key: never-read\r\nAuthorization: Bearer reader\r\nContent-Length: 2\r\n\r\n{}")
        .await
        .unwrap();
    // Read nothing while the buffers fill and the deadline passes.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut received = 0usize;
    let mut buffer = vec![0u8; 1 << 20];
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match socket.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => received += read,
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the connection was still open");
    assert!(
        received < 32 << 20,
        "the whole answer ({received} bytes) was delivered: nothing was cut off"
    );
    assert_eq!(upstream.calls.get("/big"), 1);
}

/// Issue 40 item 7: an HTTP/2 client that grants no window (initial window
/// 0, no WINDOW_UPDATE) has each answer's stream reset once it made no
/// room for the answer within the header timeout — keyed or not. hyper
/// held each such stream, its task and the rest of its answer for good.
#[tokio::test]
async fn an_http2_client_that_makes_no_room_for_its_answer_is_reset() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.header_timeout = Duration::from_millis(500);
    })
    .await;
    let (mut client, _connection) = h2_connection(proxy.address, 0).await;
    for key in [Some("zero-window"), None] {
        let mut request = Request::post(format!("http://{}/big?mib=1", proxy.address))
            .header("authorization", "Bearer zero-window");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let (response, mut body) = client
            .send_request(request.body(()).unwrap(), false)
            .unwrap();
        body.send_data(Bytes::from_static(b"{}"), true).unwrap();
        let response = tokio::time::timeout(Duration::from_secs(5), response)
            .await
            .expect("an answer head within 5 s")
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{key:?}");
        let started = Instant::now();
        let next = tokio::time::timeout(Duration::from_secs(10), response.into_body().data())
            .await
            .unwrap_or_else(|_| panic!("{key:?}: the stream was still open after 10 s"));
        let error = next
            .expect("the stream ended")
            .expect_err("data came through a zero window");
        assert_eq!(error.reason(), Some(h2::Reason::CANCEL), "{key:?}: {error}");
        assert!(started.elapsed() >= Duration::from_millis(400), "{key:?}");
    }
    assert_eq!(upstream.calls.get("/big"), 2);
}

/// The HTTP/2 deadline counts from the last progress, not from the start:
/// a client reading a 1 MiB answer a frame at a time, slowly but steadily
/// (longer in all than the deadline), gets all of it.
#[tokio::test]
async fn a_slow_but_steady_http2_reader_gets_its_whole_answer() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.header_timeout = Duration::from_millis(500);
    })
    .await;
    let (mut client, _connection) = h2_connection(proxy.address, 65_535).await;
    let request = Request::post(format!("http://{}/big?mib=1", proxy.address))
        .header("authorization", "Bearer steady")
        .header("idempotency-key", "steady")
        .body(())
        .unwrap();
    let (response, mut body) = client.send_request(request, false).unwrap();
    body.send_data(Bytes::from_static(b"{}"), true).unwrap();
    let mut body = response.await.unwrap().into_body();
    let (started, mut received) = (Instant::now(), 0);
    while let Some(data) = body.data().await {
        let data = data.expect("the answer was cut off");
        received += data.len();
        tokio::time::sleep(Duration::from_millis(20)).await;
        body.flow_control().release_capacity(data.len()).unwrap();
    }
    assert_eq!(received, 1 << 20);
    assert!(started.elapsed() > Duration::from_millis(500));
}

/// Issue 40 item 7: an unkeyed body that trickles — pauses shorter than
/// the header timeout, a few bytes each — is cut off once it falls below
/// the least pace after the body timeout (502); it held its connection and
/// the upstream's request open for as long as it liked.
#[tokio::test]
async fn an_unkeyed_body_that_trickles_is_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.header_timeout = Duration::from_millis(500);
        config.body_timeout = Duration::from_secs(1);
    })
    .await;
    let socket = tokio::net::TcpStream::connect(proxy.address).await.unwrap();
    let (mut reader, mut writer) = socket.into_split();
    let started = Instant::now();
    writer
        .write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        .await
        .unwrap();
    let trickle = tokio::spawn(async move {
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if writer.write_all(&[b' '; 20]).await.is_err() {
                return;
            }
        }
    });
    let mut answer = vec![0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(10), reader.read(&mut answer))
        .await
        .expect("an answer within 10 s: the trickle was not cut off")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]);
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    assert!(started.elapsed() >= Duration::from_secs(1), "{answer}");
    trickle.abort();
}

/// An HTTP/2 client that opens its window by one byte is held to the same
/// deadline: the last byte of an answer is handed on alone, so the stream
/// is over only once the client made room for all of it. (Handed whole, a
/// small answer went to h2 in one piece, the stream's task ended, and h2
/// kept the answer and the stream for as long as the connection lived.)
#[tokio::test]
async fn an_http2_window_of_one_byte_does_not_hold_an_answer() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.header_timeout = Duration::from_millis(500);
    })
    .await;
    let (mut client, _connection) = h2_connection(proxy.address, 1).await;
    let request = Request::post(format!("http://{}/echo", proxy.address))
        .body(())
        .unwrap();
    let (response, mut body) = client.send_request(request, false).unwrap();
    body.send_data(Bytes::from(vec![b'a'; 100]), true).unwrap();
    let mut body = response.await.unwrap().into_body();
    let mut received = 0;
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match body.data().await {
                // Room is never made for more: nothing released.
                Some(Ok(data)) => received += data.len(),
                Some(Err(error)) => return Some(error),
                None => return None,
            }
        }
    })
    .await
    .expect("the stream was still open after 10 s");
    let error = ended.expect("the whole answer came through a one-byte window");
    assert_eq!(error.reason(), Some(h2::Reason::CANCEL), "{error}");
    assert!(received < 100, "{received}");
}

/// A connection past its maximum age gives its requests in flight the
/// shutdown grace, then is closed: an answer that goes on longer (here a
/// 64 MiB one read at 16 KiB a second, well above the pace) is cut there,
/// rather than keeping the connection open for as long as it lasts.
#[tokio::test]
async fn an_aged_connection_is_closed_after_the_grace() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.connections.max_connection_age = Duration::from_millis(500);
        config.shutdown_grace = Duration::from_secs(1);
    })
    .await;
    let opened = Instant::now();
    let (mut client, _connection) = h2_connection(proxy.address, 65_535).await;
    let request = Request::get(format!("http://{}/big?mib=64", proxy.address))
        .body(())
        .unwrap();
    let (response, _) = client.send_request(request, true).unwrap();
    let mut body = response.await.unwrap().into_body();
    let cut = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(data) = body.data().await {
            let Ok(data) = data else {
                eprintln!("CUT {:?} {data:?}", opened.elapsed());
                return true;
            };
            tokio::time::sleep(Duration::from_millis(50)).await;
            body.flow_control().release_capacity(data.len()).unwrap();
        }
        false
    })
    .await
    .expect("the answer still came after 10 s: the connection was not closed");
    assert!(cut, "the whole 64 MiB came");
    let took = opened.elapsed();
    assert!(took >= Duration::from_millis(1400), "{took:?}");
}
