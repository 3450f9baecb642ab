//! The HTTP proxy's test set-up, shared by `tests/proxy.rs` (what is
//! forwarded, stored and replayed) and `tests/proxy_connections.rs` (the
//! connections on both sides): an upstream that counts its calls, the proxy
//! served in-process on sled through the production `serve`, and clients.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use dedupd::{
    clock::SystemClock,
    engine::Engine,
    proxy::{
        idempotency::{CallerScope, KeySyntax, ReleaseOn},
        server::{serve, AfterUnknownOutcome, ProxyConfig},
    },
    sealing::Keyring,
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
pub struct Upstream {
    pub address: SocketAddr,
    pub calls: Arc<counts::Counts>,
    /// Set by a call to `/outage`: a [`super::FailingStore`] built on it
    /// stops taking writes between the upstream's answer and the commit.
    pub store_down: Arc<AtomicBool>,
}

/// `/big`'s chunk.
pub const BIG_CHUNK: usize = 64 << 10;

pub mod counts {
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
    pub fn elsewhere(address: SocketAddr) -> Upstream {
        Upstream {
            address,
            calls: Arc::new(counts::Counts::default()),
            store_down: Arc::new(AtomicBool::new(false)),
        }
    }
}

pub async fn upstream() -> Upstream {
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
pub async fn hanging_up_upstream() -> Upstream {
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

pub struct Proxy {
    pub address: SocketAddr,
    pub metrics: Arc<dedupd::Metrics>,
    pub _dir: tempfile::TempDir,
    /// Dropped (or sent): the proxy shuts down.
    pub stop: tokio::sync::oneshot::Sender<()>,
    /// The proxy's `serve`, which ends once its shutdown is over.
    pub served: tokio::task::JoinHandle<std::io::Result<()>>,
}

pub async fn proxy(upstream: &Upstream) -> Proxy {
    proxy_with(upstream, |_| {}).await
}

pub async fn proxy_with(upstream: &Upstream, adjust: impl FnOnce(&mut ProxyConfig)) -> Proxy {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(&SledConfig::new(dir.path().join("data"))).unwrap();
    proxy_on(upstream, store, dir, adjust).await
}

pub async fn proxy_on<S: Store>(
    upstream: &Upstream,
    store: S,
    dir: tempfile::TempDir,
    adjust: impl FnOnce(&mut ProxyConfig),
) -> Proxy {
    proxy_on_engine(
        upstream,
        Engine::new(Arc::new(store), Arc::new(SystemClock)),
        dir,
        adjust,
    )
    .await
}

/// A proxy on the sled store in `dir` whose answers are sealed with
/// `keyring`.
pub async fn sealed_proxy(
    upstream: &Upstream,
    dir: tempfile::TempDir,
    keyring: Option<Arc<Keyring>>,
) -> Proxy {
    let store = SledStore::open(&SledConfig::new(dir.path().join("data"))).unwrap();
    let engine = Engine::new(Arc::new(store), Arc::new(SystemClock)).with_keyring(keyring);
    proxy_on_engine(upstream, engine, dir, |_| {}).await
}

async fn proxy_on_engine<S: Store>(
    upstream: &Upstream,
    engine: Engine<S>,
    dir: tempfile::TempDir,
    adjust: impl FnOnce(&mut ProxyConfig),
) -> Proxy {
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

#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: String,
}

pub async fn send(
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
pub fn http2_client() -> hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
> {
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>()
}

/// A POST with `key` from one caller: most tests' request.
pub async fn post(address: SocketAddr, path: &str, key: &str, body: &str) -> Answer {
    send(address, Method::POST, path, Some(key), Some(CALLER), body).await
}

/// The caller of [`post`].
pub const CALLER: &str = "Bearer test-client";

pub fn replayed(answer: &Answer) -> bool {
    answer
        .headers
        .get("idempotent-replayed")
        .is_some_and(|value| value == "true")
}

/// Sends `request` (headers of the caller's choosing) to `/cookie` and
/// reads the answer.
pub async fn exchange(address: SocketAddr, request: http::request::Builder, body: &str) -> Answer {
    exchange_at(address, "/cookie", request, body).await
}

/// Sends `request` (headers of the caller's choosing) to `path` and reads
/// the answer.
pub async fn exchange_at(
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

pub fn problem_type(answer: &Answer) -> String {
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

/// Writes `request` on a new connection as it is and reads the first
/// answer bytes (within 5 s).
pub async fn raw_answer(address: SocketAddr, request: &[u8]) -> String {
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

pub fn proxy_address(sidecar: &super::sidecar::Sidecar) -> SocketAddr {
    sidecar.ready["http_proxy"]
        .as_str()
        .and_then(|address| address.parse().ok())
        .unwrap_or_else(|| panic!("no proxy address in {}", sidecar.ready))
}

/// Where the test upstream counts the connections it accepted.
pub const CONNECTIONS: &str = "#connections";

/// An HTTP/2 connection (prior knowledge) to `address` granting each
/// stream `window` bytes, driven in the background: its sender, and the
/// connection's task (ended when the proxy closes it).
pub async fn h2_connection(
    address: SocketAddr,
    window: u32,
) -> (
    h2::client::SendRequest<Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let (client, connection) = h2::client::Builder::new()
        .initial_window_size(window)
        .handshake::<_, Bytes>(stream)
        .await
        .unwrap();
    (client, tokio::spawn(connection))
}

/// Eight connections from one caller ("mallory"), each sending a keyed
/// `POST /echo` announcing 8 MiB and all of it but the last byte: the
/// sockets, held open, and how many writes were cut off (a refused body).
pub async fn slow_bodies(address: SocketAddr) -> (Vec<tokio::net::TcpStream>, usize) {
    use tokio::io::AsyncWriteExt;
    let declared = 8 << 20;
    let mut held = Vec::new();
    let mut refused = 0;
    for attacker in 0..8 {
        let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
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
    (held, refused)
}

/// Another caller's ("alice") keyed payment, `POST /echo`.
pub async fn payment(address: SocketAddr) -> Answer {
    send(
        address,
        Method::POST,
        "/echo",
        Some("payment-1"),
        Some("Bearer alice"),
        "{\"amount\":10}",
    )
    .await
}
