//! The machine's Redis (127.0.0.1:6379), one fresh key prefix per test so
//! runs never collide; its keys deleted again by `drop_prefix`.

use std::{sync::Arc, time::Duration};

use dedupd::{
    clock::Clock,
    store::redis::{RedisConfig, RedisStore},
};

pub const URL: &str = "redis://127.0.0.1:6379";

/// A key prefix no other test uses.
pub fn fresh_prefix() -> String {
    format!("dedupd_test_{:016x}", rand::random::<u64>())
}

pub fn config(prefix: &str) -> RedisConfig {
    RedisConfig {
        url: URL.to_owned(),
        prefix: prefix.to_owned(),
        connections: 4,
        timeout: Duration::from_secs(5),
        ca_pem: None,
    }
}

/// A store under `prefix`, Redis checked to answer.
pub async fn store(prefix: &str, clock: Arc<dyn Clock>) -> RedisStore {
    let store = RedisStore::new(&config(prefix), clock).expect("store");
    store
        .ping()
        .await
        .expect("Redis on 127.0.0.1:6379 must answer");
    store
}

/// A plain connection for looking at what the store wrote.
pub async fn connection() -> redis::aio::MultiplexedConnection {
    redis::Client::open(URL)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("Redis on 127.0.0.1:6379 must answer")
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
