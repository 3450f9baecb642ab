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

/// A loopback TCP forwarder to the machine's PostgreSQL that a test can cut
/// (every connection dropped, new ones closed at once) and restore: the
/// server "goes away" and "comes back" without touching the real one.
pub struct Forwarder {
    pub port: u16,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    generation: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
    _task: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    pub async fn start() -> Forwarder {
        use std::sync::{
            atomic::{AtomicBool, Ordering},
            Arc,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = Arc::new(AtomicBool::new(true));
        let generation = Arc::new(tokio::sync::watch::Sender::new(0u64));
        let task = {
            let (open, generation) = (Arc::clone(&open), Arc::clone(&generation));
            tokio::spawn(async move {
                loop {
                    let Ok((mut inbound, _)) = listener.accept().await else {
                        continue;
                    };
                    if !open.load(Ordering::SeqCst) {
                        continue; // dropped: the connection closes at once
                    }
                    let mut cut = generation.subscribe();
                    tokio::spawn(async move {
                        let Ok(mut outbound) =
                            tokio::net::TcpStream::connect("127.0.0.1:5432").await
                        else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = cut.changed() => {}
                        }
                    });
                }
            })
        };
        Forwarder {
            port,
            open,
            generation,
            _task: task,
        }
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/test", self.port)
    }

    /// PostgreSQL goes away: live connections drop, new ones are refused.
    pub fn cut(&self) {
        self.open.store(false, std::sync::atomic::Ordering::SeqCst);
        self.generation.send_modify(|generation| *generation += 1);
    }

    /// PostgreSQL is back.
    pub fn restore(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}
