//! The server's flags and environment (`dedupd serve` and `dedupd
//! http-proxy`, which share them): flags in, plain settings out. Every flag
//! of the server is also a `DEDUPD_*` variable; [`ServeArgs::validate`]
//! checks the whole configuration, and the relations between its parts,
//! before anything is opened or bound. It builds no runtime object and
//! reads no secret: `main` does that with the settings. The command line as
//! a whole (every face's flags) is assembled in [`crate::command`].

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use clap::{Args, ValueEnum};

use crate::{
    api::{
        check_duration, check_namespace, Limits, HARD_MAX_LEASE_TTL, HARD_MAX_RESPONSE_BYTES,
        HARD_MAX_RETENTION,
    },
    credentials::{AuthSources, StoreUrlSource, TlsFiles, TokenSource},
    listen::ConnectionLimits,
    listen::ListenAddr,
    memory_budget::MemoryBudget,
    proxy::{
        budget::KEYED_BODY_BUDGET_BYTES,
        idempotency::{CallerScope, KeySyntax, ReleaseOn, RoutePattern},
        server::{AfterUnknownOutcome, ProxyConfig},
    },
    sealing::{KeyFiles, KeyId},
    store::{
        postgres::{self, check_schema, PostgresConfig},
        redis::{self, RedisConfig},
        sled::{SledConfig, SyncMode},
        tiered::LocalTierConfig,
    },
    telemetry::{ProcessEnvironment, TraceArgs, TraceSettings},
};

/// A clap error on one line: its message and the lines that complete it
/// (the missing argument, the possible values), without usage or help hints.
pub fn one_line_error(error: &clap::Error) -> String {
    error
        .render()
        .to_string()
        .lines()
        .map(str::trim)
        .take_while(|line| !line.starts_with("Usage:"))
        .filter(|line| !line.is_empty() && !line.starts_with("For more information"))
        .collect::<Vec<_>>()
        .join(" ")
        .trim_start_matches("error: ")
        .to_owned()
}

/// `--store`: where records live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// Embedded sled in --data-dir: one sidecar's own records.
    Sled,
    /// PostgreSQL at --store-url: every sidecar shares the records.
    Postgres,
    /// Redis at --store-url: every sidecar shares the records.
    Redis,
}

/// `--sync`, mapped onto the store's [`SyncMode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SyncFlag {
    /// Every answer waits until its change is on disk (fdatasync), shared by
    /// group commit. Survives `kill -9` and power loss.
    Always,
    /// Answers do not wait; the store flushes every 500 ms. A crash of the
    /// machine can lose the last half second of changes.
    None,
}

impl From<SyncFlag> for SyncMode {
    fn from(flag: SyncFlag) -> SyncMode {
        match flag {
            SyncFlag::Always => SyncMode::Always,
            SyncFlag::None => SyncMode::None,
        }
    }
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Server settings.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Where to serve gRPC: HOST:PORT and/or unix:///path.sock, comma-separated.
    #[arg(
        long,
        env = "DEDUPD_LISTEN",
        default_value = "127.0.0.1:50051",
        value_delimiter = ','
    )]
    pub listen: Vec<ListenAddr>,
    /// Where to serve /metrics, /healthz and /readyz over HTTP, or `off`.
    #[arg(long, env = "DEDUPD_METRICS_LISTEN", default_value = "127.0.0.1:9090")]
    pub metrics_listen: String,
    /// File holding the bearer token every call must present (recommended
    /// over DEDUPD_AUTH_TOKEN). Without a token, calls are not authenticated.
    #[arg(long, env = "DEDUPD_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,
    /// The bearer token itself, from the environment.
    #[arg(long, env = "DEDUPD_AUTH_TOKEN", hide_env_values = true, hide = true)]
    pub auth_token: Option<String>,
    /// File holding the admin token, the only one that may call Forget.
    #[arg(long, env = "DEDUPD_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// The admin token itself, from the environment.
    #[arg(long, env = "DEDUPD_ADMIN_TOKEN", hide_env_values = true, hide = true)]
    pub admin_token: Option<String>,
    /// Serve gRPC on a non-loopback TCP address without a token or mTLS
    /// (refused otherwise: anyone who reaches the port could claim, commit
    /// and release).
    #[arg(long, env = "DEDUPD_ALLOW_UNAUTHENTICATED")]
    pub allow_unauthenticated: bool,
    /// PEM certificate chain: serve TLS on the TCP listeners (needs --tls-key).
    #[arg(long, env = "DEDUPD_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "DEDUPD_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle: clients must present a certificate it signed (mTLS).
    #[arg(long, env = "DEDUPD_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// Longest a call may take before it is answered UNAVAILABLE.
    #[arg(long, env = "DEDUPD_REQUEST_TIMEOUT", default_value = "10s")]
    pub request_timeout: humantime::Duration,
    /// Longest a request message may take to arrive (before the call is
    /// admitted); slower ones are answered DEADLINE_EXCEEDED.
    #[arg(long, env = "DEDUPD_REQUEST_READ_TIMEOUT", default_value = "5s")]
    pub request_read_timeout: humantime::Duration,
    /// Calls in progress at once; more are refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "DEDUPD_MAX_CONCURRENT_REQUESTS", default_value_t = 1024)]
    pub max_concurrent_requests: usize,
    /// Connections open at once over every listener; more wait in the
    /// kernel's backlog. Lowered at start if the open-file limit is smaller.
    #[arg(long, env = "DEDUPD_MAX_CONNECTIONS", default_value_t = 1000)]
    pub max_connections: usize,
    /// Calls (HTTP/2 streams) one connection may have open at once.
    #[arg(long, env = "DEDUPD_MAX_STREAMS_PER_CONNECTION", default_value_t = 128)]
    pub max_streams_per_connection: u32,
    /// A connection is asked to close (in-flight calls finish) after this
    /// long; clients reconnect.
    #[arg(long, env = "DEDUPD_MAX_CONNECTION_AGE", default_value = "1h")]
    pub max_connection_age: humantime::Duration,
    /// Where records live: `sled` (embedded, one sidecar's own), or
    /// `postgres` / `redis` (shared by every sidecar; need --store-url).
    #[arg(long, env = "DEDUPD_STORE", value_enum, default_value_t = StoreKind::Sled)]
    pub store: StoreKind,
    /// The shared store's URL (`postgres://user:password@host:5432/db`,
    /// `redis://:password@host:6379/0`, `rediss://…` for TLS,
    /// `redis+sentinel://h1:26379,h2:26379/<name>` for the primary Sentinel
    /// names, `redis+cluster://h1:6379,h2:6379` for a Redis Cluster); prefer
    /// --store-url-file for one with a password.
    #[arg(long, env = "DEDUPD_STORE_URL", hide_env_values = true)]
    pub store_url: Option<String>,
    /// File holding the shared store's URL (e.g. a mounted Secret).
    #[arg(long, env = "DEDUPD_STORE_URL_FILE")]
    pub store_url_file: Option<PathBuf>,
    /// PEM file of the CA (or the certificate itself) that signed the shared
    /// store's TLS certificate, instead of the system's roots. TLS is used
    /// when the URL says `sslmode=require` (PostgreSQL) or `rediss://`
    /// (`rediss+cluster://`, `rediss+sentinel://`).
    #[arg(long, env = "DEDUPD_STORE_CA_FILE")]
    pub store_ca_file: Option<PathBuf>,
    /// PostgreSQL schema for dedupd's tables (created if missing), or the
    /// prefix of every Redis key dedupd writes (`<schema>:`).
    #[arg(long, env = "DEDUPD_STORE_SCHEMA", default_value = "dedupd")]
    pub store_schema: String,
    /// Connections to the shared store (Redis: multiplexed connections,
    /// calls spread over them in turn).
    #[arg(long, env = "DEDUPD_STORE_POOL_SIZE", default_value_t = 16)]
    pub store_pool_size: usize,
    /// Longest one call to the shared store may take (and a connection
    /// attempt); longer is UNAVAILABLE.
    #[arg(long, env = "DEDUPD_STORE_TIMEOUT", default_value = "5s")]
    pub store_timeout: humantime::Duration,
    /// Shared stores only: decisions follow the store's clock, measured
    /// every second; while it is known less precisely than this (the store
    /// silent, or its round trips too slow), calls are UNAVAILABLE and
    /// health NOT_SERVING instead of deciding on a wrong clock. A lease
    /// never ends early by any pod's reckoning; it may last up to four
    /// times this longer (docs/protocol.md §8).
    #[arg(long, env = "DEDUPD_MAX_CLOCK_UNCERTAINTY", default_value = "500ms")]
    pub max_clock_uncertainty: humantime::Duration,
    /// Redis only: after each write, wait (`WAIT`) until this many replicas
    /// have it, or answer UNAVAILABLE. What makes a failover lose no
    /// acknowledged claim or commit; 0 answers once the primary has it.
    #[arg(long, env = "DEDUPD_STORE_REPLICAS", default_value_t = 0)]
    pub store_replicas: u32,
    /// Redis only: serve even though Redis may evict keys (`maxmemory` set
    /// with a `maxmemory-policy` other than `noeviction`). Every record has a
    /// time to live, so `volatile-*` and `allkeys-*` policies evict live
    /// leases and commits under memory pressure, and the event is processed
    /// again. Without this flag dedupd refuses such a Redis.
    #[arg(long, env = "DEDUPD_ALLOW_REDIS_EVICTION")]
    pub allow_redis_eviction: bool,
    /// Redis only: --store-url names seed nodes of a Redis Cluster
    /// (`redis://host1:6379,host2:6379`), as a `redis+cluster://` or
    /// `rediss+cluster://` URL does without this flag. Calls go to each
    /// key's primary; MOVED, ASK and failovers are followed.
    #[arg(long, env = "DEDUPD_STORE_CLUSTER")]
    pub store_cluster: bool,
    /// Shared stores only: MiB of committed records this sidecar keeps in
    /// its local tier (in --data-dir/local-tier) to answer duplicates without
    /// asking the shared store; 0 turns the local tier off.
    #[arg(long, env = "DEDUPD_LOCAL_TIER_MB", default_value_t = 64)]
    pub local_tier_mb: u64,
    /// Shared stores only: longest the local tier keeps a record.
    #[arg(long, env = "DEDUPD_LOCAL_TIER_MAX_AGE", default_value = "10m")]
    pub local_tier_max_age: humantime::Duration,
    /// Directory of the embedded store (created if missing).
    #[arg(long, env = "DEDUPD_DATA_DIR", default_value = "./dedupd-data")]
    pub data_dir: PathBuf,
    /// `always`: every answer waits until its change is on disk (group
    /// commit). `none`: faster, but a machine crash loses recent changes.
    #[arg(long, env = "DEDUPD_SYNC", value_enum, default_value_t = SyncFlag::Always)]
    pub sync: SyncFlag,
    /// The memory the sidecar plans for (`256MiB`, `1Gi`, bytes): caches
    /// and buffers are sized from it. Default: the container's cgroup
    /// memory limit, else 128MiB.
    #[arg(long, env = "DEDUPD_MEMORY_BUDGET", value_parser = crate::memory_budget::parse_size)]
    pub memory_budget: Option<u64>,
    /// Page cache of the embedded store, in MiB (default: an eighth of
    /// --memory-budget).
    #[arg(long, env = "DEDUPD_CACHE_MB")]
    pub cache_mb: Option<u64>,
    /// Refuse writes (RESOURCE_EXHAUSTED; reads go on) while the data
    /// directory's filesystem has less than this many MiB free, so the store
    /// never meets a full disk; 0 turns the guard off.
    #[arg(long, env = "DEDUPD_DISK_RESERVE_MB", default_value_t = 64)]
    pub disk_reserve_mb: u64,
    /// A disk sync taking longer than this means the store stopped answering:
    /// dedupd reports NOT_SERVING and exits (non-zero) for a restart.
    #[arg(long, env = "DEDUPD_STORE_STALL_TIMEOUT", default_value = "30s")]
    pub store_stall_timeout: humantime::Duration,
    /// Embedded store with --sync always: longest time between checkpoints
    /// (sled made durable, the write-ahead log before it deleted). A longer
    /// interval means fewer sled flushes and a longer log to replay at start.
    #[arg(long, env = "DEDUPD_CHECKPOINT_INTERVAL", default_value = "30s")]
    pub checkpoint_interval: humantime::Duration,
    /// Embedded store with --sync always: a checkpoint starts once this many
    /// MiB of write-ahead log were written since the last one (bounds the
    /// replay at start after a crash: about 0.2 s per 16 MiB on a 2-core VM).
    #[arg(long, env = "DEDUPD_CHECKPOINT_LOG_MB", default_value_t = 16)]
    pub checkpoint_log_mb: u64,
    /// Lease granted when a Claim does not give one.
    #[arg(long, env = "DEDUPD_DEFAULT_LEASE_TTL", default_value = "30s")]
    pub default_lease_ttl: humantime::Duration,
    /// Longest lease a Claim or Renew may ask for (at most 1h).
    #[arg(long, env = "DEDUPD_MAX_LEASE_TTL", default_value = "1h")]
    pub max_lease_ttl: humantime::Duration,
    /// Retention when neither the request nor its namespace gives one.
    #[arg(long, env = "DEDUPD_DEFAULT_RETENTION", default_value = "7days")]
    pub default_retention: humantime::Duration,
    /// Longest retention a request may ask for (at most 365days).
    #[arg(long, env = "DEDUPD_MAX_RETENTION", default_value = "365days")]
    pub max_retention: humantime::Duration,
    /// Default retention per namespace, as NAMESPACE=DURATION, comma-separated
    /// (e.g. `payments=30days,http=24h`).
    #[arg(long, env = "DEDUPD_NAMESPACE_RETENTION", value_delimiter = ',', value_parser = parse_namespace_retention)]
    pub namespace_retention: Vec<(String, Duration)>,
    /// Largest response Commit may cache, in bytes (at most 1048576).
    #[arg(long, env = "DEDUPD_MAX_RESPONSE_BYTES", default_value_t = 64 << 10)]
    pub max_response_bytes: usize,
    /// Most items in one batch call.
    #[arg(long, env = "DEDUPD_MAX_BATCH_SIZE", default_value_t = 1000)]
    pub max_batch_size: usize,
    /// Largest gRPC message accepted, in bytes.
    #[arg(long, env = "DEDUPD_MAX_MESSAGE_BYTES", default_value_t = 16 << 20)]
    pub max_message_bytes: usize,
    /// How often the reaper removes expired records.
    #[arg(long, env = "DEDUPD_REAPER_INTERVAL", default_value = "10s")]
    pub reaper_interval: humantime::Duration,
    /// How long in-flight calls may take to finish on SIGTERM/SIGINT.
    #[arg(long, env = "DEDUPD_SHUTDOWN_GRACE", default_value = "20s")]
    pub shutdown_grace: humantime::Duration,
    /// Log format.
    #[arg(long, env = "DEDUPD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log filter, in tracing's EnvFilter syntax (e.g. `info,dedupd=debug`).
    #[arg(long, env = "DEDUPD_LOG", default_value = "info")]
    pub log: String,
    /// Tokio worker threads; 0 means one per CPU.
    #[arg(long, env = "DEDUPD_WORKER_THREADS", default_value_t = 0)]
    pub worker_threads: usize,
    /// Once serving, write the bound addresses here as JSON (written whole,
    /// by rename; removed on exit): a start-up signal for scripts and tests,
    /// and the way to learn ports chosen with `:0`.
    #[arg(long, env = "DEDUPD_READY_FILE")]
    pub ready_file: Option<PathBuf>,
    /// Seal every stored answer (XChaCha20-Poly1305): a file holding one
    /// 32-byte key as base64 or hex (`openssl rand -base64 32`), or a
    /// directory of them (a Secret mount); repeatable. The key whose file
    /// name sorts last seals; every key opens.
    #[arg(long, env = "DEDUPD_ENCRYPTION_KEY_FILE", value_delimiter = ',')]
    pub encryption_key_file: Vec<PathBuf>,
    /// Keys that open stored answers but never seal (same files as
    /// --encryption-key-file): the first step of a rotation on a shared
    /// store, or the old keys once sealing is turned off.
    #[arg(long, env = "DEDUPD_DECRYPTION_KEY_FILE", value_delimiter = ',')]
    pub decryption_key_file: Vec<PathBuf>,
    /// A namespace's own sealing key, as NAMESPACE=FILE (a key file or a
    /// directory of them), comma-separated or repeated; a namespace's files
    /// sort together, the name sorting last seals. Removing a key and
    /// declaring it with --erased-key-id erases that namespace's answers and
    /// no other's. Needs --encryption-key-file.
    #[arg(long, env = "DEDUPD_NAMESPACE_KEY", value_delimiter = ',', value_parser = parse_namespace_key)]
    pub namespace_key: Vec<(String, PathBuf)>,
    /// A namespace's own key that opens but never seals, as NAMESPACE=FILE.
    #[arg(long, env = "DEDUPD_NAMESPACE_DECRYPTION_KEY", value_delimiter = ',', value_parser = parse_namespace_key)]
    pub namespace_decryption_key: Vec<(String, PathBuf)>,
    /// The ID of a key destroyed on purpose (16 hexadecimal digits, as the
    /// start-up log prints it), comma-separated or repeated: answers it
    /// sealed read as erased (DUPLICATE with response_erased; the proxy's
    /// outcome-unknown). An answer under any other key that is not
    /// configured is an error, never an empty answer.
    #[arg(long, env = "DEDUPD_ERASED_KEY_ID", value_delimiter = ',')]
    pub erased_key_id: Vec<KeyId>,
    /// Hand every store a keyed hash (HMAC-SHA-256) of each correlation ID
    /// instead of the ID, for IDs that are personal data: a file holding a
    /// 32-byte key of its own (as for --encryption-key-file). The key must
    /// never change: another key reaches no stored record, and every event
    /// within retention would be processed again.
    #[arg(long, env = "DEDUPD_HASH_CORRELATION_IDS", value_name = "KEY_FILE")]
    pub hash_correlation_ids: Option<PathBuf>,
    /// How often the key files are read again: a key added to the Secret
    /// (or a new sealing key) is used without a restart; removing a key
    /// takes a restart.
    #[arg(long, env = "DEDUPD_KEY_RELOAD_INTERVAL", default_value = "30s")]
    pub key_reload_interval: humantime::Duration,
    /// The HTTP idempotency proxy (off unless --http-proxy-listen is set).
    #[command(flatten)]
    pub http_proxy: HttpProxyArgs,
    /// OpenTelemetry traces (off unless an OTLP endpoint is set).
    #[command(flatten)]
    pub traces: TraceArgs,
}

/// `--http-proxy-*`: dedupd in front of an HTTP service, deduplicating
/// requests that carry an `Idempotency-Key` header.
#[derive(Debug, Clone, Args)]
pub struct HttpProxyArgs {
    /// Serve the HTTP idempotency proxy here (HOST:PORT; HTTP/1.1 and
    /// HTTP/2). Off when unset.
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_LISTEN",
        requires = "http_proxy_upstream"
    )]
    pub http_proxy_listen: Option<SocketAddr>,
    /// The service behind the proxy (http://HOST:PORT).
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_UPSTREAM",
        requires = "http_proxy_listen"
    )]
    pub http_proxy_upstream: Option<String>,
    /// Methods whose keyed requests are deduplicated, comma-separated.
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_METHODS",
        default_value = "POST,PATCH",
        value_delimiter = ','
    )]
    pub http_proxy_methods: Vec<String>,
    /// Namespace of the proxy's records.
    #[arg(long, env = "DEDUPD_HTTP_PROXY_NAMESPACE", default_value = "http")]
    pub http_proxy_namespace: String,
    /// Who a record belongs to besides method and route: `credentials` (a
    /// hash of every Authorization, Proxy-Authorization and X-API-Key value,
    /// or of the cookies when there is none: two callers never share a
    /// record; a keyed request with none of them is refused 400) or `none`
    /// (every caller shares records: anyone who knows a key gets its
    /// answer).
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_SCOPE",
        value_enum,
        default_value_t = ProxyScope::Credentials
    )]
    pub http_proxy_scope: ProxyScope,
    /// Scope records by these request headers instead of the credentials
    /// (repeatable or comma-separated; every value of each, in order).
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_SCOPE_HEADER",
        value_name = "NAME",
        value_delimiter = ','
    )]
    pub http_proxy_scope_header: Vec<String>,
    /// Request headers that join the payload fingerprint (repeatable or
    /// comma-separated): an account-selecting header such as
    /// Stripe-Account, so that the same key and body for another account
    /// is refused (422), never answered with the first account's answer.
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_FINGERPRINT_HEADER",
        value_name = "NAME",
        value_delimiter = ','
    )]
    pub http_proxy_fingerprint_header: Vec<String>,
    /// Response headers never stored or replayed, besides Set-Cookie, which
    /// never is (repeatable or comma-separated).
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_NEVER_STORE_HEADER",
        value_name = "NAME",
        value_delimiter = ','
    )]
    pub http_proxy_never_store_header: Vec<String>,
    /// Accept only the draft's quoted Idempotency-Key ("…"), not the bare
    /// form most clients send (8e03978e-…).
    #[arg(long, env = "DEDUPD_HTTP_PROXY_STRICT_KEY_SYNTAX")]
    pub http_proxy_strict_key_syntax: bool,
    /// When a keyed request may have reached the upstream but no complete
    /// answer came back (timeout, reset, the proxy died): `report` records
    /// "outcome unknown" and never sends it again (retries get 502
    /// outcome-unknown); `retry` releases the key so a retry sends it again
    /// — only for upstreams that deduplicate themselves.
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_AFTER_UNKNOWN_OUTCOME",
        value_enum,
        default_value_t = AfterUnknownOutcomeArg::Report
    )]
    pub http_proxy_after_unknown_outcome: AfterUnknownOutcomeArg,
    /// Answers that say the service did not act, so the key is released and
    /// a retry is sent again: HTTP statuses (400-599, comma-separated) or
    /// `none`. Any other answer, 5xx included, is the outcome and replayed;
    /// 502, 503 and 504 not listed here are "outcome unknown".
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_RELEASE_ON_STATUS",
        value_name = "STATUSES",
        default_value = "408,409,425,429",
        value_delimiter = ','
    )]
    pub http_proxy_release_on_status: Vec<String>,
    /// The same for gRPC calls: codes by name or number (1-16,
    /// comma-separated) or `none`. CANCELLED, DEADLINE_EXCEEDED and
    /// UNAVAILABLE not listed here are "outcome unknown".
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_RELEASE_ON_GRPC_CODE",
        value_name = "CODES",
        default_value = "ABORTED",
        value_delimiter = ','
    )]
    pub http_proxy_release_on_grpc_code: Vec<String>,
    /// Longest a client may take to send a request's head, longest an
    /// HTTP/1 connection may sit idle between requests, and longest an
    /// answer may wait for the client to read any of it.
    #[arg(long, env = "DEDUPD_HTTP_PROXY_HEADER_TIMEOUT", default_value = "10s")]
    pub http_proxy_header_timeout: humantime::Duration,
    /// Longest a client may take to send the body of a keyed request
    /// (answered 408, not forwarded, when it is slower).
    #[arg(long, env = "DEDUPD_HTTP_PROXY_BODY_TIMEOUT", default_value = "30s")]
    pub http_proxy_body_timeout: humantime::Duration,
    /// Answer 400 to a deduplicated method without an Idempotency-Key:
    /// alone, on every route; or where one of the comma-separated patterns
    /// `[METHOD ]PATH` matches (`*` one segment, a final `**` the rest:
    /// `POST /payments/**,/orders/*/refunds`).
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_REQUIRE_KEY",
        value_name = "PATTERNS",
        num_args = 0..=1,
        default_missing_value = "*",
        value_delimiter = ','
    )]
    pub http_proxy_require_key: Vec<String>,
    /// How long a replayable response is kept.
    #[arg(long, env = "DEDUPD_HTTP_PROXY_RETENTION", default_value = "24h")]
    pub http_proxy_retention: humantime::Duration,
    /// The largest response kept for replay (larger ones are returned, and
    /// a retry is told the result cannot be replayed); at most 64 MiB.
    #[arg(long, env = "DEDUPD_HTTP_PROXY_MAX_RESPONSE_BYTES", default_value_t = 1 << 20)]
    pub http_proxy_max_response_bytes: usize,
    /// The largest body of a keyed request (buffered to fingerprint it).
    #[arg(long, env = "DEDUPD_HTTP_PROXY_MAX_REQUEST_BYTES", default_value_t = 8 << 20)]
    pub http_proxy_max_request_bytes: usize,
    /// The longest the upstream may take to answer a keyed request (then
    /// 502 outcome-unknown: it is not sent again), and the longest a
    /// streamed answer may pause.
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_UPSTREAM_TIMEOUT",
        default_value = "60s"
    )]
    pub http_proxy_upstream_timeout: humantime::Duration,
    /// An idle connection to the upstream is closed after this long, not
    /// reused: shorter than the upstream's own keep-alive timeout (Node's
    /// 5 s, gunicorn's 2 s), so that a keyed request is never written into
    /// a connection the upstream is closing (its fate unknown).
    #[arg(
        long,
        env = "DEDUPD_HTTP_PROXY_UPSTREAM_IDLE_TIMEOUT",
        default_value = "1s"
    )]
    pub http_proxy_upstream_idle_timeout: humantime::Duration,
    /// A retry that arrives while the first request runs waits up to this
    /// long for its result and gets the replay, instead of a 409 at once
    /// (`0s`: answer 409 at once).
    #[arg(long, env = "DEDUPD_HTTP_PROXY_WAIT_IN_FLIGHT", default_value = "0s")]
    pub http_proxy_wait_in_flight: humantime::Duration,
    /// Set by `dedupd http-proxy`, whose flags drop the `http-proxy-` prefix:
    /// errors name the flags as the user wrote them.
    #[arg(skip)]
    pub standalone: bool,
}

impl HttpProxyArgs {
    /// A proxy flag's name (without `--`) as this command spells it.
    fn flag(&self, name: &str) -> String {
        if self.standalone {
            name.to_owned()
        } else {
            format!("http-proxy-{name}")
        }
    }

    /// `--release-on-status` and `--release-on-grpc-code`.
    fn release_on(&self) -> Result<ReleaseOn, String> {
        let listed = |flag: &str, values: &[String]| -> Result<Vec<String>, String> {
            let values: Vec<String> = values.iter().map(|value| value.trim().to_owned()).collect();
            match &values[..] {
                [none] if none.eq_ignore_ascii_case("none") => Ok(Vec::new()),
                _ if values
                    .iter()
                    .any(|value| value.eq_ignore_ascii_case("none")) =>
                {
                    Err(format!(
                        "--{} none cannot be given with other values",
                        self.flag(flag)
                    ))
                }
                _ => Ok(values),
            }
        };
        let statuses = listed("release-on-status", &self.http_proxy_release_on_status)?
            .iter()
            .map(|text| {
                text.parse::<u16>()
                    .ok()
                    .filter(|code| (400..=599).contains(code))
                    .and_then(|code| http::StatusCode::from_u16(code).ok())
                    .ok_or_else(|| {
                        format!(
                            "--{} {text:?}: a status of 400-599 (an answer that says the service \
                             did not act), or none",
                            self.flag("release-on-status")
                        )
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let grpc_codes = listed(
            "release-on-grpc-code",
            &self.http_proxy_release_on_grpc_code,
        )?
        .iter()
        .map(|text| {
            GRPC_CODE_NAMES
                .iter()
                .position(|name| name.eq_ignore_ascii_case(text))
                .map(|code| code as u32)
                .or_else(|| text.parse::<u32>().ok())
                .filter(|code| (1..=16).contains(code))
                .ok_or_else(|| {
                    format!(
                        "--{} {text:?}: a gRPC code other than OK, by name \
                             (RESOURCE_EXHAUSTED) or number (1-16), or none",
                        self.flag("release-on-grpc-code")
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
        Ok(ReleaseOn {
            statuses,
            grpc_codes,
        })
    }

    /// The proxy's settings, if it is on; the error is one line.
    fn validate(&self, limits: &Limits) -> Result<Option<(SocketAddr, ProxyConfig)>, String> {
        let (Some(listen), Some(upstream)) = (self.http_proxy_listen, &self.http_proxy_upstream)
        else {
            return Ok(None);
        };
        let upstream_uri: http::Uri = upstream
            .parse()
            .map_err(|e| format!("--{} {upstream:?}: {e}", self.flag("upstream")))?;
        if upstream_uri.scheme_str() != Some("http")
            || upstream_uri.authority().is_none()
            || upstream_uri.path() != "/"
        {
            return Err(format!(
                "--{} {upstream:?} must be http://HOST:PORT (no path; TLS to the upstream is not supported)",
                self.flag("upstream")
            ));
        }
        let methods = self
            .http_proxy_methods
            .iter()
            .map(|method| {
                http::Method::from_bytes(method.trim().to_ascii_uppercase().as_bytes()).map_err(
                    |_| {
                        format!(
                            "--{}: {method:?} is not an HTTP method",
                            self.flag("methods")
                        )
                    },
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let header_names = |flag: &str, names: &[String]| {
            names
                .iter()
                .map(|name| {
                    http::HeaderName::from_bytes(name.trim().as_bytes())
                        .map_err(|_| format!("--{} {name:?} is not a header name", self.flag(flag)))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let scope_headers = header_names("scope-header", &self.http_proxy_scope_header)?;
        let scope = match (self.http_proxy_scope, scope_headers.is_empty()) {
            (ProxyScope::Credentials, true) => CallerScope::Credentials,
            (ProxyScope::Credentials, false) => CallerScope::Headers(scope_headers),
            (ProxyScope::None, true) => CallerScope::Shared,
            (ProxyScope::None, false) => {
                return Err(format!(
                    "--{} none and --{} contradict each other: choose one",
                    self.flag("scope"),
                    self.flag("scope-header")
                ))
            }
        };
        // An answer is gathered whole, within the proxy's budget, before it
        // is stored: a larger limit could never be reached, and said so
        // nowhere.
        if self.http_proxy_max_response_bytes > KEYED_BODY_BUDGET_BYTES {
            return Err(format!(
                "--{} must be at most {KEYED_BODY_BUDGET_BYTES} (the budget for answers gathered \
                 to be stored), got {}",
                self.flag("max-response-bytes"),
                self.http_proxy_max_response_bytes
            ));
        }
        let never_store = header_names("never-store-header", &self.http_proxy_never_store_header)?;
        let fingerprint_headers =
            header_names("fingerprint-header", &self.http_proxy_fingerprint_header)?;
        let header_timeout = check_duration_flag(
            &self.flag("header-timeout"),
            self.http_proxy_header_timeout.into(),
            Duration::from_secs(3600),
        )?;
        let body_timeout = check_duration_flag(
            &self.flag("body-timeout"),
            self.http_proxy_body_timeout.into(),
            Duration::from_secs(3600),
        )?;
        // The proxy's records follow the same rules as any client's.
        limits
            .key(&self.http_proxy_namespace, "probe")
            .map_err(|e| format!("--{}: {e}", self.flag("namespace")))?;
        let retention = check_duration_flag(
            &self.flag("retention"),
            self.http_proxy_retention.into(),
            limits.max_retention,
        )?;
        let upstream_timeout = check_duration_flag(
            &self.flag("upstream-timeout"),
            self.http_proxy_upstream_timeout.into(),
            Duration::from_secs(3600),
        )?;
        let upstream_idle_timeout = check_duration_flag(
            &self.flag("upstream-idle-timeout"),
            self.http_proxy_upstream_idle_timeout.into(),
            Duration::from_secs(3600),
        )?;
        let wait_in_flight: Duration = self.http_proxy_wait_in_flight.into();
        if wait_in_flight > upstream_timeout {
            return Err(format!(
                "--{} {} is longer than --{} {}: a retry would outwait the first request",
                self.flag("wait-in-flight"),
                self.http_proxy_wait_in_flight,
                self.flag("upstream-timeout"),
                self.http_proxy_upstream_timeout
            ));
        }
        let require_key = self
            .http_proxy_require_key
            .iter()
            .map(|text| {
                let pattern = RoutePattern::parse(text)
                    .map_err(|e| format!("--{} {text:?}: {e}", self.flag("require-key")))?;
                match pattern.method() {
                    Some(method) if !methods.contains(method) => Err(format!(
                        "--{} {text:?}: {method} is not in --{} (only those are deduplicated)",
                        self.flag("require-key"),
                        self.flag("methods")
                    )),
                    _ => Ok(pattern),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some((
            listen,
            ProxyConfig {
                upstream: upstream_uri,
                namespace: self.http_proxy_namespace.clone(),
                methods,
                scope,
                fingerprint_headers,
                never_store,
                key_syntax: if self.http_proxy_strict_key_syntax {
                    KeySyntax::Strict
                } else {
                    KeySyntax::Lenient
                },
                require_key,
                release_on: self.release_on()?,
                lease_ttl: limits.default_lease_ttl,
                retention,
                max_response_bytes: self.http_proxy_max_response_bytes,
                max_request_bytes: self.http_proxy_max_request_bytes,
                upstream_timeout,
                upstream_idle_timeout,
                wait_in_flight,
                after_unknown_outcome: match self.http_proxy_after_unknown_outcome {
                    AfterUnknownOutcomeArg::Report => AfterUnknownOutcome::Report,
                    AfterUnknownOutcomeArg::Retry => AfterUnknownOutcome::Retry,
                },
                header_timeout,
                body_timeout,
                // Set with the other connection limits (`ServeArgs::validate`).
                connections: ConnectionLimits::default(),
                shutdown_grace: Duration::from_secs(20),
            },
        )))
    }
}

/// gRPC's status codes by number (`--release-on-grpc-code` takes either).
const GRPC_CODE_NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// `--http-proxy-scope`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProxyScope {
    /// A hash of the caller's credentials.
    Credentials,
    /// None: every caller shares records.
    None,
}

/// `--http-proxy-after-unknown-outcome`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AfterUnknownOutcomeArg {
    /// Record "outcome unknown"; never send it again (at most once).
    Report,
    /// Release the key; a retry sends it again (at least once).
    Retry,
}

/// The store to open.
#[derive(Debug, Clone)]
pub enum StoreSettings {
    /// The embedded store.
    Sled(SledConfig),
    /// A store every sidecar shares; the URL is read by `main` (it may come
    /// from a file).
    Shared {
        /// Where the URL comes from.
        url: StoreUrlSource,
        /// The CA to trust for the server's certificate, read by `main`.
        ca_file: Option<PathBuf>,
        /// Which server, and how to use it (the URL filled in once read).
        backend: SharedBackend,
        /// This sidecar's local tier, unless turned off.
        local_tier: Option<LocalTierConfig>,
        /// The bound on the store clock's uncertainty
        /// ([`crate::time_policy`]).
        max_clock_uncertainty: Duration,
    },
}

/// The server behind a shared store.
#[derive(Debug, Clone)]
pub enum SharedBackend {
    /// PostgreSQL.
    Postgres(PostgresConfig),
    /// Redis.
    Redis(RedisConfig),
}

impl SharedBackend {
    /// Checks a URL for this server; the problem without the password.
    pub fn check_url(&self, url: &str) -> Result<(), String> {
        match self {
            SharedBackend::Postgres(_) => postgres::check_url(url),
            SharedBackend::Redis(config) => redis::check_url(url, config.cluster),
        }
    }

    /// The same backend with its URL and CA filled in.
    pub fn with_secrets(&self, url: String, ca_pem: Option<Vec<u8>>) -> SharedBackend {
        match self {
            SharedBackend::Postgres(config) => SharedBackend::Postgres(PostgresConfig {
                url,
                ca_pem,
                ..config.clone()
            }),
            SharedBackend::Redis(config) => SharedBackend::Redis(RedisConfig {
                url,
                ca_pem,
                ..config.clone()
            }),
        }
    }
}

/// A validated server configuration: plain values, nothing opened or read.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where to serve gRPC.
    pub listen: Vec<ListenAddr>,
    /// Where to serve the ops endpoints.
    pub metrics_listen: Option<SocketAddr>,
    /// Which store, and how to reach it.
    pub store: StoreSettings,
    /// Request limits and defaults.
    pub limits: Limits,
    /// The bearer tokens' sources.
    pub auth: AuthSources,
    /// TLS on the TCP listeners.
    pub tls: Option<TlsFiles>,
    /// Calls in progress at once.
    pub max_concurrent_requests: usize,
    /// Connection limits.
    pub connections: ConnectionLimits,
    /// Longest a call may take.
    pub request_timeout: Duration,
    /// Longest a request message may take to arrive.
    pub request_read_timeout: Duration,
    /// Largest gRPC message.
    pub max_message_bytes: usize,
    /// How often the reaper runs.
    pub reaper_interval: Duration,
    /// Time in-flight calls get on shutdown.
    pub shutdown_grace: Duration,
    /// Where to announce readiness.
    pub ready_file: Option<PathBuf>,
    /// The key files answers are sealed and opened with, and the keys
    /// declared destroyed (none: stored in plaintext).
    pub key_files: KeyFiles,
    /// The key correlation IDs are hashed with before they reach the store.
    pub hash_correlation_ids: Option<PathBuf>,
    /// How often the key files are read again.
    pub key_reload_interval: Duration,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter.
    pub log_filter: tracing_subscriber::EnvFilter,
    /// Tokio worker threads (0: one per CPU).
    pub worker_threads: usize,
    /// The HTTP idempotency proxy's address and settings, when it is on.
    pub http_proxy: Option<(SocketAddr, ProxyConfig)>,
    /// Where traces go, when they are on.
    pub traces: Option<TraceSettings>,
    /// The memory caches and buffers are sized from.
    pub memory: MemoryBudget,
}

fn parse_namespace_key(text: &str) -> Result<(String, PathBuf), String> {
    let (namespace, path) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not NAMESPACE=FILE"))?;
    if namespace.is_empty() {
        return Err(format!(
            "{text:?} names no namespace (the keys of every namespace without its own are \
             --encryption-key-file's)"
        ));
    }
    check_namespace(namespace).map_err(|problem| format!("namespace {namespace:?} {problem}"))?;
    if path.is_empty() {
        return Err(format!("{text:?} names no key file"));
    }
    Ok((namespace.to_owned(), PathBuf::from(path)))
}

fn parse_namespace_retention(text: &str) -> Result<(String, Duration), String> {
    let (namespace, duration) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not NAMESPACE=DURATION"))?;
    if namespace.is_empty() {
        return Err(format!(
            "{text:?} names no namespace (requests without one use `default`: write default=…)"
        ));
    }
    check_namespace(namespace).map_err(|problem| format!("namespace {namespace:?} {problem}"))?;
    let duration = humantime::parse_duration(duration)
        .map_err(|e| format!("retention of {namespace:?}: {e}"))?;
    Ok((namespace.to_owned(), duration))
}

fn check_duration_flag(name: &str, value: Duration, max: Duration) -> Result<Duration, String> {
    check_duration(value, max).map_err(|problem| format!("--{name} {problem}"))
}

impl ServeArgs {
    fn tls(&self) -> Result<Option<TlsFiles>, String> {
        match (&self.tls_cert, &self.tls_key) {
            (None, None) if self.tls_client_ca.is_some() => {
                Err("--tls-client-ca needs --tls-cert and --tls-key".into())
            }
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => Ok(Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            })),
            _ => Err("--tls-cert and --tls-key go together".into()),
        }
    }

    fn store(
        &self,
        stall_timeout: Duration,
        memory: &MemoryBudget,
    ) -> Result<StoreSettings, String> {
        let url = StoreUrlSource {
            value: self.store_url.clone(),
            file: self.store_url_file.clone(),
        };
        match self.store {
            StoreKind::Sled => {
                if url.value.is_some() || url.file.is_some() {
                    return Err(
                        "--store-url is for --store postgres or redis (the default store is sled)"
                            .into(),
                    );
                }
                let checkpoint_interval = check_duration_flag(
                    "checkpoint-interval",
                    self.checkpoint_interval.into(),
                    Duration::from_secs(3600),
                )?;
                if checkpoint_interval < Duration::from_millis(100) {
                    return Err("--checkpoint-interval must be at least 100ms".into());
                }
                if !(1..=4096).contains(&self.checkpoint_log_mb) {
                    return Err("--checkpoint-log-mb must be between 1 and 4096".into());
                }
                Ok(StoreSettings::Sled(SledConfig {
                    path: self.data_dir.clone(),
                    sync: self.sync.into(),
                    cache_capacity_bytes: self
                        .cache_mb
                        .map_or(memory.store_cache_bytes(), |mb| mb.saturating_mul(1 << 20)),
                    disk_reserve_bytes: self.disk_reserve_mb.saturating_mul(1 << 20),
                    stall_timeout,
                    checkpoint_interval,
                    checkpoint_log_bytes: self.checkpoint_log_mb << 20,
                    // Records are reaped about as late as the reaper's
                    // interval already makes them.
                    expiry_bucket: Duration::from(self.reaper_interval),
                }))
            }
            StoreKind::Postgres | StoreKind::Redis => {
                check_schema(&self.store_schema)
                    .map_err(|problem| format!("--store-schema {problem}"))?;
                if self.store_pool_size == 0 {
                    return Err("--store-pool-size must be at least 1".into());
                }
                let timeout = check_duration_flag(
                    "store-timeout",
                    self.store_timeout.into(),
                    Duration::from_secs(600),
                )?;
                let max_clock_uncertainty = check_duration_flag(
                    "max-clock-uncertainty",
                    self.max_clock_uncertainty.into(),
                    Duration::from_secs(10),
                )?;
                if self.store == StoreKind::Postgres
                    && (self.store_replicas > 0 || self.allow_redis_eviction || self.store_cluster)
                {
                    return Err("--store-replicas, --store-cluster and --allow-redis-eviction are for --store redis \
                                (PostgreSQL waits for its standbys itself: synchronous_standby_names)"
                        .into());
                }
                let backend = if self.store == StoreKind::Postgres {
                    SharedBackend::Postgres(PostgresConfig {
                        url: String::new(),
                        schema: self.store_schema.clone(),
                        pool_size: self.store_pool_size,
                        statement_timeout: timeout,
                        ca_pem: None,
                    })
                } else {
                    SharedBackend::Redis(RedisConfig {
                        url: String::new(),
                        prefix: self.store_schema.clone(),
                        connections: self.store_pool_size,
                        timeout,
                        ca_pem: None,
                        replicas: self.store_replicas,
                        allow_eviction: self.allow_redis_eviction,
                        cluster: self.store_cluster,
                    })
                };
                let max_age = check_duration_flag(
                    "local-tier-max-age",
                    self.local_tier_max_age.into(),
                    Duration::from_secs(365 * 86_400),
                )?;
                let local_tier = (self.local_tier_mb > 0).then(|| LocalTierConfig {
                    path: self.data_dir.join("local-tier"),
                    max_bytes: self.local_tier_mb.saturating_mul(1 << 20),
                    cache_bytes: memory.store_cache_bytes(),
                    max_age,
                });
                Ok(StoreSettings::Shared {
                    url,
                    ca_file: self.store_ca_file.clone(),
                    backend,
                    local_tier,
                    max_clock_uncertainty,
                })
            }
        }
    }

    fn auth(&self) -> AuthSources {
        AuthSources {
            client: TokenSource {
                file: self.auth_token_file.clone(),
                value: self.auth_token.clone(),
            },
            admin: TokenSource {
                file: self.admin_token_file.clone(),
                value: self.admin_token.clone(),
            },
        }
    }

    /// Checks every setting and their relations; the error is one line.
    pub fn validate(&self) -> Result<Settings, String> {
        let max_lease_ttl = check_duration_flag(
            "max-lease-ttl",
            self.max_lease_ttl.into(),
            HARD_MAX_LEASE_TTL,
        )?;
        let default_lease_ttl = check_duration_flag(
            "default-lease-ttl",
            self.default_lease_ttl.into(),
            max_lease_ttl,
        )?;
        let max_retention = check_duration_flag(
            "max-retention",
            self.max_retention.into(),
            HARD_MAX_RETENTION,
        )?;
        let default_retention = check_duration_flag(
            "default-retention",
            self.default_retention.into(),
            max_retention,
        )?;
        for (namespace, retention) in &self.namespace_retention {
            check_duration_flag(
                &format!("namespace-retention of {namespace}"),
                *retention,
                max_retention,
            )?;
        }
        let reaper_interval = check_duration_flag(
            "reaper-interval",
            self.reaper_interval.into(),
            Duration::from_secs(24 * 3600),
        )?;
        let request_timeout = check_duration_flag(
            "request-timeout",
            self.request_timeout.into(),
            Duration::from_secs(3600),
        )?;
        let stall_timeout = check_duration_flag(
            "store-stall-timeout",
            self.store_stall_timeout.into(),
            Duration::from_secs(3600),
        )?;
        let request_read_timeout = check_duration_flag(
            "request-read-timeout",
            self.request_read_timeout.into(),
            Duration::from_secs(3600),
        )?;
        if self.max_response_bytes > HARD_MAX_RESPONSE_BYTES {
            return Err(format!(
                "--max-response-bytes must be at most {HARD_MAX_RESPONSE_BYTES}, got {}",
                self.max_response_bytes
            ));
        }
        if !(1..=100_000).contains(&self.max_batch_size) {
            return Err(format!(
                "--max-batch-size must be between 1 and 100000, got {}",
                self.max_batch_size
            ));
        }
        let smallest_message = self.max_response_bytes + (64 << 10);
        if self.max_message_bytes < smallest_message {
            return Err(format!(
                "--max-message-bytes must be at least {smallest_message} (the largest response plus 64 KiB), got {}",
                self.max_message_bytes
            ));
        }
        if self.cache_mb == Some(0) {
            return Err("--cache-mb must be at least 1".into());
        }
        if self.max_concurrent_requests == 0 {
            return Err("--max-concurrent-requests must be at least 1".into());
        }
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".into());
        }
        if self.max_streams_per_connection == 0 {
            return Err("--max-streams-per-connection must be at least 1".into());
        }
        let max_connection_age = check_duration_flag(
            "max-connection-age",
            self.max_connection_age.into(),
            Duration::from_secs(30 * 86_400),
        )?;
        if self.data_dir.exists() && !self.data_dir.is_dir() {
            return Err(format!(
                "--data-dir {} exists and is not a directory",
                self.data_dir.display()
            ));
        }
        let metrics_listen = match self.metrics_listen.as_str() {
            "off" | "" => None,
            address => Some(address.parse::<SocketAddr>().map_err(|_| {
                format!("--metrics-listen {address:?} is neither HOST:PORT nor off")
            })?),
        };
        for address in &self.listen {
            if let ListenAddr::Unix(path) = address {
                let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
                if parent.is_some_and(|parent| !parent.is_dir()) {
                    return Err(format!(
                        "--listen {address}: directory {} does not exist",
                        parent.unwrap_or(path).display()
                    ));
                }
            }
        }
        if let Some(ready_file) = &self.ready_file {
            let parent = ready_file.parent().filter(|p| !p.as_os_str().is_empty());
            if parent.is_some_and(|parent| !parent.is_dir()) || ready_file.is_dir() {
                return Err(format!(
                    "--ready-file {}: not a file in an existing directory",
                    ready_file.display()
                ));
            }
        }
        let memory = MemoryBudget::resolve(self.memory_budget, Path::new("/sys/fs/cgroup"))?;
        let store = self.store(stall_timeout, &memory)?;
        let auth = self.auth();
        let tls = self.tls()?;
        self.check_exposure(&auth, tls.as_ref())?;
        let log_filter = tracing_subscriber::EnvFilter::try_new(&self.log)
            .map_err(|e| format!("--log {:?} is not a valid filter: {e}", self.log))?;
        let traces = self.traces.validate(&ProcessEnvironment)?;
        let limits = Limits {
            default_lease_ttl,
            max_lease_ttl,
            default_retention,
            max_retention,
            namespace_retention: self.namespace_retention.iter().cloned().collect(),
            max_response_bytes: self.max_response_bytes,
            max_batch_size: self.max_batch_size,
        };
        let connections = ConnectionLimits {
            max_connections: self.max_connections,
            max_streams_per_connection: self.max_streams_per_connection,
            max_connection_age,
            ..ConnectionLimits::default()
        };
        let http_proxy = self.http_proxy.validate(&limits)?.map(|(address, proxy)| {
            (
                address,
                ProxyConfig {
                    connections,
                    shutdown_grace: self.shutdown_grace.into(),
                    ..proxy
                },
            )
        });
        Ok(Settings {
            listen: self.listen.clone(),
            metrics_listen,
            store,
            limits,
            auth,
            tls,
            max_concurrent_requests: self.max_concurrent_requests,
            connections,
            request_timeout,
            request_read_timeout,
            max_message_bytes: self.max_message_bytes,
            reaper_interval,
            shutdown_grace: self.shutdown_grace.into(),
            ready_file: self.ready_file.clone(),
            key_files: KeyFiles {
                sealing: self.encryption_key_file.clone(),
                opening: self.decryption_key_file.clone(),
                namespace_sealing: self.namespace_key.clone(),
                namespace_opening: self.namespace_decryption_key.clone(),
                erased: self.erased_key_id.clone(),
            },
            hash_correlation_ids: self.hash_correlation_ids.clone(),
            key_reload_interval: check_duration_flag(
                "key-reload-interval",
                self.key_reload_interval.into(),
                Duration::from_secs(24 * 3600),
            )?,
            log_format: self.log_format,
            log_filter,
            worker_threads: self.worker_threads,
            http_proxy,
            traces,
            memory,
        })
    }

    /// A gRPC port reachable beyond this host must know its callers: a token
    /// or mTLS, unless the operator says the network is private.
    fn check_exposure(&self, auth: &AuthSources, tls: Option<&TlsFiles>) -> Result<(), String> {
        let authenticated = auth.client.is_set() || tls.is_some_and(|tls| tls.client_ca.is_some());
        if authenticated || self.allow_unauthenticated {
            return Ok(());
        }
        match self.listen.iter().find(|address| {
            matches!(address, ListenAddr::Tcp(socket) if !socket.ip().is_loopback())
        }) {
            Some(exposed) => Err(format!(
                "--listen {exposed} is reachable beyond this host, but no caller is authenticated: \
                 set --auth-token-file or --tls-client-ca, listen on 127.0.0.1 or a unix:// socket, \
                 or pass --allow-unauthenticated if only trusted peers can reach it"
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::command::{Cli, Command};

    /// `--release-on-*` as an operator writes them: names in any case,
    /// numbers, `none`.
    #[test]
    fn release_sets_take_names_numbers_and_none() {
        let cli = Cli::try_parse_from([
            "dedupd",
            "http-proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
            "--release-on-status",
            "none",
            "--release-on-grpc-code",
            "resource_exhausted, 10,UNAVAILABLE",
        ])
        .unwrap();
        let Some(Command::HttpProxy(mut args)) = cli.command else {
            panic!("the http-proxy command");
        };
        args.http_proxy.standalone = true;
        let release_on = args.http_proxy.release_on().unwrap();
        assert!(release_on.statuses.is_empty());
        assert_eq!(release_on.grpc_codes, [8, 10, 14]);

        let defaults = Cli::try_parse_from(["dedupd"]).unwrap();
        assert_eq!(
            defaults.serve.http_proxy.release_on().unwrap(),
            crate::proxy::idempotency::ReleaseOn::default()
        );
    }
}
