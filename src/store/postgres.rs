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
//! another sidecar got there first. Each statement commits on its own, so
//! an answer leaves only once PostgreSQL has made its change durable.

use std::{
    fmt,
    str::FromStr,
    sync::{
        atomic::{AtomicBool, Ordering::SeqCst},
        Arc,
    },
    time::Duration,
};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use rustls::pki_types::{pem::PemObject, CertificateDer};
use tokio::sync::mpsc;
use tokio_postgres::{config::SslMode, NoTls, Row};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{
    shared::{
        deletion_message, parse_deletion, DeletionFeed, Reachability, RecentWrites, FEED_BUFFER,
        HEARTBEAT,
    },
    IssueFencing, ReapReport, Store, StoreStats,
};
use crate::{
    clock::UnixMillis,
    domain::{FencingToken, Key, LeaseToken, OrderingPosition, OrderingScope, Record, RecordState},
    error::Error,
    machine::{Change, SequenceMark},
};

/// The schema this build creates and understands.
const SCHEMA_VERSION: i32 = 1;

/// Identifies dedupd's migration lock among the server's advisory locks.
const MIGRATION_LOCK: i64 = 0x6465_6475_7064; // "dedupd"

/// A fencing token no claim is ever given: the machine's first run for a
/// fresh key, before the insert has drawn the real one.
const PROVISIONAL: FencingToken = FencingToken(0);

/// How to reach PostgreSQL.
#[derive(Clone)]
pub struct PostgresConfig {
    /// `postgres://user:password@host:port/database?…` (never logged).
    pub url: String,
    /// The schema holding dedupd's tables (created if missing).
    pub schema: String,
    /// Connections in the pool.
    pub pool_size: usize,
    /// Longest one statement may run on the server.
    pub statement_timeout: Duration,
    /// PEM certificates to trust for the server's TLS certificate instead of
    /// the system's roots (a private CA, or the server's own certificate).
    pub ca_pem: Option<Vec<u8>>,
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &redact_url(&self.url))
            .field("schema", &self.schema)
            .field("pool_size", &self.pool_size)
            .field("statement_timeout", &self.statement_timeout)
            .field("private_ca", &self.ca_pem.is_some())
            .finish()
    }
}

/// The URL without its password (in the authority or a `password=`
/// parameter), for logs and errors.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (location, query) = match rest.split_once('?') {
        Some((location, query)) => (location, Some(query)),
        None => (rest, None),
    };
    let location = match location.rsplit_once('@') {
        Some((credentials, host)) if credentials.contains(':') => {
            let user = credentials.split(':').next().unwrap_or_default();
            format!("{user}:…@{host}")
        }
        _ => location.to_owned(),
    };
    let query = query.map(|query| {
        query
            .split('&')
            .map(|pair| {
                if pair.starts_with("password=") {
                    "password=…"
                } else {
                    pair
                }
            })
            .collect::<Vec<_>>()
            .join("&")
    });
    match query {
        Some(query) => format!("{scheme}://{location}?{query}"),
        None => format!("{scheme}://{location}"),
    }
}

/// Checks a URL the way the store will use it; the problem, if any, in one
/// line without the password.
pub fn check_url(url: &str) -> Result<(), String> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(format!(
            "{} is not a postgres:// or postgresql:// URL",
            redact_url(url)
        ));
    }
    tokio_postgres::Config::from_str(url)
        .map(|_| ())
        .map_err(|error| format!("{}: {error}", redact_url(url)))
}

/// Checks a schema name: a plain lower-case SQL identifier, so it can be
/// written into statements as it is.
pub fn check_schema(schema: &str) -> Result<(), String> {
    let mut chars = schema.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    if first_ok
        && schema.len() <= 63
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        Ok(())
    } else {
        Err(format!(
            "{schema:?} is not a schema name (a-z, 0-9 and _, at most 63 bytes, not starting with a digit)"
        ))
    }
}

/// TLS to the server with rustls, for a URL with `sslmode=require`: the
/// server's certificate is verified against `ca_pem`, or else the system's
/// roots.
fn tls_config(ca_pem: Option<&[u8]>) -> Result<rustls::ClientConfig, Error> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            for certificate in CertificateDer::pem_slice_iter(pem) {
                let certificate = certificate
                    .map_err(|error| Error::Store(format!("--store-ca-file: {error}")))?;
                roots
                    .add(certificate)
                    .map_err(|error| Error::Store(format!("--store-ca-file: {error}")))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                tracing::warn!(
                    "no system root certificates: TLS to PostgreSQL needs --store-ca-file"
                );
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| Error::Store(format!("TLS: {error}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

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
    recent: RecentWrites<(Record, i64)>,
    /// How to open the dedicated connection the deletion feed listens on.
    listen: Listen,
    /// Longest one statement (or connection attempt) may take.
    timeout: Duration,
}

/// A connection of its own for `LISTEN` (a pooled one would be recycled).
#[derive(Clone)]
enum Listen {
    Plain(tokio_postgres::Config),
    Tls(tokio_postgres::Config, MakeRustlsConnect),
}

/// The channel every dedupd over one database notifies deletions on; the
/// payload names the schema, so sidecars over other schemas ignore it.
const DELETION_CHANNEL: &str = "dedupd_deleted";

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
            }),
        })
    }

    /// Creates or migrates the schema, once for every sidecar starting at
    /// the same time (an advisory lock serialises them).
    pub async fn prepare(&self) -> Result<(), Error> {
        let client = self.client().await?;
        let schema = &self.inner.schema;
        let lock = client
            .query_one("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await;
        self.observe(lock)?;
        let migrated = client
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {schema};
                 CREATE TABLE IF NOT EXISTS {schema}.schema_version (version integer NOT NULL);"
            ))
            .await;
        let migrated = match migrated {
            Ok(()) => self.migrate(&client).await,
            Err(error) => Err(db_error(error)),
        };
        let unlocked = client
            .query_one("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await;
        migrated?;
        self.observe(unlocked)?;
        self.inner.ready.store(true, SeqCst);
        Ok(())
    }

    async fn migrate(&self, client: &deadpool_postgres::Client) -> Result<(), Error> {
        let schema = &self.inner.schema;
        let version: Option<i32> = client
            .query_opt(
                &format!("SELECT max(version) FROM {schema}.schema_version"),
                &[],
            )
            .await
            .map_err(db_error)?
            .and_then(|row| row.get(0));
        match version {
            Some(SCHEMA_VERSION) => Ok(()),
            Some(newer) if newer > SCHEMA_VERSION => Err(Error::Store(format!(
                "schema {schema} is at version {newer}, newer than this dedupd understands ({SCHEMA_VERSION}): upgrade dedupd"
            ))),
            _ => client
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {schema}.processed_events (
                        namespace text NOT NULL,
                        correlation_id text NOT NULL,
                        event_type text NOT NULL,
                        consumer_version text NOT NULL,
                        committed_at_ms bigint,
                        processed_at timestamptz GENERATED ALWAYS AS (to_timestamp(committed_at_ms / 1000.0)) STORED,
                        state smallint NOT NULL,
                        lease_token uuid NOT NULL,
                        fencing_token bigint NOT NULL,
                        lease_expires_at_ms bigint NOT NULL,
                        attempt integer NOT NULL,
                        owner text NOT NULL,
                        payload_fingerprint text NOT NULL,
                        claimed_at_ms bigint NOT NULL,
                        retain_until_ms bigint NOT NULL,
                        retention_ms bigint NOT NULL,
                        response bytea NOT NULL,
                        ordering_key text,
                        sequence bigint,
                        request_id text NOT NULL,
                        recovered boolean NOT NULL,
                        revision bigint NOT NULL,
                        PRIMARY KEY (namespace, correlation_id)
                    );
                    CREATE INDEX IF NOT EXISTS processed_events_retain_until
                        ON {schema}.processed_events (retain_until_ms);
                    CREATE TABLE IF NOT EXISTS {schema}.ordering_marks (
                        namespace text NOT NULL,
                        ordering_key text NOT NULL,
                        highest bigint NOT NULL,
                        retain_until_ms bigint NOT NULL,
                        PRIMARY KEY (namespace, ordering_key)
                    );
                    CREATE SEQUENCE IF NOT EXISTS {schema}.fencing_tokens;
                    CREATE SEQUENCE IF NOT EXISTS {schema}.revisions;
                    INSERT INTO {schema}.schema_version (version) VALUES ({SCHEMA_VERSION});"
                ))
                .await
                .map_err(db_error),
        }
    }

    async fn client(&self) -> Result<deadpool_postgres::Client, Error> {
        let client = self
            .inner
            .pool
            .get()
            .await
            .map_err(|error| Error::Unavailable(format!("PostgreSQL unreachable: {error}")));
        // A pooled connection is no proof the server answers: only
        // failures are noted here.
        client.or_else(|error| self.inner.reachability.observe(Err(error)))
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
    /// itself without traffic.
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
        client: &deadpool_postgres::Client,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<u64, Error> {
        let statement = self.observe(client.prepare_cached(sql).await)?;
        self.observe(client.execute(&statement, params).await)
    }

    /// Like [`PostgresStore::execute`], for a statement answering at most
    /// one row.
    async fn query_opt(
        &self,
        client: &deadpool_postgres::Client,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<Row>, Error> {
        let statement = self.observe(client.prepare_cached(sql).await)?;
        self.observe(client.query_opt(&statement, params).await)
    }

    /// Asks the server whether it answers (for health; cheap).
    pub async fn ping(&self) -> Result<(), Error> {
        let client = self.client().await?;
        self.observe(client.simple_query("SELECT 1").await)?;
        Ok(())
    }

    async fn read(
        &self,
        client: &deadpool_postgres::Client,
        key: &Key,
    ) -> Result<Option<(Record, i64)>, Error> {
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

    async fn next_fencing(
        &self,
        client: &deadpool_postgres::Client,
    ) -> Result<FencingToken, Error> {
        let schema = &self.inner.schema;
        let row = client
            .query_one(&format!("SELECT nextval('{schema}.fencing_tokens')"), &[])
            .await;
        Ok(fencing_from_db(self.observe(row)?.get(0)))
    }
}

/// The record columns, in the order `record_from_row` and the writes use.
const COLUMNS: &str = "state, lease_token, fencing_token, lease_expires_at_ms, attempt, \
     event_type, consumer_version, owner, payload_fingerprint, claimed_at_ms, committed_at_ms, \
     retain_until_ms, retention_ms, response, ordering_key, sequence, request_id, recovered";

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

fn millis(at: UnixMillis) -> i64 {
    i64::try_from(at.0).unwrap_or(i64::MAX)
}

fn at(millis: i64) -> UnixMillis {
    UnixMillis(u64::try_from(millis).unwrap_or(0))
}

fn fencing_from_db(value: i64) -> FencingToken {
    FencingToken(u64::try_from(value).unwrap_or(0))
}

fn record_from_row(row: &Row) -> Result<Record, Error> {
    let state: i16 = row.get("state");
    let state = RecordState::from_code(i32::from(state))
        .ok_or_else(|| Error::Corrupt(format!("unknown record state {state}")))?;
    let lease_token: uuid_bytes::Uuid = row.get("lease_token");
    let ordering_key: Option<String> = row.get("ordering_key");
    let sequence: Option<i64> = row.get("sequence");
    Ok(Record {
        state,
        lease_token: LeaseToken(lease_token.0),
        fencing_token: fencing_from_db(row.get("fencing_token")),
        lease_expires_at: at(row.get("lease_expires_at_ms")),
        attempt: u32::try_from(row.get::<_, i32>("attempt")).unwrap_or(0),
        event_type: row.get("event_type"),
        consumer_version: row.get("consumer_version"),
        owner: row.get("owner"),
        payload_fingerprint: row.get("payload_fingerprint"),
        claimed_at: at(row.get("claimed_at_ms")),
        committed_at: row.get::<_, Option<i64>>("committed_at_ms").map(at),
        retain_until: at(row.get("retain_until_ms")),
        retention: Duration::from_millis(
            u64::try_from(row.get::<_, i64>("retention_ms")).unwrap_or(0),
        ),
        response: row.get("response"),
        ordering: ordering_key.map(|ordering_key| OrderingPosition {
            ordering_key,
            sequence: u64::try_from(sequence.unwrap_or(0)).unwrap_or(0),
        }),
        request_id: row.get("request_id"),
        recovered: row.get("recovered"),
    })
}

/// The values of [`COLUMNS`] for `record`, owned so they can be borrowed as
/// statement parameters.
struct RecordValues {
    state: i16,
    lease_token: uuid_bytes::Uuid,
    fencing_token: i64,
    lease_expires_at_ms: i64,
    attempt: i32,
    event_type: String,
    consumer_version: String,
    owner: String,
    payload_fingerprint: String,
    claimed_at_ms: i64,
    committed_at_ms: Option<i64>,
    retain_until_ms: i64,
    retention_ms: i64,
    response: Vec<u8>,
    ordering_key: Option<String>,
    sequence: Option<i64>,
    request_id: String,
    recovered: bool,
}

impl RecordValues {
    fn new(record: &Record) -> Self {
        RecordValues {
            state: i16::try_from(record.state.code()).unwrap_or(0),
            lease_token: uuid_bytes::Uuid(record.lease_token.0),
            fencing_token: i64::try_from(record.fencing_token.0).unwrap_or(i64::MAX),
            lease_expires_at_ms: millis(record.lease_expires_at),
            attempt: i32::try_from(record.attempt).unwrap_or(i32::MAX),
            event_type: record.event_type.clone(),
            consumer_version: record.consumer_version.clone(),
            owner: record.owner.clone(),
            payload_fingerprint: record.payload_fingerprint.clone(),
            claimed_at_ms: millis(record.claimed_at),
            committed_at_ms: record.committed_at.map(millis),
            retain_until_ms: millis(record.retain_until),
            retention_ms: i64::try_from(record.retention.as_millis()).unwrap_or(i64::MAX),
            response: record.response.clone(),
            ordering_key: record.ordering.as_ref().map(|o| o.ordering_key.clone()),
            sequence: record
                .ordering
                .as_ref()
                .map(|o| i64::try_from(o.sequence).unwrap_or(i64::MAX)),
            request_id: record.request_id.clone(),
            recovered: record.recovered,
        }
    }

    /// The 18 values, in [`COLUMNS`] order.
    fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 18] {
        [
            &self.state,
            &self.lease_token,
            &self.fencing_token,
            &self.lease_expires_at_ms,
            &self.attempt,
            &self.event_type,
            &self.consumer_version,
            &self.owner,
            &self.payload_fingerprint,
            &self.claimed_at_ms,
            &self.committed_at_ms,
            &self.retain_until_ms,
            &self.retention_ms,
            &self.response,
            &self.ordering_key,
            &self.sequence,
            &self.request_id,
            &self.recovered,
        ]
    }
}

/// A 128-bit lease token as PostgreSQL's `uuid` (16 bytes, big-endian),
/// without pulling in a UUID crate for one conversion.
mod uuid_bytes {
    use std::error::Error;

    use tokio_postgres::types::{to_sql_checked, FromSql, IsNull, ToSql, Type};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Uuid(pub u128);

    impl ToSql for Uuid {
        fn to_sql(
            &self,
            _: &Type,
            out: &mut bytes::BytesMut,
        ) -> Result<IsNull, Box<dyn Error + Sync + Send>> {
            out.extend_from_slice(&self.0.to_be_bytes());
            Ok(IsNull::No)
        }

        fn accepts(ty: &Type) -> bool {
            *ty == Type::UUID
        }

        to_sql_checked!();
    }

    impl<'a> FromSql<'a> for Uuid {
        fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, Box<dyn Error + Sync + Send>> {
            let bytes: [u8; 16] = raw.try_into()?;
            Ok(Uuid(u128::from_be_bytes(bytes)))
        }

        fn accepts(ty: &Type) -> bool {
            *ty == Type::UUID
        }
    }
}

impl Store for PostgresStore {
    async fn update<T, F>(&self, key: &Key, mut apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, IssueFencing<'_>) -> Result<(Change, T), Error> + Send,
    {
        self.ready()?;
        let client = self.client().await?;
        let schema = &self.inner.schema;
        let mut remembered = self.inner.recent.recall(key);
        // A fresh key (as far as this sidecar knows): one statement, the
        // fencing token drawn by it.
        let fresh = match remembered {
            None => apply(None, &mut || Ok(PROVISIONAL))?.0,
            Some(_) => Change::Keep,
        };
        if let Change::Put(record) = fresh {
            let values = RecordValues::new(&record);
            let (namespace, correlation_id) = (key.namespace(), key.correlation_id());
            let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                vec![&namespace, &correlation_id];
            params.extend(values.params());
            // The fencing token (third column) is drawn by nextval instead.
            params.remove(4);
            let sql = format!(
                    "INSERT INTO {schema}.processed_events (namespace, correlation_id, {COLUMNS}, revision)
                     VALUES ($1, $2, $3, $4, nextval('{schema}.fencing_tokens'), $5, $6, $7, $8, $9, $10,
                             $11, $12, $13, $14, $15, $16, $17, $18, $19, nextval('{schema}.revisions'))
                     ON CONFLICT (namespace, correlation_id) DO NOTHING
                     RETURNING fencing_token, revision"
                );
            if let Some(row) = self.query_opt(&client, &sql, &params).await? {
                let token = fencing_from_db(row.get(0));
                let (change, answer) = apply(None, &mut || Ok(token))?;
                if let Change::Put(record) = change {
                    self.inner.recent.remember(key, (record, row.get(1)));
                }
                return Ok(answer);
            }
        }
        // The key exists (or the change was not an insert): read, decide,
        // write back only if nobody changed it meanwhile.
        loop {
            let guessed = remembered.take();
            let from_memory = guessed.is_some();
            let current = match guessed {
                Some(row) => Some(row),
                None => self.read(&client, key).await?,
            };
            let (record, revision) = match &current {
                Some((record, revision)) => (Some(record), *revision),
                None => (None, 0),
            };
            let mut wants_token = false;
            let (change, answer) = apply(record, &mut || {
                wants_token = true;
                Ok(PROVISIONAL)
            })?;
            let (change, answer) = if wants_token {
                let token = self.next_fencing(&client).await?;
                apply(record, &mut || Ok(token))?
            } else {
                (change, answer)
            };
            if from_memory && matches!(change, Change::Keep) {
                // An answer that changes nothing must come from the row as
                // it is, not as this sidecar last wrote it.
                continue;
            }
            let written = match (&change, current.is_some()) {
                (Change::Keep, _) | (Change::Delete, false) => return Ok(answer),
                (Change::Put(next), true) => {
                    let values = RecordValues::new(next);
                    let (namespace, correlation_id) = (key.namespace(), key.correlation_id());
                    let mut params = values.params().to_vec();
                    params.push(&namespace);
                    params.push(&correlation_id);
                    params.push(&revision);
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
                    self.query_opt(&client, &sql, &params)
                        .await?
                        .map(|row| row.get::<_, i64>(0))
                }
                (Change::Put(next), false) => {
                    let values = RecordValues::new(next);
                    let (namespace, correlation_id) = (key.namespace(), key.correlation_id());
                    let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                        vec![&namespace, &correlation_id];
                    params.extend(values.params());
                    let sql = format!(
                            "INSERT INTO {schema}.processed_events (namespace, correlation_id, {COLUMNS}, revision)
                             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15,
                                     $16, $17, $18, $19, $20, nextval('{schema}.revisions'))
                             ON CONFLICT (namespace, correlation_id) DO NOTHING
                             RETURNING revision"
                        );
                    self.query_opt(&client, &sql, &params)
                        .await?
                        .map(|row| row.get::<_, i64>(0))
                }
                (Change::Delete, true) => {
                    // The notice goes out with the deletion's commit, or not
                    // at all: other sidecars' local tiers drop the key.
                    let sql = format!(
                        "WITH deleted AS (
                           DELETE FROM {schema}.processed_events
                            WHERE namespace = $1 AND correlation_id = $2 AND revision = $3
                           RETURNING 1)
                         SELECT pg_notify('{DELETION_CHANNEL}', $4) FROM deleted"
                    );
                    let notice = format!("{schema} {}", deletion_message(key));
                    self.query_opt(
                        &client,
                        &sql,
                        &[&key.namespace(), &key.correlation_id(), &revision, &notice],
                    )
                    .await?
                    .map(|_| 0)
                }
            };
            if let Some(new_revision) = written {
                match change {
                    Change::Put(record) => self.inner.recent.remember(key, (record, new_revision)),
                    Change::Delete | Change::Keep => self.inner.recent.forget(key),
                }
                return Ok(answer);
            }
            // Another sidecar changed the row between our read (or memory)
            // and our write: read it again.
            self.inner.recent.forget(key);
        }
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.ready()?;
        let client = self.client().await?;
        Ok(self.read(&client, key).await?.map(|(record, _)| record))
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
            let deleted = client
                .execute(
                    &format!(
                        "DELETE FROM {schema}.{table} WHERE ctid IN (
                           SELECT ctid FROM {schema}.{table} WHERE retain_until_ms <= $1
                            LIMIT $2 FOR UPDATE SKIP LOCKED)
                         AND retain_until_ms <= $1"
                    ),
                    &[&now, &limit],
                )
                .await;
            removed += self.observe(deleted)?;
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
        let schema = &self.inner.schema;
        let Ok(client) = self.client().await else {
            return StoreStats::default();
        };
        let rows = client
            .query_one(
                &format!(
                    "SELECT count(*), pg_total_relation_size('{schema}.processed_events') FROM {schema}.processed_events"
                ),
                &[],
            )
            .await;
        match rows {
            Ok(row) => StoreStats {
                records: u64::try_from(row.get::<_, i64>(0)).ok(),
                disk_bytes: u64::try_from(row.get::<_, i64>(1)).ok(),
            },
            Err(_) => StoreStats::default(),
        }
    }

    async fn close(&self) -> Result<(), Error> {
        self.inner.pool.close();
        Ok(())
    }
}

impl PostgresStore {
    async fn read_mark(
        &self,
        client: &deadpool_postgres::Client,
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

impl DeletionFeed for PostgresStore {
    async fn subscribe(&self) -> Result<mpsc::Receiver<Key>, Error> {
        let (notices, mut noticed) = mpsc::unbounded_channel();
        let connected = tokio::time::timeout(self.inner.timeout, async {
            let client = match &self.inner.listen {
                Listen::Plain(config) => {
                    let (client, connection) = config.connect(NoTls).await?;
                    tokio::spawn(forward_notices(connection, notices));
                    client
                }
                Listen::Tls(config, tls) => {
                    let (client, connection) = config.connect(tls.clone()).await?;
                    tokio::spawn(forward_notices(connection, notices));
                    client
                }
            };
            client
                .batch_execute(&format!("LISTEN {DELETION_CHANNEL}"))
                .await?;
            Ok(client)
        })
        .await
        .map_err(|_| Error::Unavailable("PostgreSQL did not answer LISTEN".into()))?;
        let client = self.observe(connected)?;
        let schema = self.inner.schema.clone();
        let (deleted, receiver) = mpsc::channel(FEED_BUFFER);
        tokio::spawn(async move {
            let mut heartbeat = tokio::time::interval(HEARTBEAT);
            loop {
                tokio::select! {
                    notice = noticed.recv() => {
                        let Some(notice) = notice else { break };
                        let key = notice
                            .payload()
                            .split_once(' ')
                            .filter(|(from, _)| *from == schema)
                            .and_then(|(_, key)| parse_deletion(key));
                        if let Some(key) = key {
                            if deleted.send(key).await.is_err() {
                                break;
                            }
                        }
                    }
                    _ = heartbeat.tick() => {
                        // A connection that died without a word is found here.
                        match tokio::time::timeout(HEARTBEAT, client.simple_query("SELECT 1")).await {
                            Ok(Ok(_)) => {}
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

/// Drives the listening connection, handing its notifications on; returns
/// when the connection ends.
async fn forward_notices<S, T>(
    mut connection: tokio_postgres::Connection<S, T>,
    notices: mpsc::UnboundedSender<tokio_postgres::Notification>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    while let Some(message) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
        match message {
            Ok(tokio_postgres::AsyncMessage::Notification(notice)) => {
                if notices.send(notice).is_err() {
                    return;
                }
            }
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(%error, "PostgreSQL deletion feed connection ended");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_leave_the_url() {
        for (url, shown) in [
            (
                "postgres://app:s3cret@db:5432/dedup",
                "postgres://app:…@db:5432/dedup",
            ),
            (
                "postgresql://db/dedup?user=app&password=s3cret&sslmode=require",
                "postgresql://db/dedup?user=app&password=…&sslmode=require",
            ),
            ("postgres://app@db/dedup", "postgres://app@db/dedup"),
        ] {
            assert_eq!(redact_url(url), shown);
            assert!(!redact_url(url).contains("s3cret"));
        }
        let refused = check_url("postgres://app:s3cret@db:notaport/x").unwrap_err();
        assert!(!refused.contains("s3cret"), "{refused}");
        assert!(check_url("mysql://app@db/x").is_err());
        assert!(check_url("postgres://postgres@127.0.0.1:5432/test").is_ok());
    }

    #[test]
    fn schema_names_are_plain_identifiers() {
        assert!(check_schema("dedupd").is_ok());
        assert!(check_schema("dedupd_test_42").is_ok());
        for bad in ["", "1abc", "has space", "Upper", "x;drop", &"a".repeat(64)] {
            assert!(check_schema(bad).is_err(), "{bad:?}");
        }
    }
}
