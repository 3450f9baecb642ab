//! The shared store: every sidecar over one PostgreSQL, so a redelivery that
//! lands on another pod still meets the record. The rules stay in
//! [`crate::machine`]; this file only reads, inserts and conditionally
//! updates rows.
//!
//! - `processed_events`: the article's table (namespace, correlation_id,
//!   event_type, consumer_version, processed_at) plus the rest of the record
//!   and a `revision` for optimistic updates, drawn from the `revisions`
//!   sequence so it never repeats, even when a key is deleted and claimed
//!   again (a revision counter per row would start over, and a stale
//!   conditional update would hit the new row).
//! - `ordering_marks`: the highest committed sequence per ordering scope.
//! - `fencing_tokens`: a `SEQUENCE`, so fencing tokens increase across every
//!   sidecar and restart.
//! - `schema_version`: migrations, applied at start under an advisory lock
//!   so N sidecars starting at once migrate once.
//! - Deletions are announced by the deleting statement itself
//!   (`pg_notify('dedupd_deleted', '<schema> <key>')`, delivered at its
//!   commit) and heard on a `LISTEN` connection of the sidecar's own: the
//!   [`DeletionFeed`] that keeps local tiers honest.
//!
//! A fresh Claim is one statement (`INSERT … ON CONFLICT DO NOTHING
//! RETURNING`, the fencing token drawn by `nextval` in the same statement):
//! the machine runs once with a provisional token to learn what to insert,
//! and once more with the token the insert drew (it is a pure function, so
//! both runs agree but for the token). Everything else reads the row, runs
//! the machine, and writes back `WHERE revision = $read`, retrying when
//! another sidecar got there first (the loop is [`super::optimistic`]'s;
//! this file gives it one connection and one deadline per call). Each statement commits on its own, so
//! an answer leaves only once PostgreSQL has made its change durable.

mod config;
mod feed;
mod rows;
mod schema;

use std::{
    fmt,
    future::Future,
    ops::Deref,
    str::FromStr,
    sync::{
        atomic::{AtomicBool, Ordering::SeqCst},
        Arc, Mutex,
    },
    time::Duration,
};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio::time::Instant;
use tokio_postgres::{config::SslMode, NoTls, Row};
use tokio_postgres_rustls::MakeRustlsConnect;

pub use self::config::{check_schema, check_url, redact_url, PostgresConfig};
use self::{
    config::tls_config,
    feed::DELETION_CHANNEL,
    rows::{at, fencing_from_db, millis, record_from_row, RecordValues, COLUMNS},
};
use super::{
    optimistic::{self, with_token, Conditional, Swapped, Versioned},
    shared::{deletion_message, Reachability, RecentWrites},
    Attempt, ReapReport, ScanCursor, ScanPage, Store, StoreStats,
};
use crate::{
    clock::UnixMillis,
    domain::{FencingToken, Key, OrderingScope, Record},
    error::Error,
    machine::{Change, SequenceMark},
    time_policy::{ClockReading, TimeSource},
};

/// How long a size figure for `/metrics` is reused: counting rows is a scan,
/// and every pod's every scrape would run one on the shared database.
const STATS_FOR: Duration = Duration::from_secs(30);

/// The PostgreSQL store; clones share one pool.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    schema: String,
    /// Set once the schema is in place; until then every call is UNAVAILABLE.
    ready: AtomicBool,
    reachability: Reachability,
    /// Rows this sidecar wrote last, with their revision: a Commit after our
    /// own Claim can write back `WHERE revision = $cached` at once.
    recent: RecentWrites<Versioned<i64>>,
    /// How to open the dedicated connection the deletion feed listens on.
    listen: Listen,
    /// Longest one call may take, from taking a connection to the last
    /// statement's answer.
    timeout: Duration,
    /// The last size figures, and when they were counted.
    stats: Mutex<Option<(Instant, StoreStats)>>,
    /// Set while one call counts them (the others reuse the last figures).
    counting: AtomicBool,
}

/// A pooled connection for one call, with the call's deadline. A connection
/// whose statement outlived the deadline leaves the pool instead of going
/// back: its socket may still owe a late answer, or be silent for good (a
/// partition, a primary gone without a reset).
struct Conn {
    client: Option<deadpool_postgres::Client>,
    deadline: Instant,
    broken: AtomicBool,
}

impl Deref for Conn {
    type Target = deadpool_postgres::Client;

    fn deref(&self) -> &Self::Target {
        self.client.as_ref().expect("a connection until dropped")
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if *self.broken.get_mut() {
            if let Some(client) = self.client.take() {
                drop(deadpool_postgres::Object::take(client));
            }
        }
    }
}

/// A connection of its own for `LISTEN` (a pooled one would be recycled).
#[derive(Clone)]
enum Listen {
    Plain(tokio_postgres::Config),
    Tls(tokio_postgres::Config, MakeRustlsConnect),
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("schema", &self.inner.schema)
            .field("ready", &self.inner.ready.load(SeqCst))
            .finish()
    }
}

impl PostgresStore {
    /// A store over `config`. Nothing is contacted yet: call
    /// [`PostgresStore::prepare`] (the server retries it in the background).
    pub fn new(config: &PostgresConfig) -> Result<PostgresStore, Error> {
        let mut pg = tokio_postgres::Config::from_str(&config.url)
            .map_err(|error| Error::Store(format!("{}: {error}", redact_url(&config.url))))?;
        let timeout_ms = config.statement_timeout.as_millis();
        pg.options(format!(
            "-c statement_timeout={timeout_ms} -c search_path={}",
            config.schema
        ));
        pg.connect_timeout(config.statement_timeout);
        pg.application_name("dedupd");
        // A peer that vanished without a reset (a partition, a primary
        // gone) is found by the kernel too, not only by our deadlines: the
        // sockets of connections taken out of the pool close in seconds, not
        // after the ~15 minutes of TCP retransmissions.
        pg.keepalives(true)
            .keepalives_idle(Duration::from_secs(5))
            .keepalives_interval(Duration::from_secs(1))
            .keepalives_retries(3)
            .tcp_user_timeout(config.statement_timeout.max(Duration::from_secs(1)) * 2);
        let recycling = || ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        // TLS only when the URL insists (sslmode=require), and then always
        // verified: an unverified "prefer" handshake would only look secure.
        let (manager, listen) = if pg.get_ssl_mode() == SslMode::Require {
            let tls = MakeRustlsConnect::new(tls_config(config.ca_pem.as_deref())?);
            let listen = Listen::Tls(pg.clone(), tls.clone());
            (Manager::from_config(pg, tls, recycling()), listen)
        } else {
            let listen = Listen::Plain(pg.clone());
            (Manager::from_config(pg, NoTls, recycling()), listen)
        };
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .wait_timeout(Some(config.statement_timeout))
            .create_timeout(Some(config.statement_timeout))
            .recycle_timeout(Some(config.statement_timeout))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|error| Error::Store(format!("connection pool: {error}")))?;
        Ok(PostgresStore {
            inner: Arc::new(Inner {
                pool,
                schema: config.schema.clone(),
                ready: AtomicBool::new(false),
                reachability: Reachability::default(),
                recent: RecentWrites::default(),
                listen,
                timeout: config.statement_timeout,
                stats: Mutex::new(None),
                counting: AtomicBool::new(false),
            }),
        })
    }

    /// A connection for one call, which must be over by `--store-timeout`
    /// from now: every statement on it is bounded by that one deadline.
    async fn client(&self) -> Result<Conn, Error> {
        let deadline = Instant::now() + self.inner.timeout;
        let client = match tokio::time::timeout_at(deadline, self.inner.pool.get()).await {
            Ok(Ok(client)) => client,
            Ok(Err(error)) => {
                return self
                    .inner
                    .reachability
                    .observe(Err(Error::Unavailable(format!(
                        "PostgreSQL unreachable: {error}"
                    ))))
            }
            Err(_) => return self.inner.reachability.observe(Err(self.silent())),
        };
        // A pooled connection is no proof the server answers: only
        // failures are noted here.
        Ok(Conn {
            client: Some(client),
            deadline,
            broken: AtomicBool::new(false),
        })
    }

    fn silent(&self) -> Error {
        Error::Unavailable(format!(
            "PostgreSQL did not answer within {:?} (--store-timeout)",
            self.inner.timeout
        ))
    }

    /// Runs one exchange with the server on `conn` within the call's
    /// deadline, noting for health whether the server answered. A
    /// connection is reused only once its exchange is over: past the
    /// deadline, or if the call is dropped midway (a client that went
    /// away), it is dropped instead.
    async fn bounded<T>(
        &self,
        conn: &Conn,
        exchange: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, Error> {
        conn.broken.store(true, SeqCst);
        match tokio::time::timeout_at(conn.deadline, exchange).await {
            Ok(answered) => {
                let closed = answered
                    .as_ref()
                    .is_err_and(tokio_postgres::Error::is_closed);
                conn.broken.store(closed, SeqCst);
                self.observe(answered)
            }
            Err(_) => {
                conn.broken.store(true, SeqCst);
                self.inner.reachability.observe(Err(self.silent()))
            }
        }
    }

    /// Notes whether the server answered, for health.
    fn observe<T>(&self, result: Result<T, tokio_postgres::Error>) -> Result<T, Error> {
        self.inner.reachability.observe(result.map_err(db_error))
    }

    fn ready(&self) -> Result<(), Error> {
        if self.inner.ready.load(SeqCst) {
            Ok(())
        } else {
            Err(Error::Unavailable(
                "PostgreSQL schema not ready yet (is the server reachable?)".into(),
            ))
        }
    }

    /// Keeps the store connected for as long as it lives: prepares the
    /// schema (retrying with backoff while the server is unreachable, so a
    /// sidecar can start before its database), then pings once a second
    /// while the last statement found the server gone, so health recovers by
    /// itself without traffic. (With a [`crate::time_policy::StoreClock`]
    /// measuring this store, its once-a-second reading also finds a server
    /// gone silent while nobody calls.)
    pub fn keep_connected(&self) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(100);
            while !store.inner.ready.load(SeqCst) {
                match store.prepare().await {
                    Ok(()) => {
                        tracing::info!(schema = %store.inner.schema, "PostgreSQL schema ready")
                    }
                    Err(error) => {
                        tracing::warn!(%error, ?backoff, "PostgreSQL not ready; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                    }
                }
            }
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if store.writable().is_err() {
                    if let Err(error) = store.ping().await {
                        tracing::debug!(%error, "PostgreSQL still unreachable");
                    }
                }
            }
        })
    }

    /// Runs one statement, prepared once per connection, noting for health
    /// whether the server answered; how many rows it changed.
    async fn execute(
        &self,
        client: &Conn,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<u64, Error> {
        let statement = self.bounded(client, client.prepare_cached(sql)).await?;
        self.bounded(client, client.execute(&statement, params))
            .await
    }

    /// Like [`PostgresStore::execute`], for a statement answering at most
    /// one row.
    async fn query_opt(
        &self,
        client: &Conn,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<Row>, Error> {
        let statement = self.bounded(client, client.prepare_cached(sql)).await?;
        self.bounded(client, client.query_opt(&statement, params))
            .await
    }

    /// Asks the server whether it answers (for health; cheap).
    pub async fn ping(&self) -> Result<(), Error> {
        let client = self.client().await?;
        self.bounded(&client, client.simple_query("SELECT 1"))
            .await?;
        Ok(())
    }

    async fn read(&self, client: &Conn, key: &Key) -> Result<Option<(Record, i64)>, Error> {
        let schema = &self.inner.schema;
        let sql = format!(
            "SELECT {COLUMNS}, revision FROM {schema}.processed_events
                  WHERE namespace = $1 AND correlation_id = $2"
        );
        self.query_opt(client, &sql, &[&key.namespace(), &key.correlation_id()])
            .await?
            .map(|row| Ok((record_from_row(&row)?, row.get::<_, i64>("revision"))))
            .transpose()
    }

    /// A fencing token for a claim over `current`: the sequence's next,
    /// but never at or below the token the row already holds. A sequence
    /// can go back — a switchover by logical replication (sequences are not
    /// replicated), an asynchronous failover, a restore — and a key's
    /// tokens must not.
    async fn next_fencing(
        &self,
        client: &Conn,
        current: Option<&Record>,
    ) -> Result<FencingToken, Error> {
        let schema = &self.inner.schema;
        let sql = format!("SELECT nextval('{schema}.fencing_tokens')");
        let drawn = self
            .query_opt(client, &sql, &[])
            .await?
            .map_or(0, |row| row.get::<_, i64>(0));
        let floor = current.map_or(0, |record| record.fencing_token.0.saturating_add(1));
        Ok(FencingToken(fencing_from_db(drawn).0.max(floor)))
    }
}

fn db_error(error: tokio_postgres::Error) -> Error {
    // No server answer at all (refused, reset, closed), or a timeout: retry.
    let unavailable = error.is_closed()
        || error.code().is_none()
        || error.code().is_some_and(|code| {
            code == &tokio_postgres::error::SqlState::QUERY_CANCELED
                || code.code().starts_with("08")
                || code.code().starts_with("57")
        });
    if unavailable {
        Error::Unavailable(format!("PostgreSQL: {error}"))
    } else {
        Error::Store(format!("PostgreSQL: {error}"))
    }
}

impl Store for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgresql"
    }

    async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
    {
        self.ready()?;
        // One connection and one deadline for the whole call.
        let call = Call {
            store: self,
            client: self.client().await?,
        };
        // Our own last write of the key, if any: a Commit after our Claim
        // writes back `WHERE revision = $remembered` at once. Otherwise the
        // key is assumed fresh: a Claim is one INSERT.
        let remembered = self.inner.recent.recall(key);
        let (answer, written) = optimistic::update(&call, key, remembered, apply).await?;
        if let Some(written) = written {
            self.inner.recent.remember(key, written);
        }
        Ok(answer)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.ready()?;
        let client = self.client().await?;
        Ok(self.read(&client, key).await?.map(|(record, _)| record))
    }

    async fn scan(&self, cursor: &ScanCursor, limit: usize) -> Result<ScanPage, Error> {
        self.ready()?;
        let client = self.client().await?;
        let schema = &self.inner.schema;
        // Keyset pagination on the primary key: each page one index range.
        let after = Key::from_bytes(&cursor.0);
        let (namespace, correlation_id) = after
            .as_ref()
            .map_or(("", ""), |key| (key.namespace(), key.correlation_id()));
        let limit = limit.clamp(1, 10_000);
        let sql = format!(
            "SELECT namespace, correlation_id, {COLUMNS} FROM {schema}.processed_events
              WHERE (namespace, correlation_id) > ($1, $2)
              ORDER BY namespace, correlation_id LIMIT $3"
        );
        let statement = self.bounded(&client, client.prepare_cached(&sql)).await?;
        let rows = self
            .bounded(
                &client,
                client.query(&statement, &[&namespace, &correlation_id, &(limit as i64)]),
            )
            .await?;
        let mut page = ScanPage::default();
        for row in &rows {
            page.keys.push(Key::new_unchecked(
                row.get("namespace"),
                row.get("correlation_id"),
            ));
        }
        if page.keys.len() == limit {
            page.next = page.keys.last().map(|key| ScanCursor(key.to_bytes()));
        }
        Ok(page)
    }

    async fn update_mark<F>(&self, scope: &OrderingScope, mut apply: F) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        self.ready()?;
        let client = self.client().await?;
        let schema = &self.inner.schema;
        loop {
            let current = self.read_mark(&client, scope).await?;
            let Some(next) = apply(current) else {
                return Ok(());
            };
            let (highest, until) = (
                i64::try_from(next.highest).unwrap_or(i64::MAX),
                millis(next.retain_until),
            );
            let written = match current {
                None => {
                    let sql = format!(
                            "INSERT INTO {schema}.ordering_marks (namespace, ordering_key, highest, retain_until_ms)
                             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING"
                        );
                    self.execute(
                        &client,
                        &sql,
                        &[&scope.namespace, &scope.ordering_key, &highest, &until],
                    )
                    .await?
                }
                Some(old) => {
                    let (old_highest, old_until) = (
                        i64::try_from(old.highest).unwrap_or(i64::MAX),
                        millis(old.retain_until),
                    );
                    let sql = format!(
                        "UPDATE {schema}.ordering_marks SET highest = $3, retain_until_ms = $4
                              WHERE namespace = $1 AND ordering_key = $2
                                AND highest = $5 AND retain_until_ms = $6"
                    );
                    self.execute(
                        &client,
                        &sql,
                        &[
                            &scope.namespace,
                            &scope.ordering_key,
                            &highest,
                            &until,
                            &old_highest,
                            &old_until,
                        ],
                    )
                    .await?
                }
            };
            if written == 1 {
                return Ok(());
            }
        }
    }

    async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
        self.ready()?;
        let client = self.client().await?;
        self.read_mark(&client, scope).await
    }

    async fn durable(&self) -> Result<(), Error> {
        // Every statement committed before it answered.
        Ok(())
    }

    async fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        self.ready()?;
        let client = self.client().await?;
        let schema = &self.inner.schema;
        let limit = i64::try_from(budget).unwrap_or(i64::MAX);
        let now = millis(now);
        // Small batches, rows others are busy with skipped, the expiry
        // checked again at delete: harmless from any number of sidecars.
        let mut removed = 0;
        for table in ["processed_events", "ordering_marks"] {
            let sql = format!(
                "DELETE FROM {schema}.{table} WHERE ctid IN (
                   SELECT ctid FROM {schema}.{table} WHERE retain_until_ms <= $1
                    LIMIT $2 FOR UPDATE SKIP LOCKED)
                 AND retain_until_ms <= $1"
            );
            removed += self.execute(&client, &sql, &[&now, &limit]).await?;
        }
        let removed = usize::try_from(removed).unwrap_or(usize::MAX);
        Ok(ReapReport {
            removed,
            examined: removed,
        })
    }

    fn health(&self) -> Result<(), Error> {
        // Nothing here is permanent: an unreachable server passes by itself.
        Ok(())
    }

    fn writable(&self) -> Result<(), Error> {
        self.ready()?;
        self.inner.reachability.check()
    }

    async fn stats(&self) -> StoreStats {
        let cached = *self.inner.stats.lock().expect("stats lock");
        if let Some((counted, stats)) = cached {
            if counted.elapsed() < STATS_FOR {
                return stats;
            }
        }
        // One count at a time per sidecar; the others reuse the last one.
        if self.inner.counting.swap(true, SeqCst) {
            return cached.map(|(_, stats)| stats).unwrap_or_default();
        }
        // Cleared however this ends: a scrape dropped midway must not stop
        // the counting for good.
        struct Counting<'a>(&'a AtomicBool);
        impl Drop for Counting<'_> {
            fn drop(&mut self) {
                self.0.store(false, SeqCst);
            }
        }
        let _counting = Counting(&self.inner.counting);
        let stats = self.count().await;
        *self.inner.stats.lock().expect("stats lock") = Some((Instant::now(), stats));
        stats
    }

    async fn close(&self) -> Result<(), Error> {
        self.inner.pool.close();
        Ok(())
    }
}

/// One call's connection to PostgreSQL, for the optimistic driver.
struct Call<'a> {
    store: &'a PostgresStore,
    client: Conn,
}

impl Conditional for Call<'_> {
    /// The row's revision (drawn from the `revisions` sequence: it never
    /// repeats, even for a key deleted and claimed again).
    type Version = i64;

    async fn read(&self, key: &Key) -> Result<Option<Versioned<i64>>, Error> {
        Ok(self
            .store
            .read(&self.client, key)
            .await?
            .map(|(record, revision)| Versioned {
                record,
                version: revision,
            }))
    }

    async fn write_if(
        &self,
        key: &Key,
        believed: Option<&Versioned<i64>>,
        change: &Change,
        draw_token: bool,
    ) -> Result<Swapped<i64>, Error> {
        let (store, client) = (self.store, &self.client);
        let schema = &store.inner.schema;
        let (namespace, correlation_id) = (key.namespace(), key.correlation_id());
        let written = match (change, believed) {
            (Change::Keep, _) | (Change::Delete, None) => {
                return Ok(Swapped::Done {
                    token: None,
                    version: None,
                })
            }
            // A fresh key: one statement; a claim's fencing token drawn by
            // it (nextval in the same INSERT).
            (Change::Put(record), None) => {
                let values = RecordValues::new(record);
                let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                    vec![&namespace, &correlation_id];
                params.extend(values.params());
                let sql = if draw_token {
                    // The fencing token (third column) is drawn by nextval.
                    params.remove(4);
                    format!(
                        "INSERT INTO {schema}.processed_events (namespace, correlation_id, {COLUMNS}, revision)
                         VALUES ($1, $2, $3, $4, nextval('{schema}.fencing_tokens'), $5, $6, $7, $8, $9, $10,
                                 $11, $12, $13, $14, $15, $16, $17, $18, $19, nextval('{schema}.revisions'))
                         ON CONFLICT (namespace, correlation_id) DO NOTHING
                         RETURNING fencing_token, revision"
                    )
                } else {
                    format!(
                        "INSERT INTO {schema}.processed_events (namespace, correlation_id, {COLUMNS}, revision)
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15,
                                 $16, $17, $18, $19, $20, nextval('{schema}.revisions'))
                         ON CONFLICT (namespace, correlation_id) DO NOTHING
                         RETURNING fencing_token, revision"
                    )
                };
                store.query_opt(client, &sql, &params).await?.map(|row| {
                    let token = draw_token.then(|| fencing_from_db(row.get(0)));
                    (token, Some(row.get::<_, i64>(1)))
                })
            }
            // An existing row, written back only at the revision read.
            (Change::Put(record), Some(believed)) => {
                let token = if draw_token {
                    Some(store.next_fencing(client, Some(&believed.record)).await?)
                } else {
                    None
                };
                let record =
                    token.map_or_else(|| record.clone(), |token| with_token(record, token));
                let values = RecordValues::new(&record);
                let mut params = values.params().to_vec();
                params.push(&namespace);
                params.push(&correlation_id);
                params.push(&believed.version);
                let sql = format!(
                    "UPDATE {schema}.processed_events SET
                           (state, lease_token, fencing_token, lease_expires_at_ms, attempt,
                            event_type, consumer_version, owner, payload_fingerprint,
                            claimed_at_ms, committed_at_ms, retain_until_ms, retention_ms,
                            response, ordering_key, sequence, request_id, recovered, revision)
                         = ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15,
                            $16, $17, $18, nextval('{schema}.revisions'))
                         WHERE namespace = $19 AND correlation_id = $20 AND revision = $21
                         RETURNING revision"
                );
                store
                    .query_opt(client, &sql, &params)
                    .await?
                    .map(|row| (token, Some(row.get::<_, i64>(0))))
            }
            (Change::Delete, Some(believed)) => {
                // The notice goes out with the deletion's commit, or not at
                // all: other sidecars' local tiers drop the key.
                let sql = format!(
                    "WITH deleted AS (
                       DELETE FROM {schema}.processed_events
                        WHERE namespace = $1 AND correlation_id = $2 AND revision = $3
                       RETURNING 1)
                     SELECT pg_notify('{DELETION_CHANNEL}', $4) FROM deleted"
                );
                let notice = format!("{schema} {}", deletion_message(key));
                store
                    .query_opt(
                        client,
                        &sql,
                        &[&namespace, &correlation_id, &believed.version, &notice],
                    )
                    .await?
                    .map(|_| (None, None))
            }
        };
        match written {
            Some((token, version)) => Ok(Swapped::Done { token, version }),
            // Another sidecar got there first (or our belief was wrong):
            // the row as it is.
            None => Ok(Swapped::Conflict(self.read(key).await?.map(Box::new))),
        }
    }
}

impl PostgresStore {
    /// Counts the rows now (a scan: [`Store::stats`] reuses it for
    /// [`STATS_FOR`]).
    pub async fn count(&self) -> StoreStats {
        let schema = &self.inner.schema;
        let Ok(client) = self.client().await else {
            return StoreStats::default();
        };
        let sql = format!(
            "SELECT count(*), pg_total_relation_size('{schema}.processed_events') FROM {schema}.processed_events"
        );
        match self.query_opt(&client, &sql, &[]).await {
            Ok(Some(row)) => StoreStats {
                records: u64::try_from(row.get::<_, i64>(0)).ok(),
                disk_bytes: u64::try_from(row.get::<_, i64>(1)).ok(),
                local_tier_on: None,
            },
            _ => StoreStats::default(),
        }
    }

    async fn read_mark(
        &self,
        client: &Conn,
        scope: &OrderingScope,
    ) -> Result<Option<SequenceMark>, Error> {
        let schema = &self.inner.schema;
        let sql = format!(
            "SELECT highest, retain_until_ms FROM {schema}.ordering_marks
                  WHERE namespace = $1 AND ordering_key = $2"
        );
        Ok(self
            .query_opt(client, &sql, &[&scope.namespace, &scope.ordering_key])
            .await?
            .map(|row| SequenceMark {
                highest: u64::try_from(row.get::<_, i64>(0)).unwrap_or(0),
                retain_until: at(row.get(1)),
            }))
    }
}

impl TimeSource for PostgresStore {
    async fn read_clock(&self) -> Result<ClockReading, Error> {
        let client = self.client().await?;
        // One round trip (the simple protocol: no prepare); the server's
        // clock as the statement runs, not its transaction's start.
        let sent = std::time::Instant::now();
        let answer = self
            .bounded(
                &client,
                client.simple_query(
                    "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
                ),
            )
            .await?;
        let received = std::time::Instant::now();
        let store_micros = answer
            .iter()
            .find_map(|message| match message {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0),
                _ => None,
            })
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| Error::Store("PostgreSQL's clock_timestamp() is unreadable".into()))?;
        Ok(ClockReading {
            sent,
            store_micros,
            received,
        })
    }
}
