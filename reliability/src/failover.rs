//! A Redis Cluster primary failed over under load: SIGKILLed, its replica
//! promoted by the cluster itself, then the old primary started again with
//! its own settings, so it rejoins as the new primary's replica. Driven with
//! `redis-cli`, as an operator would; the cluster's nodes run on this
//! machine (their processes are signalled).

use std::time::{Duration, Instant};

use tokio::process::Command;

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
    let pid: u32 = cli(&victim.address, &["info", "server"])
        .await?
        .lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse().ok())
        .ok_or("no process_id in INFO server")?;
    let mut settings = Vec::new();
    for name in KEPT_SETTINGS {
        let answer = cli(&victim.address, &["config", "get", name]).await?;
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
    let mut restart = Command::new("redis-server");
    for (name, value) in &settings {
        restart.arg(format!("--{name}"));
        // `bind` and `save` are lists; every other value is one argument
        // (a `dir` may hold spaces).
        if matches!(name.as_str(), "bind" | "save") && !value.is_empty() {
            restart.args(value.split_whitespace());
        } else {
            restart.arg(value);
        }
    }
    let daemonized = settings
        .iter()
        .any(|(name, value)| name == "daemonize" && value == "yes");
    if daemonized {
        let status = restart
            .status()
            .await
            .map_err(|error| format!("redis-server: {error}"))?;
        if !status.success() {
            return Err(format!("restarting {} failed", victim.address));
        }
    } else {
        // Runs on after this process (the cluster's owner stops it).
        restart
            .stdout(std::process::Stdio::null())
            .spawn()
            .map_err(|error| format!("redis-server: {error}"))?;
    }
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

/// Whether `node` was a replica of the primary `primary_id` before.
fn before_replica_of(before: &[Node], node: &Node, primary_id: &str) -> bool {
    before
        .iter()
        .any(|old| old.id == node.id && !old.primary && old.primary_id == primary_id)
}
