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
//!   deletes, so no deletion commits without its notification.
//!
//! Each call touches one key, named in `KEYS`, so each is valid on any
//! Redis Cluster slot; this store speaks to one primary (a Cluster client is
//! not built in).
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
    fmt,
    sync::{
        atomic::{AtomicUsize, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::Duration,
};

use futures_util::StreamExt;
use redis::{aio::ConnectionManager, FromRedisValue, Script, ScriptInvocation};
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

/// Writes a record if it still is what the caller read; otherwise answers
/// with what it is. Draws the fencing token when asked to.
const UPDATE_SCRIPT: &str = r"
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
";

/// The same for an ordering mark (a plain string).
const MARK_SCRIPT: &str = r"
-- KEYS[1] the mark; ARGV[1] as believed ('' = absent); ARGV[2] new; ARGV[3] ttl ms
local now = redis.call('GET', KEYS[1]) or ''
if now ~= ARGV[1] then
  return {0, now}
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {1, ''}
";

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
            .finish()
    }
}

/// Checks a URL the way the store will use it; the problem, if any, in one
/// line without the password.
pub fn check_url(url: &str) -> Result<(), String> {
    let shown = super::postgres::redact_url(url);
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return Err(format!("{shown} is not a redis:// or rediss:// URL"));
    }
    if url.contains("#insecure") {
        return Err(format!(
            "{shown}: #insecure turns off certificate checks; give the CA with --store-ca-file instead"
        ));
    }
    redis::Client::open(url)
        .map(|_| ())
        .map_err(|error| format!("{shown}: {error}"))
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

/// The Redis store; clones share the connections.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    client: redis::Client,
    connections: Vec<ConnectionManager>,
    /// With `--store-replicas`: connections for the fence write and `WAIT`
    /// alone (see [`RedisStore::replicated`]).
    fences: Vec<ConnectionManager>,
    /// The fence key of this sidecar.
    fence_key: String,
    next: AtomicUsize,
    prefix: String,
    timeout: Duration,
    clock: Arc<dyn Clock>,
    reachability: Reachability,
    recent: RecentWrites<Stored>,
    update: Script,
    mark: Script,
    replicas: u32,
    allow_eviction: bool,
    /// Whether Redis may evict keys, as last read.
    eviction: Mutex<Eviction>,
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
        let info = redis::IntoConnectionInfo::into_connection_info(config.url.as_str())
            .map_err(invalid)?
            .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
        let client = match &config.ca_pem {
            Some(pem) => redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            ),
            None => redis::Client::open(info),
        }
        .map_err(invalid)?;
        let manager_config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.timeout))
            .set_response_timeout(Some(config.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let open = |count: usize| {
            (0..count)
                .map(|_| {
                    ConnectionManager::new_lazy_with_config(client.clone(), manager_config.clone())
                        .map_err(|error| Error::Store(format!("{shown}: {error}")))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let connections = open(config.connections.max(1))?;
        let fences = if config.replicas > 0 {
            open(config.connections.max(1))?
        } else {
            Vec::new()
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                client,
                connections,
                fences,
                fence_key: format!("{}:fence:{:016x}", config.prefix, rand::random::<u64>()),
                next: AtomicUsize::new(0),
                prefix: config.prefix.clone(),
                timeout: config.timeout,
                clock,
                reachability: Reachability::default(),
                recent: RecentWrites::default(),
                update: Script::new(UPDATE_SCRIPT),
                mark: Script::new(MARK_SCRIPT),
                replicas: config.replicas,
                allow_eviction: config.allow_eviction,
                eviction: Mutex::new(Eviction::Unread),
            }),
        })
    }

    fn connection(&self) -> ConnectionManager {
        let turn = self.inner.next.fetch_add(1, Relaxed);
        self.inner.connections[turn % self.inner.connections.len()].clone()
    }

    /// Runs one call on a connection within the timeout, noting for health
    /// whether Redis answered. A call that found its connection dropped is
    /// made once more on the same connection, which then waits for the
    /// reconnection: after Redis restarts, every connection's first call
    /// meets the old socket. A repeated write is safe: the script compares
    /// before it writes, and [`RedisStore::update`] recognises its own claim.
    async fn call<T, Fut>(&self, make: impl Fn(ConnectionManager) -> Fut) -> Result<T, Error>
    where
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        self.call_on(self.connection(), make).await
    }

    async fn call_on<T, Fut>(
        &self,
        connection: ConnectionManager,
        make: impl Fn(ConnectionManager) -> Fut,
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
        connection: ConnectionManager,
        make: impl Fn(ConnectionManager) -> Fut,
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
        let result = match tokio::time::timeout(self.inner.timeout, attempts).await {
            Ok(answered) => answered.map_err(redis_error),
            Err(_) => Err(Error::Unavailable(format!(
                "Redis did not answer within {:?}",
                self.inner.timeout
            ))),
        };
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
    /// clock (at least 1 ms: Redis refuses zero).
    fn ttl_ms(&self, until: UnixMillis) -> u64 {
        until
            .saturating_since(self.inner.clock.now())
            .as_millis()
            .clamp(1, u128::from(u64::MAX)) as u64
    }

    async fn read(&self, redis_key: &str) -> Result<Option<Stored>, Error> {
        let read = redis::cmd("HMGET").arg(redis_key).arg("r").arg("f").clone();
        let (bytes, token): (Option<Vec<u8>>, Option<String>) = self
            .call(|mut connection| {
                let read = &read;
                async move { read.query_async(&mut connection).await }
            })
            .await?;
        decode_stored(bytes.unwrap_or_default(), token.unwrap_or_default())
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

    /// With `--store-replicas N`: proves that N replicas hold everything
    /// this call wrote or read. `WAIT` counts the replicas that have the
    /// last write *of its own connection*, and replicas apply the primary's
    /// stream in order; so a write of a fence key followed by `WAIT N`, in
    /// one round trip on a connection of their own, covers every write the
    /// primary made before it — this call's, on any connection, and the
    /// ones its reads revealed (a DUPLICATE of a commit a failover would
    /// lose). The fence connections are apart from the others: Redis serves
    /// nothing else on a connection while it is blocked in `WAIT`.
    async fn replicated(&self) -> Result<(), Error> {
        let replicas = self.inner.replicas;
        if replicas == 0 {
            return Ok(());
        }
        let wait_ms = u64::try_from((self.inner.timeout / 2).as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let turn = self.inner.next.fetch_add(1, Relaxed);
        let connection = self.inner.fences[turn % self.inner.fences.len()].clone();
        let fence = &self.inner.fence_key;
        let acknowledged: u32 = self
            .call_on(connection, |mut connection| async move {
                let (acknowledged,): (u32,) = redis::pipe()
                    .cmd("SET")
                    .arg(fence)
                    .arg(turn)
                    .arg("PX")
                    .arg(60_000)
                    .ignore()
                    .cmd("WAIT")
                    .arg(replicas)
                    .arg(wait_ms)
                    .query_async(&mut connection)
                    .await?;
                Ok(acknowledged)
            })
            .await?;
        if acknowledged < replicas {
            return Err(Error::Unavailable(format!(
                "{acknowledged} of {replicas} replicas confirmed within {wait_ms} ms (--store-replicas): not acknowledged, though it may stand on the primary"
            )));
        }
        Ok(())
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
        let info: String = self
            .call(|mut connection| async move {
                redis::cmd("INFO")
                    .arg("memory")
                    .query_async(&mut connection)
                    .await
            })
            .await?;
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
                .unwrap_or_default()
                .to_owned()
        };
        let (maxmemory, policy) = (field("maxmemory"), field("maxmemory_policy"));
        let refusal = if maxmemory == "0" || policy == "noeviction" {
            None
        } else {
            Some(format!(
                "Redis may evict dedupd's records (maxmemory {maxmemory}, maxmemory-policy {policy}): \
                 a live lease or commit evicted is an event processed twice; set maxmemory-policy \
                 noeviction, or accept the risk with --allow-redis-eviction"
            ))
        };
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
    async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, IssueFencing<'_>) -> Result<(Change, T), Error> + Send,
    {
        self.not_evicting().await?;
        // Start from a belief (our own last write, or "absent" for a key we
        // never wrote); the script checks it and answers with the truth if
        // it was wrong.
        let remembered = self.inner.recent.recall(key);
        let (answer, written) = optimistic::update(self, key, remembered, apply).await?;
        if let Some(written) = written {
            self.inner.recent.remember(key, written);
        }
        Ok(answer)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.not_evicting().await?;
        Ok(self
            .read(&self.record_key(key))
            .await?
            .map(|stored| stored.record))
    }

    async fn update_mark<F>(&self, scope: &OrderingScope, mut apply: F) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        self.not_evicting().await?;
        let redis_key = self.mark_key(scope);
        let read = redis::cmd("GET").arg(&redis_key).clone();
        let mut current: String = self
            .call(|mut connection| {
                let read = &read;
                async move {
                    read.query_async::<Option<String>>(&mut connection)
                        .await
                        .map(Option::unwrap_or_default)
                }
            })
            .await?;
        loop {
            let Some(next) = apply(decode_mark(&current)?) else {
                return Ok(());
            };
            let mut invocation = self.inner.mark.key(&redis_key);
            invocation
                .arg(&current)
                .arg(encode_mark(next))
                .arg(self.ttl_ms(next.retain_until));
            let (done, now): (i64, String) = self.write_script(&invocation).await?.answer;
            if done == 1 || now == encode_mark(next) {
                return Ok(());
            }
            current = now;
        }
    }

    async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
        self.not_evicting().await?;
        let read = redis::cmd("GET").arg(self.mark_key(scope)).clone();
        let text: Option<String> = self
            .call(|mut connection| {
                let read = &read;
                async move { read.query_async(&mut connection).await }
            })
            .await?;
        decode_mark(&text.unwrap_or_default())
    }

    async fn durable(&self) -> Result<(), Error> {
        // Redis answered each write after applying it, and after its
        // append-only file's fsync when `appendfsync always` is set: that
        // setting is the durability of this store on one server; across a
        // failover, `--store-replicas`.
        self.replicated().await
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
        let sent = std::time::Instant::now();
        let (seconds, micros): (u64, u64) =
            self.call(|mut connection| async move {
                redis::cmd("TIME").query_async(&mut connection).await
            })
            .await?;
        Ok(ClockReading {
            sent,
            store_micros: seconds.saturating_mul(1_000_000).saturating_add(micros),
            received: std::time::Instant::now(),
        })
    }
}

impl DeletionFeed for RedisStore {
    async fn subscribe(&self) -> Result<mpsc::Receiver<Key>, Error> {
        let pubsub = tokio::time::timeout(self.inner.timeout, self.inner.client.get_async_pubsub())
            .await
            .map_err(|_| Error::Unavailable("Redis did not answer the subscription".into()))?
            .map_err(redis_error);
        let mut pubsub = self.inner.reachability.observe(pubsub)?;
        let subscribed = tokio::time::timeout(self.inner.timeout, pubsub.subscribe(self.channel()))
            .await
            .map_err(|_| Error::Unavailable("Redis did not answer the subscription".into()))?
            .map_err(redis_error);
        self.inner.reachability.observe(subscribed)?;
        let (sink, mut messages) = pubsub.split();
        let (deleted, receiver) = mpsc::channel(FEED_BUFFER);
        tokio::spawn(async move {
            let mut sink = sink;
            let mut heartbeat = tokio::time::interval(HEARTBEAT);
            loop {
                tokio::select! {
                    message = messages.next() => {
                        let Some(message) = message else { break };
                        let Ok(text) = message.get_payload::<String>() else { continue };
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
                    }
                    () = deleted.closed() => break,
                }
            }
        });
        Ok(receiver)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_without_showing_passwords() {
        assert!(check_url("redis://127.0.0.1:6379").is_ok());
        assert!(check_url("rediss://cache.internal:6380/2").is_ok());
        let refused = check_url("postgres://app:s3cret@db/x").unwrap_err();
        assert!(!refused.contains("s3cret"), "{refused}");
        let insecure = check_url("rediss://:s3cret@cache:6380/#insecure").unwrap_err();
        assert!(insecure.contains("--store-ca-file"), "{insecure}");
        assert!(!insecure.contains("s3cret"), "{insecure}");
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
    fn marks_round_trip() {
        let mark = SequenceMark {
            highest: 42,
            retain_until: UnixMillis(1_700_000_000_000),
        };
        assert_eq!(decode_mark(&encode_mark(mark)).unwrap(), Some(mark));
        assert_eq!(decode_mark("").unwrap(), None);
        assert!(decode_mark("42").is_err());
    }
}
