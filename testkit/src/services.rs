//! The PostgreSQL and Redis the tests use, found once per test process (see
//! the crate docs for the order), and throwaway servers of either kind.
//!
//! A throwaway server runs under a small `sh` wrapper that reads its stdin
//! until the end: the test process holds the other end of that pipe, so
//! when the process ends — passing, failing, or killed — the pipe closes,
//! and the wrapper stops the server and removes its directory. Nothing
//! outlives the test run, and no test needs to remember to stop anything.

use std::{
    collections::BTreeSet,
    ffi::OsString,
    net::TcpListener,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use crate::skip::skip_for_store;

/// A server the tests may use.
#[derive(Debug)]
pub struct Service {
    /// Where it answers (no TLS).
    pub url: String,
    /// Where it came from, for messages.
    pub origin: Origin,
    /// The port it listens on at 127.0.0.1.
    pub port: u16,
    _server: Option<Throwaway>,
}

/// Where a [`Service`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The URL in this environment variable.
    Given(&'static str),
    /// The machine's own service, found where the harness looks.
    Machine,
    /// Started by the harness for this test process.
    Started,
}

/// The kind of server: how to reach it, find it and start it.
struct Kind {
    name: &'static str,
    url_variable: &'static str,
    default_variable: &'static str,
    default_url: &'static str,
    install: &'static str,
}

const POSTGRES: Kind = Kind {
    name: "PostgreSQL",
    url_variable: "DEDUPD_TEST_POSTGRES_URL",
    default_variable: "DEDUPD_TEST_POSTGRES_DEFAULT_URL",
    default_url: "postgres://postgres@127.0.0.1:5432/test",
    install: "install PostgreSQL's server (initdb and postgres on PATH or under \
              /usr/lib/postgresql/*/bin; Debian: apt install postgresql), \
              or set DEDUPD_TEST_POSTGRES_URL",
};

const REDIS: Kind = Kind {
    name: "Redis",
    url_variable: "DEDUPD_TEST_REDIS_URL",
    default_variable: "DEDUPD_TEST_REDIS_DEFAULT_URL",
    default_url: "redis://127.0.0.1:6379",
    install: "install redis-server (on PATH; Debian: apt install redis-server), \
              or set DEDUPD_TEST_REDIS_URL",
};

/// The PostgreSQL for this test process, or `None` when there is none to
/// be had (the caller skips: see [`require_postgres`]). Panics when
/// `DEDUPD_TEST_POSTGRES_URL` is set and does not answer, or when the
/// binaries are there and the server they start fails.
pub fn postgres() -> Option<&'static Service> {
    static SERVICE: OnceLock<Result<Option<Service>, String>> = OnceLock::new();
    found(SERVICE.get_or_init(|| resolve(&POSTGRES, postgres_answers, || start_postgres(&[], &[]))))
}

/// The Redis for this test process; as [`postgres`].
pub fn redis() -> Option<&'static Service> {
    static SERVICE: OnceLock<Result<Option<Service>, String>> = OnceLock::new();
    found(SERVICE.get_or_init(|| resolve(&REDIS, redis_answers, || start_redis(&[]))))
}

/// What [`resolve`] found, its error a panic in every test that asks (the
/// search itself runs once).
fn found(resolved: &'static Result<Option<Service>, String>) -> Option<&'static Service> {
    match resolved {
        Ok(service) => service.as_ref(),
        Err(error) => panic!("{error}"),
    }
}

/// [`postgres`], or a skip saying what to install (the caller returns).
pub fn require_postgres() -> Option<&'static Service> {
    let service = postgres();
    if service.is_none() {
        skip_for_store(&format!("no PostgreSQL: {}", POSTGRES.install));
    }
    service
}

/// [`redis`], or a skip saying what to install (the caller returns).
pub fn require_redis() -> Option<&'static Service> {
    let service = redis();
    if service.is_none() {
        skip_for_store(&format!("no Redis: {}", REDIS.install));
    }
    service
}

fn resolve(
    kind: &Kind,
    answers: fn(&str) -> Result<(), String>,
    start: impl FnOnce() -> Result<Option<Throwaway>, String>,
) -> Result<Option<Service>, String> {
    if let Ok(url) = std::env::var(kind.url_variable) {
        // Given explicitly: it must answer (allowing it a moment to start).
        let started = Instant::now();
        loop {
            match answers(&url) {
                Ok(()) => {
                    return Ok(Some(Service {
                        port: port_of(&url),
                        url,
                        origin: Origin::Given(kind.url_variable),
                        _server: None,
                    }))
                }
                Err(error) if started.elapsed() > Duration::from_secs(10) => {
                    return Err(format!(
                        "{}={} does not answer: {error}",
                        kind.url_variable,
                        redact(&url)
                    ))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
    let default = std::env::var(kind.default_variable).unwrap_or_else(|_| kind.default_url.into());
    if answers(&default).is_ok() {
        return Ok(Some(Service {
            port: port_of(&default),
            url: default,
            origin: Origin::Machine,
            _server: None,
        }));
    }
    match start() {
        Ok(Some(server)) => {
            let line = format!(
                "{} for the tests: nothing answers at {}; started one from {} at {} for this test process\n",
                kind.name,
                redact(&default),
                server.binaries.display(),
                server.url
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            Ok(Some(Service {
                url: server.url.clone(),
                port: server.port,
                origin: Origin::Started,
                _server: Some(server),
            }))
        }
        Ok(None) => Ok(None),
        Err(error) => Err(format!(
            "starting a {} for the tests failed: {error}",
            kind.name
        )),
    }
}

/// The port of a `scheme://[user@]host:port/…` URL (the scheme's default
/// when none is written).
fn port_of(url: &str) -> u16 {
    let authority = url
        .split_once("://")
        .map_or(url, |(_, rest)| rest)
        .split(['/', '?'])
        .next()
        .unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    host_port
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or(if url.starts_with("redis") { 6379 } else { 5432 })
}

/// `url` without its password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme_end + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// Whether PostgreSQL at `url` runs a query (plaintext), within 5 s.
pub fn postgres_answers(url: &str) -> Result<(), String> {
    let url = url.to_owned();
    on_own_runtime(async move {
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .map_err(|error| error.to_string())?;
        let connection = tokio::spawn(connection);
        let answered = client.simple_query("SELECT 1").await.map(drop);
        drop(client);
        let _ = connection.await;
        answered.map_err(|error| error.to_string())
    })
}

/// Whether Redis at `url` answers PING, within 5 s.
pub fn redis_answers(url: &str) -> Result<(), String> {
    let client = redis::Client::open(url).map_err(|error| error.to_string())?;
    let mut connection = client
        .get_connection_with_timeout(Duration::from_secs(5))
        .map_err(|error| error.to_string())?;
    connection
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|error| error.to_string())?;
    redis::cmd("PING")
        .query::<String>(&mut connection)
        .map(drop)
        .map_err(|error| error.to_string())
}

/// Runs `work` (bounded by 5 s) on a runtime of its own in a thread of its
/// own, so it can be called from sync code and from inside a test's runtime.
fn on_own_runtime(
    work: impl std::future::Future<Output = Result<(), String>> + Send + 'static,
) -> Result<(), String> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| error.to_string())?;
        runtime.block_on(async move {
            tokio::time::timeout(Duration::from_secs(5), work)
                .await
                .map_err(|_| "no answer within 5 s".to_owned())?
        })
    })
    .join()
    .map_err(|_| "the check panicked".to_owned())?
}

/// A server started by the harness under its wrapper (see the module docs);
/// dropping it stops the server and removes its directory.
#[derive(Debug)]
pub struct Throwaway {
    /// Where it answers (no TLS).
    pub url: String,
    /// Its port at 127.0.0.1.
    pub port: u16,
    /// Its directory (the wrapper removes it at the end).
    pub dir: PathBuf,
    /// The folder its binaries came from.
    pub binaries: PathBuf,
    wrapper: Child,
    /// Held open for as long as the server should live.
    lifeline: Option<ChildStdin>,
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        drop(self.lifeline.take());
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(15) {
            if let Ok(Some(_)) = self.wrapper.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.wrapper.kill();
        let _ = self.wrapper.wait();
    }
}

/// Where the harness looks for server binaries: `DEDUPD_TEST_STORE_BINARIES`
/// (a `PATH`-style list) if set, else `PATH` and then
/// `/usr/lib/postgresql/*/bin`, the newest version first.
pub fn binary_folders() -> Vec<PathBuf> {
    if let Some(folders) = std::env::var_os("DEDUPD_TEST_STORE_BINARIES") {
        return std::env::split_paths(&folders).collect();
    }
    let mut folders: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect())
        .unwrap_or_default();
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_string_lossy().parse().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versions.sort_by_key(|(version, _)| std::cmp::Reverse(*version));
    folders.extend(versions.into_iter().map(|(_, folder)| folder));
    folders
}

/// The first folder of [`binary_folders`] holding every one of `names`.
pub fn find_binaries(names: &[&str]) -> Option<PathBuf> {
    binary_folders().into_iter().find(|folder| {
        names.iter().all(|name| {
            std::fs::metadata(folder.join(name))
                .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        })
    })
}

/// A port free on 127.0.0.1 right now, and never handed out before by
/// this process: the kernel hands a probed and closed port out again, and
/// two servers given one port leave the second dead while the first
/// answers for both (a cluster created so never knows its six nodes).
pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port on 127.0.0.1")
            .port();
        if HANDED_OUT.lock().expect("ports lock").insert(port) {
            return port;
        }
    }
}

/// Starts PostgreSQL from the binaries found, with `files` written into
/// its directory (readable by the server only) and `settings` for
/// `postgres -c` (`{dir}` in a value is that directory); `Ok(None)` when
/// there are no binaries. PostgreSQL refuses to run as root: as root the
/// server runs as the `postgres` user (or `nobody`).
pub fn start_postgres(
    files: &[(&str, &[u8])],
    settings: &[(&str, &str)],
) -> Result<Option<Throwaway>, String> {
    let Some(binaries) = find_binaries(&["initdb", "postgres"]) else {
        return Ok(None);
    };
    let port = free_port();
    let dir = server_dir("pg")?;
    let user = unprivileged_user()?;
    for (name, content) in files {
        let path = dir.join(name);
        std::fs::write(&path, content).map_err(|e| format!("{}: {e}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| e.to_string())?;
    }
    if let Some((uid, gid)) = user.as_ref().map(|user| user.ids) {
        for path in std::iter::once(dir.clone()).chain(files.iter().map(|(name, _)| dir.join(name)))
        {
            std::os::unix::fs::chown(&path, Some(uid), Some(gid)).map_err(|e| e.to_string())?;
        }
    }
    let mut extra: Vec<OsString> = Vec::new();
    for (name, value) in settings {
        let value = value.replace("{dir}", &dir.to_string_lossy());
        extra.push("-c".into());
        extra.push(format!("{name}={value}").into());
    }
    let script = r#"
set -e
"$BIN/initdb" -D "$DIR/data" -A trust -U postgres --no-sync -E UTF8 --locale=C >"$DIR/initdb.log" 2>&1
"$BIN/postgres" -D "$DIR/data" -p "$PORT" -k "$DIR" -c listen_addresses=127.0.0.1 \
  -c max_connections=300 "$@" >"$DIR/server.log" 2>&1 </dev/null &
server=$!
trap 'kill -INT "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -rf "$DIR"' EXIT
# dash runs no EXIT trap when a signal ends it (Ctrl-C, timeout's SIGTERM).
trap 'exit 130' INT TERM HUP
cat >/dev/null
"#;
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let server = spawn_wrapper(script, &binaries, &dir, port, &extra, user.as_ref(), url)?;
    wait_until_answering(server, postgres_answers, &["initdb.log", "server.log"]).map(Some)
}

/// [`start_postgres`] speaking TLS (plaintext still accepted) with this
/// certificate and key.
pub fn start_postgres_tls(cert_pem: &[u8], key_pem: &[u8]) -> Result<Option<Throwaway>, String> {
    start_postgres(
        &[("server.crt", cert_pem), ("server.key", key_pem)],
        &[
            ("ssl", "on"),
            ("ssl_cert_file", "{dir}/server.crt"),
            ("ssl_key_file", "{dir}/server.key"),
        ],
    )
}

/// The end of a Redis wrapper script: the server started in the
/// background is stopped, and its directory removed, when the test's end
/// of the lifeline (the wrapper's stdin) closes or the wrapper is killed.
const REDIS_LIFELINE: &str = r#"server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -rf "$DIR"' EXIT
trap 'exit 130' INT TERM HUP
cat >/dev/null
"#;

/// Starts `redis-server` from the binaries found, with `args` after the
/// harness's own (`--port <free> --bind 127.0.0.1 --save "" --appendonly
/// no`; later ones win), without waiting for it to answer; `Ok(None)` when
/// there is none.
pub fn spawn_redis(args: &[OsString]) -> Result<Option<Throwaway>, String> {
    let Some(binaries) = find_binaries(&["redis-server"]) else {
        return Ok(None);
    };
    let port = free_port();
    let dir = server_dir("redis")?;
    let script = format!(
        "{}{REDIS_LIFELINE}",
        r#"
"$BIN/redis-server" --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$DIR" \
  "$@" >"$DIR/server.log" 2>&1 </dev/null &
"#
    );
    let url = format!("redis://127.0.0.1:{port}");
    spawn_wrapper(&script, &binaries, &dir, port, args, None, url).map(Some)
}

/// A Redis Sentinel of the harness's own (`redis-server <conf> --sentinel`)
/// monitoring the primary at 127.0.0.1:`primary_port` as `name`, with
/// `quorum`, judging it down after `down_after_ms` of silence; waits until
/// it answers PING. `Ok(None)` without `redis-server`.
pub fn start_redis_sentinel(
    name: &str,
    primary_port: u16,
    quorum: u32,
    down_after_ms: u64,
) -> Result<Option<Throwaway>, String> {
    on_a_free_port(|| spawn_redis_sentinel(name, primary_port, quorum, down_after_ms))
}

fn spawn_redis_sentinel(
    name: &str,
    primary_port: u16,
    quorum: u32,
    down_after_ms: u64,
) -> Result<Option<Throwaway>, String> {
    let Some(binaries) = find_binaries(&["redis-server"]) else {
        return Ok(None);
    };
    let port = free_port();
    let dir = server_dir("sentinel")?;
    // Sentinel rewrites its configuration file as it learns the topology,
    // so it gets one of its own.
    let script = r#"
cat >"$DIR/sentinel.conf" <<CONF
port $PORT
bind 127.0.0.1
dir $DIR
sentinel monitor $1 127.0.0.1 $2 $3
sentinel down-after-milliseconds $1 $4
sentinel failover-timeout $1 10000
sentinel parallel-syncs $1 1
CONF
"$BIN/redis-server" "$DIR/sentinel.conf" --sentinel >"$DIR/server.log" 2>&1 </dev/null &
"#;
    let script = format!("{script}{REDIS_LIFELINE}");
    let url = format!("redis://127.0.0.1:{port}");
    let args: Vec<OsString> = [
        name.to_owned(),
        primary_port.to_string(),
        quorum.to_string(),
        down_after_ms.to_string(),
    ]
    .into_iter()
    .map(OsString::from)
    .collect();
    let server = spawn_wrapper(&script, &binaries, &dir, port, &args, None, url)?;
    wait_until_answering(server, redis_answers, &["server.log"]).map(Some)
}

/// What a server logs when its port is taken.
const PORT_TAKEN: &str = "Address already in use";

/// `start` again, on a new port, while the port it picked was taken
/// between the pick and the server's bind (up to five times).
fn on_a_free_port(
    mut start: impl FnMut() -> Result<Option<Throwaway>, String>,
) -> Result<Option<Throwaway>, String> {
    let mut tries = 0;
    loop {
        match start() {
            Err(error) if error.contains(PORT_TAKEN) && tries < 4 => tries += 1,
            started => return started,
        }
    }
}

/// [`spawn_redis`], waiting until it answers PING in plaintext.
pub fn start_redis(args: &[OsString]) -> Result<Option<Throwaway>, String> {
    on_a_free_port(|| match spawn_redis(args)? {
        Some(server) => wait_until_answering(server, redis_answers, &["server.log"]).map(Some),
        None => Ok(None),
    })
}

/// A Redis Cluster of the harness's own on 127.0.0.1: three primaries and
/// a replica of each (`redis-cli --cluster create --cluster-replicas 1`),
/// each node durable as the README asks (`appendonly yes`, `appendfsync
/// always`) and failed over 2 s after it stops answering. Dropping it
/// stops every node.
#[derive(Debug)]
pub struct RedisCluster {
    /// `redis+cluster://127.0.0.1:<port>,…`: every node a seed.
    pub url: String,
    /// The nodes, in the order `--cluster create` was given them (the
    /// first three start as primaries).
    pub nodes: Vec<Throwaway>,
}

/// How long a silent node stays a primary (`cluster-node-timeout`): long
/// enough that a node starved of CPU on a loaded machine is not failed
/// over in the middle of an unrelated test (2 s was not).
pub const CLUSTER_NODE_TIMEOUT: Duration = Duration::from_secs(5);

/// The cluster for this test process, as [`redis`]: `DEDUPD_TEST_REDIS_CLUSTER_URL`
/// (a `redis+cluster://` URL that must answer), else one of the harness's
/// own ([`start_redis_cluster`]), else `None` (the caller skips).
pub fn redis_cluster() -> Option<&'static str> {
    /// The URL, and the cluster if the harness started it (held to the end).
    type Found = Option<(String, Option<RedisCluster>)>;
    static CLUSTER: OnceLock<Result<Found, String>> = OnceLock::new();
    let resolved = CLUSTER.get_or_init(|| {
        if let Ok(url) = std::env::var("DEDUPD_TEST_REDIS_CLUSTER_URL") {
            let seed = url
                .replacen("redis+cluster://", "redis://", 1)
                .split(',')
                .next()
                .unwrap_or_default()
                .to_owned();
            redis_answers(&seed).map_err(|error| {
                format!("DEDUPD_TEST_REDIS_CLUSTER_URL={url} does not answer: {error}")
            })?;
            return Ok(Some((url, None)));
        }
        Ok(start_redis_cluster()?.map(|cluster| (cluster.url.clone(), Some(cluster))))
    });
    match resolved {
        Ok(found) => found.as_ref().map(|(url, _)| url.as_str()),
        Err(error) => panic!("{error}"),
    }
}

/// [`redis_cluster`], or a skip saying what to install (the caller returns).
pub fn require_redis_cluster() -> Option<&'static str> {
    let url = redis_cluster();
    if url.is_none() {
        skip_for_store(
            "no Redis Cluster: install redis-server and redis-cli (Debian: apt install redis-server), \
             or set DEDUPD_TEST_REDIS_CLUSTER_URL",
        );
    }
    url
}

/// Starts a [`RedisCluster`]; `Ok(None)` without `redis-server` and
/// `redis-cli`. Returns once every node says `cluster_state:ok` and knows
/// all six, and every replica's link to its primary is up.
pub fn start_redis_cluster() -> Result<Option<RedisCluster>, String> {
    let Some(binaries) = find_binaries(&["redis-server", "redis-cli"]) else {
        return Ok(None);
    };
    let mut nodes = Vec::new();
    for _ in 0..6 {
        // The bus port is its own flag: port + 10 000 may not exist.
        let args: Vec<OsString> = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            &CLUSTER_NODE_TIMEOUT.as_millis().to_string(),
            "--cluster-port",
            &free_port().to_string(),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        match start_redis(&args)? {
            Some(node) => nodes.push(node),
            None => return Ok(None),
        }
    }
    let created = Command::new(binaries.join("redis-cli"))
        .args(["--cluster", "create"])
        .args(nodes.iter().map(|node| format!("127.0.0.1:{}", node.port)))
        .args(["--cluster-replicas", "1", "--cluster-yes"])
        .stdin(Stdio::null())
        .output()
        .map_err(|error| format!("redis-cli --cluster create: {error}"))?;
    if !created.status.success() {
        return Err(format!(
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&created.stdout),
            String::from_utf8_lossy(&created.stderr)
        ));
    }
    let cluster = RedisCluster {
        url: format!(
            "redis+cluster://{}",
            nodes
                .iter()
                .map(|node| format!("127.0.0.1:{}", node.port))
                .collect::<Vec<_>>()
                .join(",")
        ),
        nodes,
    };
    cluster.wait_until_settled(Duration::from_secs(60))?;
    Ok(Some(cluster))
}

impl RedisCluster {
    /// `redis-cli -p <port> <args>`'s output, or why it failed.
    pub fn cli(&self, port: u16, args: &[&str]) -> Result<String, String> {
        let binaries = &self.nodes[0].binaries;
        let output = Command::new(binaries.join("redis-cli"))
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|error| format!("redis-cli: {error}"))?;
        if !output.status.success() {
            return Err(String::from_utf8_lossy(&output.stderr).into_owned());
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Waits until every node that answers says `cluster_state:ok` and
    /// knows the others, and every replica's link is up.
    pub fn wait_until_settled(&self, within: Duration) -> Result<(), String> {
        let started = Instant::now();
        loop {
            let unsettled = self.nodes.iter().find_map(|node| {
                let info = match self.cli(node.port, &["cluster", "info"]) {
                    Ok(info) => info,
                    Err(error) => return Some(format!("{}: {error}", node.port)),
                };
                if !info.contains("cluster_state:ok") || !info.contains("cluster_known_nodes:6") {
                    return Some(format!("{}: {info}", node.port));
                }
                let replication = self.cli(node.port, &["info", "replication"]).ok()?;
                (replication.contains("role:slave")
                    && !replication.contains("master_link_status:up"))
                .then(|| format!("{}: {replication}", node.port))
            });
            match unsettled {
                None => return Ok(()),
                Some(why) if started.elapsed() > within => {
                    return Err(format!(
                        "the cluster did not settle within {within:?}: {why}"
                    ))
                }
                Some(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

/// A fresh directory for a server (removed by its wrapper at the end).
fn server_dir(kind: &str) -> Result<PathBuf, String> {
    tempfile::Builder::new()
        .prefix(&format!("dedupd-test-{kind}-"))
        .tempdir()
        .map(tempfile::TempDir::keep)
        .map_err(|error| format!("a temporary directory: {error}"))
}

/// Who a server runs as when this process is root.
struct User {
    name: String,
    ids: (u32, u32),
}

/// `None` unless this process runs as root; then `postgres`, else `nobody`.
fn unprivileged_user() -> Result<Option<User>, String> {
    // /proc/self belongs to the process's effective user.
    let root = std::fs::metadata("/proc/self").is_ok_and(|meta| meta.uid() == 0);
    if !root {
        return Ok(None);
    }
    for name in ["postgres", "nobody"] {
        let id = |flag: &str| -> Option<u32> {
            let output = Command::new("id").args([flag, name]).output().ok()?;
            String::from_utf8(output.stdout).ok()?.trim().parse().ok()
        };
        if let (Some(uid), Some(gid)) = (id("-u"), id("-g")) {
            return Ok(Some(User {
                name: name.to_owned(),
                ids: (uid, gid),
            }));
        }
    }
    Err(
        "running as root, and neither a postgres nor a nobody user exists to run PostgreSQL as"
            .into(),
    )
}

fn spawn_wrapper(
    script: &str,
    binaries: &Path,
    dir: &Path,
    port: u16,
    args: &[OsString],
    user: Option<&User>,
    url: String,
) -> Result<Throwaway, String> {
    let mut command = match user {
        Some(user) => {
            let mut command = Command::new("runuser");
            command.args(["-u", &user.name, "--", "sh"]);
            command
        }
        None => Command::new("sh"),
    };
    let mut wrapper = command
        .arg("-c")
        .arg(script)
        .arg("sh")
        .args(args)
        .env("BIN", binaries)
        .env("DIR", dir)
        .env("PORT", port.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|error| format!("starting sh for {}: {error}", binaries.display()))?;
    let lifeline = wrapper.stdin.take();
    Ok(Throwaway {
        url,
        port,
        dir: dir.to_owned(),
        binaries: binaries.to_owned(),
        wrapper,
        lifeline,
    })
}

/// Waits (up to 60 s) until `server` answers; else its logs in the error.
fn wait_until_answering(
    mut server: Throwaway,
    answers: fn(&str) -> Result<(), String>,
    logs: &[&str],
) -> Result<Throwaway, String> {
    let started = Instant::now();
    let failure = loop {
        // An exited wrapper first: a stranger on the port is not ours.
        if let Ok(Some(status)) = server.wrapper.try_wait() {
            break format!("it exited ({status})");
        }
        let last = match answers(&server.url) {
            Ok(()) => return Ok(server),
            Err(error) => error,
        };
        // The port was free when picked, and taken since (another test's
        // server, or a connection's local port): the caller picks another.
        let taken = logs.iter().any(|log| {
            std::fs::read_to_string(server.dir.join(log))
                .is_ok_and(|content| content.contains(PORT_TAKEN))
        });
        if taken {
            break format!("its port was taken ({PORT_TAKEN})");
        }
        if started.elapsed() > Duration::from_secs(60) {
            break format!("no answer within 60 s: {last}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut text = format!("{} at {}: {failure}", server.binaries.display(), server.url);
    for log in logs {
        if let Ok(content) = std::fs::read_to_string(server.dir.join(log)) {
            text.push_str(&format!("\n--- {log}:\n{content}"));
        }
    }
    let _ = std::fs::remove_dir_all(&server.dir);
    Err(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_and_redaction() {
        assert_eq!(port_of("postgres://postgres@127.0.0.1:5433/test"), 5433);
        assert_eq!(port_of("postgres://app:pw@db/x?sslmode=require"), 5432);
        assert_eq!(port_of("redis://:secret@127.0.0.1:7000/0"), 7000);
        assert_eq!(port_of("redis://cache"), 6379);
        assert_eq!(
            redact("postgres://app:s3cret@db:5432/x"),
            "postgres://app:***@db:5432/x"
        );
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    }
}
