//! A Redis primary failed over under load — a Redis Cluster's, or the one
//! Redis Sentinel names: SIGKILLed, a replica promoted by the cluster or
//! the sentinels themselves, then the old primary started again with its
//! own settings, so it rejoins as the new primary's replica. Driven with
//! `redis-cli`, as an operator would; the nodes run on this machine (their
//! processes are signalled).

use std::time::{Duration, Instant};

use tokio::process::Command;

/// Where failovers are made.
#[derive(Debug, Clone)]
pub enum Target {
    /// A Redis Cluster, asked through this seed node (`host:port`).
    Cluster { seed: String },
    /// The primary the Sentinel at `sentinel` (`host:port`) monitors as
    /// `name`.
    Sentinel { sentinel: String, name: String },
}

impl Target {
    /// Fails one primary over, bounded by `within`.
    pub async fn fail_over(&self, within: Duration) -> Result<Failover, String> {
        match self {
            Target::Cluster { seed } => fail_over_a_primary(seed, within).await,
            Target::Sentinel { sentinel, name } => {
                fail_over_through_sentinel(sentinel, name, within).await
            }
        }
    }
}

/// What one failover did.
#[derive(Debug, Clone)]
pub struct Failover {
    /// `host:port` of the primary killed.
    pub killed: String,
    /// `host:port` of the replica promoted in its place.
    pub promoted: String,
    /// From the SIGKILL until the promoted replica served the slots.
    pub promotion: Duration,
    /// From the SIGKILL until every node said `cluster_state:ok` again, the
    /// old primary back as a replica with its link up.
    pub settled: Duration,
    /// When the SIGKILL was sent (floor, wall-clock ms since the epoch).
    pub killed_at_ms: u64,
}

impl Failover {
    /// When the cluster had settled again (ceil, wall-clock ms).
    pub fn settled_at_ms(&self) -> u64 {
        self.killed_at_ms + self.settled.as_millis() as u64 + 1
    }
}

/// The settings a killed node is started again with (read with `CONFIG
/// GET` before the kill; the rest are Redis's defaults).
const KEPT_SETTINGS: &[&str] = &[
    "port",
    "bind",
    "dir",
    "cluster-enabled",
    "cluster-config-file",
    "cluster-port",
    "cluster-node-timeout",
    "appendonly",
    "appendfsync",
    "appendfilename",
    "appenddirname",
    "save",
    "logfile",
    "pidfile",
    "daemonize",
    "maxmemory",
    "maxmemory-policy",
];

async fn cli(node: &str, args: &[&str]) -> Result<String, String> {
    let (host, port) = node
        .rsplit_once(':')
        .ok_or_else(|| format!("{node} is not host:port"))?;
    let output = tokio::time::timeout(
        Duration::from_secs(10),
        Command::new("redis-cli")
            .args(["-h", host, "-p", port])
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .map_err(|_| {
        format!(
            "redis-cli -p {port} {}: no answer within 10 s",
            args.join(" ")
        )
    })?
    .map_err(|error| format!("redis-cli: {error}"))?;
    if !output.status.success() {
        return Err(format!(
            "redis-cli -p {port} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// One line of `CLUSTER NODES`.
struct Node {
    id: String,
    address: String,
    primary: bool,
    failed: bool,
    primary_id: String,
    slots: bool,
}

async fn nodes(via: &str) -> Result<Vec<Node>, String> {
    Ok(cli(via, &["cluster", "nodes"])
        .await?
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?;
            Some(Node {
                id: fields[0].to_owned(),
                address: fields[1].split('@').next()?.to_owned(),
                primary: flags.contains("master"),
                failed: flags.contains("fail"),
                primary_id: fields.get(3)?.to_string(),
                slots: fields.len() > 8,
            })
        })
        .collect())
}

/// Whether every node of `addresses` that answers says `cluster_state:ok`
/// and every replica's link is up.
async fn settled(addresses: &[String]) -> bool {
    for address in addresses {
        let Ok(info) = cli(address, &["cluster", "info"]).await else {
            return false;
        };
        if !info.contains("cluster_state:ok") {
            return false;
        }
        let Ok(replication) = cli(address, &["info", "replication"]).await else {
            return false;
        };
        if replication.contains("role:slave") && !replication.contains("master_link_status:up") {
            return false;
        }
    }
    true
}

/// Fails over one primary of the cluster `seed` (`host:port`) belongs to:
/// not the seed itself, so it can still be asked. Bounded by `within`.
pub async fn fail_over_a_primary(seed: &str, within: Duration) -> Result<Failover, String> {
    let before = nodes(seed).await?;
    let victim = before
        .iter()
        .find(|node| node.primary && !node.failed && node.slots && node.address != seed)
        .ok_or("no primary to fail over but the seed")?;
    let addresses: Vec<String> = before.iter().map(|node| node.address.clone()).collect();
    let (settings, killed_at, killed_at_ms) = kill(&victim.address).await?;
    // The cluster promotes the replica once the primary is silent for
    // cluster-node-timeout and the other primaries agree.
    let promoted = loop {
        if killed_at.elapsed() > within {
            return Err(format!(
                "no replica of {} promoted within {within:?}",
                victim.address
            ));
        }
        if let Ok(now) = nodes(seed).await {
            if let Some(replica) = now.iter().find(|node| {
                node.primary
                    && !node.failed
                    && node.slots
                    && before_replica_of(&before, node, &victim.id)
            }) {
                break replica.address.clone();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let promotion = killed_at.elapsed();
    restart(&victim.address, &settings, &[]).await?;
    loop {
        if settled(&addresses).await {
            break;
        }
        if killed_at.elapsed() > within {
            return Err(format!(
                "the cluster did not settle within {within:?} after {} was killed",
                victim.address
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Failover {
        killed: victim.address.clone(),
        promoted,
        promotion,
        settled: killed_at.elapsed(),
        killed_at_ms,
    })
}

/// The settings of the server at `address` (see [`KEPT_SETTINGS`]), then
/// SIGKILLs it: the settings, and when it was killed (monotonic, and
/// wall-clock ms since the epoch, floor).
async fn kill(address: &str) -> Result<(Vec<(String, String)>, Instant, u64), String> {
    let pid: u32 = cli(address, &["info", "server"])
        .await?
        .lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse().ok())
        .ok_or("no process_id in INFO server")?;
    let mut settings = Vec::new();
    for name in KEPT_SETTINGS {
        let answer = cli(address, &["config", "get", name]).await?;
        let mut lines = answer.lines();
        if let (Some(_), Some(value)) = (lines.next(), lines.next()) {
            settings.push((name.to_string(), value.to_owned()));
        }
    }
    let killed_at = Instant::now();
    let killed_at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64);
    let status = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .await
        .map_err(|error| format!("kill: {error}"))?;
    if !status.success() {
        return Err(format!("kill -9 {pid} failed"));
    }
    Ok((settings, killed_at, killed_at_ms))
}

/// Starts the server killed at `address` again with its `settings` and
/// `extra` arguments.
async fn restart(
    address: &str,
    settings: &[(String, String)],
    extra: &[&str],
) -> Result<(), String> {
    let mut restart = Command::new("redis-server");
    for (name, value) in settings {
        restart.arg(format!("--{name}"));
        // `bind` and `save` are lists; every other value is one argument
        // (a `dir` may hold spaces).
        if matches!(name.as_str(), "bind" | "save") && !value.is_empty() {
            restart.args(value.split_whitespace());
        } else {
            restart.arg(value);
        }
    }
    restart.args(extra);
    let daemonized = settings
        .iter()
        .any(|(name, value)| name == "daemonize" && value == "yes");
    if daemonized {
        let status = restart
            .status()
            .await
            .map_err(|error| format!("redis-server: {error}"))?;
        if !status.success() {
            return Err(format!("restarting {address} failed"));
        }
    } else {
        // Runs on after this process (the servers' owner stops it).
        restart
            .stdout(std::process::Stdio::null())
            .spawn()
            .map_err(|error| format!("redis-server: {error}"))?;
    }
    Ok(())
}

/// The primary the Sentinel at `sentinel` names `name`, as `host:port`.
async fn named_primary(sentinel: &str, name: &str) -> Result<String, String> {
    let answer = cli(sentinel, &["sentinel", "get-master-addr-by-name", name]).await?;
    let mut lines = answer.lines();
    match (lines.next(), lines.next()) {
        (Some(host), Some(port)) if !host.is_empty() => Ok(format!("{host}:{port}")),
        _ => Err(format!(
            "the sentinel at {sentinel} names no primary {name}: {answer}"
        )),
    }
}

/// Fails over the primary the Sentinel at `sentinel` monitors as `name`:
/// SIGKILLed, one of its replicas promoted by the sentinels, then started
/// again as the new primary's replica. Bounded by `within`.
pub async fn fail_over_through_sentinel(
    sentinel: &str,
    name: &str,
    within: Duration,
) -> Result<Failover, String> {
    let victim = named_primary(sentinel, name).await?;
    let (settings, killed_at, killed_at_ms) = kill(&victim).await?;
    // The sentinels agree it is down after down-after-milliseconds, elect
    // a leader, and promote a replica.
    let promoted = loop {
        if killed_at.elapsed() > within {
            return Err(format!("no replica of {victim} promoted within {within:?}"));
        }
        if let Ok(now) = named_primary(sentinel, name).await {
            if now != victim {
                break now;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let promotion = killed_at.elapsed();
    let (host, port) = promoted
        .rsplit_once(':')
        .ok_or_else(|| format!("{promoted} is not host:port"))?;
    restart(&victim, &settings, &["--replicaof", host, port]).await?;
    // Settled: the old primary replicates the one the sentinels name now
    // (which need not be the first promoted: a second election can follow
    // the first within seconds, and the sentinels reconfigure the old
    // primary to follow it), and every replica of that one is online.
    let settled_on = loop {
        if let Ok(now) = named_primary(sentinel, name).await {
            if now != victim && replica_of(&victim, &now).await && replicas_linked(&now).await {
                break now;
            }
        }
        if killed_at.elapsed() > within {
            return Err(format!(
                "{victim} did not rejoin the primary the sentinels name as its replica within {within:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if settled_on != promoted {
        eprintln!("dedupd-reliability: the sentinels promoted {promoted}, then {settled_on}");
    }
    Ok(Failover {
        killed: victim,
        promoted: settled_on,
        promotion,
        settled: killed_at.elapsed(),
        killed_at_ms,
    })
}

/// Whether the server at `address` is a replica of `primary` (`host:port`)
/// with its link up.
async fn replica_of(address: &str, primary: &str) -> bool {
    let Some((_, port)) = primary.rsplit_once(':') else {
        return false;
    };
    cli(address, &["info", "replication"])
        .await
        .is_ok_and(|info| {
            info.contains("role:slave")
                && info.contains("master_link_status:up")
                && info
                    .lines()
                    .any(|line| line.trim() == format!("master_port:{port}"))
        })
}

/// Whether the primary at `address` has at least two replicas, each
/// `online`.
async fn replicas_linked(address: &str) -> bool {
    cli(address, &["info", "replication"])
        .await
        .is_ok_and(|info| {
            let online = info
                .lines()
                .filter(|line| line.starts_with("slave") && line.contains("state=online"))
                .count();
            info.contains("role:master") && online >= 2
        })
}

/// Whether `node` was a replica of the primary `primary_id` before.
fn before_replica_of(before: &[Node], node: &Node, primary_id: &str) -> bool {
    before
        .iter()
        .any(|old| old.id == node.id && !old.primary && old.primary_id == primary_id)
}
