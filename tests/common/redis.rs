//! The tests' Redis (given, the machine's, or started for the run: see
//! `dedupd-testkit`), one fresh key prefix per test so runs never collide;
//! its keys deleted again by `drop_prefix`.

use std::{sync::Arc, time::Duration};

use dedupd::{
    clock::Clock,
    store::redis::{RedisConfig, RedisStore},
};

/// Whether there is a Redis for the tests; if not, the running test is
/// reported skipped (a failure under `CI=true`) and must return.
pub fn available() -> bool {
    dedupd_testkit::services::require_redis().is_some()
}

/// Where the tests' Redis answers. A test that can run without one asks
/// [`available`] first; here its absence is a failure.
pub fn url() -> &'static str {
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
        replicas: 0,
        allow_eviction: false,
    }
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

/// A plain connection for looking at what the store wrote.
pub async fn connection() -> redis::aio::MultiplexedConnection {
    redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|error| panic!("Redis at {} must answer: {error}", url()))
}

/// Every key under `prefix`.
pub async fn keys(prefix: &str) -> Vec<String> {
    let mut connection = connection().await;
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut connection)
            .await
            .unwrap();
        keys.extend(batch);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
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
