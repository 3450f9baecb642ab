//! The machine's PostgreSQL (127.0.0.1:5432, database `test`), one fresh
//! schema per test so runs never collide; dropped again by `drop_schema`.

use std::time::Duration;

use dedupd::store::postgres::{PostgresConfig, PostgresStore};

pub const URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// A schema name no other test uses.
pub fn fresh_schema() -> String {
    format!("dedupd_test_{:016x}", rand::random::<u64>())
}

pub fn config(schema: &str) -> PostgresConfig {
    PostgresConfig {
        url: URL.to_owned(),
        schema: schema.to_owned(),
        pool_size: 8,
        statement_timeout: Duration::from_secs(5),
        ca_pem: None,
    }
}

/// A store over `schema`, its tables created.
pub async fn store(schema: &str) -> PostgresStore {
    let store = PostgresStore::new(&config(schema)).expect("store");
    store
        .prepare()
        .await
        .expect("PostgreSQL on 127.0.0.1:5432 (database test) must answer");
    store
}

/// Drops `schema` and everything in it.
pub async fn drop_schema(schema: &str) {
    let (client, connection) = tokio_postgres::connect(URL, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let connection = tokio::spawn(connection);
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .await
        .expect("drop schema");
    drop(client);
    let _ = connection.await;
}
