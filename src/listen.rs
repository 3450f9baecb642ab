//! Where dedupd listens: TCP addresses and Unix domain sockets (for a shared
//! `emptyDir` in a pod), parsed from `--listen` and bound before serving;
//! the accept loop, which caps the connections of the whole process and
//! backs off when accepting fails instead of spinning; and the limits every
//! listener shares (gRPC, the proxy, the webhook): [`ConnectionLimits`].

use std::{
    fmt, fs,
    future::Future,
    io,
    net::SocketAddr,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    pin::Pin,
    str::FromStr,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream, UnixListener, UnixStream},
    sync::{mpsc, OwnedSemaphorePermit, Semaphore},
};
use tokio_stream::{wrappers::ReceiverStream, Stream};
use tonic::transport::server::Connected;

/// One `--listen` value: `HOST:PORT` or `unix:///path/to.sock`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A Unix domain socket path.
    Unix(PathBuf),
}

/// The socket path of a `unix:///path` (or `unix:/path`) address; `None`
/// for anything else. Shared by the server's `--listen` and the client's
/// `--addr`.
pub(crate) fn unix_socket_path(address: &str) -> Option<PathBuf> {
    address
        .strip_prefix("unix://")
        .or_else(|| address.strip_prefix("unix:"))
        .map(PathBuf::from)
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Some(path) = unix_socket_path(text) {
            if !path.is_absolute() {
                return Err(format!(
                    "{text:?}: the socket path must be absolute (unix:///path)"
                ));
            }
            return Ok(ListenAddr::Unix(path));
        }
        text.parse()
            .map(ListenAddr::Tcp)
            .map_err(|_| format!("{text:?} is neither HOST:PORT nor unix:///path"))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(address) => write!(f, "{address}"),
            ListenAddr::Unix(path) => write!(f, "unix://{}", path.display()),
        }
    }
}

/// A bound listener.
#[derive(Debug)]
pub enum Listener {
    /// TCP.
    Tcp(TcpListener),
    /// A Unix domain socket, removed again when dropped.
    Unix(UnixListener, SocketFile),
}

impl From<TcpListener> for Listener {
    fn from(listener: TcpListener) -> Self {
        Listener::Tcp(listener)
    }
}

impl Listener {
    /// Binds `address`. A leftover socket file from an earlier run is
    /// replaced; any other file in the way is an error.
    pub async fn bind(address: &ListenAddr) -> io::Result<Listener> {
        match address {
            ListenAddr::Tcp(address) => Ok(Listener::Tcp(TcpListener::bind(address).await?)),
            ListenAddr::Unix(path) => {
                match fs::symlink_metadata(path) {
                    Ok(meta) if meta.file_type().is_socket() => fs::remove_file(path)?,
                    Ok(_) => {
                        return Err(io::Error::new(
                            io::ErrorKind::AlreadyExists,
                            format!("{} exists and is not a socket", path.display()),
                        ))
                    }
                    Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                    Err(error) => return Err(error),
                }
                let listener = UnixListener::bind(path)?;
                // Owner and group: the app container shares the pod's group.
                fs::set_permissions(path, fs::Permissions::from_mode(0o660))?;
                Ok(Listener::Unix(listener, SocketFile(path.clone())))
            }
        }
    }

    /// What to call this listener in logs.
    pub fn describe(&self) -> String {
        match self {
            Listener::Tcp(listener) => listener
                .local_addr()
                .map_or_else(|_| "tcp (unknown address)".into(), |a| a.to_string()),
            Listener::Unix(_, socket) => format!("unix://{}", socket.0.display()),
        }
    }
}

/// Removes the socket file when the listener is dropped.
#[derive(Debug)]
pub struct SocketFile(PathBuf);

impl SocketFile {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Linux's "too many open files" (per process, and system-wide): an
/// overload that passes, not a broken socket or disk.
pub(crate) fn out_of_descriptors(error: &io::Error) -> bool {
    const ENFILE: i32 = 23;
    const EMFILE: i32 = 24;
    matches!(error.raw_os_error(), Some(ENFILE | EMFILE))
}

/// Limits on connections, so that no client can hold the sidecar: a cap for
/// the process, streams per connection, keepalive, a maximum age, and the
/// TLS handshake's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once over every listener; more wait in the
    /// kernel's backlog.
    pub max_connections: usize,
    /// HTTP/2 streams (calls) one connection may have open at once.
    pub max_streams_per_connection: u32,
    /// A connection is asked to close (GOAWAY, in-flight calls finish) after
    /// this long, so stalled or forgotten ones do not pile up.
    pub max_connection_age: Duration,
    /// Ping interval: a peer that does not answer within the timeout is gone.
    pub keepalive_interval: Duration,
    /// How long to wait for a keepalive ping's answer.
    pub keepalive_timeout: Duration,
    /// Longest a TLS handshake may take, and the longest a new connection
    /// may take to send its first bytes (the HTTP/2 preface or the TLS
    /// ClientHello) before it is closed.
    pub handshake_timeout: Duration,
}

/// Largest header list (metadata) a call may carry: gRPC's own default
/// (grpc-go, grpc-java). A larger one ends the connection after at most five
/// CONTINUATION frames (about 80 KiB read), however large it claims to be.
pub const MAX_HEADER_LIST_BYTES: u32 = 16 << 10;
/// Streams a client may open and reset before the server has seen them,
/// per connection; more is a GOAWAY (the "rapid reset" flood, CVE-2023-44487).
pub const MAX_PENDING_RESET_STREAMS: usize = 20;
/// Streams the server may reset for a client's protocol errors before it
/// ends the connection.
pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 1000,
            max_streams_per_connection: 128,
            max_connection_age: Duration::from_secs(3600),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// First pause after a failed accept; it doubles up to [`ACCEPT_BACKOFF_MAX`].
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The HTTP/2 client preface's length (RFC 9113 §3.4): a connection must
/// send this much before its first-bytes deadline.
const PREFACE_BYTES: usize = 24;

/// A connection holding one of the process's connection slots until it
/// closes.
///
/// It must also send its first [`PREFACE_BYTES`] bytes (the HTTP/2 preface,
/// or a TLS ClientHello) before a deadline: hyper waits for a preface
/// forever, so connections that send nothing, or a byte now and then, would
/// otherwise hold their slots for good and, at `--max-connections` of them,
/// keep every new client out (found by `dedupd-reliability hostile`).
#[derive(Debug)]
pub(crate) struct Capped<IO> {
    io: IO,
    _slot: OwnedSemaphorePermit,
    first_bytes: Option<FirstBytes>,
}

#[derive(Debug)]
struct FirstBytes {
    deadline: Pin<Box<tokio::time::Sleep>>,
    missing: usize,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Capped<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let Some(first) = &mut this.first_bytes else {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        };
        if first.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client sent no HTTP/2 preface in time",
            )));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = read {
            first.missing = first.missing.saturating_sub(buf.filled().len() - before);
            if first.missing == 0 {
                this.first_bytes = None;
            }
        }
        read
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Capped<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: Connected> Connected for Capped<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// A connection whose writes must make progress: once a write has waited
/// longer than `stall` without the peer taking a byte — a client that
/// never reads its answers — the connection fails, instead of holding its
/// slot, its buffers and its upstream for good. hyper has no write timeout
/// of its own, and its header timeout is not armed while it writes.
#[derive(Debug)]
pub(crate) struct WriteDeadline<IO> {
    io: IO,
    stall: Duration,
    /// Armed at the first write that could not proceed; disarmed by any
    /// progress.
    stalled_since: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<IO> WriteDeadline<IO> {
    pub(crate) fn new(io: IO, stall: Duration) -> Self {
        WriteDeadline {
            io,
            stall,
            stalled_since: None,
        }
    }

    /// `Pending` from a write: arms the deadline, or fails once it passed.
    fn waited(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let stall = self.stall;
        let deadline = self
            .stalled_since
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        if deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client read nothing of its answer in time",
            )));
        }
        Poll::Pending
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for WriteDeadline<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write(cx, buf) {
            Poll::Pending => this.waited(cx),
            ready => {
                this.stalled_since = None;
                ready
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write_vectored(cx, bufs) {
            Poll::Pending => this.waited(cx),
            ready => {
                this.stalled_since = None;
                ready
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A listener the accept loop can drive.
pub(crate) trait Accept: Send + Sync + 'static {
    /// The connections it yields.
    type Io: Send + 'static;
    /// The next connection.
    fn accept(&self) -> impl Future<Output = io::Result<Self::Io>> + Send;
}

impl Accept for TcpListener {
    type Io = TcpStream;

    async fn accept(&self) -> io::Result<TcpStream> {
        let (stream, _) = TcpListener::accept(self).await?;
        // `serve_with_incoming` ignores the builder's TCP settings: without
        // this, small answers wait for Nagle.
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}

impl Accept for UnixListener {
    type Io = UnixStream;

    async fn accept(&self) -> io::Result<UnixStream> {
        Ok(UnixListener::accept(self).await?.0)
    }
}

/// Accepts connections from `listener` while a slot of `slots` is free (at
/// the cap, new connections wait in the kernel's backlog), and backs off when
/// accepting fails — out of descriptors, say — instead of spinning. Each
/// connection must send its first bytes within `first_bytes_timeout`.
pub(crate) fn accept_capped<A: Accept>(
    listener: A,
    slots: Arc<Semaphore>,
    first_bytes_timeout: Duration,
) -> impl Stream<Item = io::Result<Capped<A::Io>>> {
    let (sender, receiver) = mpsc::channel(1);
    tokio::spawn(async move {
        let mut backoff = ACCEPT_BACKOFF_MIN;
        loop {
            let slot = tokio::select! {
                slot = Arc::clone(&slots).acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => return,
                },
                () = sender.closed() => return,
            };
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = sender.closed() => return,
            };
            match accepted {
                Ok(io) => {
                    backoff = ACCEPT_BACKOFF_MIN;
                    let capped = Capped {
                        io,
                        _slot: slot,
                        first_bytes: Some(FirstBytes {
                            deadline: Box::pin(tokio::time::sleep(first_bytes_timeout)),
                            missing: PREFACE_BYTES,
                        }),
                    };
                    if sender.send(Ok(capped)).await.is_err() {
                        return;
                    }
                }
                Err(error) => {
                    drop(slot);
                    if out_of_descriptors(&error) {
                        tracing::warn!(%error, ?backoff, "out of file descriptors: not accepting for a moment");
                    } else {
                        tracing::warn!(%error, ?backoff, "accept failed; backing off");
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                }
            }
        }
    });
    ReceiverStream::new(receiver)
}

/// Accepts TCP connections on `listener` until `shutdown` resolves, running
/// `serve(stream, peer, stopping)` for each (with TCP_NODELAY set); then
/// cancels `stopping` so each connection finishes its request in progress
/// and closes (HTTP clients keep connections open), and waits for them, at
/// most `grace`. An accept error (out of file descriptors, say) is logged
/// and retried after a pause rather than ending the server.
pub async fn serve_tcp<F, Fut>(
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    serve: F,
) where
    F: Fn(TcpStream, SocketAddr, tokio_util::sync::CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        loop {
            match listener.accept().await {
                Ok(accepted) => return Some((accepted, listener)),
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    });
    serve_until(incoming, shutdown, grace, |(stream, peer), stopping| {
        let _ = stream.set_nodelay(true);
        serve(stream, peer, stopping)
    })
    .await;
}

/// Like [`serve_tcp`], but through [`accept_capped`]: each connection holds
/// one of `slots` while open and must send its first bytes within
/// `first_bytes_timeout` — the defences of the gRPC listener, for the
/// HTTP faces.
pub(crate) async fn serve_tcp_capped<F, Fut>(
    listener: TcpListener,
    slots: Arc<Semaphore>,
    first_bytes_timeout: Duration,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    serve: F,
) where
    F: Fn(Capped<TcpStream>, tokio_util::sync::CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    use futures_util::StreamExt;
    // accept_capped logs and backs off on accept errors itself.
    let incoming = accept_capped(listener, slots, first_bytes_timeout)
        .filter_map(|accepted| std::future::ready(accepted.ok()));
    serve_until(incoming, shutdown, grace, serve).await;
}

/// Runs `serve` for each connection of `incoming` until `shutdown`, then
/// stops them gracefully within `grace` (see [`serve_tcp`]).
async fn serve_until<C, F, Fut>(
    incoming: impl Stream<Item = C>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    serve: F,
) where
    F: Fn(C, tokio_util::sync::CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    use futures_util::StreamExt;
    let connections = tokio_util::task::TaskTracker::new();
    let stopping = tokio_util::sync::CancellationToken::new();
    tokio::pin!(shutdown);
    tokio::pin!(incoming);
    loop {
        let connection = tokio::select! {
            () = &mut shutdown => break,
            next = incoming.next() => match next {
                Some(connection) => connection,
                None => break,
            },
        };
        connections.spawn(serve(connection, stopping.clone()));
    }
    stopping.cancel();
    connections.close();
    if tokio::time::timeout(grace, connections.wait())
        .await
        .is_err()
    {
        // They are not waited for: the process exits, and they end with it.
        tracing::warn!(
            open = connections.len(),
            "connections still open when the shutdown grace ended; they end with the process"
        );
    }
}

/// Serves one HTTP connection until it ends, until `stopping` is
/// cancelled, or until `aged` resolves: then it finishes the requests in
/// progress and closes (HTTP/2: a GOAWAY). The age bound is what makes a
/// client that keeps one connection alive forever (answering PINGs)
/// reconnect, as the gRPC listener's `--max-connection-age` does; `drain`,
/// if given, is how long an aged connection's requests may take to finish
/// before it is closed regardless (gRPC's `MAX_CONNECTION_AGE_GRACE`). On
/// `stopping`, the server's shutdown grace bounds it instead.
pub async fn until_stopped<C>(
    connection: C,
    stopping: &tokio_util::sync::CancellationToken,
    aged: impl Future<Output = ()>,
    drain: Option<Duration>,
) -> Result<(), C::Error>
where
    C: hyper_util::server::graceful::GracefulConnection,
{
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        ended = connection.as_mut() => ended,
        () = stopping.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
        () = aged => {
            connection.as_mut().graceful_shutdown();
            let Some(drain) = drain else {
                return connection.await;
            };
            match tokio::time::timeout(drain, connection).await {
                Ok(ended) => ended,
                Err(_) => {
                    tracing::debug!(
                        ?drain,
                        "an aged connection's requests did not finish within the grace; closed"
                    );
                    Ok(())
                }
            }
        }
    }
}
