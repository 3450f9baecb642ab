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
//! - With `--store-replicas`: `<prefix>:fence:<sidecar>` (one primary: a
//!   string expiring 10 s after its last use: it only has to outlive its
//!   own `WAIT`) or `<prefix>:fence:<sidecar>:<nonce>:{<tag>}` (a cluster:
//!   one per call, a witness its fence deletes, expiring by itself 10 s
//!   after it was written).
//!
//! Each call touches one key, named in `KEYS` (and its witness key in the
//! same slot, with `--store-replicas` on a cluster), so each is valid on any Redis
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
//! an answer leaves, a fence write and `WAIT N` prove N replicas hold all
//! it wrote or read; fewer replicas is UNAVAILABLE). Times to live are computed by the engine's clock, which
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

use futures_util::StreamExt;
use redis::{
    aio::ConnectionManager,
    cluster_async::ClusterConnection,
    cluster_routing::{
        MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo,
        SlotAddr,
    },
    FromRedisValue, Script, ScriptInvocation,
};
use tokio::sync::mpsc;

use super::{
    codec,
    shared::{
        deletion_message, parse_deletion, DeletionFeed, Reachability, RecentWrites, FEED_BUFFER,
        HEARTBEAT,
    },
    IssueFencing, ReapReport, Store, StoreStats,
};
use crate::{
    clock::{Clock, UnixMillis},
    domain::{FencingToken, Key, OrderingScope, Record},
    error::Error,
    machine::{Change, SequenceMark},
    time_policy::{ClockReading, TimeSource},
};

use super::optimistic::{self, Conditional, Swapped, Versioned, PROVISIONAL};

/// How often the eviction policy is read again while running (an operator
/// or a managed service's parameter group can change it under us).
const EVICTION_CHECK_EVERY: Duration = Duration::from_secs(5);

/// How long a fence key lives after its write: it only has to outlive the
/// `WAIT` that follows it in the same round trip. A cluster's witness keys
/// live this much longer than two store timeouts (their call's and their
/// fence's, see [`RedisStore::fence`]).
const FENCE_TTL_MS: u64 = 10_000;

/// The first lines of every script a witnessed call runs (see
/// [`RedisStore::fence`]): this call's witness key, in its key's slot, is
/// written in the same atomic step as what the call reads or writes.
macro_rules! witness_lua {
    () => {
        "
-- KEYS[2], when given: this call's witness key (in KEYS[1]'s slot);
-- ARGV[#ARGV] its time to live in ms
if KEYS[2] then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[#ARGV])
end
"
    };
}

/// Writes a record if it still is what the caller read; otherwise answers
/// with what it is. Draws the fencing token when asked to.
const UPDATE_SCRIPT: &str = concat!(
    witness_lua!(),
    r"
-- KEYS[1] the record; ARGV[1], ARGV[2]: its bytes and token as believed ('' = absent)
-- ARGV[3] 'put': ARGV[4] new bytes, ARGV[5] token ('' = draw one), ARGV[6] ttl ms
-- ARGV[3] 'delete': ARGV[4] channel, ARGV[5] message
local now = redis.call('HMGET', KEYS[1], 'r', 'f')
local bytes, token = now[1] or '', now[2] or ''
if bytes ~= ARGV[1] or token ~= ARGV[2] then
  return {0, bytes, token}
end
if ARGV[3] == 'delete' then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  return {1, '', ''}
end
local new_token = ARGV[5]
if new_token == '' then
  local clock = redis.call('TIME')
  local micros = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  new_token = string.format('%.0f', math.max(micros, (tonumber(token) or 0) + 1))
end
redis.call('HSET', KEYS[1], 'r', ARGV[4], 'f', new_token)
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return {1, new_token, ''}
"
);

/// The same for an ordering mark (a plain string).
const MARK_SCRIPT: &str = concat!(
    witness_lua!(),
    r"
-- KEYS[1] the mark; ARGV[1] as believed ('' = absent); ARGV[2] new; ARGV[3] ttl ms
local now = redis.call('GET', KEYS[1]) or ''
if now ~= ARGV[1] then
  return {0, now}
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {1, ''}
"
);

/// A read that leaves its witness (only on a cluster with
/// `--store-replicas`; elsewhere reads are plain commands).
const READ_SCRIPT: &str = concat!(
    witness_lua!(),
    r"
-- KEYS[1] a record ('record': its bytes and token) or a mark (ARGV[1] 'mark')
if ARGV[1] == 'record' then
  return redis.call('HMGET', KEYS[1], 'r', 'f')
end
return redis.call('GET', KEYS[1])
"
);

tokio::task_local! {
    /// The witness key of the last call the current store operation made,
    /// for its fence to find (see [`RedisStore::fence`]); set only on a
    /// cluster with `--store-replicas`.
    static WITNESS: RefCell<Option<String>>;
}

/// What a read fetches.
#[derive(Clone, Copy)]
enum Fetch {
    /// A record's bytes and token (`HMGET r f`).
    Record,
    /// An ordering mark (`GET`).
    Mark,
}

/// How to reach Redis.
#[derive(Clone)]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port[/db]` or `rediss://…` (never
    /// logged).
    pub url: String,
    /// Every key dedupd writes starts with `<prefix>:`.
    pub prefix: String,
    /// Multiplexed connections; calls are spread over them in turn.
    pub connections: usize,
    /// Longest one call may take (and a connection attempt).
    pub timeout: Duration,
    /// PEM certificates to trust for a `rediss://` server instead of the
    /// system's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// Replicas each write must reach (`WAIT`) before it is answered.
    pub replicas: u32,
    /// Serve even if Redis may evict keys.
    pub allow_eviction: bool,
    /// `url` names seed nodes of a Redis Cluster (also implied by a
    /// `redis+cluster://` or `rediss+cluster://` URL).
    pub cluster: bool,
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &super::postgres::redact_url(&self.url))
            .field("prefix", &self.prefix)
            .field("connections", &self.connections)
            .field("timeout", &self.timeout)
            .field("private_ca", &self.ca_pem.is_some())
            .field("replicas", &self.replicas)
            .field("allow_eviction", &self.allow_eviction)
            .field("cluster", &self.cluster)
            .finish()
    }
}

/// Checks a URL the way the store will use it; the problem, if any, in one
/// line without the password.
pub fn check_url(url: &str, cluster: bool) -> Result<(), String> {
    let shown = super::postgres::redact_url(url);
    if url.contains("#insecure") {
        return Err(format!(
            "{shown}: #insecure turns off certificate checks; give the CA with --store-ca-file instead"
        ));
    }
    for node in nodes(url, cluster)? {
        redis::Client::open(node.as_str()).map_err(|error| format!("{shown}: {error}"))?;
    }
    Ok(())
}

/// Whether `url` names a cluster by its scheme.
pub fn is_cluster_url(url: &str) -> bool {
    url.starts_with("redis+cluster://") || url.starts_with("rediss+cluster://")
}

/// The node URLs `url` names: itself for one primary; for a cluster
/// (`cluster`, or a `+cluster` scheme) one `redis://` or `rediss://` URL
/// per comma-separated host, each with the URL's credentials. A cluster
/// has only database 0.
pub fn nodes(url: &str, cluster: bool) -> Result<Vec<String>, String> {
    let shown = super::postgres::redact_url(url);
    let (scheme, rest) = match url.split_once("://") {
        Some(("redis" | "redis+cluster", rest)) => ("redis", rest),
        Some(("rediss" | "rediss+cluster", rest)) => ("rediss", rest),
        _ => {
            return Err(format!(
                "{shown} is not a redis://, rediss://, redis+cluster:// or rediss+cluster:// URL"
            ))
        }
    };
    let split = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(split);
    if !(cluster || is_cluster_url(url)) {
        let hosts = authority
            .rsplit_once('@')
            .map_or(authority, |(_, hosts)| hosts);
        if hosts.contains(',') {
            return Err(format!(
                "{shown} names several hosts: a cluster's seed nodes are given as redis+cluster://host1:port,host2:port (or with --store-cluster)"
            ));
        }
        return Ok(vec![url.to_owned()]);
    }
    let (credentials, hosts) = match authority.rsplit_once('@') {
        Some((credentials, hosts)) => (format!("{credentials}@"), hosts),
        None => (String::new(), authority),
    };
    let database = tail.split('?').next().unwrap_or_default().trim_matches('/');
    if !(database.is_empty() || database == "0") {
        return Err(format!(
            "{shown}: a Redis Cluster has only database 0, not {database}"
        ));
    }
    let hosts: Vec<&str> = hosts.split(',').map(str::trim).collect();
    if hosts.iter().any(|host| host.is_empty()) {
        return Err(format!("{shown}: an empty host in the list of seed nodes"));
    }
    Ok(hosts
        .into_iter()
        .map(|host| format!("{scheme}://{credentials}{host}"))
        .collect())
}

/// A record's hash as it is in Redis: what a conditional write must find.
#[derive(Debug, Clone)]
pub struct Held {
    /// The encoded record, its fencing token zeroed (`r`).
    bytes: Vec<u8>,
    /// Its fencing token (`f`).
    token: String,
}

/// A record as read from Redis, with its hash's fields.
type Stored = Versioned<Held>;

/// The record in a hash's fields (`None` for a hash that is not there).
fn decode_stored(bytes: Vec<u8>, token: String) -> Result<Option<Stored>, Error> {
    if token.is_empty() {
        return Ok(None);
    }
    let mut record = codec::decode_record(&bytes)?;
    record.fencing_token = parse_token(&token)?;
    Ok(Some(Versioned {
        record,
        version: Held { bytes, token },
    }))
}

fn parse_token(token: &str) -> Result<FencingToken, Error> {
    token
        .parse()
        .map(FencingToken)
        .map_err(|_| Error::Corrupt(format!("fencing token {token:?}")))
}

/// What the update script is asked to write.
enum Write {
    /// The record's bytes at rest (see [`encode_without_token`]), its
    /// fencing token (`None`: draw one), and when it stops being live.
    Put {
        bytes: Vec<u8>,
        token: Option<FencingToken>,
        retain_until: UnixMillis,
    },
    Delete,
}

/// A call's answer, and whether it took a second attempt.
struct Attempt<T> {
    answer: T,
    retried: bool,
}

/// What the update script answered.
enum Swap {
    /// Written; the fencing token the record now has (empty for a delete).
    Done(String),
    /// The record was not what the caller believed: here is what it is.
    Conflict(Option<Box<Stored>>),
}

/// One multiplexed way to Redis: a connection manager to one primary, or
/// a cluster client (its slot map, a connection per node, MOVED and ASK
/// followed, the map refreshed when a node moves or fails). Every call in
/// this module goes through it unchanged: a key's command or script is
/// routed by its key.
#[derive(Clone)]
pub enum Connection {
    /// One primary.
    Primary(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(
        &'a mut self,
        command: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Connection::Primary(connection) => connection.req_packed_command(command),
            Connection::Cluster(connection) => connection.req_packed_command(command),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Connection::Primary(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            Connection::Cluster(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Primary(connection) => connection.get_db(),
            Connection::Cluster(connection) => connection.get_db(),
        }
    }
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Connection::Primary(_) => "Connection::Primary",
            Connection::Cluster(_) => "Connection::Cluster",
        })
    }
}

impl Connection {
    /// Runs `command` where `routing` says on a cluster (several nodes'
    /// answers come back as a map by node); on one primary, there.
    pub async fn route(
        &mut self,
        command: redis::Cmd,
        routing: RoutingInfo,
    ) -> redis::RedisResult<redis::Value> {
        match self {
            Connection::Primary(connection) => command.query_async(connection).await,
            Connection::Cluster(connection) => connection.route_command(command, routing).await,
        }
    }
}

/// What differs between one primary and a cluster besides the connections.
enum Topology {
    /// One primary: the deletion feed subscribes here.
    Primary { client: redis::Client },
    /// A cluster.
    Cluster {
        /// The seed nodes, where the deletion feed subscribes (the next one
        /// after a failure: a classic `PUBLISH` reaches every node).
        seeds: Vec<redis::Client>,
        next_seed: AtomicUsize,
        /// A hash tag for every slot (`{<tag>}` hashes to it), so a fence key
        /// lands on the primary of the key it fences.
        fence_tags: HashMap<Route, String>,
    },
}

/// A hash tag for each of the cluster's 16 384 slots: the shortest decimal
/// numbers that hash there, found by trying them in turn (about 180 000
/// CRC16s, once at start).
fn fence_tags() -> HashMap<Route, String> {
    const SLOTS: usize = 16_384;
    let mut tags = HashMap::with_capacity(SLOTS);
    let mut number: u64 = 0;
    while tags.len() < SLOTS {
        let tag = number.to_string();
        tags.entry(Route::with_key(format!("{{{tag}}}"), SlotAddr::Master))
            .or_insert(tag);
        number += 1;
    }
    tags
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

/// What Redis's memory settings allow.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Eviction {
    /// Not read yet: nothing is written until it is.
    Unread,
    /// Redis never evicts (or the operator allowed it).
    Never,
    /// Redis may evict: refused, for this reason.
    Refused(String),
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

    async fn read(&self, redis_key: &str) -> Result<Option<Stored>, Error> {
        let (bytes, token): (Option<Vec<u8>>, Option<String>) =
            self.fetch(redis_key, Fetch::Record).await?;
        decode_stored(bytes.unwrap_or_default(), token.unwrap_or_default())
    }

    /// Reads a record or a mark: a plain command, or on a cluster with
    /// `--store-replicas` the read script, which leaves the call's witness.
    async fn fetch<T: FromRedisValue>(&self, redis_key: &str, what: Fetch) -> Result<T, Error> {
        if self.witnessing() {
            let mut invocation = self.inner.read.key(redis_key);
            invocation.arg(match what {
                Fetch::Record => "record",
                Fetch::Mark => "mark",
            });
            self.add_witness(&mut invocation, redis_key)?;
            let invocation = &invocation;
            return self
                .call(
                    |mut connection| async move { invocation.invoke_async(&mut connection).await },
                )
                .await;
        }
        let read = match what {
            Fetch::Record => redis::cmd("HMGET").arg(redis_key).arg("r").arg("f").clone(),
            Fetch::Mark => redis::cmd("GET").arg(redis_key).clone(),
        };
        let read = &read;
        self.call(|mut connection| async move { read.query_async(&mut connection).await })
            .await
    }

    /// Whether calls leave a witness for their fence: on a cluster with
    /// `--store-replicas`.
    fn witnessing(&self) -> bool {
        self.is_cluster() && self.inner.replicas > 0
    }

    /// When [`RedisStore::witnessing`]: gives a script (its own arguments
    /// all given) a fresh witness key in `redis_key`'s slot as `KEYS[2]`,
    /// noted as the operation's last call's for [`RedisStore::fence`] (see
    /// `witness_lua!`).
    fn add_witness(
        &self,
        invocation: &mut ScriptInvocation<'_>,
        redis_key: &str,
    ) -> Result<(), Error> {
        if !self.witnessing() {
            return Ok(());
        }
        let witness = self.witness_key(redis_key)?;
        invocation.key(&witness).arg(self.inner.witness_ttl_ms);
        WITNESS
            .try_with(|last| last.replace(Some(witness)))
            .map_err(|_| {
                Error::Store(format!(
                    "a call on {redis_key} made outside a store operation could not be fenced"
                ))
            })?;
        Ok(())
    }

    /// Makes `write` if the record is still `believed`.
    async fn swap(
        &self,
        key: &Key,
        redis_key: &str,
        believed: Option<&Stored>,
        write: &Write,
    ) -> Result<Attempt<Swap>, Error> {
        let mut invocation = self.inner.update.key(redis_key);
        match believed {
            Some(stored) => invocation
                .arg(&stored.version.bytes[..])
                .arg(&stored.version.token),
            None => invocation.arg("").arg(""),
        };
        match write {
            Write::Put {
                bytes,
                token,
                retain_until,
            } => {
                invocation
                    .arg("put")
                    .arg(&bytes[..])
                    .arg(token.map_or_else(String::new, |token| token.0.to_string()))
                    .arg(self.ttl_ms(*retain_until));
            }
            Write::Delete => {
                invocation
                    .arg("delete")
                    .arg(self.channel())
                    .arg(deletion_message(key));
            }
        }
        self.add_witness(&mut invocation, redis_key)?;
        let attempt = self
            .write_script::<(i64, Vec<u8>, String)>(&invocation)
            .await?;
        let (done, bytes, token) = attempt.answer;
        let answer = if done == 1 {
            // `bytes` is empty here; the second field is the token.
            Swap::Done(
                String::from_utf8(bytes)
                    .map_err(|_| Error::Corrupt("fencing token is not text".into()))?,
            )
        } else {
            Swap::Conflict(decode_stored(bytes, token)?.map(Box::new))
        };
        Ok(Attempt {
            answer,
            retried: attempt.retried,
        })
    }

    /// Runs a write script, telling whether it took a second attempt.
    async fn write_script<T: FromRedisValue>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<Attempt<T>, Error> {
        self.call_tracked(self.connection(), |mut connection| async move {
            invocation.invoke_async(&mut connection).await
        })
        .await
    }

    /// A fresh witness key in `redis_key`'s slot (a cluster's: its hash
    /// tag hashes there): `<fence key>:<nonce>:{<tag>}`.
    fn witness_key(&self, redis_key: &str) -> Result<String, Error> {
        let Topology::Cluster { fence_tags, .. } = &self.inner.topology else {
            return Err(Error::Store("witness keys are for a cluster".into()));
        };
        let tag = fence_tags
            .get(&Route::with_key(redis_key, SlotAddr::Master))
            .ok_or_else(|| Error::Store(format!("no fence tag for the slot of {redis_key}")))?;
        Ok(format!(
            "{}:{:016x}:{{{tag}}}",
            self.inner.fence_key,
            rand::random::<u64>()
        ))
    }

    /// With `--store-replicas N`: proves that N replicas hold everything
    /// this operation wrote or read. `WAIT` counts the replicas that have
    /// the last write *of its own connection*, and replicas apply the
    /// primary's stream in order; so a write followed by `WAIT N`, in one
    /// round trip on a connection of their own, covers every write the
    /// primary made before it — this operation's, on any connection, and
    /// the ones its reads revealed (a DUPLICATE of a commit a failover would
    /// lose). The fence connections are apart from the others: Redis serves
    /// nothing else on a connection while it is blocked in `WAIT`.
    ///
    /// On one primary, [`Store::durable`] fences once for all a task did,
    /// with a `SET` of this sidecar's fence key.
    ///
    /// On a cluster each primary replicates only its own slots, so every
    /// operation fences the key it touched (`slot_of`), and it must fence
    /// on the very node that served it: a failover or a slot move between
    /// the call and the fence would otherwise send the fence to a node
    /// that never had the call's write, whose `WAIT` proves nothing about
    /// it. So each call, in its own script, writes a fresh witness key in
    /// its key's slot (a hash tag keeps both in one slot; it expires by
    /// itself, two store timeouts and 10 s later), and the fence's write is
    /// `SET <witness> fenced XX KEEPTTL GET` for the operation's last
    /// witness: it writes (and answers the old value) only on a node that
    /// holds that call's effects — the primary that ran it, or a replica
    /// promoted after receiving it — and finding none is UNAVAILABLE (not
    /// acknowledged; the call may stand). It is repeatable: a fence sent
    /// again after a lost answer still finds the witness.
    async fn fence(&self, slot_of: Option<&str>) -> Result<(), Error> {
        let replicas = self.inner.replicas;
        if replicas == 0 {
            return Ok(());
        }
        // The write `WAIT` then covers: the last call's witness on a
        // cluster, this sidecar's fence key on one primary.
        let witness = match slot_of {
            Some(key) => Some(
                WITNESS
                    .try_with(|last| last.borrow_mut().take())
                    .ok()
                    .flatten()
                    .ok_or_else(|| Error::Store(format!("no witnessed call on {key} to fence")))?,
            ),
            None => None,
        };
        let wait_ms = u64::try_from((self.inner.timeout / 2).as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let turn = self.inner.next.fetch_add(1, Relaxed);
        let connection = self.inner.fences[turn % self.inner.fences.len()].clone();
        let (fence_key, witness) = (&self.inner.fence_key, &witness);
        let (found, acknowledged): (bool, u32) = self
            .call_on(connection, |mut connection| async move {
                let mut pipeline = redis::pipe();
                match witness {
                    Some(witness) => pipeline
                        .cmd("SET")
                        .arg(witness)
                        .arg("fenced")
                        .arg("XX")
                        .arg("KEEPTTL")
                        .arg("GET"),
                    None => pipeline
                        .cmd("SET")
                        .arg(fence_key)
                        .arg(turn)
                        .arg("PX")
                        .arg(FENCE_TTL_MS),
                };
                let (written, acknowledged): (redis::Value, u32) = pipeline
                    .cmd("WAIT")
                    .arg(replicas)
                    .arg(wait_ms)
                    .query_async(&mut connection)
                    .await?;
                let found = match witness {
                    // The old value: nil where the witness is not.
                    Some(_) => written != redis::Value::Nil,
                    None => true,
                };
                Ok((found, acknowledged))
            })
            .await?;
        if !found {
            return Err(Error::Unavailable(format!(
                "the primary of {} does not hold this call's effects (a failover or a slot move since; --store-replicas): not acknowledged, though it may stand",
                slot_of.unwrap_or_default()
            )));
        }
        if acknowledged < replicas {
            return Err(Error::Unavailable(format!(
                "{acknowledged} of {replicas} replicas confirmed within {wait_ms} ms (--store-replicas): not acknowledged, though it may stand on the primary"
            )));
        }
        Ok(())
    }

    /// On a cluster, [`RedisStore::fence`] for a call that touched
    /// `redis_key`; on one primary, nothing (`durable` fences).
    async fn fence_on_cluster(&self, redis_key: &str) -> Result<(), Error> {
        if self.is_cluster() {
            self.fence(Some(redis_key)).await
        } else {
            Ok(())
        }
    }

    /// `INFO memory` of every primary, with the node's address (empty for
    /// one primary).
    async fn memory_reports(&self) -> Result<Vec<(String, String)>, Error> {
        let every_primary = RoutingInfo::MultiNode((
            MultipleNodeRoutingInfo::AllMasters,
            Some(ResponsePolicy::Special),
        ));
        let answer = self
            .call(|mut connection| {
                let every_primary = every_primary.clone();
                async move {
                    connection
                        .route(redis::cmd("INFO").arg("memory").clone(), every_primary)
                        .await
                }
            })
            .await?;
        let text = |value: redis::Value| {
            String::from_redis_value(value)
                .map_err(|error| Error::Store(format!("Redis's INFO memory: {error}")))
        };
        match answer {
            redis::Value::Map(by_node) => by_node
                .into_iter()
                .map(|(node, report)| Ok((text(node)?, text(report)?)))
                .collect(),
            report => Ok(vec![(String::new(), text(report)?)]),
        }
    }

    /// Why Redis must not be used, if it may evict keys (and the operator
    /// did not allow it): `Ok(None)` when it may not. Reads `INFO memory`,
    /// which managed services answer even where `CONFIG` is disabled.
    pub async fn eviction_refusal(&self) -> Result<Option<String>, Error> {
        if self.inner.allow_eviction {
            // Allowed: nothing to read (nor to need the INFO permission for).
            *self.inner.eviction.lock().expect("eviction lock") = Eviction::Never;
            return Ok(None);
        }
        // On a cluster every primary is asked: one that may evict is
        // enough to lose records in its slots.
        let mut refusal = None;
        let mut full = false;
        for (node, info) in self.memory_reports().await? {
            let field = |name: &str| {
                info.lines()
                    .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                    .map(str::trim)
                    .unwrap_or_default()
                    .to_owned()
            };
            let (maxmemory, policy) = (field("maxmemory"), field("maxmemory_policy"));
            // At its maxmemory a primary refuses every write (noeviction).
            if let (Ok(limit @ 1..), Ok(used)) = (
                maxmemory.parse::<u64>(),
                field("used_memory").parse::<u64>(),
            ) {
                full |= used >= limit;
            }
            if !(maxmemory == "0" || policy == "noeviction") {
                let which = if node.is_empty() {
                    String::new()
                } else {
                    format!(" primary {node}")
                };
                refusal = Some(format!(
                    "Redis{which} may evict dedupd's records (maxmemory {maxmemory}, maxmemory-policy {policy}): \
                     a live lease or commit evicted is an event processed twice; set maxmemory-policy \
                     noeviction, or accept the risk with --allow-redis-eviction"
                ));
                break;
            }
        }
        self.note_full(full);
        let now = match &refusal {
            Some(reason) => Eviction::Refused(reason.clone()),
            None => Eviction::Never,
        };
        let before = std::mem::replace(
            &mut *self.inner.eviction.lock().expect("eviction lock"),
            now.clone(),
        );
        // A change while serving is logged here; the first reading's
        // verdict by whoever asked for it (at start: one configuration
        // line and exit 64).
        match (&before, &now) {
            (Eviction::Refused(_), Eviction::Never) => {
                tracing::info!("Redis no longer evicts keys: serving again")
            }
            (Eviction::Never, Eviction::Refused(reason)) => {
                tracing::error!(reason = %reason, "Redis refused: NOT_SERVING")
            }
            _ => {}
        }
        Ok(refusal)
    }

    /// Notes that Redis is full (for the next two eviction checks: a
    /// reading of `INFO memory` below `maxmemory` clears it sooner), or not.
    fn note_full(&self, full: bool) {
        *self.inner.full_until.lock().expect("full lock") =
            full.then(|| tokio::time::Instant::now() + 2 * EVICTION_CHECK_EVERY);
    }

    /// `Err` while Redis is refused for evicting keys; reads the policy
    /// first if nobody has yet.
    async fn not_evicting(&self) -> Result<(), Error> {
        let known = self.inner.eviction.lock().expect("eviction lock").clone();
        let refusal = match known {
            Eviction::Never => None,
            Eviction::Refused(reason) => Some(reason),
            Eviction::Unread => self.eviction_refusal().await?,
        };
        match refusal {
            Some(reason) => Err(Error::Unavailable(reason)),
            None => Ok(()),
        }
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

    /// [`Store::update_mark`] inside its witness scope.
    async fn update_mark_witnessed<F>(&self, redis_key: &str, mut apply: F) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        let mut current = self
            .fetch::<Option<String>>(redis_key, Fetch::Mark)
            .await?
            .unwrap_or_default();
        while let Some(next) = apply(decode_mark(&current)?) {
            let mut invocation = self.inner.mark.key(redis_key);
            invocation
                .arg(&current)
                .arg(encode_mark(next))
                .arg(self.ttl_ms(next.retain_until));
            self.add_witness(&mut invocation, redis_key)?;
            let (done, now): (i64, String) = self.write_script(&invocation).await?.answer;
            if done == 1 || now == encode_mark(next) {
                break;
            }
            current = now;
        }
        self.fence_on_cluster(redis_key).await
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

/// Whether what the update script found is our own `write`, carried out by
/// an attempt whose answer was lost:
/// - a claim (`draw_token`): the bytes hold the lease token this call drew at
///   random, so equal bytes are ours, retried or not;
/// - any other write, only if the call was `retried`: other changes are
///   deterministic, so equal bytes could be another sidecar's identical
///   write, but after a retry our first attempt may have landed — a Commit
///   answers COMMITTED (not ALREADY_COMMITTED), a Forget finds the record it
///   deleted.
fn is_our_write(write: &Write, found: Option<&Stored>, draw_token: bool, retried: bool) -> bool {
    match (write, found) {
        (Write::Put { bytes, token, .. }, Some(found)) if found.version.bytes == *bytes => {
            draw_token
                || (retried
                    && token.is_some_and(|token| token.0.to_string() == found.version.token))
        }
        (Write::Delete, None) => retried,
        _ => false,
    }
}

/// The record's bytes at rest: its fencing token lives in the hash's `f`
/// field, where the script can draw it.
fn encode_without_token(record: &Record) -> Vec<u8> {
    codec::encode_record(&Record {
        fencing_token: PROVISIONAL,
        ..record.clone()
    })
}

fn encode_mark(mark: SequenceMark) -> String {
    format!("{}:{}", mark.highest, mark.retain_until.0)
}

fn decode_mark(text: &str) -> Result<Option<SequenceMark>, Error> {
    if text.is_empty() {
        return Ok(None);
    }
    let corrupt = || Error::Corrupt(format!("ordering mark {text:?}"));
    let (highest, until) = text.split_once(':').ok_or_else(corrupt)?;
    Ok(Some(SequenceMark {
        highest: highest.parse().map_err(|_| corrupt())?,
        retain_until: UnixMillis(until.parse().map_err(|_| corrupt())?),
    }))
}

impl Store for RedisStore {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, IssueFencing<'_>) -> Result<(Change, T), Error> + Send,
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
                self.fence_on_cluster(&self.record_key(key)).await?;
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
                self.fence_on_cluster(&redis_key).await?;
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
                self.fence_on_cluster(&redis_key).await?;
                decode_mark(&text.unwrap_or_default())
            })
            .await
    }

    async fn durable(&self) -> Result<(), Error> {
        // Redis answered each write after applying it, and after its
        // append-only file's fsync when `appendfsync always` is set: that
        // setting is the durability of this store on one server; across a
        // failover, `--store-replicas` (on a cluster, each call fenced the
        // key it touched already).
        if self.is_cluster() {
            Ok(())
        } else {
            self.fence(None).await
        }
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

    async fn stats(&self) -> StoreStats {
        // Counting one prefix's keys would scan the whole keyspace.
        StoreStats::default()
    }

    async fn close(&self) -> Result<(), Error> {
        Ok(())
    }
}

impl Conditional for RedisStore {
    type Version = Held;

    async fn read(&self, key: &Key) -> Result<Option<Stored>, Error> {
        RedisStore::read(self, &self.record_key(key)).await
    }

    async fn write_if(
        &self,
        key: &Key,
        believed: Option<&Stored>,
        change: &Change,
        draw_token: bool,
    ) -> Result<Swapped<Held>, Error> {
        let write = match change {
            Change::Keep => {
                return Ok(Swapped::Done {
                    token: None,
                    version: None,
                })
            }
            Change::Delete if believed.is_none() => {
                return Ok(Swapped::Done {
                    token: None,
                    version: None,
                })
            }
            Change::Delete => Write::Delete,
            Change::Put(next) => Write::Put {
                bytes: encode_without_token(next),
                token: (!draw_token).then_some(next.fencing_token),
                retain_until: next.retain_until,
            },
        };
        let swapped = self
            .swap(key, &self.record_key(key), believed, &write)
            .await?;
        let token = match swapped.answer {
            Swap::Done(token) => token,
            // Our own write, made by an attempt whose answer was lost.
            Swap::Conflict(current)
                if is_our_write(&write, current.as_deref(), draw_token, swapped.retried) =>
            {
                current
                    .map(|stored| stored.version.token)
                    .unwrap_or_default()
            }
            Swap::Conflict(current) => return Ok(Swapped::Conflict(current)),
        };
        let drawn = if draw_token {
            Some(parse_token(&token)?)
        } else {
            None
        };
        // The bytes written hold no token, so they are those of the record
        // re-run with the drawn one too.
        let version = match write {
            Write::Put { bytes, .. } => Some(Held { bytes, token }),
            Write::Delete => None,
        };
        Ok(Swapped::Done {
            token: drawn,
            version,
        })
    }
}

impl TimeSource for RedisStore {
    async fn read_clock(&self) -> Result<ClockReading, Error> {
        // On a cluster, the same node's clock (slot 0's primary) while it
        // serves, so readings do not jump between nodes' clocks; while it
        // does not (its replica not promoted yet, or none), the primary of
        // slot 8192, then of slot 16383: the same fallback for every
        // sidecar, so they keep reading one clock.
        let mut unanswered = None;
        for slot in [0, 8192, 16383] {
            let primary = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                slot,
                SlotAddr::Master,
            )));
            match self.time_from(primary).await {
                Err(Error::Unavailable(error)) if self.is_cluster() => {
                    tracing::debug!(%error, slot, "the primary of a slot did not tell the time");
                    unanswered = Some(error);
                }
                read => return read,
            }
        }
        Err(Error::Unavailable(unanswered.unwrap_or_default()))
    }
}

impl RedisStore {
    /// `TIME` of the node `node` routes to (on one primary, its).
    async fn time_from(&self, node: RoutingInfo) -> Result<ClockReading, Error> {
        let sent = std::time::Instant::now();
        let answer = self
            .call(|mut connection| {
                let node = node.clone();
                async move { connection.route(redis::cmd("TIME"), node).await }
            })
            .await?;
        let (seconds, micros) = <(u64, u64)>::from_redis_value(answer)
            .map_err(|error| Error::Store(format!("Redis's TIME: {error}")))?;
        Ok(ClockReading {
            sent,
            store_micros: seconds.saturating_mul(1_000_000).saturating_add(micros),
            received: std::time::Instant::now(),
        })
    }
}

impl DeletionFeed for RedisStore {
    async fn subscribe(&self) -> Result<mpsc::Receiver<Key>, Error> {
        let client = match &self.inner.topology {
            Topology::Primary { client } => client,
            Topology::Cluster {
                seeds, next_seed, ..
            } => &seeds[next_seed.fetch_add(1, Relaxed) % seeds.len()],
        };
        let pubsub = tokio::time::timeout(self.inner.timeout, client.get_async_pubsub())
            .await
            .map_err(|_| Error::Unavailable("Redis did not answer the subscription".into()))?
            .map_err(redis_error);
        let mut pubsub = self.inner.reachability.observe(pubsub)?;
        let subscribed = tokio::time::timeout(self.inner.timeout, pubsub.subscribe(self.channel()))
            .await
            .map_err(|_| Error::Unavailable("Redis did not answer the subscription".into()))?
            .map_err(redis_error);
        self.inner.reachability.observe(subscribed)?;
        // On a cluster a notice published on another primary reaches this
        // node over the cluster bus, which drops what it cannot deliver
        // while a link is down — silently. So every heartbeat also
        // publishes a probe on every primary, on a channel of this
        // subscription's own; a probe not heard back from every primary
        // within two heartbeats means notices may have been lost, and the
        // feed ends (the local tier clears and resubscribes).
        let probe_channel = if self.is_cluster() {
            let channel = format!("{}:probe:{:016x}", self.inner.prefix, rand::random::<u64>());
            let subscribed = tokio::time::timeout(self.inner.timeout, pubsub.subscribe(&channel))
                .await
                .map_err(|_| Error::Unavailable("Redis did not answer the subscription".into()))?
                .map_err(redis_error);
            self.inner.reachability.observe(subscribed)?;
            Some(channel)
        } else {
            None
        };
        let (sink, mut messages) = pubsub.split();
        let (deleted, receiver) = mpsc::channel(FEED_BUFFER);
        let store = self.clone();
        tokio::spawn(async move {
            let mut sink = sink;
            let mut heartbeat = tokio::time::interval(HEARTBEAT);
            // Ticks missed while busy are not made up in a burst: each
            // check must come after the messages that arrived before it.
            heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut probes = Probes::default();
            loop {
                tokio::select! {
                    // Messages first: a probe's echo waiting to be read is
                    // not a probe lost.
                    biased;
                    message = messages.next() => {
                        let Some(message) = message else { break };
                        let Ok(text) = message.get_payload::<String>() else { continue };
                        if probe_channel.as_deref() == Some(message.get_channel_name()) {
                            probes.heard(&text);
                            continue;
                        }
                        match parse_deletion(&text) {
                            Some(key) => {
                                if deleted.send(key).await.is_err() {
                                    break;
                                }
                            }
                            None => tracing::warn!(message = %text, "unreadable deletion notice"),
                        }
                    }
                    _ = heartbeat.tick() => {
                        // A connection that died without a word is found here.
                        match tokio::time::timeout(HEARTBEAT, sink.ping::<()>()).await {
                            Ok(Ok(())) => {}
                            _ => break,
                        }
                        if let Some(channel) = &probe_channel {
                            if let Err(lost) = probes.check(tokio::time::Instant::now()) {
                                tracing::warn!(%lost, "deletion feed: a primary's notices stopped arriving");
                                break;
                            }
                            // Bounded by the store's timeout, as any call.
                            match store.publish_probe(channel, probes.next).await {
                                Ok(primaries) => probes.sent(primaries, tokio::time::Instant::now()),
                                Err(error) => {
                                    tracing::warn!(%error, "deletion feed: cannot probe every primary");
                                    break;
                                }
                            }
                        }
                    }
                    () = deleted.closed() => break,
                }
            }
        });
        Ok(receiver)
    }
}

impl RedisStore {
    /// Publishes probe `sequence` on every primary of the cluster: how many
    /// took it.
    async fn publish_probe(&self, channel: &str, sequence: u64) -> Result<usize, Error> {
        let every_primary = RoutingInfo::MultiNode((
            MultipleNodeRoutingInfo::AllMasters,
            Some(ResponsePolicy::Special),
        ));
        let publish = redis::cmd("PUBLISH").arg(channel).arg(sequence).clone();
        let answer = self
            .call(|mut connection| {
                let (publish, every_primary) = (publish.clone(), every_primary.clone());
                async move { connection.route(publish, every_primary).await }
            })
            .await?;
        Ok(match answer {
            redis::Value::Map(by_node) => by_node.len(),
            _ => 1,
        })
    }
}

/// The deletion feed's probes on a cluster (see [`RedisStore::subscribe`]):
/// each sent to every primary, each to be heard back from all of them
/// within [`PROBE_WITHIN`].
#[derive(Debug, Default)]
struct Probes {
    /// The sequence number of the next probe.
    next: u64,
    /// Probes sent and not yet heard back from every primary.
    pending: std::collections::VecDeque<Probe>,
}

/// One probe on its way.
#[derive(Debug)]
struct Probe {
    sequence: u64,
    /// Primaries that took it.
    primaries: usize,
    /// Echoes heard.
    heard: usize,
    sent: tokio::time::Instant,
}

/// How long a probe's echoes may take: the cluster bus carries a message
/// in milliseconds, so past this some were dropped.
const PROBE_WITHIN: Duration = HEARTBEAT.saturating_mul(2);

impl Probes {
    /// Notes an echo heard.
    fn heard(&mut self, text: &str) {
        let Ok(sequence) = text.parse::<u64>() else {
            return;
        };
        if let Some(probe) = self
            .pending
            .iter_mut()
            .find(|probe| probe.sequence == sequence)
        {
            probe.heard += 1;
        }
        self.pending.retain(|probe| probe.heard < probe.primaries);
    }

    /// Notes probe `next` taken by `primaries` primaries at `now`.
    fn sent(&mut self, primaries: usize, now: tokio::time::Instant) {
        self.pending.push_back(Probe {
            sequence: self.next,
            primaries,
            heard: 0,
            sent: now,
        });
        self.next += 1;
    }

    /// `Err` if a probe sent more than [`PROBE_WITHIN`] before `now` is
    /// still not heard back from every primary.
    fn check(&self, now: tokio::time::Instant) -> Result<(), String> {
        match self.pending.front() {
            Some(probe) if now.duration_since(probe.sent) > PROBE_WITHIN => Err(format!(
                "probe {} heard from {} of {} primaries within {PROBE_WITHIN:?}",
                probe.sequence, probe.heard, probe.primaries
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_without_showing_passwords() {
        assert!(check_url("redis://127.0.0.1:6379", false).is_ok());
        assert!(check_url("rediss://cache.internal:6380/2", false).is_ok());
        let refused = check_url("postgres://app:s3cret@db/x", false).unwrap_err();
        assert!(!refused.contains("s3cret"), "{refused}");
        let insecure = check_url("rediss://:s3cret@cache:6380/#insecure", false).unwrap_err();
        assert!(insecure.contains("--store-ca-file"), "{insecure}");
        assert!(!insecure.contains("s3cret"), "{insecure}");
    }

    #[test]
    fn cluster_urls_name_each_seed_node_with_the_credentials() {
        assert_eq!(
            nodes(
                "redis+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2:7001/",
                false
            )
            .unwrap(),
            [
                "redis://app:s3cret@10.0.0.1:7000",
                "redis://app:s3cret@10.0.0.2:7001"
            ]
        );
        assert_eq!(
            nodes("rediss+cluster://cache-0:6380", false).unwrap(),
            ["rediss://cache-0:6380"]
        );
        // --store-cluster makes a plain URL's hosts seed nodes.
        assert_eq!(
            nodes("redis://a:1,b:2", true).unwrap(),
            ["redis://a:1", "redis://b:2"]
        );
        // Several hosts without saying "cluster", a database other than 0,
        // an empty host: refused, the password never shown.
        let several = check_url("redis://:s3cret@a:1,b:2", false).unwrap_err();
        assert!(several.contains("redis+cluster://"), "{several}");
        assert!(!several.contains("s3cret"), "{several}");
        let database = check_url("redis+cluster://:s3cret@a:1,b:2/3", false).unwrap_err();
        assert!(database.contains("only database 0"), "{database}");
        assert!(!database.contains("s3cret"), "{database}");
        assert!(check_url("redis+cluster://a:1,,b:2", false).is_err());
        assert!(check_url("redis+cluster://a:1,b:2/0", false).is_ok());
        assert!(check_url("redis://a:1,b:2", true).is_ok());
        // A comma in a one-primary URL's password is not a host list.
        assert!(check_url("redis://:pa,ss@cache:6379", false).is_ok());
    }

    #[test]
    fn every_slot_has_a_fence_tag_that_hashes_to_it() {
        let tags = fence_tags();
        assert_eq!(tags.len(), 16_384);
        for key in ["dedupd:r:payments/pay-1", "x:{tagged}:y", "dedupd:m:n/o"] {
            let route = Route::with_key(key, SlotAddr::Master);
            let fence = format!("dedupd:fence:0123:{{{}}}", tags[&route]);
            assert_eq!(Route::with_key(&fence, SlotAddr::Master), route, "{key}");
        }
    }

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

    #[test]
    fn a_retried_write_that_landed_is_recognised_as_ours() {
        let record = |bytes: &[u8], token: &str| Stored {
            version: Held {
                bytes: bytes.to_vec(),
                token: token.to_owned(),
            },
            record: Record::committed_for_tests(Vec::new()),
        };
        let put = |token: Option<u64>| Write::Put {
            bytes: b"committed".to_vec(),
            token: token.map(FencingToken),
            retain_until: UnixMillis(1),
        };
        // A Commit (token kept) found written after a retry: ours, COMMITTED.
        let found = record(b"committed", "7");
        assert!(is_our_write(&put(Some(7)), Some(&found), false, true));
        // Without a retry the same bytes may be another sidecar's write.
        assert!(!is_our_write(&put(Some(7)), Some(&found), false, false));
        assert!(!is_our_write(&put(Some(8)), Some(&found), false, true));
        // A claim's bytes hold its random lease token: equal bytes are ours.
        assert!(is_our_write(&put(None), Some(&found), true, false));
        assert!(!is_our_write(
            &put(None),
            Some(&record(b"other", "7")),
            true,
            true
        ));
        // A Forget that finds nothing after a retry deleted it itself.
        assert!(is_our_write(&Write::Delete, None, false, true));
        assert!(!is_our_write(&Write::Delete, None, false, false));
        assert!(!is_our_write(&Write::Delete, Some(&found), false, true));
    }

    #[test]
    fn a_probe_not_heard_from_every_primary_in_time_ends_the_feed() {
        let start = tokio::time::Instant::now();
        let at = |millis: u64| start + Duration::from_millis(millis);
        let mut probes = Probes::default();
        // Probe 0 taken by three primaries, heard from all: nothing pending.
        probes.check(at(0)).unwrap();
        probes.sent(3, at(0));
        for _ in 0..3 {
            probes.heard("0");
        }
        assert!(probes.pending.is_empty());
        // Probe 1 heard from two of three; a stray or old text ignored.
        probes.sent(3, at(1000));
        probes.heard("1");
        probes.heard("1");
        probes.heard("0");
        probes.heard("not a number");
        probes.sent(3, at(2000));
        for sequence in ["2", "2", "2"] {
            probes.heard(sequence);
        }
        probes.check(at(3000)).unwrap();
        let lost = probes.check(at(3001)).unwrap_err();
        assert!(lost.contains("probe 1 heard from 2 of 3"), "{lost}");
    }

    #[test]
    fn marks_round_trip() {
        let mark = SequenceMark {
            highest: 42,
            retain_until: UnixMillis(1_700_000_000_000),
        };
        assert_eq!(decode_mark(&encode_mark(mark)).unwrap(), Some(mark));
        assert_eq!(decode_mark("").unwrap(), None);
        assert!(decode_mark("42").is_err());
    }

    /// A command routed to the node at `address` (`host:port`).
    async fn on_node(
        connection: &mut Connection,
        address: &str,
        command: &redis::Cmd,
    ) -> redis::RedisResult<redis::Value> {
        let (host, port) = address.rsplit_once(':').expect("host:port");
        connection
            .route(
                command.clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.to_owned(),
                    port: port.parse().expect("a port"),
                }),
            )
            .await
    }

    /// The primary serving `redis_key`'s slot and a replica of it, by
    /// `CLUSTER NODES`.
    async fn primary_and_replica(connection: &mut Connection, redis_key: &str) -> (String, String) {
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(redis_key)
            .query_async(connection)
            .await
            .unwrap();
        let nodes = connection
            .route(
                redis::cmd("CLUSTER").arg("NODES").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            )
            .await
            .unwrap();
        let nodes = String::from_redis_value(nodes).unwrap();
        let lines: Vec<Vec<&str>> = nodes
            .lines()
            .map(|line| line.split_whitespace().collect())
            .collect();
        let address = |fields: &[&str]| fields[1].split('@').next().unwrap().to_owned();
        let serves = |range: &&str| {
            let (low, high) = range.split_once('-').unwrap_or((range, range));
            (low.parse::<u16>().ok()..=high.parse::<u16>().ok()).contains(&Some(slot))
        };
        let primary = lines
            .iter()
            .find(|fields| {
                fields[2].contains("master")
                    && !fields[2].contains("fail")
                    && fields[8..].iter().any(&serves)
            })
            .expect("a primary serves the slot");
        let replica = lines
            .iter()
            .find(|fields| fields[2].contains("slave") && fields[3] == primary[0])
            .expect("the primary has a replica");
        (address(primary), address(replica))
    }

    /// A store on the cluster at `url`, under a fresh prefix, on one
    /// connection.
    fn cluster_store(url: &str, timeout: Duration, replicas: u32) -> RedisStore {
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
    static ON_THE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// While slot 0's primary does not answer, the cluster's time comes
    /// from another primary.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_tells_the_time_while_slot_0s_primary_is_silent() {
        let Some(url) = dedupd_testkit::services::require_redis_cluster() else {
            return;
        };
        let _alone = ON_THE_CLUSTER.lock().await;
        let store = cluster_store(url, Duration::from_millis(500), 0);
        let mut inspect = store.inspection_connection();
        store
            .read_clock()
            .await
            .expect("slot 0's primary tells the time");
        let slot_0 = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
            0,
            SlotAddr::Master,
        )));
        // Its clients paused (the cluster bus is not a client: no
        // failover) for far longer than the reading may take (its store
        // timeout: 500 ms), so a slow machine cannot mistake the paused
        // node's late answer for another's. (A pause of ALL cannot be lifted
        // early: CLIENT UNPAUSE waits with the rest.)
        let pause = Duration::from_secs(6);
        inspect
            .route(
                redis::cmd("CLIENT")
                    .arg("PAUSE")
                    .arg(pause.as_millis() as u64)
                    .arg("ALL")
                    .clone(),
                slot_0.clone(),
            )
            .await
            .unwrap();
        let asked = std::time::Instant::now();
        let reading = store.read_clock().await;
        let waited = asked.elapsed();
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        // The next test finds the node answering again.
        let _ = inspect
            .route(redis::cmd("CLIENT").arg("UNPAUSE").clone(), slot_0.clone())
            .await;
        while inspect
            .route(redis::cmd("PING").clone(), slot_0.clone())
            .await
            .is_err()
        {
            assert!(asked.elapsed() < pause * 3, "slot 0's primary stays paused");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let reading = reading.expect("another primary told the time");
        assert!(
            waited < pause - Duration::from_secs(1),
            "answered after {waited:?}: by the paused node"
        );
        assert!(
            reading.store_micros.abs_diff(wall) < 5_000_000,
            "{} is not this machine's time ({wall})",
            reading.store_micros
        );
    }

    /// Writes the absent `key`, inside a witness scope: its Redis key and
    /// the call's witness key.
    async fn write_new(store: &RedisStore, key: &Key) -> (String, String) {
        let redis_key = store.record_key(key);
        let write = Write::Put {
            bytes: b"claimed".to_vec(),
            token: None,
            retain_until: store
                .inner
                .clock
                .now()
                .saturating_add(Duration::from_secs(60)),
        };
        let swapped = store.swap(key, &redis_key, None, &write).await.unwrap();
        assert!(matches!(swapped.answer, Swap::Done(_)), "{key} is new");
        let witness = WITNESS
            .with(|last| last.borrow().clone())
            .expect("the call left its witness");
        (redis_key, witness)
    }

    /// The fence of a cluster call runs on a node holding that call's
    /// effects: it follows a failover to the replica that received them,
    /// and refuses a node without them (as a replica promoted before the
    /// write reached it would be).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_fence_passes_only_where_the_call_landed() {
        let Some(url) = dedupd_testkit::services::require_redis_cluster() else {
            return;
        };
        let _alone = ON_THE_CLUSTER.lock().await;
        let store = cluster_store(url, Duration::from_secs(5), 1);
        let mut inspect = store.inspection_connection();
        // Fenced where it landed: passes, and takes its witness away.
        let key = Key::from_bytes(b"payments\0fenced").unwrap();
        WITNESS
            .scope(RefCell::new(None), async {
                let (redis_key, witness) = write_new(&store, &key).await;
                let slot = |key: &str| Route::with_key(key, SlotAddr::Master);
                assert_eq!(
                    slot(&witness),
                    slot(&redis_key),
                    "{witness}: not in {redis_key}'s slot"
                );
                let held: bool = redis::cmd("EXISTS")
                    .arg(&witness)
                    .query_async(&mut inspect)
                    .await
                    .unwrap();
                assert!(held, "the script wrote {witness}");
                store.fence(Some(&redis_key)).await.unwrap();
                let held: bool = redis::cmd("EXISTS")
                    .arg(&witness)
                    .query_async(&mut inspect)
                    .await
                    .unwrap();
                assert!(held, "the fence keeps {witness} (it expires by itself)");
                let fenced: String = redis::cmd("GET")
                    .arg(&witness)
                    .query_async(&mut inspect)
                    .await
                    .unwrap();
                assert_eq!(fenced, "fenced");
                // A fence sent again (its answer lost) still finds it.
                WITNESS.with(|last| last.replace(Some(witness.clone())));
                store.fence(Some(&redis_key)).await.unwrap();
            })
            .await;

        // A node without the call's effects: refused, not acknowledged.
        let key = Key::from_bytes(b"payments\0lost").unwrap();
        WITNESS
            .scope(RefCell::new(None), async {
                let (redis_key, witness) = write_new(&store, &key).await;
                let _: u32 = redis::cmd("DEL")
                    .arg(&witness)
                    .query_async(&mut inspect)
                    .await
                    .unwrap();
                match store.fence(Some(&redis_key)).await {
                    Err(Error::Unavailable(reason)) => {
                        assert!(reason.contains("does not hold"), "{reason}")
                    }
                    other => panic!("fenced on a node without the write: {other:?}"),
                }
            })
            .await;

        // A failover between the call and its fence: the promoted replica
        // received the call (a graceful CLUSTER FAILOVER waits for that),
        // the fence follows the slot there and passes.
        let key = Key::from_bytes(b"payments\0failed-over").unwrap();
        WITNESS
            .scope(RefCell::new(None), async {
                let (redis_key, _) = write_new(&store, &key).await;
                let (primary, replica) = primary_and_replica(&mut inspect, &redis_key).await;
                on_node(
                    &mut inspect,
                    &replica,
                    redis::cmd("CLUSTER").arg("FAILOVER"),
                )
                .await
                .unwrap();
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                loop {
                    let role = on_node(
                        &mut inspect,
                        &replica,
                        &redis::cmd("INFO").arg("replication").clone(),
                    )
                    .await;
                    let promoted = role.ok().map(String::from_redis_value).and_then(Result::ok);
                    if promoted.is_some_and(|info| {
                        info.contains("role:master") && info.contains("connected_slaves:1")
                    }) {
                        break;
                    }
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{replica} not promoted over {primary} within 20 s"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                store.fence(Some(&redis_key)).await.unwrap();
            })
            .await;
        let stored: Option<Vec<u8>> = redis::cmd("HGET")
            .arg(store.record_key(&key))
            .arg("r")
            .query_async(&mut inspect)
            .await
            .unwrap();
        assert_eq!(
            stored.as_deref(),
            Some(&b"claimed"[..]),
            "the record survived the failover"
        );
        for key in ["fenced", "lost", "failed-over"] {
            let key = Key::from_bytes(format!("payments\0{key}").as_bytes()).unwrap();
            let _: () = redis::cmd("DEL")
                .arg(store.record_key(&key))
                .query_async(&mut inspect)
                .await
                .unwrap();
        }
    }
}
