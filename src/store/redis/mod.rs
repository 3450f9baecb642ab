//! The shared store on Redis: every sidecar over one Redis primary, so a
//! redelivery that lands on another pod still meets the record. The rules
//! stay in [`crate::machine`]; Redis only stores bytes and runs two small
//! compare-and-set scripts that know nothing of them.
//!
//! - One hash per record, `<prefix>:r:<namespace>/<correlation_id>`, with
//!   `r` = the encoded record (its fencing token zeroed) and `f` = its
//!   fencing token, expiring natively (`PEXPIRE`) when its retention ends: no
//!   reaper.
//! - One string per ordering mark, `<prefix>:m:<namespace>/<ordering_key>`.
//! - Deletions are published on `<prefix>:deleted` by the script that
//!   deletes, so no deletion commits without its notification. On a cluster
//!   a classic `PUBLISH` reaches every node, so the feed subscribes on any
//!   one of the seed nodes, the next one after a loss.
//! - With `--store-replicas`: one witness per call,
//!   `<prefix>:fence:<sidecar>:<nonce>` (on a cluster followed by `:{<tag>}`
//!   in the slot of the key the call touched), written by the call's
//!   script, marked by its fence, expiring by itself two store timeouts
//!   and 10 s after it was written.
//!
//! Each call touches one key, named in `KEYS` (and its witness key in the
//! same slot, with `--store-replicas`), so each is valid on any Redis
//! Cluster slot, and no record or mark needs a hash tag: no command or script
//! reads a record and an ordering mark together (a Claim reads the mark,
//! then writes the record, in two calls; the mark's own compare-and-set
//! keeps it right). On a cluster (`redis+cluster://h1:p1,h2:p2` or
//! `--store-cluster`) the cluster client routes each call to its key's
//! primary, follows MOVED and ASK and refreshes its slot map; a slot
//! without a reachable primary makes calls on it UNAVAILABLE and health
//! NOT_SERVING until a replica is promoted. The only keys with a hash tag
//! are the witness keys of `--store-replicas`, each placed on the slot of
//! the key it fences, so a call's script can write it (see
//! [`RedisStore::fence`]).
//!
//! What Redis must not do, checked rather than hoped for: evict (every
//! record has a time to live, so any `maxmemory-policy` but `noeviction`
//! under a `maxmemory` would drop live leases and commits: refused, at
//! start and every few seconds after, unless `--allow-redis-eviction`), and
//! lose an acknowledged write in a failover (`--store-replicas N`: before
//! an answer leaves, a fence write and `WAIT N` on the server that took
//! the call prove N replicas hold all it wrote or read; fewer replicas, or
//! a fence that reached another server, is UNAVAILABLE). Times to live are computed by the engine's clock, which
//! on a shared store is Redis's own (`TIME`, [`crate::time_policy`]).
//!
//! A write sends what the record was believed to be (this sidecar's own
//! last write, or "absent") and the new record; the script writes only if the
//! belief holds, and otherwise answers with the record as it is, so a fresh
//! Claim is one round trip, and so is a DUPLICATE. Fencing tokens are drawn
//! inside the script as `max(Redis's clock in µs, the key's last token + 1)`:
//! they increase per key across sidecars, and also after a record expired,
//! as long as Redis's clock does not step back by more than a retention.
//! Two different keys may get equal tokens (claimed in the same
//! microsecond): a token orders the claims of one key, which is what a
//! fencing check compares.

mod clock;
mod cluster;
mod config;
mod eviction;
mod feed;
mod fence;
mod records;
mod scan;
mod scripts;
mod sentinel;

use std::{
    cell::RefCell,
    collections::HashMap,
    fmt,
    sync::{
        atomic::{AtomicUsize, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::Duration,
};

use redis::{aio::ConnectionManager, Script};

pub use self::{
    cluster::Connection,
    config::{check_url, is_cluster_url, is_sentinel_url, nodes, RedisConfig},
    records::Held,
};
use self::{
    cluster::Topology,
    eviction::{Eviction, EVICTION_CHECK_EVERY},
    fence::{fence_tags, FENCE_TTL_MS, WITNESS},
    records::{decode_mark, Stored},
    scripts::{Fetch, MARK_SCRIPT, READ_SCRIPT, UPDATE_SCRIPT},
};
use super::{
    self as store, optimistic,
    shared::{Reachability, RecentWrites, HEARTBEAT},
    ReapReport, Store, StoreStats,
};
use crate::{
    clock::{Clock, UnixMillis},
    domain::{Key, OrderingScope, Record},
    error::Error,
    machine::{Change, SequenceMark},
};

/// A call's answer, and whether it took a second attempt.
struct Attempt<T> {
    answer: T,
    retried: bool,
}

/// The Redis store; clones share the connections.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    topology: Topology,
    connections: Vec<Connection>,
    /// With `--store-replicas`: connections for the fence write and `WAIT`
    /// alone (see [`RedisStore::fence`]).
    fences: Vec<Connection>,
    /// The fence key of this sidecar (on a cluster, the start of each
    /// witness key).
    fence_key: String,
    /// How long a witness key lives (see [`FENCE_TTL_MS`]).
    witness_ttl_ms: u64,
    next: AtomicUsize,
    prefix: String,
    timeout: Duration,
    clock: Arc<dyn Clock>,
    reachability: Reachability,
    recent: RecentWrites<Stored>,
    update: Script,
    mark: Script,
    read: Script,
    replicas: u32,
    allow_eviction: bool,
    /// Whether Redis may evict keys, as last read.
    eviction: Mutex<Eviction>,
    /// Until when Redis counts as full (at its `maxmemory`: writes refused),
    /// since a call was refused for it or `INFO memory` showed it.
    full_until: Mutex<Option<tokio::time::Instant>>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("connections", &self.inner.connections.len())
            .finish()
    }
}

fn redis_error(error: redis::RedisError) -> Error {
    // Redis at `maxmemory` under `noeviction` refuses the write (a script's
    // first write, before anything was written): the store is full.
    if error.code() == Some("OOM") {
        return Error::DiskFull(std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            format!("Redis is at its maxmemory: {error}"),
        ));
    }
    // Anything the client would retry (a dropped or refused connection, a
    // server loading its data, a replica not yet promoted) is an outage.
    if matches!(error.retry_method(), redis::RetryMethod::NoRetry) {
        Error::Store(format!("Redis: {error}"))
    } else {
        Error::Unavailable(format!("Redis: {error}"))
    }
}

impl RedisStore {
    /// A store over `config`, telling time by `clock` (expiry is set as a
    /// time to live from its "now"). Nothing is contacted yet: connections
    /// are made on first use and again whenever one drops.
    pub fn new(config: &RedisConfig, clock: Arc<dyn Clock>) -> Result<RedisStore, Error> {
        let shown = super::postgres::redact_url(&config.url);
        // Redis's TLS builds its rustls configuration from the process's
        // default provider; ring is the one this build carries.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let invalid = |error: redis::RedisError| Error::Store(format!("{shown}: {error}"));
        // Nagle's algorithm (redis-rs leaves it on) holds each command until
        // the last one is acknowledged: measured 3-5x fewer calls per second.
        let nodelay = redis::io::tcp::TcpSettings::default().set_nodelay(true);
        let certificates = config.ca_pem.as_ref().map(|pem| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pem.clone()),
        });
        let single = |url: &str| {
            let info = redis::IntoConnectionInfo::into_connection_info(url)
                .map_err(invalid)?
                .set_tcp_settings(nodelay.clone());
            match &certificates {
                Some(certificates) => redis::Client::build_with_tls(info, certificates.clone()),
                None => redis::Client::open(info),
            }
            .map_err(invalid)
        };
        let count = config.connections.max(1);
        let wanted = |fences: bool| if fences { count } else { 0 };
        let (topology, connections, fences) = if config.cluster || is_cluster_url(&config.url) {
            let nodes = nodes(&config.url, true).map_err(Error::Store)?;
            let seeds = nodes
                .iter()
                .map(|node| single(node))
                .collect::<Result<Vec<_>, _>>()?;
            let mut builder = redis::cluster::ClusterClientBuilder::new(nodes)
                .connection_timeout(config.timeout)
                .response_timeout(config.timeout)
                .tcp_settings(nodelay.clone());
            if let Some(certificates) = &certificates {
                builder = builder.certs(certificates.clone());
            }
            let cluster = builder.build().map_err(invalid)?;
            // Connected in the background; the first calls wait for it.
            let open = |count: usize| {
                (0..count)
                    .map(|_| {
                        // The config replaces the builder's timeouts: given again,
                        // so a node that goes silent is timed out inside the
                        // client (which then reconnects and refreshes its map).
                        Connection::Cluster(
                            cluster.get_pending_async_connection_with_config(
                                redis::cluster::ClusterConfig::new()
                                    .set_connection_timeout(config.timeout)
                                    .set_response_timeout(config.timeout),
                            ),
                        )
                    })
                    .collect::<Vec<_>>()
            };
            let topology = Topology::Cluster {
                seeds,
                next_seed: AtomicUsize::new(0),
                fence_tags: if config.replicas > 0 {
                    fence_tags()
                } else {
                    HashMap::new()
                },
            };
            (topology, open(count), open(wanted(config.replicas > 0)))
        } else if is_sentinel_url(&config.url) {
            let target = config::sentinel_target(&config.url).map_err(Error::Store)?;
            let sentinel = sentinel::Sentinel::new(
                &target,
                certificates.clone(),
                nodelay.clone(),
                config.timeout,
            )
            .map_err(invalid)?;
            let open = |count: usize| {
                (0..count)
                    .map(|_| Connection::Sentinel(sentinel.connection()))
                    .collect::<Vec<_>>()
            };
            let (connections, fences) = (open(count), open(wanted(config.replicas > 0)));
            (Topology::Sentinel { sentinel }, connections, fences)
        } else {
            let client = single(&config.url)?;
            let manager_config = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(config.timeout))
                .set_response_timeout(Some(config.timeout))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_secs(1));
            let open = |count: usize| {
                (0..count)
                    .map(|_| {
                        ConnectionManager::new_lazy_with_config(
                            client.clone(),
                            manager_config.clone(),
                        )
                        .map(Connection::Primary)
                        .map_err(invalid)
                    })
                    .collect::<Result<Vec<_>, _>>()
            };
            let connections = open(count)?;
            let fences = open(wanted(config.replicas > 0))?;
            (Topology::Primary { client }, connections, fences)
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                topology,
                connections,
                fences,
                fence_key: format!("{}:fence:{:016x}", config.prefix, rand::random::<u64>()),
                witness_ttl_ms: u64::try_from(config.timeout.as_millis())
                    .unwrap_or(u64::MAX / 4)
                    .saturating_mul(2)
                    .saturating_add(FENCE_TTL_MS),
                next: AtomicUsize::new(0),
                prefix: config.prefix.clone(),
                timeout: config.timeout,
                clock,
                reachability: Reachability::default(),
                recent: RecentWrites::default(),
                update: Script::new(UPDATE_SCRIPT),
                mark: Script::new(MARK_SCRIPT),
                read: Script::new(READ_SCRIPT),
                replicas: config.replicas,
                allow_eviction: config.allow_eviction,
                eviction: Mutex::new(Eviction::Unread),
                full_until: Mutex::new(None),
            }),
        })
    }

    /// A connection of the store's own kind (one primary's, or the
    /// cluster's), for looking at what it wrote: tests and tools.
    pub fn inspection_connection(&self) -> Connection {
        self.connection()
    }

    fn is_cluster(&self) -> bool {
        matches!(self.inner.topology, Topology::Cluster { .. })
    }

    fn connection(&self) -> Connection {
        let turn = self.inner.next.fetch_add(1, Relaxed);
        self.inner.connections[turn % self.inner.connections.len()].clone()
    }

    /// Runs one call on a connection within the timeout, noting for health
    /// whether Redis answered. A call that found its connection dropped is
    /// made once more on the same connection, which then waits for the
    /// reconnection: after Redis restarts, every connection's first call
    /// meets the old socket. A repeated write is safe: the script compares
    /// before it writes, and [`RedisStore::update`] recognises its own claim.
    async fn call<T, Fut>(&self, make: impl Fn(Connection) -> Fut) -> Result<T, Error>
    where
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        self.call_on(self.connection(), make).await
    }

    async fn call_on<T, Fut>(
        &self,
        connection: Connection,
        make: impl Fn(Connection) -> Fut,
    ) -> Result<T, Error>
    where
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        Ok(self.call_tracked(connection, make).await?.answer)
    }

    /// Like [`RedisStore::call_on`], telling whether the call was made a
    /// second time: then the first may have been carried out too.
    async fn call_tracked<T, Fut>(
        &self,
        connection: Connection,
        make: impl Fn(Connection) -> Fut,
    ) -> Result<Attempt<T>, Error>
    where
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let attempts = async {
            match make(connection.clone()).await {
                Err(error) if error.is_unrecoverable_error() || error.is_io_error() => {
                    make(connection).await.map(|answer| Attempt {
                        answer,
                        retried: true,
                    })
                }
                answered => answered.map(|answer| Attempt {
                    answer,
                    retried: false,
                }),
            }
        };
        // The cluster client retries by itself after a lost connection (and
        // after MOVED, ASK, TRYAGAIN): its first attempt may have landed
        // unseen, whatever this loop saw.
        let cluster = self.is_cluster();
        let attempts = async move {
            attempts.await.map(|attempt| Attempt {
                retried: attempt.retried || cluster,
                ..attempt
            })
        };
        let result = match tokio::time::timeout(self.inner.timeout, attempts).await {
            Ok(answered) => answered.map_err(redis_error),
            Err(_) => Err(Error::Unavailable(format!(
                "Redis did not answer within {:?}",
                self.inner.timeout
            ))),
        };
        if let Err(Error::DiskFull(_)) = &result {
            self.note_full(true);
        }
        self.inner.reachability.observe(result)
    }

    fn record_key(&self, key: &Key) -> String {
        format!("{}:r:{key}", self.inner.prefix)
    }

    fn mark_key(&self, scope: &OrderingScope) -> String {
        format!(
            "{}:m:{}/{}",
            self.inner.prefix, scope.namespace, scope.ordering_key
        )
    }

    fn channel(&self) -> String {
        format!("{}:deleted", self.inner.prefix)
    }

    /// Time to live of something retained until `until`, by this store's
    /// clock: from the interval's `earliest`, so Redis keeps it at least as
    /// long as any pod's reckoning holds it (at least 1 ms: Redis refuses
    /// zero).
    fn ttl_ms(&self, until: UnixMillis) -> u64 {
        until
            .saturating_since(self.inner.clock.interval().earliest)
            .as_millis()
            .clamp(1, u128::from(u64::MAX)) as u64
    }

    /// Keeps health current while nobody calls: pings once a second while
    /// the last call found Redis gone (or none was made yet), so health
    /// recovers by itself; reads the eviction policy again every
    /// [`EVICTION_CHECK_EVERY`] and whenever Redis is back.
    pub fn keep_connected(&self) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut checked: Option<tokio::time::Instant> = None;
            loop {
                if store.inner.reachability.check().is_err() {
                    match store.ping().await {
                        Ok(()) => {
                            tracing::info!("Redis reachable");
                            checked = None;
                        }
                        Err(error) => tracing::debug!(%error, "Redis still unreachable"),
                    }
                }
                store.check_roles().await;
                if checked.is_none_or(|at| at.elapsed() >= EVICTION_CHECK_EVERY) {
                    let first = checked.is_none();
                    match store.eviction_refusal().await {
                        Ok(refusal) => {
                            if let (true, Some(reason)) = (first, refusal) {
                                tracing::error!(reason = %reason, "Redis refused: NOT_SERVING");
                            }
                            checked = Some(tokio::time::Instant::now());
                        }
                        Err(Error::Unavailable(error)) => {
                            tracing::debug!(%error, "cannot read Redis's eviction policy yet")
                        }
                        // Redis answered, and refused (e.g. NOPERM for a user
                        // without INFO): a configuration to fix, not an outage.
                        Err(error) => tracing::warn!(
                            %error,
                            "cannot read Redis's eviction policy (INFO memory): not serving until it can be read; grant the user INFO, or pass --allow-redis-eviction"
                        ),
                    }
                }
                tokio::time::sleep(HEARTBEAT).await;
            }
        })
    }

    /// Through sentinels: asks each connection's server whether it still
    /// is the primary; one that is not (demoted after a failover, still
    /// answering reads) is dropped, and made again to the one the
    /// sentinels name.
    async fn check_roles(&self) {
        // All at once: one at a time, a silent server would hold the
        // heartbeat (and its health checks) for a timeout per connection.
        let checks = self
            .inner
            .connections
            .iter()
            .chain(&self.inner.fences)
            .filter_map(|connection| match connection {
                Connection::Sentinel(connection) => Some(connection.check_role()),
                _ => None,
            });
        for checked in futures_util::future::join_all(checks).await {
            match checked {
                Ok(sentinel::Demoted::Yes) => tracing::warn!(
                    "Redis: a connection's server is no longer the primary; following the \
                     sentinels to the new one"
                ),
                Err(error) => tracing::debug!(%error, "Redis: cannot ask for the role"),
                Ok(sentinel::Demoted::No) => {}
            }
        }
    }

    /// Asks Redis whether it answers, on every connection (for health;
    /// cheap): each one that had dropped reconnects, so the first calls after
    /// an outage do not meet a dead socket.
    pub async fn ping(&self) -> Result<(), Error> {
        for connection in &self.inner.connections {
            self.call_on(connection.clone(), |mut connection| async move {
                redis::cmd("PING").query_async::<()>(&mut connection).await
            })
            .await?;
        }
        Ok(())
    }
}

impl Store for RedisStore {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, store::Attempt<'_>) -> Result<(Change, T), Error> + Send,
    {
        self.not_evicting().await?;
        // Each operation's calls note their witness for its fence.
        WITNESS
            .scope(RefCell::new(None), async move {
                // Start from a belief (our own last write, or "absent" for a
                // key we never wrote); the script checks it and answers with
                // the truth if it was wrong.
                let remembered = self.inner.recent.recall(key);
                let (answer, written) = optimistic::update(self, key, remembered, apply).await?;
                if let Some(written) = written {
                    self.inner.recent.remember(key, written);
                }
                self.fence(&self.record_key(key)).await?;
                Ok(answer)
            })
            .await
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.not_evicting().await?;
        let redis_key = self.record_key(key);
        WITNESS
            .scope(RefCell::new(None), async {
                let stored = self.read(&redis_key).await?;
                self.fence(&redis_key).await?;
                Ok(stored.map(|stored| stored.record))
            })
            .await
    }

    async fn update_mark<F>(&self, scope: &OrderingScope, apply: F) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        self.not_evicting().await?;
        let redis_key = self.mark_key(scope);
        WITNESS
            .scope(
                RefCell::new(None),
                self.update_mark_witnessed(&redis_key, apply),
            )
            .await
    }

    async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
        self.not_evicting().await?;
        let redis_key = self.mark_key(scope);
        WITNESS
            .scope(RefCell::new(None), async {
                let text: Option<String> = self.fetch(&redis_key, Fetch::Mark).await?;
                self.fence(&redis_key).await?;
                decode_mark(&text.unwrap_or_default())
            })
            .await
    }

    async fn durable(&self) -> Result<(), Error> {
        // Redis answered each write after applying it, and after its
        // append-only file's fsync when `appendfsync always` is set: that
        // setting is the durability of this store on one server; across a
        // failover, `--store-replicas`: each operation fenced what it
        // touched already, before it answered (and so before the local
        // tier learned it).
        Ok(())
    }

    async fn reap(&self, _now: UnixMillis, _budget: usize) -> Result<ReapReport, Error> {
        // Redis expires records itself.
        Ok(ReapReport::default())
    }

    fn health(&self) -> Result<(), Error> {
        // Nothing here is permanent: an unreachable Redis passes by itself.
        Ok(())
    }

    fn writable(&self) -> Result<(), Error> {
        self.inner.reachability.check()?;
        let full_until = *self.inner.full_until.lock().expect("full lock");
        if full_until.is_some_and(|until| tokio::time::Instant::now() < until) {
            return Err(Error::DiskFull(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "Redis is at its maxmemory: writes are refused",
            )));
        }
        match &*self.inner.eviction.lock().expect("eviction lock") {
            Eviction::Never => Ok(()),
            Eviction::Refused(reason) => Err(Error::Unavailable(reason.clone())),
            Eviction::Unread => Err(Error::Unavailable(
                "Redis's eviction policy not read yet".into(),
            )),
        }
    }

    async fn scan(
        &self,
        cursor: &store::ScanCursor,
        limit: usize,
    ) -> Result<store::ScanPage, Error> {
        self.not_evicting().await?;
        self.scan_page(cursor, limit).await
    }

    async fn stats(&self) -> StoreStats {
        // Counting one prefix's keys would scan the whole keyspace.
        StoreStats::default()
    }

    async fn close(&self) -> Result<(), Error> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_over_or_unreachable_redis_is_unavailable_not_a_store_fault() {
        use redis::{ErrorKind, RedisError, ServerErrorKind};

        for kind in [
            ServerErrorKind::ReadOnly,
            ServerErrorKind::BusyLoading,
            ServerErrorKind::MasterDown,
            ServerErrorKind::TryAgain,
        ] {
            let error = RedisError::from((ErrorKind::Server(kind), "failing over"));
            assert!(
                matches!(redis_error(error), Error::Unavailable(_)),
                "{kind:?}"
            );
        }
        let reset = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(redis_error(reset), Error::Unavailable(_)));
        // A script Redis refuses is our fault, not an outage to wait out.
        let refused = RedisError::from((ErrorKind::Server(ServerErrorKind::ResponseError), "ERR"));
        assert!(matches!(redis_error(refused), Error::Store(_)));
    }

    /// A store on the cluster at `url`, under a fresh prefix, on one
    /// connection.
    pub(super) fn cluster_store(url: &str, timeout: Duration, replicas: u32) -> RedisStore {
        let config = RedisConfig {
            url: url.to_owned(),
            prefix: format!("dedupd_test_{:016x}", rand::random::<u64>()),
            connections: 1,
            timeout,
            ca_pem: None,
            replicas,
            allow_eviction: true,
            cluster: true,
        };
        RedisStore::new(&config, Arc::new(crate::clock::SystemClock)).unwrap()
    }

    /// The cluster tests here change the cluster (a failover, a paused
    /// node): one at a time.
    pub(super) static ON_THE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
}
