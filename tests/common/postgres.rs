//! The tests' PostgreSQL (given, the machine's, or started for the run:
//! see `dedupd-testkit`), one fresh schema per test so runs never collide;
//! dropped again by `drop_schema`.

use std::time::Duration;

use dedupd::store::postgres::{PostgresConfig, PostgresStore};

/// Whether there is a PostgreSQL for the tests; if not, the running test is
/// reported skipped (a failure under `CI=true`) and must return.
pub fn available() -> bool {
    dedupd_testkit::services::require_postgres().is_some()
}

/// Where the tests' PostgreSQL answers. A test that can run without one
/// asks [`available`] first; here its absence is a failure.
pub fn url() -> &'static str {
    match dedupd_testkit::postgres() {
        Some(service) => &service.url,
        None => panic!(
            "this test needs PostgreSQL and there is none: set DEDUPD_TEST_POSTGRES_URL, \
             run one on 127.0.0.1:5432, or install its server (initdb, postgres)"
        ),
    }
}

/// The port it listens on at 127.0.0.1.
pub fn port() -> u16 {
    url();
    dedupd_testkit::postgres().map_or(5432, |service| service.port)
}

/// [`url`], reached through `port` on 127.0.0.1 instead (a forwarder).
pub fn url_via(port: u16) -> String {
    let written = format!(":{}/", self::port());
    assert!(url().contains(&written), "{} names no port", url());
    url().replacen(&written, &format!(":{port}/"), 1)
}

/// A schema name no other test uses.
pub fn fresh_schema() -> String {
    format!("dedupd_test_{:016x}", rand::random::<u64>())
}

pub fn config(schema: &str) -> PostgresConfig {
    PostgresConfig {
        url: url().to_owned(),
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
        .unwrap_or_else(|error| panic!("PostgreSQL at {} must answer: {error}", url()));
    store
}

/// Rows in `schema`'s `processed_events`, counted now.
pub async fn rows(schema: &str) -> usize {
    let (client, connection) = tokio_postgres::connect(url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    let connection = tokio::spawn(connection);
    let count: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM {schema}.processed_events"),
            &[],
        )
        .await
        .expect("count rows")
        .get(0);
    drop(client);
    let _ = connection.await;
    usize::try_from(count).unwrap_or(usize::MAX)
}

/// Drops `schema` and everything in it.
pub async fn drop_schema(schema: &str) {
    let (client, connection) = tokio_postgres::connect(url(), tokio_postgres::NoTls)
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
