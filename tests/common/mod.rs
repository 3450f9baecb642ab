//! Shared set-up for integration tests: a real dedupd server on
//! `127.0.0.1:0` over a sled store in a temporary directory, told time by a
//! manual clock, and shut down through the same future production uses.

#![allow(dead_code)]

pub mod faultshim;
pub mod forwarder;
pub mod ops_http;
pub mod otlp;
pub mod postgres;
pub mod proxy;
pub mod redis;
pub mod shared;
pub mod sidecar;

#[allow(unused_imports)]
pub use forwarder::Forwarder;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use dedupd::{
    clock::{Clock, ManualClock, UnixMillis},
    domain::{Key, OrderingScope, Record},
    machine::{Change, SequenceMark},
    proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient},
    server::ServerConfig,
    store::{
        memory::MemoryStore,
        postgres::PostgresStore,
        redis::RedisStore,
        sled::{SledConfig, SledStore},
        tiered::Tiered,
        Attempt, ReapReport, Store, StoreObserver, StoreStats,
    },
    Error, ListenAddr, Listener, Listeners, Metrics,
};
use tempfile::TempDir;
use tokio::{
    net::TcpListener,
    sync::{oneshot, Semaphore},
    task::JoinHandle,
};
use tonic::transport::Channel;

/// 2026-01-01T00:00:00Z: tests start here and move time by hand.
pub const START: UnixMillis = UnixMillis(1_767_225_600_000);

pub type Client = ClaimAndCommitClient<Channel>;

/// A real server on `127.0.0.1:0` (plus, if asked, a Unix socket and the ops
/// port), over a sled store in a temporary directory unless given another
/// store, stopped through the same future production uses.
pub struct TestServer<S: Store = TestStore> {
    pub addr: SocketAddr,
    pub clock: ManualClock,
    pub dir: Arc<TempDir>,
    pub store: Arc<S>,
    /// The Unix socket, with [`Builder::unix_socket`].
    pub socket: Option<PathBuf>,
    /// The ops HTTP address, with [`Builder::ops`].
    pub ops: Option<SocketAddr>,
    /// What the server counts.
    pub metrics: Arc<Metrics>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), Error>>>,
}

/// How to start a [`TestServer`].
pub struct Builder {
    config: ServerConfig,
    dir: Option<Arc<TempDir>>,
    clock: ManualClock,
    unix_socket: bool,
    ops: bool,
    space: Option<Space>,
}

impl Builder {
    /// Lets `adjust` change the server configuration.
    pub fn config(mut self, adjust: impl FnOnce(&mut ServerConfig)) -> Self {
        adjust(&mut self.config);
        self
    }

    /// Also listens on a Unix socket in the server's directory.
    pub fn unix_socket(mut self) -> Self {
        self.unix_socket = true;
        self
    }

    /// Also serves the ops endpoints on `127.0.0.1:0`.
    pub fn ops(mut self) -> Self {
        self.ops = true;
        self
    }

    /// Uses the store in `dir` and `clock` (e.g. after a restart).
    pub fn in_dir(mut self, dir: Arc<TempDir>, clock: ManualClock) -> Self {
        self.dir = Some(dir);
        self.clock = clock;
        self
    }

    /// Starts over the suite's store (see [`TestStore`]): sled in the
    /// directory, reporting group commits into the server's metrics, or a
    /// shared store in a space of its own.
    pub async fn start(self) -> TestServer {
        let dir = self.directory();
        let store = Arc::new(
            TestStore::open(
                &dir.path().join("data"),
                Arc::clone(&self.config.metrics),
                Arc::new(self.clock.clone()),
                self.space.clone(),
            )
            .await,
        );
        self.start_on(dir, store).await
    }

    /// Runs over `space` on a shared store (the suite's choice of store
    /// aside): a second sidecar over the same records, or a restart.
    pub fn in_space(mut self, space: Option<Space>) -> Self {
        self.space = space;
        self
    }

    /// Starts over `store`.
    pub async fn start_with_store<S: Store>(self, store: Arc<S>) -> TestServer<S> {
        let dir = self.directory();
        self.start_on(dir, store).await
    }

    fn directory(&self) -> Arc<TempDir> {
        self.dir
            .clone()
            .unwrap_or_else(|| Arc::new(tempfile::tempdir().expect("temp dir")))
    }

    async fn start_on<S: Store>(self, dir: Arc<TempDir>, store: Arc<S>) -> TestServer<S> {
        let mut config = self.config;
        config.clock = Arc::new(self.clock.clone());
        let metrics = Arc::clone(&config.metrics);
        // Bind before spawning: the ports are ready before the first call.
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("local addr");
        let mut grpc = vec![Listener::Tcp(tcp)];
        let socket = if self.unix_socket {
            let path = dir.path().join("dedupd.sock");
            grpc.push(
                Listener::bind(&ListenAddr::Unix(path.clone()))
                    .await
                    .expect("bind unix socket"),
            );
            Some(path)
        } else {
            None
        };
        let (ops_listener, ops) = if self.ops {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind ops");
            let address = listener.local_addr().expect("ops addr");
            (Some(listener), Some(address))
        } else {
            (None, None)
        };
        let listeners = Listeners {
            grpc,
            ops: ops_listener,
            http_proxy: None,
        };
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = tokio::spawn(dedupd::run(listeners, Arc::clone(&store), config, async {
            let _ = stop.await;
        }));
        TestServer {
            addr,
            clock: self.clock,
            dir,
            store,
            socket,
            ops,
            metrics,
            shutdown: Some(shutdown),
            task: Some(task),
        }
    }
}

impl TestServer {
    /// How to start a server; defaults: sled, TCP only, a manual clock at
    /// [`START`], a 5 s shutdown grace.
    pub fn builder() -> Builder {
        Builder {
            config: ServerConfig {
                shutdown_grace: Duration::from_secs(5),
                ..ServerConfig::default()
            },
            dir: None,
            clock: ManualClock::new(START),
            unix_socket: false,
            ops: false,
            space: None,
        }
    }

    /// A server with default limits on a fresh directory.
    pub async fn start() -> TestServer {
        TestServer::builder().start().await
    }

    /// A server whose configuration `adjust` may change.
    pub async fn start_with(adjust: impl FnOnce(&mut ServerConfig)) -> TestServer {
        TestServer::builder().config(adjust).start().await
    }

    /// Stops and starts again on the same directory and clock.
    pub async fn restart(mut self) -> TestServer {
        self.stop_in_place().await.expect("clean stop");
        let TestServer {
            dir, clock, store, ..
        } = self;
        let space = store.test_space();
        drop(store);
        TestServer::builder()
            .in_dir(dir, clock)
            .in_space(space)
            .start()
            .await
    }
}

/// What the suite's servers run on: sled, or a shared store with a local
/// tier in front when `DEDUPD_TEST_STORE=postgres` or `redis` (`.ci/run`
/// runs the wire tests all three ways), so every store passes the same
/// tests.
pub enum TestStore {
    Sled(SledStore),
    Postgres {
        store: Tiered<PostgresStore>,
        schema: String,
        upkeep: JoinHandle<()>,
    },
    Redis {
        store: Tiered<RedisStore>,
        prefix: String,
        upkeep: JoinHandle<()>,
    },
}

/// Runs `$call` on whichever store `$self` holds, bound to `$store`.
macro_rules! on_each {
    ($self:expr, $store:ident => $call:expr) => {
        match $self {
            TestStore::Sled($store) => $call,
            TestStore::Postgres { store: $store, .. } => $call,
            TestStore::Redis { store: $store, .. } => $call,
        }
    };
}

/// Where a test's records live on a shared server, to reuse after a
/// restart and to remove when the test is done.
#[derive(Debug, Clone)]
pub enum Space {
    Postgres(String),
    Redis(String),
}

impl Space {
    /// A fresh schema on the machine's PostgreSQL.
    pub fn postgres() -> Space {
        Space::Postgres(postgres::fresh_schema())
    }

    /// A fresh key prefix on the machine's Redis.
    pub fn redis() -> Space {
        Space::Redis(redis::fresh_prefix())
    }

    /// Removes everything the test wrote.
    pub async fn remove(&self) {
        match self {
            Space::Postgres(schema) => postgres::drop_schema(schema).await,
            Space::Redis(prefix) => redis::drop_prefix(prefix).await,
        }
    }
}

impl Drop for TestStore {
    fn drop(&mut self) {
        if let TestStore::Postgres { upkeep, .. } | TestStore::Redis { upkeep, .. } = self {
            upkeep.abort();
        }
    }
}

impl TestStore {
    /// Which store the suite runs on this time: `sled`, `postgres` or
    /// `redis`.
    pub fn kind() -> String {
        std::env::var("DEDUPD_TEST_STORE").unwrap_or_else(|_| "sled".into())
    }

    async fn open(
        path: &Path,
        metrics: Arc<Metrics>,
        clock: Arc<dyn Clock>,
        space: Option<Space>,
    ) -> TestStore {
        let observer: Arc<dyn StoreObserver> = Arc::clone(&metrics) as _;
        let kind = match &space {
            Some(Space::Postgres(_)) => "postgres".to_owned(),
            Some(Space::Redis(_)) => "redis".to_owned(),
            None => TestStore::kind(),
        };
        match kind.as_str() {
            "postgres" => {
                let schema = match space {
                    Some(Space::Postgres(schema)) => schema,
                    _ => postgres::fresh_schema(),
                };
                let shared = postgres::store(&schema).await;
                let (store, upkeep) = shared::tiered(shared, path, clock, observer).await;
                TestStore::Postgres {
                    store,
                    schema,
                    upkeep,
                }
            }
            "redis" | "redis-cluster" => {
                let prefix = match space {
                    Some(Space::Redis(prefix)) => prefix,
                    _ => redis::fresh_prefix(),
                };
                let shared = redis::store(&prefix, Arc::clone(&clock)).await;
                let (store, upkeep) = shared::tiered(shared, path, clock, observer).await;
                TestStore::Redis {
                    store,
                    prefix,
                    upkeep,
                }
            }
            "sled" => TestStore::Sled(open_store_observed(path, metrics)),
            other => {
                panic!("DEDUPD_TEST_STORE={other}: expected sled, postgres, redis or redis-cluster")
            }
        }
    }

    pub fn is_sled(&self) -> bool {
        matches!(self, TestStore::Sled(_))
    }

    /// Whether the store expires records itself (Redis) instead of reaping.
    pub fn expires_natively(&self) -> bool {
        matches!(self, TestStore::Redis { .. })
    }

    /// Records stored now, expired ones not yet reaped included.
    pub async fn records(&self) -> usize {
        match self {
            TestStore::Sled(store) => store.record_count(),
            // Counted now: the store's own figure is cached for /metrics.
            TestStore::Postgres { schema, .. } => postgres::rows(schema).await,
            TestStore::Redis { prefix, .. } => redis::keys(&format!("{prefix}:r")).await.len(),
        }
    }
}

/// A store a test made a space on a shared server for, to remove when it
/// is done.
pub trait TestSpace {
    fn test_space(&self) -> Option<Space> {
        None
    }
}

impl TestSpace for TestStore {
    fn test_space(&self) -> Option<Space> {
        match self {
            TestStore::Sled(_) => None,
            TestStore::Postgres { schema, .. } => Some(Space::Postgres(schema.clone())),
            TestStore::Redis { prefix, .. } => Some(Space::Redis(prefix.clone())),
        }
    }
}

impl TestSpace for SledStore {}
impl TestSpace for PostgresStore {}
impl TestSpace for RedisStore {}
impl<S> TestSpace for Tiered<S> {}
impl TestSpace for GatedStore {}

impl Store for TestStore {
    async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
    {
        on_each!(self, store => store.update(key, apply).await)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        on_each!(self, store => store.get(key).await)
    }

    async fn update_mark<F>(&self, scope: &OrderingScope, apply: F) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        on_each!(self, store => store.update_mark(scope, apply).await)
    }

    async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
        on_each!(self, store => store.get_mark(scope).await)
    }

    async fn scan(
        &self,
        cursor: &dedupd::store::ScanCursor,
        limit: usize,
    ) -> Result<dedupd::store::ScanPage, Error> {
        on_each!(self, store => store.scan(cursor, limit).await)
    }

    async fn durable(&self) -> Result<(), Error> {
        on_each!(self, store => store.durable().await)
    }

    async fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        on_each!(self, store => store.reap(now, budget).await)
    }

    fn health(&self) -> Result<(), Error> {
        on_each!(self, store => store.health())
    }

    fn writable(&self) -> Result<(), Error> {
        on_each!(self, store => store.writable())
    }

    async fn stats(&self) -> StoreStats {
        on_each!(self, store => store.stats().await)
    }

    async fn close(&self) -> Result<(), Error> {
        on_each!(self, store => store.close().await)
    }
}

impl<S: Store + TestSpace> TestServer<S> {
    pub async fn client(&self) -> Client {
        ClaimAndCommitClient::new(self.channel().await)
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .expect("uri")
            .connect()
            .await
            .expect("connect")
    }

    /// Graceful shutdown; returns what `run` returned. A space made for
    /// the server on a shared store is removed.
    pub async fn stop(mut self) -> Result<(), Error> {
        let stopped = self.stop_in_place().await;
        if let Some(space) = self.store.test_space() {
            space.remove().await;
        }
        stopped
    }

    pub async fn stop_in_place(&mut self) -> Result<(), Error> {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        match self.task.take() {
            Some(task) => task.await.expect("server task"),
            None => Ok(()),
        }
    }
}

pub fn sled_config(path: &Path) -> SledConfig {
    SledConfig {
        cache_capacity_bytes: 16 << 20,
        // The shortest, as a sidecar with the tests' quick reaper files it.
        expiry_bucket: Duration::from_secs(1),
        ..SledConfig::new(path)
    }
}

pub fn open_store(path: &Path) -> SledStore {
    SledStore::open(&sled_config(path)).expect("open sled store")
}

fn open_store_observed(path: &Path, metrics: Arc<Metrics>) -> SledStore {
    SledStore::open_observed(&sled_config(path), Some(metrics)).expect("open sled store")
}

/// The dedup service's status from the health service at `addr`.
pub async fn health_of(addr: SocketAddr) -> i32 {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: "dedup.v1.ClaimAndCommit".into(),
        })
        .await
        .expect("health answers")
        .into_inner()
        .status
}

/// `SERVING` and `NOT_SERVING` as the health service numbers them.
pub const SERVING: i32 = 1;
pub const NOT_SERVING: i32 = 2;

/// Waits (bounded) until the health service at `addr` reports `status`.
pub async fn until_health(addr: SocketAddr, status: i32) {
    let started = std::time::Instant::now();
    while health_of(addr).await != status {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "health never became {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn claim_request(correlation_id: &str) -> pb::ClaimRequest {
    pb::ClaimRequest {
        correlation_id: correlation_id.to_owned(),
        event_type: "PaymentReceived".into(),
        consumer_version: "1.4.2".into(),
        owner: "pod-a".into(),
        ..Default::default()
    }
}

/// Claims `id` (it must be CLAIMED) and commits it with `response`; the
/// code of the first call that fails.
pub async fn claim_and_commit(
    client: &mut Client,
    id: &str,
    response: Vec<u8>,
) -> Result<(), tonic::Code> {
    let claimed = client
        .claim(claim_request(id))
        .await
        .map_err(|status| status.code())?
        .into_inner();
    assert_eq!(outcome(&claimed), pb::ClaimOutcome::Claimed, "{id}");
    client
        .commit(pb::CommitRequest {
            response,
            ..commit_request(id, &claimed.lease_token)
        })
        .await
        .map(|_| ())
        .map_err(|status| status.code())
}

pub fn commit_request(correlation_id: &str, lease_token: &str) -> pb::CommitRequest {
    pb::CommitRequest {
        correlation_id: correlation_id.to_owned(),
        lease_token: lease_token.to_owned(),
        ..Default::default()
    }
}

pub fn seconds(seconds: i64) -> Option<prost_types::Duration> {
    Some(prost_types::Duration { seconds, nanos: 0 })
}

pub fn outcome(response: &pb::ClaimResponse) -> pb::ClaimOutcome {
    pb::ClaimOutcome::try_from(response.outcome).expect("known outcome")
}

pub async fn claim(client: &mut Client, request: pb::ClaimRequest) -> pb::ClaimResponse {
    client
        .claim(request)
        .await
        .expect("claim call")
        .into_inner()
}

/// An in-memory store that refuses every write (UNAVAILABLE, nothing
/// written) while `down` is set: a store outage a test switches on and off.
/// With [`FailingStore::losing_answers`], writes are made and their answers
/// lost (UNAVAILABLE) while `lose_answers` is set: a store that applied a
/// change its client never heard of.
#[derive(Debug)]
pub struct FailingStore {
    inner: MemoryStore,
    down: Arc<std::sync::atomic::AtomicBool>,
    lose_answers: Arc<std::sync::atomic::AtomicBool>,
}

impl FailingStore {
    /// A store that is down while `down` is set.
    pub fn new(down: Arc<std::sync::atomic::AtomicBool>) -> FailingStore {
        FailingStore::losing_answers(down, Arc::default())
    }

    /// Also applies writes and loses their answers while `lose_answers` is
    /// set.
    pub fn losing_answers(
        down: Arc<std::sync::atomic::AtomicBool>,
        lose_answers: Arc<std::sync::atomic::AtomicBool>,
    ) -> FailingStore {
        FailingStore {
            inner: MemoryStore::new(),
            down,
            lose_answers,
        }
    }

    fn check(&self) -> Result<(), Error> {
        if self.down.load(Ordering::SeqCst) {
            Err(Error::Unavailable("the test took the store down".into()))
        } else {
            Ok(())
        }
    }
}

impl Store for FailingStore {
    async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
    {
        self.check()?;
        let answer = self.inner.update(key, apply).await;
        if self.lose_answers.load(Ordering::SeqCst) {
            return Err(Error::Unavailable(
                "the test lost the store's answer".into(),
            ));
        }
        answer
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.inner.get(key).await
    }

    async fn update_mark<F>(&self, scope: &OrderingScope, apply: F) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        self.check()?;
        self.inner.update_mark(scope, apply).await
    }

    async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
        self.inner.get_mark(scope).await
    }

    async fn durable(&self) -> Result<(), Error> {
        self.check()?;
        self.inner.durable().await
    }

    async fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        self.inner.reap(now, budget).await
    }

    fn health(&self) -> Result<(), Error> {
        self.inner.health()
    }

    async fn stats(&self) -> StoreStats {
        self.inner.stats().await
    }

    async fn close(&self) -> Result<(), Error> {
        self.inner.close().await
    }
}

/// An in-memory store whose `durable()` waits until the test opens the
/// gate: calls stay in flight for as long as a test needs, without sleeps.
#[derive(Debug)]
pub struct GatedStore {
    inner: MemoryStore,
    gate: Semaphore,
    waiting: AtomicUsize,
}

impl GatedStore {
    /// A store whose gate is closed.
    pub fn closed() -> Arc<GatedStore> {
        Arc::new(GatedStore {
            inner: MemoryStore::new(),
            gate: Semaphore::new(0),
            waiting: AtomicUsize::new(0),
        })
    }

    /// Calls waiting at the gate.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Waits (bounded) until `count` calls wait at the gate.
    pub async fn until_waiting(&self, count: usize) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while self.waiting() < count {
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{count} calls never reached the gate"));
    }

    /// Lets every waiting and future call through.
    pub fn open(&self) {
        self.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    }
}

impl Store for GatedStore {
    fn update<T, F>(
        &self,
        key: &Key,
        apply: F,
    ) -> impl std::future::Future<Output = Result<T, Error>> + Send
    where
        T: Send,
        F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
    {
        self.inner.update(key, apply)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.inner.get(key).await
    }

    fn update_mark<F>(
        &self,
        scope: &OrderingScope,
        apply: F,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        self.inner.update_mark(scope, apply)
    }

    async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
        self.inner.get_mark(scope).await
    }

    async fn durable(&self) -> Result<(), Error> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let permit = self.gate.acquire().await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        drop(permit);
        self.inner.durable().await
    }

    async fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        self.inner.reap(now, budget).await
    }

    fn health(&self) -> Result<(), Error> {
        self.inner.health()
    }

    async fn stats(&self) -> StoreStats {
        self.inner.stats().await
    }

    async fn close(&self) -> Result<(), Error> {
        self.inner.close().await
    }
}

/// The head of a call of the dedup service's `method` for a raw HTTP/2
/// client (h2), which then sends the message — or withholds it.
pub fn grpc_request_head(addr: SocketAddr, method: &str) -> http::Request<()> {
    http::Request::post(format!("http://{addr}/dedup.v1.ClaimAndCommit/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// Whether any file under `dir` holds `needle` (a store's raw bytes).
pub fn files_hold(dir: &Path, needle: &[u8]) -> bool {
    std::fs::read_dir(dir)
        .expect("read dir")
        .flatten()
        .any(|entry| {
            let path = entry.path();
            if path.is_dir() {
                files_hold(&path, needle)
            } else {
                std::fs::read(&path)
                    .is_ok_and(|bytes| bytes.windows(needle.len()).any(|w| w == needle))
            }
        })
}
