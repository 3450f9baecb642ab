//! The PostgreSQL store: the shared-store scenarios (tests/common/shared.rs),
//! migrations from many sidecars at once, an outage, reaping together, and
//! TLS. Against the tests' PostgreSQL (see `dedupd-testkit`), each test in a
//! schema of its own; TLS against a server of the test's own.

mod common;

use std::{str::FromStr, sync::Arc};

use common::{postgres, shared, *};
use dedupd::{proto::v1 as pb, store::postgres::PostgresStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sidecars_over_one_postgres_behave_as_one() {
    if !postgres::available() {
        return;
    }
    shared::two_sidecars_behave_as_one(Space::postgres()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_tasks_on_three_sidecars_one_winner_per_round() {
    if !postgres::available() {
        return;
    }
    shared::sidecars_race_for_one_key(Space::postgres()).await;
}

/// N sidecars starting at once migrate the schema once, without errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_starting_together_migrate_once() {
    if !postgres::available() {
        return;
    }
    let schema = postgres::fresh_schema();
    let stores: Vec<_> = (0..6)
        .map(|_| PostgresStore::new(&postgres::config(&schema)).unwrap())
        .collect();
    let prepared: Vec<_> = stores
        .iter()
        .map(|store| {
            let store = store.clone();
            tokio::spawn(async move { store.prepare().await })
        })
        .collect();
    for task in prepared {
        task.await
            .unwrap()
            .expect("every sidecar finds the schema ready");
    }
    let (client, connection) = tokio_postgres::connect(postgres::url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let versions: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM {schema}.schema_version"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(versions, 1);
    drop(client);
    postgres::drop_schema(&schema).await;
}

/// PostgreSQL unreachable at start and going away mid-run: calls are
/// UNAVAILABLE (never CLAIMED), health NOT_SERVING, and the sidecar recovers
/// by itself when the server is back, its records intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_postgres_is_unavailable_and_recovers_by_itself() {
    if !postgres::available() {
        return;
    }
    let schema = postgres::fresh_schema();
    let forwarder = Forwarder::start(postgres::port()).await;
    forwarder.cut();
    let store = PostgresStore::new(&dedupd::store::postgres::PostgresConfig {
        url: postgres::url_via(forwarder.port),
        statement_timeout: std::time::Duration::from_secs(1),
        ..postgres::config(&schema)
    })
    .unwrap();
    let _upkeep = store.keep_connected();
    let server = TestServer::builder()
        .start_with_store(Arc::new(store))
        .await;
    let mut client = server.client().await;

    // Down from the start: NOT_SERVING, calls UNAVAILABLE.
    until_health(server.addr, NOT_SERVING).await;
    let refused = client.claim(claim_request("early")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");

    forwarder.restore();
    until_health(server.addr, SERVING).await;
    let claimed = claim(&mut client, claim_request("pay-1")).await;
    assert_eq!(outcome(&claimed), pb::ClaimOutcome::Claimed);

    // Gone mid-run.
    forwarder.cut();
    let started = std::time::Instant::now();
    let refused = client.claim(claim_request("pay-2")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    until_health(server.addr, NOT_SERVING).await;

    // Back: serving again without a restart, the claim still held.
    forwarder.restore();
    until_health(server.addr, SERVING).await;
    assert_eq!(
        outcome(&claim(&mut client, claim_request("pay-1")).await),
        pb::ClaimOutcome::InProgress
    );
    assert_eq!(
        outcome(&claim(&mut client, claim_request("pay-2")).await),
        pb::ClaimOutcome::Claimed
    );
    server.stop().await.unwrap();
    postgres::drop_schema(&schema).await;
}

/// Expired rows are reaped in small batches, from two sidecars at once,
/// harmlessly: every expired row goes, live ones stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sidecars_reap_together_harmlessly() {
    if !postgres::available() {
        return;
    }
    use dedupd::{clock::UnixMillis, store::Store};

    let schema = postgres::fresh_schema();
    let (a, b) = (
        postgres::store(&schema).await,
        postgres::store(&schema).await,
    );
    let server = TestServer::builder()
        .start_with_store(Arc::new(a.clone()))
        .await;
    let mut client = server.client().await;
    for i in 0..50 {
        let claimed = claim(
            &mut client,
            pb::ClaimRequest {
                retention: seconds(60),
                ..claim_request(&format!("old-{i}"))
            },
        )
        .await;
        client
            .commit(commit_request(&format!("old-{i}"), &claimed.lease_token))
            .await
            .unwrap();
    }
    let keeper = claim(&mut client, claim_request("keep")).await;
    assert_eq!(outcome(&keeper), pb::ClaimOutcome::Claimed);
    // An hour on, the 50 commits are expired; the claim with the default
    // retention (7 days) is not.
    let later = UnixMillis(START.0 + 3_600_000);
    let (from_a, from_b) = tokio::join!(
        async {
            let mut removed = 0;
            loop {
                let pass = a.reap(later, 7).await.unwrap();
                removed += pass.removed;
                if pass.examined < 7 {
                    return removed;
                }
            }
        },
        async {
            let mut removed = 0;
            loop {
                let pass = b.reap(later, 7).await.unwrap();
                removed += pass.removed;
                if pass.examined < 7 {
                    return removed;
                }
            }
        }
    );
    assert_eq!(from_a + from_b, 50, "each expired row removed once");
    assert_eq!(a.stats().await.records, Some(1));
    let keep = dedupd::api::Limits::default().key("", "keep").unwrap();
    assert!(b.get(&keep).await.unwrap().is_some());
    // /metrics' figure is counted once per 30 s, not at every scrape of
    // every pod: gone from the table, still in the cached figure.
    b.update(&keep, |_, _| Ok((dedupd::machine::Change::Delete, ())))
        .await
        .unwrap();
    assert_eq!(a.count().await.records, Some(0));
    assert_eq!(a.stats().await.records, Some(1), "counted again");
    server.stop().await.unwrap();
    postgres::drop_schema(&schema).await;
}

/// TLS to PostgreSQL with rustls: `sslmode=require` against a server of
/// the test's own with a certificate issued to `localhost` works when that
/// certificate is trusted (`--store-ca-file`), and is refused — as an
/// unreachable store, never silently in plaintext — when another CA is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_postgres_is_verified() {
    let certificate = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let started = tokio::task::spawn_blocking({
        let (cert, key) = (
            certificate.cert.pem(),
            certificate.signing_key.serialize_pem(),
        );
        move || dedupd_testkit::services::start_postgres_tls(cert.as_bytes(), key.as_bytes())
    })
    .await
    .unwrap();
    let server = match started {
        Ok(Some(server)) => server,
        Ok(None) => {
            return dedupd_testkit::skip_for_store(
                "no PostgreSQL server binaries (initdb, postgres) to start one speaking TLS",
            )
        }
        Err(error) => panic!("a PostgreSQL speaking TLS: {error}"),
    };
    let schema = postgres::fresh_schema();
    let url = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=require",
        server.port
    );
    let trusted = PostgresStore::new(&dedupd::store::postgres::PostgresConfig {
        url: url.clone(),
        ca_pem: Some(certificate.cert.pem().into_bytes()),
        schema: schema.clone(),
        ..tls_config()
    })
    .unwrap();
    trusted
        .prepare()
        .await
        .expect("TLS with the trusted certificate");
    let sidecar = TestServer::builder()
        .start_with_store(Arc::new(trusted))
        .await;
    let mut client = sidecar.client().await;
    assert_eq!(
        outcome(&claim(&mut client, claim_request("over-tls")).await),
        pb::ClaimOutcome::Claimed
    );
    sidecar.stop().await.unwrap();

    let stranger = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let distrusting = PostgresStore::new(&dedupd::store::postgres::PostgresConfig {
        url,
        ca_pem: Some(stranger.cert.pem().into_bytes()),
        schema,
        ..tls_config()
    })
    .unwrap();
    let refused = distrusting.prepare().await.unwrap_err();
    assert!(
        matches!(refused, dedupd::Error::Unavailable(_)),
        "an untrusted certificate is no server: {refused:?}"
    );
    tokio::task::spawn_blocking(move || drop(server))
        .await
        .unwrap();
}

/// Settings for a store on a server of the test's own (not the suite's).
fn tls_config() -> dedupd::store::postgres::PostgresConfig {
    dedupd::store::postgres::PostgresConfig {
        url: String::new(),
        schema: String::new(),
        pool_size: 4,
        statement_timeout: std::time::Duration::from_secs(5),
        ca_pem: None,
    }
}

/// Behind PgBouncer in transaction mode (its usual setting) LISTEN succeeds
/// and hears nothing: the listening server session goes back to the pool.
/// The deletion feed proves itself with a probe sent from a pooled
/// connection, so it refuses to subscribe (the local tier stays off, with a
/// warning) instead of keeping records whose Forget it would never hear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_behind_a_transaction_pooler_is_refused() {
    use dedupd::store::shared::DeletionFeed;

    if !postgres::available() {
        return;
    }
    let Some(pgbouncer) = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
        .into_iter()
        .find(|path| std::path::Path::new(path).exists())
    else {
        dedupd_testkit::skip::skip("PgBouncer is missing: apt-get install pgbouncer");
        return;
    };
    let target = tokio_postgres::Config::from_str(postgres::url()).unwrap();
    let database = target.get_dbname().unwrap_or("postgres").to_owned();
    let user = target.get_user().unwrap_or("postgres").to_owned();
    let dir = tempfile::tempdir().unwrap();
    // PgBouncer refuses to run as root; as root it runs as postgres, which
    // must reach its directory.
    let root = running_as_root();
    if root {
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
    }
    let port = dedupd_testkit::services::free_port();
    let ini = dir.path().join("pgbouncer.ini");
    std::fs::write(
        &ini,
        format!(
            "[databases]\n{database} = host=127.0.0.1 port={} dbname={database} user={user}\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nauth_type = any\n\
             pool_mode = transaction\nunix_socket_dir =\nlogfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\nignore_startup_parameters = extra_float_digits,options\n",
            postgres::port(),
            dir = dir.path().display(),
        ),
    )
    .unwrap();
    let mut command = if root {
        let mut command = std::process::Command::new("runuser");
        command.args(["-u", "postgres", "--", pgbouncer]);
        command
    } else {
        std::process::Command::new(pgbouncer)
    };
    let mut bouncer = command
        .arg(&ini)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start pgbouncer");
    let started = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "PgBouncer never listened: {}",
            std::fs::read_to_string(dir.path().join("pgbouncer.log")).unwrap_or_default()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let schema = postgres::fresh_schema();
    let through_pooler = PostgresStore::new(&dedupd::store::postgres::PostgresConfig {
        url: postgres::url_via(port),
        ..postgres::config(&schema)
    })
    .unwrap();
    let refused = through_pooler
        .subscribe()
        .await
        .expect_err("LISTEN through a transaction pooler hears nothing");
    assert!(
        refused.to_string().contains("connection pooler"),
        "{refused}"
    );
    // The same feed straight to PostgreSQL proves itself.
    let direct = postgres::store(&schema).await;
    direct
        .subscribe()
        .await
        .expect("a direct LISTEN hears its probe");
    let _ = bouncer.kill();
    let _ = bouncer.wait();
    postgres::drop_schema(&schema).await;
}

/// Whether this process runs as root (the owner of /proc/self).
fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|meta| meta.uid() == 0)
}
