//! Hostile clients against the sidecar's HTTP idempotency proxy
//! (`hostile --target proxy`). The runner serves the upstream itself
//! ([`Upstream`]: 201 to everything) and starts the sidecar with the proxy
//! in front of it and 3 s head and body deadlines ([`Upstream::sidecar_flags`]).
//! The well-behaved client is one HTTP/1.1 keep-alive connection sending
//! `POST /orders` with a fresh `Idempotency-Key` each time.
//!
//! The attacks write HTTP/1.1 by hand on raw sockets:
//! - `idle-tcp`: connections that send nothing;
//! - `slowloris`: a request head sent a byte a second, never ended;
//! - `slow-body`: a keyed request whose 1 MB body comes 10 bytes a second;
//! - `big-headers`: a request head carrying a 1 MiB header value;
//! - `non-reading`: keyed `POST /big` requests (a 60 KiB answer each),
//!   pipelined 32 a write, and not one byte of the answers read;
//! - `slow-unkeyed-body`: a request without a key, streamed through, whose
//!   1 MB body comes 10 bytes a second;
//!
//! and HTTP/2 by hand ([`crate::h2raw`]):
//! - `idle-h2`: connections that send the preface and SETTINGS, then only
//!   answer PINGs (closed at the maximum connection age, [`MAX_AGE`]);
//! - `zero-window-h2`: connections granting no stream window that open 32
//!   keyed `POST /big` streams and never make room for an answer;
//! - `tiny-window-h2`: the same granting one byte, for `POST /orders`'s
//!   small answers (an answer handed to h2 whole outlived its stream's task).

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
        Arc, OnceLock,
    },
    time::{Duration, Instant},
};

use http_body_util::{BodyExt, Full};
use hyper::{
    body::{Bytes, Incoming},
    header::{HeaderValue, CONTENT_TYPE},
    Request, Response, StatusCode, Uri,
};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::{TokioExecutor, TokioIo},
};
use tokio::{
    io::AsyncWriteExt,
    net::{TcpListener, TcpStream},
    task::JoinSet,
};

use super::{AttackCounters, HostileConfig, Latencies, PhaseReport, WellBehaved};
use crate::{h2raw, sidecar::Sidecar};

/// The attacks on the proxy, in the order they run.
pub const PROXY_ATTACKS: [&str; 9] = [
    "idle-tcp",
    "idle-h2",
    "slowloris",
    "slow-body",
    "slow-unkeyed-body",
    "big-headers",
    "non-reading",
    "zero-window-h2",
    "tiny-window-h2",
];

/// The proxy's head and body deadlines in this run
/// (`--http-proxy-header-timeout`, `--http-proxy-body-timeout`); the head
/// deadline is also its deadline for a connection's first bytes.
pub const DEADLINE: Duration = Duration::from_secs(3);

/// The sidecar's `--max-connection-age` in this run: an HTTP/2 connection
/// is closed within a tenth more (HTTP/1 ones are exempt, so the
/// well-behaved client's stays).
pub const MAX_AGE: Duration = Duration::from_secs(4);

/// The streams each `zero-window-h2` and `tiny-window-h2` connection opens.
pub const WINDOW_STREAMS: u32 = 32;

/// What one connection that never reads may pin in the proxy, KiB, over
/// the configured memory bound: the answer hyper is stuck writing (60 KiB,
/// queued as it is), its head buffer (at most 64 KiB, the proxy's head
/// limit) and the handler's state for the request in progress (its gathered
/// upstream answer, 60 KiB, and the upstream connection): some 200 KiB,
/// allowed 2 MiB for the allocator's slack. Not in it: the answers these
/// requests commit (some 60 a connection before the socket buffers fill),
/// which the store keeps as it keeps anyone's.
pub const UNREAD_CONNECTION_KIB: u64 = 2 << 10;

/// The upstream's answer to `/big`, bytes.
const BIG_ANSWER_BYTES: usize = 60 << 10;

/// The upstream the proxy forwards to, serving HTTP/1.1 on loopback: 201
/// to every request, with 60 KiB for `/big` and `{"ok":true}` otherwise.
/// Stopped when dropped.
#[derive(Debug)]
pub struct Upstream {
    /// Where it listens.
    pub address: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl Upstream {
    /// Binds 127.0.0.1:0 and serves.
    pub async fn start() -> Result<Upstream, String> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("the upstream cannot listen: {e}"))?;
        let address = listener
            .local_addr()
            .map_err(|e| format!("the upstream's address: {e}"))?;
        let server = tokio::spawn(async move {
            // Owned here: aborting the server drops every connection.
            let mut connections = JoinSet::new();
            loop {
                while connections.try_join_next().is_some() {}
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                connections.spawn(async move {
                    let service = hyper::service::service_fn(answer);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Upstream { address, server })
    }

    /// The sidecar's flags that put its proxy in front of this upstream,
    /// with [`DEADLINE`] for heads and bodies.
    pub fn sidecar_flags(&self) -> Vec<String> {
        let deadline = humantime::format_duration(DEADLINE).to_string();
        vec![
            "--max-connection-age".into(),
            humantime::format_duration(MAX_AGE).to_string(),
            "--http-proxy-listen".into(),
            "127.0.0.1:0".into(),
            "--http-proxy-upstream".into(),
            format!("http://{}", self.address),
            "--http-proxy-header-timeout".into(),
            deadline.clone(),
            "--http-proxy-body-timeout".into(),
            deadline,
        ]
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn answer(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    static BIG: OnceLock<Bytes> = OnceLock::new();
    let body = if request.uri().path() == "/big" {
        BIG.get_or_init(|| Bytes::from(vec![b'x'; BIG_ANSWER_BYTES]))
            .clone()
    } else {
        Bytes::from_static(br#"{"ok":true}"#)
    };
    // The request's body is read whole, as a service does.
    let _ = request.into_body().collect().await;
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = StatusCode::CREATED;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(response)
}

/// The well-behaved client: one pooled HTTP/1.1 keep-alive connection.
struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    orders: Uri,
}

impl HttpClient {
    /// `POST /orders` with `key`, within 5 s: the answer's status, its body
    /// read whole.
    async fn order(&self, key: &str) -> Result<StatusCode, String> {
        let request = Request::post(self.orders.clone())
            .header("idempotency-key", key)
            .header("authorization", "Bearer client")
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .map_err(|e| e.to_string())?;
        let answered = tokio::time::timeout(Duration::from_secs(5), async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            let status = response.status();
            response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?;
            Ok(status)
        })
        .await;
        answered.unwrap_or_else(|_| Err("no answer within 5 s".into()))
    }
}

impl WellBehaved for HttpClient {
    async fn work(&mut self, prefix: &str, duration: Duration) -> Latencies {
        let mut latencies = Latencies::default();
        let end = Instant::now() + duration;
        let mut i = 0u64;
        while Instant::now() < end {
            i += 1;
            let started = Instant::now();
            match self.order(&format!("good-{prefix}-{i}")).await {
                Ok(StatusCode::CREATED) => {
                    latencies.samples.push(started.elapsed().as_micros() as u32)
                }
                Ok(status) => latencies.failed(format!("POST /orders: {status}")),
                Err(error) => latencies.failed(format!("POST /orders: {error}")),
            }
        }
        latencies
    }
}

/// Runs the phases against `sidecar`'s proxy.
pub(super) async fn run(
    sidecar: &Sidecar,
    config: &HostileConfig,
    attacks: &[&str],
) -> Result<Vec<PhaseReport>, String> {
    let address = sidecar
        .http_proxy
        .ok_or("the sidecar announced no HTTP proxy in its ready file")?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let mut client = HttpClient {
        client: Client::builder(TokioExecutor::new()).build(connector),
        orders: format!("http://{address}/orders")
            .parse()
            .map_err(|e| format!("the proxy's URI: {e}"))?,
    };
    // Through the proxy to the upstream and back, before anything else.
    match client.order("good-check").await {
        Ok(StatusCode::CREATED) => {}
        Ok(status) => return Err(format!("the proxy answered {status}, not 201 Created")),
        Err(error) => return Err(format!("the well-behaved client got no answer: {error}")),
    }
    super::phases(sidecar, config, attacks, address, &mut client).await
}

/// Sleeps `duration`, ending early when `stop` or `closed` is set.
async fn pause(duration: Duration, stop: &AtomicBool, closed: &AtomicBool) {
    let end = Instant::now() + duration;
    while Instant::now() < end && !stop.load(Relaxed) && !closed.load(Relaxed) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Writes `opening`, then `trickle` byte after byte (cycling), `per_pause`
/// bytes every second, reading and dropping whatever the proxy sends, until
/// stopped; `Err` when the proxy closed the connection.
async fn trickle(
    socket: TcpStream,
    counters: &AttackCounters,
    stop: &AtomicBool,
    opening: &[u8],
    trickle: &[u8],
    per_pause: usize,
) -> Result<(), ()> {
    let (reader, mut writer) = socket.into_split();
    let closed = Arc::new(AtomicBool::new(false));
    super::drain(reader, Arc::clone(&closed));
    writer.write_all(opening).await.map_err(drop)?;
    counters.streams.fetch_add(1, Relaxed);
    counters.bytes.fetch_add(opening.len() as u64, Relaxed);
    let mut bytes = trickle.iter().copied().cycle();
    while !stop.load(Relaxed) && !closed.load(Relaxed) {
        pause(Duration::from_secs(1), stop, &closed).await;
        if stop.load(Relaxed) || closed.load(Relaxed) {
            break;
        }
        let some: Vec<u8> = bytes.by_ref().take(per_pause).collect();
        writer.write_all(&some).await.map_err(drop)?;
        counters.bytes.fetch_add(some.len() as u64, Relaxed);
    }
    if closed.load(Relaxed) {
        Err(())
    } else {
        Ok(())
    }
}

/// A request line and a header, then more header lines a byte a second:
/// the head never ends.
pub(super) async fn slowloris(
    socket: TcpStream,
    counters: &AttackCounters,
    stop: &AtomicBool,
) -> Result<(), ()> {
    let opening = b"POST /orders HTTP/1.1\r\nHost: x\r\n";
    trickle(socket, counters, stop, opening, b"X-Slowloris: 1\r\n", 1).await
}

/// A keyed request announcing a 1 MB body, which comes 10 bytes a second.
pub(super) async fn slow_body(
    socket: TcpStream,
    counters: &AttackCounters,
    stop: &AtomicBool,
) -> Result<(), ()> {
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-{:016x}\r\nAuthorization: Bearer attacker\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n",
        rand::random::<u64>()
    );
    trickle(socket, counters, stop, head.as_bytes(), b"0123456789", 10).await
}

/// A request without a key announcing a 1 MB body, which comes 10 bytes a
/// second: streamed through, it is cut off once it falls below the proxy's
/// least pace after the body deadline.
pub(super) async fn slow_unkeyed_body(
    socket: TcpStream,
    counters: &AttackCounters,
    stop: &AtomicBool,
) -> Result<(), ()> {
    let head = "POST /orders HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n";
    trickle(socket, counters, stop, head.as_bytes(), b"0123456789", 10).await
}

/// An HTTP/2 connection that sends the preface and SETTINGS, then only
/// acknowledges the proxy's SETTINGS and answers its PINGs; `Err` when the
/// proxy closed it.
pub(super) async fn idle_h2(socket: &mut TcpStream, stop: &AtomicBool) -> Result<(), ()> {
    socket.write_all(&h2raw::open()).await.map_err(drop)?;
    let heard = h2raw::converse(socket, stop, Duration::ZERO, |_| false).await;
    if heard.closed {
        Err(())
    } else {
        Ok(())
    }
}

/// An HTTP/2 connection granting each stream `window` bytes that opens
/// [`WINDOW_STREAMS`] keyed `POST` streams to `path` (one key per
/// connection: the first is forwarded, the rest replayed) and never makes
/// room for more of their answers; `Err` once the proxy reset every one of
/// them with CANCEL, no sooner than [`DEADLINE`] after its answer began
/// (or closed the connection).
pub(super) async fn small_window_h2(
    socket: &mut TcpStream,
    counters: &AttackCounters,
    stop: &AtomicBool,
    (window, path): (u32, &str),
) -> Result<(), ()> {
    static CONNECTIONS: AtomicU64 = AtomicU64::new(0);
    let key = format!("window-{window}-{}", CONNECTIONS.fetch_add(1, Relaxed));
    let block = h2raw::header_block(&[
        (":method", b"POST"),
        (":scheme", b"http"),
        (":path", path.as_bytes()),
        (":authority", b"x"),
        ("idempotency-key", key.as_bytes()),
        ("authorization", b"Bearer attacker"),
        ("content-type", b"application/json"),
    ]);
    let mut opening = h2raw::open_with_window(window);
    for stream in (1..).step_by(2).take(WINDOW_STREAMS as usize) {
        opening.extend(h2raw::headers(stream, &block, false));
        opening.extend(h2raw::data(stream, b"{}"));
    }
    socket.write_all(&opening).await.map_err(drop)?;
    counters
        .streams
        .fetch_add(u64::from(WINDOW_STREAMS), Relaxed);
    counters.bytes.fetch_add(opening.len() as u64, Relaxed);
    let all = u64::from(WINDOW_STREAMS);
    let heard = h2raw::converse(socket, stop, DEADLINE.mul_f64(0.9), |heard| {
        heard.cancelled >= all
    })
    .await;
    if heard.closed || heard.cancelled >= all {
        Err(())
    } else {
        Ok(())
    }
}

/// A request whose head carries a 1 MiB header value, written 64 KiB at a
/// time, then a read until the proxy ends the connection (or 5 s pass);
/// `Err` when it did.
pub(super) async fn big_headers(
    socket: &mut TcpStream,
    counters: &AttackCounters,
) -> Result<(), ()> {
    // Built once for every attacker: building it is the attacker's work,
    // and it shares the CPUs with the sidecar.
    static REQUEST: OnceLock<Vec<u8>> = OnceLock::new();
    let request = REQUEST.get_or_init(|| {
        let mut request = b"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big-headers\r\nAuthorization: Bearer attacker\r\nContent-Type: application/json\r\nContent-Length: 2\r\nX-Big: ".to_vec();
        request.extend(std::iter::repeat_n(b'x', 1 << 20));
        request.extend(b"\r\n\r\n{}");
        request
    });
    // An answer (431) is read and dropped: the proxy must also close.
    super::send_whole_until_closed(socket, request, counters).await
}

/// Keyed `POST /big` requests (one key per connection, a 60 KiB answer
/// each), 32 pipelined a write, a write a second, and not one byte read.
pub(super) async fn non_reading(
    socket: &mut TcpStream,
    counters: &AttackCounters,
    stop: &AtomicBool,
) -> Result<(), ()> {
    const PER_WRITE: u64 = 32;
    static CONNECTIONS: AtomicU64 = AtomicU64::new(0);
    // One key per connection: its first request is forwarded and stored,
    // the rest are replays — the attack is the unread answers, not a
    // stream of new records (which the store keeps for the retention).
    let key = CONNECTIONS.fetch_add(1, Relaxed);
    let request = format!(
        "POST /big HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big-{key}\r\nAuthorization: Bearer attacker\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
    );
    while !stop.load(Relaxed) {
        let burst = request.repeat(PER_WRITE as usize);
        // The proxy's answers are never read: once the socket's buffers
        // fill, it must stop reading us rather than buffer without end.
        match tokio::time::timeout(Duration::from_secs(1), socket.write_all(burst.as_bytes())).await
        {
            Ok(Err(_)) => return Err(()),
            Ok(Ok(())) => {
                counters.streams.fetch_add(PER_WRITE, Relaxed);
                counters.bytes.fetch_add(burst.len() as u64, Relaxed);
            }
            // The proxy stopped reading us (a request may be cut short, so
            // nothing more is written): hold the connection as it is.
            Err(_) => break,
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // Still without reading: the proxy closes a connection whose answers
    // make no progress (its header timeout); a write then fails.
    while !stop.load(Relaxed) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match socket.try_write(b"\r\n") {
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return Err(()),
        }
    }
    Ok(())
}
