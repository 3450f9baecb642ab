//! The tests' Redis (given, the machine's, or started for the run: see
//! `dedupd-testkit`), one fresh key prefix per test so runs never collide;
//! its keys deleted again by `drop_prefix`. With
//! `DEDUPD_TEST_STORE=redis-cluster`, a Redis Cluster instead (given in
//! `DEDUPD_TEST_REDIS_CLUSTER_URL`, or started for the run). With
//! `DEDUPD_TEST_REDIS_REPLICAS=N`, every call waits for N replicas
//! (`--store-replicas`), which on a cluster fences each call on its key's
//! primary.

use std::{sync::Arc, time::Duration};

use dedupd::{
    clock::{Clock, SystemClock},
    store::redis::{Connection, RedisConfig, RedisStore},
};
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};

/// Whether the suite runs on a Redis Cluster this time.
pub fn on_cluster() -> bool {
    std::env::var("DEDUPD_TEST_STORE").as_deref() == Ok("redis-cluster")
}

/// `--store-replicas` for the suite: `DEDUPD_TEST_REDIS_REPLICAS`, else 0.
pub fn replicas() -> u32 {
    match std::env::var("DEDUPD_TEST_REDIS_REPLICAS") {
        Ok(count) => count
            .parse()
            .unwrap_or_else(|_| panic!("DEDUPD_TEST_REDIS_REPLICAS={count}: not a number")),
        Err(_) => 0,
    }
}

/// Whether there is a Redis for the tests; if not, the running test is
/// reported skipped (a failure under `CI=true`) and must return.
pub fn available() -> bool {
    if on_cluster() {
        return dedupd_testkit::services::require_redis_cluster().is_some();
    }
    dedupd_testkit::services::require_redis().is_some()
}

/// Where the tests' Redis answers. A test that can run without one asks
/// [`available`] first; here its absence is a failure.
pub fn url() -> &'static str {
    if on_cluster() {
        return dedupd_testkit::redis_cluster().expect(
            "this test needs a Redis Cluster and there is none: set DEDUPD_TEST_REDIS_CLUSTER_URL, \
             or install redis-server and redis-cli",
        );
    }
    match dedupd_testkit::redis() {
        Some(service) => &service.url,
        None => panic!(
            "this test needs Redis and there is none: set DEDUPD_TEST_REDIS_URL, \
             run one on 127.0.0.1:6379, or install redis-server"
        ),
    }
}

/// The port it listens on at 127.0.0.1.
pub fn port() -> u16 {
    url();
    dedupd_testkit::redis().map_or(6379, |service| service.port)
}

/// [`url`], reached through `port` on 127.0.0.1 instead (a forwarder).
pub fn url_via(port: u16) -> String {
    let written = format!(":{}", self::port());
    assert!(url().contains(&written), "{} names no port", url());
    url().replacen(&written, &format!(":{port}"), 1)
}

/// A key prefix no other test uses.
pub fn fresh_prefix() -> String {
    format!("dedupd_test_{:016x}", rand::random::<u64>())
}

pub fn config(prefix: &str) -> RedisConfig {
    RedisConfig {
        url: url().to_owned(),
        prefix: prefix.to_owned(),
        connections: 4,
        timeout: Duration::from_secs(5),
        ca_pem: None,
        replicas: replicas(),
        allow_eviction: false,
        cluster: on_cluster(),
    }
}

/// A store under `prefix` reaching the tests' Redis through `port` on
/// 127.0.0.1 (a forwarder), calls bounded at 1 s; nothing contacted yet.
pub fn store_via(port: u16, prefix: &str, clock: Arc<dyn Clock>) -> RedisStore {
    RedisStore::new(
        &RedisConfig {
            url: url_via(port),
            timeout: Duration::from_secs(1),
            ..config(prefix)
        },
        clock,
    )
    .unwrap()
}

/// A store under `prefix`, Redis checked to answer.
pub async fn store(prefix: &str, clock: Arc<dyn Clock>) -> RedisStore {
    let store = RedisStore::new(&config(prefix), clock).expect("store");
    store
        .ping()
        .await
        .unwrap_or_else(|error| panic!("Redis at {} must answer: {error}", url()));
    // What the sidecar's upkeep does at start: health waits for it.
    let refused = store.eviction_refusal().await.expect("INFO memory");
    assert_eq!(refused, None, "the tests' Redis must not evict keys");
    store
}

/// A connection like the store's (to the one Redis, or the cluster: each
/// command goes to its key's primary), for looking at what it wrote.
pub async fn connection() -> Connection {
    RedisStore::new(&config("inspection"), Arc::new(SystemClock))
        .expect("a Redis client")
        .inspection_connection()
}

/// Every key under `prefix`: scanned on every node (each cluster node
/// holds only its slots'), sorted, once each.
pub async fn keys(prefix: &str) -> Vec<String> {
    let mut connection = connection().await;
    let nodes: Vec<RoutingInfo> = match url().strip_prefix("redis+cluster://") {
        Some(hosts) => hosts
            .split(',')
            .map(|host| {
                let (host, port) = host.rsplit_once(':').expect("host:port");
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.to_owned(),
                    port: port.parse().expect("a port"),
                })
            })
            .collect(),
        None => vec![RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random)],
    };
    let mut keys = std::collections::BTreeSet::new();
    for node in nodes {
        let mut cursor: u64 = 0;
        loop {
            let scan = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}:*"))
                .arg("COUNT")
                .arg(1000)
                .clone();
            let answer = match connection.route(scan, node.clone()).await {
                Ok(answer) => answer,
                // A replica: the cluster client keeps connections to the
                // primaries only, which hold every key.
                Err(error) if error.kind() == redis::ErrorKind::ClusterConnectionNotFound => break,
                Err(error) => panic!("SCAN at {}: {error}", url()),
            };
            let (next, batch): (u64, Vec<String>) = redis::from_redis_value(answer).unwrap();
            keys.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    keys.into_iter().collect()
}

/// Deletes every key under `prefix`.
pub async fn drop_prefix(prefix: &str) {
    let mut connection = connection().await;
    for key in keys(prefix).await {
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut connection)
            .await
            .unwrap();
    }
}
