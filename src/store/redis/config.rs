//! How to reach Redis: the configuration (shown without its password), and
//! its URL checked and split into the nodes it names (one primary, a
//! cluster's seed nodes, or the sentinels that name a primary).

use std::{fmt, time::Duration};

/// How to reach Redis.
#[derive(Clone)]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port[/db]` or `rediss://…`, a
    /// cluster's `redis+cluster://h1:p1,h2:p2`, or the sentinels of a
    /// primary, `redis+sentinel://h1:p1,h2:p2/<name>[/db]` (never logged).
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
            .field("url", &crate::store::postgres::redact_url(&self.url))
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
    let shown = crate::store::postgres::redact_url(url);
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

/// Whether `url` names the sentinels of a primary by its scheme.
pub fn is_sentinel_url(url: &str) -> bool {
    url.starts_with("redis+sentinel://") || url.starts_with("rediss+sentinel://")
}

/// What a `redis+sentinel://` URL names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelTarget {
    /// One `redis://` or `rediss://` URL per sentinel, with the URL's
    /// credentials (used for the sentinels and the primary alike).
    pub sentinels: Vec<String>,
    /// The name the sentinels monitor the primary by.
    pub master: String,
    /// The primary's database.
    pub db: i64,
    /// TLS to the sentinels and the primary (`rediss+sentinel://`).
    pub tls: bool,
}

/// Splits `redis+sentinel://[user:password@]h1:p1,h2:p2/<name>[/db]` (or
/// `rediss+sentinel://…`).
pub fn sentinel_target(url: &str) -> Result<SentinelTarget, String> {
    let shown = crate::store::postgres::redact_url(url);
    let (tls, rest) = match url.split_once("://") {
        Some(("redis+sentinel", rest)) => (false, rest),
        Some(("rediss+sentinel", rest)) => (true, rest),
        _ => return Err(format!("{shown} is not a redis+sentinel:// URL")),
    };
    let split = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(split);
    let path = tail.split('?').next().unwrap_or_default().trim_matches('/');
    let (master, db) = match path.split_once('/') {
        Some((master, db)) => (master, db),
        None => (path, "0"),
    };
    if master.is_empty() {
        return Err(format!(
            "{shown}: name the primary the sentinels monitor: redis+sentinel://host1:26379,host2:26379/<name>"
        ));
    }
    let db = db
        .parse::<i64>()
        .ok()
        .filter(|db| *db >= 0)
        .ok_or_else(|| format!("{shown}: {db} is not a database number"))?;
    let scheme = if tls { "rediss" } else { "redis" };
    Ok(SentinelTarget {
        sentinels: hosts(&shown, scheme, authority)?,
        master: master.to_owned(),
        db,
        tls,
    })
}

/// One `<scheme>://` URL per comma-separated host of `authority`, each
/// with its credentials.
fn hosts(shown: &str, scheme: &str, authority: &str) -> Result<Vec<String>, String> {
    let (credentials, hosts) = match authority.rsplit_once('@') {
        Some((credentials, hosts)) => (format!("{credentials}@"), hosts),
        None => (String::new(), authority),
    };
    let hosts: Vec<&str> = hosts.split(',').map(str::trim).collect();
    if hosts.iter().any(|host| host.is_empty()) {
        return Err(format!("{shown}: an empty host in the list of nodes"));
    }
    Ok(hosts
        .into_iter()
        .map(|host| format!("{scheme}://{credentials}{host}"))
        .collect())
}

/// The node URLs `url` names: itself for one primary; for a cluster
/// (`cluster`, or a `+cluster` scheme) one `redis://` or `rediss://` URL
/// per comma-separated host, each with the URL's credentials (a cluster
/// has only database 0); for Sentinel, the sentinels' (see
/// [`sentinel_target`]).
pub fn nodes(url: &str, cluster: bool) -> Result<Vec<String>, String> {
    let shown = crate::store::postgres::redact_url(url);
    if is_sentinel_url(url) {
        if cluster {
            return Err(format!(
                "{shown}: --store-cluster is for a Redis Cluster; Sentinel manages one primary"
            ));
        }
        return Ok(sentinel_target(url)?.sentinels);
    }
    let (scheme, rest) = match url.split_once("://") {
        Some(("redis" | "redis+cluster", rest)) => ("redis", rest),
        Some(("rediss" | "rediss+cluster", rest)) => ("rediss", rest),
        _ => {
            return Err(format!(
                "{shown} is not a redis://, rediss://, redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel:// URL"
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
    let database = tail.split('?').next().unwrap_or_default().trim_matches('/');
    if !(database.is_empty() || database == "0") {
        return Err(format!(
            "{shown}: a Redis Cluster has only database 0, not {database}"
        ));
    }
    hosts(&shown, scheme, authority)
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
    fn sentinel_urls_name_the_sentinels_the_primary_and_its_database() {
        assert_eq!(
            sentinel_target("redis+sentinel://app:s3cret@s1:26379,s2:26380/payments/2").unwrap(),
            SentinelTarget {
                sentinels: vec![
                    "redis://app:s3cret@s1:26379".into(),
                    "redis://app:s3cret@s2:26380".into()
                ],
                master: "payments".into(),
                db: 2,
                tls: false,
            }
        );
        let tls = sentinel_target("rediss+sentinel://s1:26379/mymaster").unwrap();
        assert_eq!(
            (tls.sentinels, tls.master, tls.db, tls.tls),
            (
                vec!["rediss://s1:26379".to_owned()],
                "mymaster".to_owned(),
                0,
                true
            )
        );
        assert!(check_url("redis+sentinel://s1:26379,s2:26379/mymaster", false).is_ok());
        // No name, a bad database, an empty host, --store-cluster: refused,
        // the password never shown.
        for (url, cluster, says) in [
            (
                "redis+sentinel://:s3cret@s1:26379",
                false,
                "name the primary",
            ),
            (
                "redis+sentinel://:s3cret@s1:26379/",
                false,
                "name the primary",
            ),
            (
                "redis+sentinel://:s3cret@s1:26379/m/x",
                false,
                "not a database",
            ),
            ("redis+sentinel://:s3cret@s1:1,,s2:2/m", false, "empty host"),
            (
                "redis+sentinel://:s3cret@s1:26379/m",
                true,
                "--store-cluster",
            ),
        ] {
            let refused = check_url(url, cluster).unwrap_err();
            assert!(refused.contains(says), "{url}: {refused}");
            assert!(!refused.contains("s3cret"), "{refused}");
        }
    }
}
