//! The HTTP idempotency proxy: a real upstream that counts its calls, the
//! proxy on the sled store, real HTTP/1.1 and HTTP/2 clients; and the
//! `dedupd` binary with `--http-proxy-listen`, killed with SIGKILL between
//! a request and its retry, and in the middle of one. The promise under
//! test: a keyed request reaches the upstream at most once, whatever the
//! client retries and whatever fails.

mod common;

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use dedupd::{
    clock::SystemClock,
    engine::Engine,
    proxy::{
        idempotency::{CallerScope, KeySyntax, ReleaseOn, RoutePattern},
        server::{serve, AfterUnknownOutcome, ProxyConfig},
    },
    server::ConnectionLimits,
    store::{
        sled::{SledConfig, SledStore},
        Store,
    },
};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// The upstream: counts calls per path. `/orders` answers 201 with the call
/// number, slowly enough for retries to overlap; `/slow` answers 201 after
/// 2.5 s; `/gateway-timeout` answers 504, as a mesh proxy in front of the
/// service does when the service is slow; `/flaky` answers 500 on its first
/// call and 201 after, `/busy` 429 then 201, `/shed` 503 on odd calls and
/// 201 on even ones; `/stream`
/// echoes each chunk as it comes; `/cookie` gives the caller a session
/// cookie and names it in the body; `/big?mib=N` answers N MiB, generated as
/// it is sent; `/outage` sets `store_down` before answering 201; any other
/// path answers 200 with the body. Connections accepted count under
/// [`CONNECTIONS`].
struct Upstream {
    address: SocketAddr,
    calls: Arc<counts::Counts>,
    /// Set by a call to `/outage`: a [`common::FailingStore`] built on it
    /// stops taking writes between the upstream's answer and the commit.
    store_down: Arc<AtomicBool>,
}

/// `/big`'s chunk.
const BIG_CHUNK: usize = 64 << 10;

mod counts {
    use std::{collections::HashMap, sync::Mutex};

    #[derive(Default)]
    pub struct Counts(Mutex<HashMap<String, usize>>);

    impl Counts {
        pub fn bump(&self, path: &str) -> usize {
            let mut counts = self.0.lock().unwrap();
            let count = counts.entry(path.to_owned()).or_default();
            *count += 1;
            *count
        }

        pub fn get(&self, path: &str) -> usize {
            self.0.lock().unwrap().get(path).copied().unwrap_or(0)
        }
    }
}

impl Upstream {
    /// A service at `address` this test does not count calls of.
    fn elsewhere(address: SocketAddr) -> Upstream {
        Upstream {
            address,
            calls: Arc::new(counts::Counts::default()),
            store_down: Arc::new(AtomicBool::new(false)),
        }
    }
}

async fn upstream() -> Upstream {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let calls = Arc::new(counts::Counts::default());
    let store_down = Arc::new(AtomicBool::new(false));
    let counts = Arc::clone(&calls);
    let trip = Arc::clone(&store_down);
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            counts.bump(CONNECTIONS);
            let counts = Arc::clone(&counts);
            let trip = Arc::clone(&trip);
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                        let counts = Arc::clone(&counts);
                        let trip = Arc::clone(&trip);
                        async move {
                            let path = request.uri().path().to_owned();
                            let call = counts.bump(&path);
                            if path == "/stream" {
                                // Each chunk is sent back as it arrives.
                                return Ok(Response::new(request.into_body().boxed()));
                            }
                            if path == "/big" {
                                let mib: usize = request
                                    .uri()
                                    .query()
                                    .and_then(|query| query.strip_prefix("mib="))
                                    .and_then(|mib| mib.parse().ok())
                                    .unwrap_or(1);
                                let chunks = (mib << 20) / BIG_CHUNK;
                                let frames = futures_util::StreamExt::map(
                                    futures_util::stream::iter(0..chunks),
                                    |index| {
                                        Ok::<_, hyper::Error>(hyper::body::Frame::data(
                                            Bytes::from(vec![b'a' + (index % 26) as u8; BIG_CHUNK]),
                                        ))
                                    },
                                );
                                return Ok(Response::new(
                                    http_body_util::StreamBody::new(frames).boxed(),
                                ));
                            }
                            let authorization = request
                                .headers()
                                .get("authorization")
                                .map(|value| value.to_str().unwrap().to_owned())
                                .unwrap_or_default();
                            let body = request.into_body().collect().await.unwrap().to_bytes();
                            let mut cookie = None;
                            let (status, text) = match path.as_str() {
                                "/orders" => {
                                    tokio::time::sleep(Duration::from_millis(200)).await;
                                    (StatusCode::CREATED, format!("{{\"order\":{call}}}"))
                                }
                                "/slow" => {
                                    tokio::time::sleep(Duration::from_millis(2500)).await;
                                    (StatusCode::CREATED, format!("{{\"slow\":{call}}}"))
                                }
                                "/outage" => {
                                    trip.store(true, Ordering::SeqCst);
                                    (StatusCode::CREATED, format!("{{\"outage\":{call}}}"))
                                }
                                "/cookie" => {
                                    cookie = Some(format!(
                                        "session={}",
                                        authorization.replace(' ', "-")
                                    ));
                                    (
                                        StatusCode::CREATED,
                                        format!("{{\"caller\":\"{authorization}\"}}"),
                                    )
                                }
                                "/gateway-timeout" => (
                                    StatusCode::GATEWAY_TIMEOUT,
                                    "upstream request timeout".into(),
                                ),
                                "/flaky" if call == 1 => {
                                    (StatusCode::INTERNAL_SERVER_ERROR, "boom".into())
                                }
                                "/busy" if call == 1 => {
                                    (StatusCode::TOO_MANY_REQUESTS, "slow down".into())
                                }
                                "/shed" if call % 2 == 1 => {
                                    (StatusCode::SERVICE_UNAVAILABLE, "shedding".into())
                                }
                                "/flaky" | "/busy" | "/shed" => {
                                    (StatusCode::CREATED, format!("{{\"call\":{call}}}"))
                                }
                                _ => (StatusCode::OK, String::from_utf8_lossy(&body).into_owned()),
                            };
                            let mut response = Response::builder()
                                .status(status)
                                .header("content-type", "application/json")
                                .header("x-upstream-call", call.to_string());
                            if let Some(cookie) = cookie {
                                response = response.header("set-cookie", cookie);
                            }
                            let response = response
                                .body(
                                    Full::new(Bytes::from(text))
                                        .map_err(|never| match never {})
                                        .boxed(),
                                )
                                .unwrap();
                            Ok::<_, Infallible>(response)
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Upstream {
        address,
        calls,
        store_down,
    }
}

/// An upstream that reads each request, counts it, and closes the
/// connection without a word: an answer that never comes.
async fn hanging_up_upstream() -> Upstream {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let calls = Arc::new(counts::Counts::default());
    let counts = Arc::clone(&calls);
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            let counts = Arc::clone(&counts);
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(read) => request.extend_from_slice(&buffer[..read]),
                    }
                }
                counts.bump("/hang-up");
                drop(stream);
            });
        }
    });
    Upstream {
        address,
        calls,
        store_down: Arc::new(AtomicBool::new(false)),
    }
}

struct Proxy {
    address: SocketAddr,
    metrics: Arc<dedupd::Metrics>,
    _dir: tempfile::TempDir,
    /// Dropped (or sent): the proxy shuts down.
    stop: tokio::sync::oneshot::Sender<()>,
    /// The proxy's `serve`, which ends once its shutdown is over.
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn proxy(upstream: &Upstream) -> Proxy {
    proxy_with(upstream, |_| {}).await
}

async fn proxy_with(upstream: &Upstream, adjust: impl FnOnce(&mut ProxyConfig)) -> Proxy {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(&SledConfig::new(dir.path().join("data"))).unwrap();
    proxy_on(upstream, store, dir, adjust).await
}

async fn proxy_on<S: Store>(
    upstream: &Upstream,
    store: S,
    dir: tempfile::TempDir,
    adjust: impl FnOnce(&mut ProxyConfig),
) -> Proxy {
    let engine = Engine::new(Arc::new(store), Arc::new(SystemClock));
    let metrics = Arc::clone(engine.metrics());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let mut config = ProxyConfig {
        upstream: format!("http://{}", upstream.address).parse().unwrap(),
        namespace: "http".into(),
        methods: vec![Method::POST, Method::PATCH],
        scope: CallerScope::Credentials,
        fingerprint_headers: Vec::new(),
        never_store: Vec::new(),
        key_syntax: KeySyntax::Lenient,
        release_on: ReleaseOn::default(),
        require_key: Vec::new(),
        lease_ttl: Duration::from_secs(5),
        retention: Duration::from_secs(3600),
        max_response_bytes: 64 << 10,
        max_request_bytes: 1 << 20,
        upstream_timeout: Duration::from_secs(10),
        upstream_idle_timeout: Duration::from_secs(1),
        wait_in_flight: Duration::ZERO,
        after_unknown_outcome: AfterUnknownOutcome::Report,
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(10),
        connections: ConnectionLimits::default(),
        shutdown_grace: Duration::from_secs(20),
    };
    adjust(&mut config);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let slots = Arc::new(tokio::sync::Semaphore::new(
        config.connections.max_connections,
    ));
    let served = tokio::spawn(serve(listener, engine, config, slots, async {
        let _ = stopped.await;
    }));
    Proxy {
        address,
        metrics,
        _dir: dir,
        stop,
        served,
    }
}

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: String,
}

async fn send(
    address: SocketAddr,
    method: Method,
    path: &str,
    key: Option<&str>,
    caller: Option<&str>,
    body: &str,
) -> Answer {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let mut request = Request::builder()
        .method(method)
        .uri(format!("http://{address}{path}"))
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    if let Some(caller) = caller {
        request = request.header("authorization", caller);
    }
    let response = client
        .request(
            request
                .body(Full::new(Bytes::from(body.to_owned())))
                .unwrap(),
        )
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap(),
    }
}

/// A client that speaks HTTP/2 only (prior knowledge).
fn http2_client() -> hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
> {
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>()
}

/// A POST with `key` from one caller: most tests' request.
async fn post(address: SocketAddr, path: &str, key: &str, body: &str) -> Answer {
    send(address, Method::POST, path, Some(key), Some(CALLER), body).await
}

/// The caller of [`post`].
const CALLER: &str = "Bearer test-client";

fn replayed(answer: &Answer) -> bool {
    answer
        .headers
        .get("idempotent-replayed")
        .is_some_and(|value| value == "true")
}

#[tokio::test]
async fn twenty_identical_posts_reach_the_upstream_once() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let body = r#"{"amount":10,"currency":"EUR"}"#;
    let answers = futures_util::future::join_all(
        (0..20).map(|_| post(proxy.address, "/orders", "\"order-1\"", body)),
    )
    .await;
    assert_eq!(
        upstream.calls.get("/orders"),
        1,
        "the upstream saw one request"
    );
    let originals = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED && !replayed(a))
        .count();
    assert_eq!(originals, 1);
    for answer in &answers {
        match answer.status {
            StatusCode::CREATED => assert_eq!(answer.body, "{\"order\":1}"),
            StatusCode::CONFLICT => {
                assert_eq!(answer.headers["content-type"], "application/problem+json");
                assert!(answer.headers.contains_key("retry-after"));
                assert!(answer.body.contains("request-in-progress"));
            }
            other => panic!("unexpected {other}: {}", answer.body),
        }
    }

    let retry = post(proxy.address, "/orders", "\"order-1\"", body).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(replayed(&retry));
    assert_eq!(retry.body, "{\"order\":1}");
    assert_eq!(
        retry.headers["x-upstream-call"], "1",
        "the upstream's headers are replayed"
    );
    assert!(retry.headers.contains_key("idempotency-key-expires"));
    assert_eq!(upstream.calls.get("/orders"), 1);
}

#[tokio::test]
async fn json_key_order_does_not_matter_but_another_payload_is_refused() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let first = post(proxy.address, "/echo", "\"k\"", r#"{"a":1,"b":[1,2]}"#).await;
    assert_eq!(first.status, StatusCode::OK);
    let reordered = send(
        proxy.address,
        Method::POST,
        "/echo",
        Some("\"k\""),
        Some(CALLER),
        "{ \"b\": [1, 2], \"a\": 1 }",
    )
    .await;
    assert_eq!(reordered.status, StatusCode::OK);
    assert!(replayed(&reordered));
    assert_eq!(reordered.body, r#"{"a":1,"b":[1,2]}"#);
    let other = post(proxy.address, "/echo", "\"k\"", r#"{"a":2,"b":[1,2]}"#).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.headers["content-type"], "application/problem+json");
    assert!(other.body.contains("idempotency-key-reused"));
    assert_eq!(upstream.calls.get("/echo"), 1);
}

#[tokio::test]
async fn callers_keys_never_collide() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for caller in ["Bearer alice", "Bearer bob"] {
        let answer = send(
            proxy.address,
            Method::POST,
            "/echo",
            Some("\"same\""),
            Some(caller),
            "{}",
        )
        .await;
        assert!(!replayed(&answer), "{caller} got another caller's replay");
    }
    assert_eq!(upstream.calls.get("/echo"), 2);
}

/// Issue 40 item 1: a service that did the work and then failed (500) is
/// not run again by a retry — the 500 is the outcome, replayed; only an
/// answer that says it did not act (429 by default) releases the key.
#[tokio::test]
async fn a_server_error_after_the_work_is_replayed_and_a_429_releases_the_key() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let first = post(proxy.address, "/flaky", "\"f\"", "{}").await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    for _ in 0..2 {
        let retry = post(proxy.address, "/flaky", "\"f\"", "{}").await;
        assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(replayed(&retry), "a retry after a 500 is a replay");
        assert_eq!(retry.body, "boom");
    }
    assert_eq!(upstream.calls.get("/flaky"), 1, "the work ran once");

    let busy = post(proxy.address, "/busy", "\"b\"", "{}").await;
    assert_eq!(busy.status, StatusCode::TOO_MANY_REQUESTS);
    let retry = post(proxy.address, "/busy", "\"b\"", "{}").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!replayed(&retry));
    assert_eq!(upstream.calls.get("/busy"), 2);
    let again = post(proxy.address, "/busy", "\"b\"", "{}").await;
    assert!(replayed(&again));
    assert_eq!(again.body, "{\"call\":2}");

    let text = proxy.metrics.render();
    for (result, count) in [("released", 1), ("forwarded", 2), ("replayed", 3)] {
        let line = format!("dedupd_http_proxy_requests_total{{result=\"{result}\"}} {count}");
        assert!(text.contains(&line), "no {line:?} in\n{text}");
    }
    assert!(
        text.contains("dedupd_http_proxy_added_seconds_count 6"),
        "{text}"
    );
}

/// The operator's "did not act" set replaces the default: a service that
/// sheds load with its own 503 (no gateway in front) releases with
/// `--release-on-status 503`; 429 is then an outcome like any other. (By
/// default a 503 is a gateway's: `a_gateway_timeout_is_an_unknown_outcome`.)
#[tokio::test]
async fn the_release_statuses_are_the_operators() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.release_on.statuses = vec![StatusCode::SERVICE_UNAVAILABLE];
    })
    .await;
    let shed = post(proxy.address, "/shed", "\"s\"", "{}").await;
    assert_eq!(shed.status, StatusCode::SERVICE_UNAVAILABLE);
    let retry = post(proxy.address, "/shed", "\"s\"", "{}").await;
    assert_eq!(
        (retry.status, replayed(&retry)),
        (StatusCode::CREATED, false)
    );
    let busy = post(proxy.address, "/busy", "\"b\"", "{}").await;
    assert_eq!(busy.status, StatusCode::TOO_MANY_REQUESTS);
    let retry = post(proxy.address, "/busy", "\"b\"", "{}").await;
    assert_eq!(
        (retry.status, replayed(&retry)),
        (StatusCode::TOO_MANY_REQUESTS, true)
    );
    assert_eq!(upstream.calls.get("/shed"), 2);
    assert_eq!(upstream.calls.get("/busy"), 1);
}

/// Issue 40 item 4: two `Idempotency-Key` lines are one invalid value
/// (RFC 8941), refused before anything is sent — even when both lines
/// agree, and over gRPC metadata too.
#[tokio::test]
async fn a_key_header_given_twice_is_400_and_not_forwarded() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for (first, second) in [("\"a\"", "\"b\""), ("\"a\"", "\"a\"")] {
        let request = Request::builder()
            .method(Method::POST)
            .header("authorization", "Bearer alice")
            .header("idempotency-key", first)
            .header("idempotency-key", second);
        let answer = exchange(proxy.address, request, "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.body);
        assert_eq!(problem_type(&answer), "invalid-idempotency-key");
        assert!(answer.body.contains("more than once"), "{}", answer.body);
    }
    let request = Request::builder()
        .method(Method::POST)
        .header("content-type", "application/grpc")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b");
    let answer = exchange(proxy.address, request, "").await;
    assert_eq!(
        answer
            .headers
            .get("grpc-status")
            .map(|v| v.to_str().unwrap()),
        Some("3"),
        "INVALID_ARGUMENT"
    );
    assert_eq!(upstream.calls.get("/cookie"), 0, "nothing was forwarded");
}

#[tokio::test]
async fn bad_or_missing_keys_are_400_and_other_requests_pass_through() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for bad in ["two words", "a,b", "\"open", "\"\""] {
        let answer = post(proxy.address, "/echo", bad, "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bad}");
        assert!(answer.body.contains("invalid-idempotency-key"));
    }
    let long = format!("\"{}\"", "k".repeat(256));
    let answer = post(proxy.address, "/echo", &long, "{}").await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        upstream.calls.get("/echo"),
        0,
        "refused requests never reach the upstream"
    );

    // No key, or a method that is not deduplicated: straight through, each time.
    for _ in 0..2 {
        send(proxy.address, Method::POST, "/echo", None, None, "{}").await;
        send(
            proxy.address,
            Method::PUT,
            "/echo",
            Some("\"k\""),
            None,
            "{}",
        )
        .await;
    }
    assert_eq!(upstream.calls.get("/echo"), 4);

    // Required on POST /echo/** and on /orders/*/refunds, for any
    // deduplicated method; nowhere else.
    let strict = proxy_with(&upstream, |config| {
        config.require_key = ["POST /echo/**", "/orders/*/refunds"]
            .iter()
            .map(|pattern| RoutePattern::parse(pattern).unwrap())
            .collect();
    })
    .await;
    let mut refused = Vec::new();
    for (method, path) in [
        (Method::POST, "/echo"),
        (Method::POST, "/echo/deeper/still"),
        (Method::PATCH, "/orders/7/refunds"),
        (Method::POST, "/orders/7/refunds"),
    ] {
        let missing = send(strict.address, method.clone(), path, None, None, "{}").await;
        assert_eq!(missing.status, StatusCode::BAD_REQUEST, "{method} {path}");
        assert!(missing.body.contains("missing-idempotency-key"));
        refused.push(path);
    }
    assert_eq!(upstream.calls.get("/echo"), 4, "refused: {refused:?}");
    for (method, path) in [
        (Method::PATCH, "/echo"),
        (Method::PUT, "/orders/7/refunds"),
        (Method::POST, "/orders/7/refunds/1"),
        (Method::POST, "/other"),
    ] {
        let before = upstream.calls.get(path);
        let passed = send(strict.address, method.clone(), path, None, None, "{}").await;
        assert_ne!(passed.status, StatusCode::BAD_REQUEST, "{method} {path}");
        assert_eq!(upstream.calls.get(path), before + 1, "{method} {path}");
    }
}

#[tokio::test]
async fn an_http2_client_is_deduplicated_too() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let client = http2_client();
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let request = Request::post(format!("http://{}/echo", proxy.address))
            .header("idempotency-key", "\"h2\"")
            .header("authorization", CALLER)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"x\":1}")))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        statuses.push((
            response.status(),
            response.headers().contains_key("idempotent-replayed"),
        ));
    }
    assert_eq!(statuses, [(StatusCode::OK, false), (StatusCode::OK, true)]);
    assert_eq!(upstream.calls.get("/echo"), 1);
}

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

#[tokio::test]
async fn a_client_that_disconnects_still_gets_its_result_committed() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    // Give up long before the upstream's 200 ms answer.
    let abandoned = tokio::time::timeout(
        Duration::from_millis(50),
        post(proxy.address, "/orders", "\"gone\"", "{}"),
    )
    .await;
    assert!(abandoned.is_err());
    let mut replay = None;
    // Long enough to outlast the lease (5 s) if the claim were orphaned.
    for _ in 0..300 {
        let answer = post(proxy.address, "/orders", "\"gone\"", "{}").await;
        if answer.status == StatusCode::CREATED {
            replay = Some(answer);
            break;
        }
        assert_eq!(answer.status, StatusCode::CONFLICT);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let replay = replay.expect("the abandoned request was committed");
    assert!(replayed(&replay));
    assert_eq!(upstream.calls.get("/orders"), 1);
}

/// The record survives the sidecar: a request answered, the binary killed
/// with SIGKILL, restarted on the same store with `flags`, and the retry is
/// a replay.
async fn record_survives_a_kill_9(flags: &[&str]) {
    let upstream = upstream().await;
    let data = tempfile::tempdir().unwrap();
    let upstream_url = format!("http://{}", upstream.address);
    let mut flags = flags.to_vec();
    flags.push(&upstream_url);
    let sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let first = post(proxy_address(&sidecar), "/orders", "\"k9\"", "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    sidecar.kill_9();

    let sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let retry = post(proxy_address(&sidecar), "/orders", "\"k9\"", "{}").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(replayed(&retry), "{:?}", retry.headers);
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.calls.get("/orders"), 1);
}

#[tokio::test]
async fn the_record_survives_a_kill_9_between_request_and_retry_on_sled() {
    record_survives_a_kill_9(&[
        "--http-proxy-listen",
        "127.0.0.1:0",
        "--http-proxy-upstream",
    ])
    .await;
}

/// The same through `dedupd http-proxy` (its `--listen` is the proxy's; the
/// sidecar helper's `--listen 127.0.0.1:0` lands there) on PostgreSQL.
#[tokio::test]
async fn the_record_survives_a_kill_9_between_request_and_retry_on_postgres() {
    if !common::postgres::available() {
        return;
    }
    let schema = common::postgres::fresh_schema();
    record_survives_a_kill_9(&[
        "http-proxy",
        "--grpc-listen",
        "127.0.0.1:0",
        "--store",
        "postgres",
        "--store-url",
        common::postgres::url(),
        "--store-schema",
        &schema,
        "--upstream",
    ])
    .await;
    common::postgres::drop_schema(&schema).await;
}

#[test]
fn bad_proxy_flags_exit_64_with_one_line() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--http-proxy-listen", "127.0.0.1:0"],
            "http-proxy-upstream",
        ),
        (
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "https://x:1",
            ],
            "http://HOST:PORT",
        ),
        (
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "http://127.0.0.1:1",
                "--http-proxy-methods",
                "PO ST",
            ],
            "not an HTTP method",
        ),
        (
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "http://127.0.0.1:1",
                "--http-proxy-retention",
                "900days",
            ],
            "http-proxy-retention",
        ),
        (
            &["http-proxy", "--upstream", "http://127.0.0.1:1"],
            "--listen",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--retention",
                "900days",
            ],
            "--retention must be at most 365days, got 900days",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--require-key",
                "GET /reports/**",
            ],
            "--require-key \"GET /reports/**\": GET is not in --methods",
        ),
        (
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "http://127.0.0.1:1",
                "--http-proxy-require-key",
                "payments/**",
            ],
            "--http-proxy-require-key \"payments/**\": \"payments/**\" is neither * nor a path",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--release-on-status",
                "429,200",
            ],
            "--release-on-status \"200\": a status of 400-599",
        ),
        (
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "http://127.0.0.1:1",
                "--http-proxy-release-on-status",
                "none,429",
            ],
            "--http-proxy-release-on-status none cannot be given with other values",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--release-on-grpc-code",
                "ABORTED,ok",
            ],
            "--release-on-grpc-code \"ok\": a gRPC code other than OK",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--max-response-bytes",
                "1000000000",
            ],
            "--max-response-bytes must be at most 67108864",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--fingerprint-header",
                "stripe account",
            ],
            "--fingerprint-header \"stripe account\" is not a header name",
        ),
    ];
    for (flags, expected) in cases {
        let output = std::process::Command::new(common::sidecar::BINARY)
            .args(*flags)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(64), "{flags:?}");
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(expected), "{flags:?}: {stderr}");
    }
}

/// An HTTP/1.0 upstream (Python's http.server, say): the client still gets
/// an HTTP/1.1 answer on its keep-alive connection, first and replayed.
#[tokio::test]
async fn an_http_1_0_upstream_is_answered_in_the_clients_version() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                // Headers, then the 2-byte body the tests send.
                while !request.windows(4).any(|w| w == b"\r\n\r\n") || !request.ends_with(b"{}") {
                    let read = stream.read(&mut buffer).await.unwrap();
                    if read == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..read]);
                }
                let _ = stream
                    .write_all(b"HTTP/1.0 201 Created\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\r\n{\"id\":1}")
                    .await;
            });
        }
    });
    let upstream = Upstream::elsewhere(address);
    let proxy = proxy(&upstream).await;
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    for replay in [false, true] {
        let request = Request::post(format!("http://{}/orders", proxy.address))
            .header("idempotency-key", "\"v10\"")
            .header("authorization", CALLER)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let response = client.request(request).await.unwrap();
        if response.status() != StatusCode::CREATED {
            let body = response.into_body().collect().await.unwrap().to_bytes();
            panic!("replay {replay}: {}", String::from_utf8_lossy(&body));
        }
        assert_eq!(
            response.version(),
            http::Version::HTTP_11,
            "replay: {replay}"
        );
        assert_eq!(
            response.headers().contains_key("idempotent-replayed"),
            replay
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"{\"id\":1}");
    }
}

/// A response over the size kept for replay still reaches the client; the
/// key is committed, and a retry is told the result cannot be replayed
/// (never runs the request again).
#[tokio::test]
async fn a_response_too_large_to_keep_is_answered_once_and_not_replayed() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| config.max_response_bytes = 8).await;
    let body = r#"{"a long":"body of more than eight bytes"}"#;
    let first = post(proxy.address, "/echo", "\"big\"", body).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body, body);
    let retry = post(proxy.address, "/echo", "\"big\"", body).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert!(
        retry.body.contains("response-not-replayable"),
        "{}",
        retry.body
    );
    assert_eq!(upstream.calls.get("/echo"), 1);
}

/// gRPC unary calls carrying `idempotency-key` metadata: the answer —
/// message and trailers, or an error status — is replayed without calling
/// the service again; another request under the same key is
/// INVALID_ARGUMENT. The service here is a real dedupd.
#[tokio::test]
async fn grpc_unary_calls_are_replayed_with_their_status() {
    use dedupd::proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient};
    let service = common::TestServer::start().await;
    let upstream = Upstream::elsewhere(service.addr);
    let proxy = proxy(&upstream).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", proxy.address))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = ClaimAndCommitClient::new(channel);
    fn keyed<T>(message: T, key: &str) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
        request
            .metadata_mut()
            .insert("authorization", "Bearer grpc-client".parse().unwrap());
        request
    }

    let first = client
        .claim(keyed(common::claim_request("grpc-1"), "claim-1"))
        .await
        .unwrap();
    assert!(!first.metadata().contains_key("idempotent-replayed"));
    let first = first.into_inner();
    assert_eq!(common::outcome(&first), pb::ClaimOutcome::Claimed);
    let replay = client
        .claim(keyed(common::claim_request("grpc-1"), "claim-1"))
        .await
        .unwrap();
    assert_eq!(
        replay.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(
        replay.into_inner(),
        first,
        "the same answer, lease token and all"
    );
    // The service saw one Claim: called directly, the key is still held.
    let direct = service
        .client()
        .await
        .claim(common::claim_request("grpc-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(common::outcome(&direct), pb::ClaimOutcome::InProgress);

    // An error the request itself caused is kept and replayed, status,
    // message and details.
    let wrong_token = common::commit_request("grpc-1", &"0".repeat(32));
    let refused = client
        .commit(keyed(wrong_token.clone(), "commit-1"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let replayed_refusal = client
        .commit(keyed(wrong_token, "commit-1"))
        .await
        .unwrap_err();
    assert_eq!(replayed_refusal.code(), tonic::Code::FailedPrecondition);
    assert_eq!(replayed_refusal.message(), refused.message());
    assert_eq!(replayed_refusal.details(), refused.details());
    assert_eq!(
        replayed_refusal
            .metadata()
            .get("idempotent-replayed")
            .unwrap(),
        "true"
    );

    // The same key with another request.
    let mismatch = client
        .claim(keyed(common::claim_request("grpc-2"), "claim-1"))
        .await
        .unwrap_err();
    assert_eq!(mismatch.code(), tonic::Code::InvalidArgument);
    assert!(
        mismatch.message().contains("different request"),
        "{}",
        mismatch.message()
    );

    // Without a key, calls pass straight through (the service answers
    // IN_PROGRESS: it holds grpc-1).
    let passed = client
        .claim(common::claim_request("grpc-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(common::outcome(&passed), pb::ClaimOutcome::InProgress);
}

/// With a wait for in-flight requests, a retry arriving while the first
/// runs gets its result instead of a 409.
#[tokio::test]
async fn a_retry_can_wait_for_the_first_requests_result() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.wait_in_flight = Duration::from_secs(5);
    })
    .await;
    let first = post(proxy.address, "/orders", "\"w\"", "{}");
    let retry = async {
        // Sent while the upstream (200 ms) still works on the first.
        tokio::time::sleep(Duration::from_millis(50)).await;
        post(proxy.address, "/orders", "\"w\"", "{}").await
    };
    let (first, retry) = tokio::join!(first, retry);
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.body);
    // Whichever claimed first (on a slow machine the "retry" may), the
    // other waited and got its answer replayed.
    assert_eq!(
        [replayed(&first), replayed(&retry)]
            .iter()
            .filter(|r| **r)
            .count(),
        1
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.calls.get("/orders"), 1);
}

/// Sends `request` (headers of the caller's choosing) to `/cookie` and
/// reads the answer.
async fn exchange(address: SocketAddr, request: http::request::Builder, body: &str) -> Answer {
    exchange_at(address, "/cookie", request, body).await
}

/// Sends `request` (headers of the caller's choosing) to `path` and reads
/// the answer.
async fn exchange_at(
    address: SocketAddr,
    path: &str,
    request: http::request::Builder,
    body: &str,
) -> Answer {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let request = request
        .uri(format!("http://{address}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap(),
    }
}

fn problem_type(answer: &Answer) -> String {
    let problem: serde_json::Value = serde_json::from_str(&answer.body)
        .unwrap_or_else(|_| panic!("not a problem document: {}", answer.body));
    problem["type"]
        .as_str()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .to_owned()
}

/// The upstream takes 2.5 s, the proxy waits 1 s: the client gets 502
/// outcome-unknown, and every retry — at once, while the upstream still
/// works, and after it finished — gets the same, never a second send.
#[tokio::test]
async fn a_slow_upstream_runs_once_whatever_the_client_retries() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.upstream_timeout = Duration::from_secs(1);
    })
    .await;
    let first = post(proxy.address, "/slow", "s-1", "{}").await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{}", first.body);
    assert_eq!(problem_type(&first), "outcome-unknown");
    assert!(
        first.body.contains("did not answer within 1s"),
        "{}",
        first.body
    );
    let during = post(proxy.address, "/slow", "s-1", "{}").await;
    assert_eq!(during.status, StatusCode::BAD_GATEWAY);
    assert_eq!(problem_type(&during), "outcome-unknown");
    // The upstream finishes its one call.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    for _ in 0..3 {
        let after = post(proxy.address, "/slow", "s-1", "{}").await;
        assert_eq!(after.status, StatusCode::BAD_GATEWAY);
        assert_eq!(problem_type(&after), "outcome-unknown");
    }
    assert_eq!(upstream.calls.get("/slow"), 1);
    let text = proxy.metrics.render();
    assert!(
        text.contains("dedupd_http_proxy_requests_total{result=\"outcome_unknown\"} 5"),
        "{text}"
    );
}

/// `--after-unknown-outcome retry` is the opt-in to at-least-once: the same
/// timeout releases the key and the retry is sent again.
#[tokio::test]
async fn after_unknown_outcome_retry_sends_the_retry_again() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.upstream_timeout = Duration::from_secs(1);
        config.after_unknown_outcome = AfterUnknownOutcome::Retry;
    })
    .await;
    let first = post(proxy.address, "/slow", "r-1", "{}").await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    assert_eq!(problem_type(&first), "upstream-failed");
    let retry = post(proxy.address, "/slow", "r-1", "{}").await;
    assert_eq!(problem_type(&retry), "upstream-failed");
    assert_eq!(upstream.calls.get("/slow"), 2);
}

/// A connection closed after the request was sent is an unknown outcome;
/// a connection that could not be made at all (nothing sent) releases the
/// key.
#[tokio::test]
async fn a_reset_is_an_unknown_outcome_but_a_refused_connection_releases() {
    let upstream = hanging_up_upstream().await;
    let proxy = proxy(&upstream).await;
    for _ in 0..3 {
        let answer = post(proxy.address, "/orders", "reset-1", "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{}", answer.body);
        assert_eq!(problem_type(&answer), "outcome-unknown");
    }
    assert_eq!(upstream.calls.get("/hang-up"), 1);

    // A port nobody listens on.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let nowhere = Upstream::elsewhere(closed.local_addr().unwrap());
    drop(closed);
    let refusing = self::proxy(&nowhere).await;
    for _ in 0..2 {
        let answer = post(refusing.address, "/orders", "refused-1", "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
        assert_eq!(
            problem_type(&answer),
            "upstream-failed",
            "released, so the retry is tried again: {}",
            answer.body
        );
    }
}

/// By default a record is scoped by the caller's credentials: two callers
/// with the same key (and body, and route) never see each other's body or
/// session cookie, and a caller's own retry never gets its cookie back.
#[tokio::test]
async fn two_callers_never_see_each_others_body_or_cookie() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let as_caller = |credentials: (&'static str, &'static str)| {
        Request::post("/")
            .header("idempotency-key", "shared-key")
            .header(credentials.0, credentials.1)
    };
    let alice = exchange(
        proxy.address,
        as_caller(("authorization", "Bearer alice")),
        "{}",
    )
    .await;
    assert_eq!(alice.status, StatusCode::CREATED);
    assert_eq!(alice.headers["set-cookie"], "session=Bearer-alice");
    let bob = exchange(
        proxy.address,
        as_caller(("authorization", "Bearer bob")),
        "{}",
    )
    .await;
    assert!(!replayed(&bob), "bob got alice's record: {}", bob.body);
    assert!(bob.body.contains("Bearer bob"), "{}", bob.body);
    assert_eq!(bob.headers["set-cookie"], "session=Bearer-bob");
    // Cookie-only callers are told apart by their cookies.
    let carol = exchange(proxy.address, as_caller(("cookie", "sid=carol")), "{}").await;
    let dave = exchange(proxy.address, as_caller(("cookie", "sid=dave")), "{}").await;
    assert!(!replayed(&carol) && !replayed(&dave));
    assert_eq!(upstream.calls.get("/cookie"), 4);

    let alice_again = exchange(
        proxy.address,
        as_caller(("authorization", "Bearer alice")),
        "{}",
    )
    .await;
    assert!(replayed(&alice_again));
    assert_eq!(alice_again.body, alice.body);
    assert!(
        !alice_again.headers.contains_key("set-cookie"),
        "a replay never hands out a session"
    );
    assert_eq!(upstream.calls.get("/cookie"), 4);

    // A second Authorization value is part of the identity: it cannot be
    // used to step into alice's record.
    let smuggled = exchange(
        proxy.address,
        as_caller(("authorization", "Bearer alice")).header("authorization", "Bearer mallory"),
        "{}",
    )
    .await;
    assert!(!replayed(&smuggled));

    // Named scope headers: every value of each, in order.
    let by_tenant = proxy_with(&upstream, |config| {
        config.scope = CallerScope::Headers(vec![http::HeaderName::from_static("x-tenant")]);
        config.never_store = vec![http::HeaderName::from_static("x-upstream-call")];
    })
    .await;
    let t1 = exchange(by_tenant.address, as_caller(("x-tenant", "t1")), "{}").await;
    let t1_t2 = exchange(
        by_tenant.address,
        as_caller(("x-tenant", "t1")).header("x-tenant", "t2"),
        "{}",
    )
    .await;
    assert!(!replayed(&t1_t2), "a second value chose another scope");
    let t1_again = exchange(by_tenant.address, as_caller(("x-tenant", "t1")), "{}").await;
    assert!(replayed(&t1_again));
    assert!(t1.headers.contains_key("x-upstream-call"));
    assert!(
        !t1_again.headers.contains_key("x-upstream-call"),
        "--never-store-header is neither stored nor replayed"
    );
}

/// Stripe's bare keys and the draft's quoted ones are the same key;
/// `--strict-key-syntax` accepts only the draft's.
#[tokio::test]
async fn bare_and_quoted_keys_dedupe_together() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let bare = post(proxy.address, "/orders", uuid, "{}").await;
    assert_eq!(bare.status, StatusCode::CREATED, "{}", bare.body);
    let quoted = post(proxy.address, "/orders", &format!("\"{uuid}\""), "{}").await;
    assert!(replayed(&quoted));
    assert_eq!(quoted.body, bare.body);
    assert_eq!(upstream.calls.get("/orders"), 1);

    let strict = proxy_with(&upstream, |config| config.key_syntax = KeySyntax::Strict).await;
    let refused = post(strict.address, "/orders", uuid, "{}").await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(problem_type(&refused), "invalid-idempotency-key");
    assert_eq!(upstream.calls.get("/orders"), 1);
}

/// Issue 40 item 2: tenants identified by `X-API-Key` alone never share a
/// record; a keyed request that names no caller is refused before its
/// body is read (unless the operator said `--scope none`); an account
/// header named with `--fingerprint-header` makes the same key and body
/// for another account a mismatch, never the first account's answer.
#[tokio::test]
async fn callers_are_always_told_apart_and_anonymous_keyed_requests_are_refused() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.fingerprint_headers = vec![http::HeaderName::from_static("stripe-account")];
    })
    .await;
    let keyed = |headers: &[(&'static str, &'static str)]| {
        let mut request = Request::post("/").header("idempotency-key", "card-charge");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request
    };
    let tenant_a = exchange(proxy.address, keyed(&[("x-api-key", "key-a")]), "{}").await;
    let tenant_b = exchange(proxy.address, keyed(&[("x-api-key", "key-b")]), "{}").await;
    assert_eq!(tenant_a.status, StatusCode::CREATED);
    assert_eq!(tenant_b.status, StatusCode::CREATED);
    assert!(
        !replayed(&tenant_b),
        "tenant B got tenant A's stored answer"
    );
    assert_eq!(upstream.calls.get("/cookie"), 2);

    let anonymous = exchange(proxy.address, keyed(&[]), "{}").await;
    assert_eq!(
        anonymous.status,
        StatusCode::BAD_REQUEST,
        "{}",
        anonymous.body
    );
    assert_eq!(problem_type(&anonymous), "caller-unidentified");
    assert!(anonymous.body.contains("X-API-Key"), "{}", anonymous.body);
    assert_eq!(upstream.calls.get("/cookie"), 2, "not forwarded");

    let account = |id: &'static str| {
        Request::post("/")
            .header("idempotency-key", "payout")
            .header("x-api-key", "key-a")
            .header("stripe-account", id)
    };
    let first = exchange(proxy.address, account("acct_1"), "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = exchange(proxy.address, account("acct_2"), "{}").await;
    assert_eq!(
        other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        other.body
    );
    assert_eq!(problem_type(&other), "idempotency-key-reused");
    assert_eq!(upstream.calls.get("/cookie"), 3);

    let shared = proxy_with(&upstream, |config| config.scope = CallerScope::Shared).await;
    let anonymous = exchange(shared.address, keyed(&[]), "{}").await;
    assert_eq!(anonymous.status, StatusCode::CREATED);
    assert_eq!(upstream.calls.get("/cookie"), 4);
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

/// Writes `request` on a new connection as it is and reads the first
/// answer bytes (within 5 s).
async fn raw_answer(address: SocketAddr, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    socket.write_all(request).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(5), socket.read(&mut answer))
        .await
        .expect("an answer within 5 s")
        .unwrap();
    String::from_utf8_lossy(&answer[..read]).into_owned()
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

/// Two IDs a double cannot tell apart are two payloads: the second is 422,
/// not the first one's answer.
#[tokio::test]
async fn numbers_beyond_2_pow_53_are_not_confused() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let first = post(
        proxy.address,
        "/echo",
        "big-id",
        r#"{"id":9007199254740993}"#,
    )
    .await;
    assert_eq!(first.status, StatusCode::OK);
    let other = post(
        proxy.address,
        "/echo",
        "big-id",
        r#"{"id":9007199254740992}"#,
    )
    .await;
    assert_eq!(
        other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        other.body
    );
    let same = post(
        proxy.address,
        "/echo",
        "big-id",
        r#"{ "id": 9007199254740993 }"#,
    )
    .await;
    assert!(replayed(&same));
    assert_eq!(upstream.calls.get("/echo"), 1);
}

/// Issue 40 item 5: the store applies the claim but its answers are lost
/// (the proxy answers 503, nothing sent). The claim is given back in the
/// background once the store answers again, so the client's retry is sent
/// — it used to find the key held (409) for the lease, then "outcome
/// unknown" for the retention, though nothing was ever sent.
#[tokio::test]
async fn a_claim_whose_answer_was_lost_is_given_back_and_the_retry_is_sent() {
    let upstream = upstream().await;
    let lose = Arc::new(AtomicBool::new(true));
    let store = common::FailingStore::losing_answers(Arc::default(), Arc::clone(&lose));
    let proxy = proxy_on(&upstream, store, tempfile::tempdir().unwrap(), |config| {
        config.lease_ttl = Duration::from_secs(8);
    })
    .await;
    let first = post(proxy.address, "/orders", "lost-claim", "{}").await;
    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        first.body
    );
    assert_eq!(problem_type(&first), "store-unavailable");
    lose.store(false, Ordering::SeqCst);
    let started = Instant::now();
    let mut retry = post(proxy.address, "/orders", "lost-claim", "{}").await;
    while retry.status == StatusCode::CONFLICT && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        retry = post(proxy.address, "/orders", "lost-claim", "{}").await;
    }
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.body);
    assert!(!replayed(&retry));
    assert_eq!(upstream.calls.get("/orders"), 1, "sent once, by the retry");
}

/// The store stops taking writes the moment the upstream answers. A short
/// outage: the commit is retried (the lease renewed) and the answer is
/// replayable. A long one: the client gets the answer marked
/// `idempotency-replayable: false`, and a retry — once the store is back
/// and the lease over — is answered outcome-unknown, not sent again.
#[tokio::test]
async fn a_store_outage_between_the_answer_and_the_commit() {
    let upstream = upstream().await;
    let store = common::FailingStore::new(Arc::clone(&upstream.store_down));
    let proxy = proxy_on(&upstream, store, tempfile::tempdir().unwrap(), |config| {
        config.lease_ttl = Duration::from_secs(2);
    })
    .await;
    let heal = |after: Duration| {
        let down = Arc::clone(&upstream.store_down);
        tokio::spawn(async move {
            while !down.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(after).await;
            down.store(false, Ordering::SeqCst);
        })
    };

    let healing = heal(Duration::from_millis(400));
    let first = post(proxy.address, "/outage", "brief", "{}").await;
    healing.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.headers.contains_key("idempotency-replayable"));
    let retry = post(proxy.address, "/outage", "brief", "{}").await;
    assert!(replayed(&retry), "{}", retry.body);
    assert_eq!(upstream.calls.get("/outage"), 1);

    let healing = heal(Duration::from_secs(3));
    let first = post(proxy.address, "/outage", "long", "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.headers["idempotency-replayable"], "false");
    healing.await.unwrap();
    // The claim's lease (2 s) has ended by now: the retry recovers it.
    let mut retry = post(proxy.address, "/outage", "long", "{}").await;
    for _ in 0..100 {
        if retry.status != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        retry = post(proxy.address, "/outage", "long", "{}").await;
    }
    assert_eq!(retry.status, StatusCode::BAD_GATEWAY, "{}", retry.body);
    assert_eq!(problem_type(&retry), "outcome-unknown");
    assert_eq!(upstream.calls.get("/outage"), 2, "one call per key");
}

fn proxy_address(sidecar: &common::sidecar::Sidecar) -> SocketAddr {
    sidecar.ready["http_proxy"]
        .as_str()
        .and_then(|address| address.parse().ok())
        .unwrap_or_else(|| panic!("no proxy address in {}", sidecar.ready))
}

/// Issue 40 item 9: under Kubernetes, the proxy on the embedded store warns
/// at start that replicas do not share its records (a retry sent to
/// another pod is forwarded again); elsewhere it says nothing of it.
#[test]
fn the_proxy_on_the_embedded_store_warns_under_kubernetes() {
    // Empty, not unset: the tests may themselves run in a pod.
    for (host, warned) in [("10.96.0.1", true), ("", false)] {
        let environment = [("KUBERNETES_SERVICE_HOST", host)];
        let data = tempfile::tempdir().unwrap();
        let mut sidecar = common::sidecar::Sidecar::start_in_environment(
            &[],
            data.path(),
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "http://127.0.0.1:1",
            ],
            &environment,
        );
        common::sidecar::terminate(&mut sidecar, Duration::from_secs(20));
        let log = sidecar.log_after_exit();
        assert_eq!(
            log.contains("a retry that reaches another pod is forwarded again"),
            warned,
            "{log}"
        );
    }
}

/// Issue 40 item 9, decided: the route is the path as sent —
/// `/echo` and `/echo/` are two records, as they may be two resources to
/// the service (one may redirect, and its 308 is what a retry of it gets).
#[tokio::test]
async fn a_trailing_slash_is_another_route() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for path in ["/echo", "/echo/", "/echo"] {
        post(proxy.address, path, "\"slash\"", "{}").await;
    }
    assert_eq!(upstream.calls.get("/echo"), 1);
    assert_eq!(upstream.calls.get("/echo/"), 1);
}

/// Issue 40 item 3: one caller sending large keyed bodies slowly holds at
/// most its share of the proxy's body budget (429 past it), so another
/// caller's payment still goes through — eight such bodies used to take
/// the whole budget and every other keyed request got 503.
#[tokio::test]
async fn one_caller_with_slow_bodies_cannot_starve_another() {
    use tokio::io::AsyncWriteExt;
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| config.max_request_bytes = 8 << 20).await;
    let declared = 8 << 20;
    let mut held = Vec::new();
    let mut refused = 0;
    for attacker in 0..8 {
        let mut socket = tokio::net::TcpStream::connect(proxy.address).await.unwrap();
        let head = format!(
            "POST /echo HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-{attacker}\r\n\
             Authorization: Bearer mallory\r\nContent-Type: application/json\r\n\
             Content-Length: {declared}\r\n\r\n"
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        // All but the last byte; a refused body may be cut off mid-write.
        let body = vec![b' '; declared - 1];
        let written = tokio::time::timeout(Duration::from_secs(5), socket.write_all(&body)).await;
        if !matches!(written, Ok(Ok(()))) {
            refused += 1;
        }
        held.push(socket);
    }
    // Mallory's share (16 MiB) holds two bodies: the other six are refused
    // once the proxy has read past it.
    let overloaded = "dedupd_http_proxy_requests_total{result=\"caller_overloaded\"} 6";
    let started = Instant::now();
    while !proxy.metrics.render().contains(overloaded)
        && started.elapsed() < Duration::from_secs(20)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let payment = send(
        proxy.address,
        Method::POST,
        "/echo",
        Some("payment-1"),
        Some("Bearer alice"),
        "{\"amount\":10}",
    )
    .await;
    assert_eq!(payment.status, StatusCode::OK, "{}", payment.body);
    let text = proxy.metrics.render();
    assert!(
        text.contains(overloaded),
        "mallory's bodies past its share were refused ({refused} writes cut off):\n{text}"
    );
    drop(held);
}

/// Where the test upstream counts the connections it accepted.
const CONNECTIONS: &str = "#connections";

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

/// Through the binary on `store_flags`: the slow upstream's request is
/// sent once whatever the client retries, and a proxy killed with SIGKILL
/// while the upstream works leaves a claim the next proxy answers
/// outcome-unknown instead of sending again.
async fn at_most_once_through_the_binary(store_flags: &[&str]) {
    let upstream = upstream().await;
    let data = tempfile::tempdir().unwrap();
    let upstream_url = format!("http://{}", upstream.address);
    let mut flags = store_flags.to_vec();
    flags.extend([
        "--http-proxy-listen",
        "127.0.0.1:0",
        "--http-proxy-upstream",
        &upstream_url,
        "--http-proxy-upstream-timeout",
        "1s",
        "--default-lease-ttl",
        "2s",
    ]);
    let sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let address = proxy_address(&sidecar);
    for attempt in 0..3 {
        let answer = post(address, "/slow", "timed-out", "{}").await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_GATEWAY,
            "attempt {attempt}: {}",
            answer.body
        );
        assert_eq!(problem_type(&answer), "outcome-unknown");
    }
    assert_eq!(upstream.calls.get("/slow"), 1);

    // Killed while the upstream works on the request (well within the
    // proxy's 1 s timeout).
    let in_flight = tokio::spawn(async move {
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .build_http::<Full<Bytes>>();
        let request = Request::post(format!("http://{address}/slow"))
            .header("idempotency-key", "killed")
            .header("authorization", CALLER)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        client
            .request(request)
            .await
            .map(|response| response.status())
    });
    tokio::time::timeout(Duration::from_secs(5), async {
        while upstream.calls.get("/slow") < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the request reached the upstream");
    sidecar.kill_9();
    assert!(
        in_flight.await.unwrap().is_err(),
        "the killed proxy answered nothing"
    );

    let sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let address = proxy_address(&sidecar);
    let mut answer = post(address, "/slow", "killed", "{}").await;
    // In progress until the dead proxy's lease (2 s) ends.
    for _ in 0..100 {
        if answer.status != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        answer = post(address, "/slow", "killed", "{}").await;
    }
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{}", answer.body);
    assert_eq!(problem_type(&answer), "outcome-unknown");
    assert!(answer.body.contains("earlier attempt"), "{}", answer.body);
    let again = post(address, "/slow", "killed", "{}").await;
    assert_eq!(problem_type(&again), "outcome-unknown");
    // Whatever the killed proxy's upstream call did, it was the only one.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(upstream.calls.get("/slow"), 2);
    drop(sidecar);
}

#[tokio::test]
async fn at_most_once_across_timeouts_and_a_kill_9_on_sled() {
    at_most_once_through_the_binary(&[]).await;
}

#[tokio::test]
async fn at_most_once_across_timeouts_and_a_kill_9_on_postgres() {
    if !common::postgres::available() {
        return;
    }
    let schema = common::postgres::fresh_schema();
    at_most_once_through_the_binary(&[
        "--store",
        "postgres",
        "--store-url",
        common::postgres::url(),
        "--store-schema",
        &schema,
    ])
    .await;
    common::postgres::drop_schema(&schema).await;
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

/// A 504 (or, by default, a 503: Envoy's "upstream reset before headers")
/// from a gateway in front of the service means the service may have
/// acted: the first client gets that answer, retries get outcome-unknown.
#[tokio::test]
async fn a_gateway_timeout_is_an_unknown_outcome() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for (path, status, body) in [
        (
            "/gateway-timeout",
            StatusCode::GATEWAY_TIMEOUT,
            "upstream request timeout",
        ),
        ("/shed", StatusCode::SERVICE_UNAVAILABLE, "shedding"),
    ] {
        let first = post(proxy.address, path, "gw-1", "{}").await;
        assert_eq!(first.status, status);
        assert_eq!(first.body, body);
        let retry = post(proxy.address, path, "gw-1", "{}").await;
        assert_eq!(retry.status, StatusCode::BAD_GATEWAY);
        assert_eq!(problem_type(&retry), "outcome-unknown");
        assert!(retry.body.contains(status.as_str()), "{}", retry.body);
        assert_eq!(upstream.calls.get(path), 1);
    }
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
    let stream = tokio::net::TcpStream::connect(proxy.address).await.unwrap();
    let (mut client, connection) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, Bytes>(stream)
        .await
        .unwrap();
    tokio::spawn(connection);
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
    let stream = tokio::net::TcpStream::connect(proxy.address).await.unwrap();
    let (mut client, connection) = h2::client::handshake(stream).await.unwrap();
    tokio::spawn(connection);
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

/// Issue 40, items 1–4, 7 and 8 as the payments team tried them: against
/// the real binary, one scenario after another on one sidecar, then its
/// shutdown and a restart on the same data.
#[tokio::test]
async fn the_issues_scenarios_through_the_binary() {
    use tokio::io::AsyncWriteExt;
    let upstream = upstream().await;
    let data = tempfile::tempdir().unwrap();
    let upstream_url = format!("http://{}", upstream.address);
    let flags = [
        "--http-proxy-listen",
        "127.0.0.1:0",
        "--http-proxy-upstream",
        &upstream_url,
        "--http-proxy-header-timeout",
        "1s",
        "--max-connection-age",
        "2s",
        "--shutdown-grace",
        "8s",
    ];
    let mut sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let address = proxy_address(&sidecar);

    // 1. A 500 after the work is the outcome: retries are replays.
    assert_eq!(
        post(address, "/flaky", "charge-1", "{}").await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    for _ in 0..2 {
        let retry = post(address, "/flaky", "charge-1", "{}").await;
        assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(replayed(&retry), "{:?}", retry.headers);
    }
    assert_eq!(upstream.calls.get("/flaky"), 1, "the work ran once");

    // 2. Tenants told apart by X-API-Key alone; no identity at all is 400.
    let tenant = |api_key: &'static str| {
        Request::post("/")
            .header("x-api-key", api_key)
            .header("idempotency-key", "same-key")
    };
    let a = exchange_at(address, "/orders", tenant("tenant-a"), "{}").await;
    let b = exchange_at(address, "/orders", tenant("tenant-b"), "{}").await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(
        !replayed(&b),
        "tenant B was given tenant A's answer: {}",
        b.body
    );
    assert_ne!(a.body, b.body);
    let a_again = exchange_at(address, "/orders", tenant("tenant-a"), "{}").await;
    assert!(replayed(&a_again));
    assert_eq!(a_again.body, a.body);
    let anonymous = exchange_at(
        address,
        "/orders",
        Request::post("/").header("idempotency-key", "same-key"),
        "{}",
    )
    .await;
    assert_eq!(anonymous.status, StatusCode::BAD_REQUEST);
    assert_eq!(problem_type(&anonymous), "caller-unidentified");
    assert_eq!(upstream.calls.get("/orders"), 2);

    // 3. Eight slow 8 MiB bodies from one caller: another's payment goes
    // through.
    let mut held = Vec::new();
    for attacker in 0..8 {
        let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
        let head = format!(
            "POST /echo HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-{attacker}\r\n\
             Authorization: Bearer mallory\r\nContent-Length: {}\r\n\r\n",
            8 << 20
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        let body = vec![b' '; (8 << 20) - 1];
        let _ = tokio::time::timeout(Duration::from_secs(5), socket.write_all(&body)).await;
        held.push(socket);
    }
    let payment = send(
        address,
        Method::POST,
        "/echo",
        Some("payment-1"),
        Some("Bearer alice"),
        "{\"amount\":10}",
    )
    .await;
    assert_eq!(payment.status, StatusCode::OK, "{}", payment.body);
    drop(held);

    // 4. Two key lines: 400, never forwarded.
    let twice = exchange_at(
        address,
        "/orders",
        Request::post("/")
            .header("authorization", CALLER)
            .header("idempotency-key", "k1")
            .header("idempotency-key", "k2"),
        "{}",
    )
    .await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST);
    assert_eq!(upstream.calls.get("/orders"), 2);

    // 7. An HTTP/2 client that makes no room for its answer has its stream
    // reset; one that only answers PINGs is closed at its age.
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let (mut client, connection) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, Bytes>(stream)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    let request = Request::get(format!("http://{address}/big?mib=1"))
        .body(())
        .unwrap();
    let (response, _) = client.send_request(request, true).unwrap();
    let response = response.await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(10), response.into_body().data())
        .await
        .expect("the zero-window stream was still open after 10 s");
    assert!(matches!(next, Some(Err(_))), "{next:?}");
    drop(client);
    tokio::time::timeout(Duration::from_secs(10), connection)
        .await
        .expect("the HTTP/2 connection was still open past its age")
        .unwrap()
        .ok();

    // 8. SIGTERM while a keyed request is with the service (2.5 s): it is
    // answered and committed within the grace; after a restart, replayed.
    let calls_before = upstream.calls.get("/slow");
    let in_flight = tokio::spawn(async move { post(address, "/slow", "at-shutdown", "{}").await });
    while upstream.calls.get("/slow") == calls_before {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Off the runtime: the upstream answers from this test's runtime.
    let (code, log) = tokio::task::spawn_blocking(move || {
        common::sidecar::terminate(&mut sidecar, Duration::from_secs(15))
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{log}");
    let answered = in_flight.await.unwrap();
    assert_eq!(answered.status, StatusCode::CREATED, "{}", answered.body);
    let sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let retry = post(proxy_address(&sidecar), "/slow", "at-shutdown", "{}").await;
    assert!(replayed(&retry), "{} {}", retry.status, retry.body);
    assert_eq!(retry.body, answered.body);
    assert_eq!(upstream.calls.get("/slow"), calls_before + 1);
}
