//! The PostgreSQL store: sidecars with their own processes' worth of state
//! (own server, own pool) over one schema behave as one — a claim on one is
//! IN_PROGRESS on the other, a commit on one is DUPLICATE with its response
//! on the other, fencing tokens increase across both, and 64 tasks spread
//! over two sidecars racing for one key get exactly one CLAIMED. Against
//! the machine's PostgreSQL, each test in a schema of its own.

mod common;

use std::sync::Arc;

use common::{postgres, *};
use dedupd::{proto::v1 as pb, store::postgres::PostgresStore};

async fn sidecar(schema: &str) -> TestServer<PostgresStore> {
    TestServer::builder()
        .start_with_store(Arc::new(postgres::store(schema).await))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sidecars_over_one_postgres_behave_as_one() {
    let schema = postgres::fresh_schema();
    let (a, b) = (sidecar(&schema).await, sidecar(&schema).await);
    let (mut on_a, mut on_b) = (a.client().await, b.client().await);

    let claimed = claim(&mut on_a, claim_request("pay-1")).await;
    assert_eq!(outcome(&claimed), pb::ClaimOutcome::Claimed);
    let elsewhere = claim(&mut on_b, claim_request("pay-1")).await;
    assert_eq!(outcome(&elsewhere), pb::ClaimOutcome::InProgress);

    on_a.commit(pb::CommitRequest {
        response: b"transfer 77".to_vec(),
        ..commit_request("pay-1", &claimed.lease_token)
    })
    .await
    .unwrap();
    let duplicate = claim(&mut on_b, claim_request("pay-1")).await;
    assert_eq!(outcome(&duplicate), pb::ClaimOutcome::Duplicate);
    let record = duplicate.record.expect("the committed record");
    assert_eq!(record.response, b"transfer 77");
    assert_eq!(record.fencing_token, claimed.fencing_token);
    // The article's columns, visible through Lookup from either sidecar.
    assert_eq!(record.event_type, "PaymentReceived");
    assert_eq!(record.consumer_version, "1.4.2");
    assert!(record.committed_at.is_some());

    // Fencing tokens increase across both sidecars.
    let mut last = claimed.fencing_token;
    for i in 0..4 {
        let client = if i % 2 == 0 { &mut on_a } else { &mut on_b };
        let next = claim(client, claim_request(&format!("fence-{i}"))).await;
        assert!(
            next.fencing_token > last,
            "{} after {last}",
            next.fencing_token
        );
        last = next.fencing_token;
    }

    // A lease that expired on one sidecar is recovered on the other.
    let held = claim(
        &mut on_a,
        pb::ClaimRequest {
            lease_ttl: seconds(5),
            ..claim_request("pay-2")
        },
    )
    .await;
    a.clock.advance(std::time::Duration::from_secs(6));
    b.clock.advance(std::time::Duration::from_secs(6));
    let recovered = claim(&mut on_b, claim_request("pay-2")).await;
    assert_eq!(outcome(&recovered), pb::ClaimOutcome::Claimed);
    assert!(recovered.recovered);
    assert!(recovered.fencing_token > held.fencing_token);
    assert_eq!(recovered.attempt, 2);
    // The first holder lost its lease to the other sidecar's claim.
    let lost = on_a
        .commit(commit_request("pay-2", &held.lease_token))
        .await
        .unwrap_err();
    assert_eq!(lost.code(), tonic::Code::FailedPrecondition);

    a.stop().await.unwrap();
    b.stop().await.unwrap();
    postgres::drop_schema(&schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_tasks_on_two_sidecars_one_winner() {
    let schema = postgres::fresh_schema();
    let (a, b) = (sidecar(&schema).await, sidecar(&schema).await);
    let (on_a, on_b) = (a.client().await, b.client().await);
    let mut tasks = Vec::new();
    for i in 0..64 {
        let mut client = if i % 2 == 0 {
            on_a.clone()
        } else {
            on_b.clone()
        };
        tasks.push(tokio::spawn(async move {
            outcome(&claim(&mut client, claim_request("contended")).await)
        }));
    }
    let mut claimed = 0;
    for task in tasks {
        match task.await.unwrap() {
            pb::ClaimOutcome::Claimed => claimed += 1,
            pb::ClaimOutcome::InProgress => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(claimed, 1, "exactly one claim wins");
    a.stop().await.unwrap();
    b.stop().await.unwrap();
    postgres::drop_schema(&schema).await;
}

/// N sidecars starting at once migrate the schema once, without errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_starting_together_migrate_once() {
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
    let (client, connection) = tokio_postgres::connect(postgres::URL, tokio_postgres::NoTls)
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
    let schema = postgres::fresh_schema();
    let forwarder = Forwarder::start(5432).await;
    forwarder.cut();
    let store = PostgresStore::new(&dedupd::store::postgres::PostgresConfig {
        url: format!("postgres://postgres@127.0.0.1:{}/test", forwarder.port),
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
    server.stop().await.unwrap();
    postgres::drop_schema(&schema).await;
}

/// TLS to PostgreSQL with rustls: `sslmode=require` against the machine's
/// server (Debian's snakeoil certificate, issued to `localhost`) works when
/// that certificate is trusted, and is refused when another CA is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_postgres_is_verified() {
    const SNAKEOIL: &str = "/etc/ssl/certs/ssl-cert-snakeoil.pem";
    let schema = postgres::fresh_schema();
    let url = "postgres://postgres@localhost:5432/test?sslmode=require".to_owned();
    let trusted = PostgresStore::new(&dedupd::store::postgres::PostgresConfig {
        url: url.clone(),
        ca_pem: Some(std::fs::read(SNAKEOIL).expect("the server's certificate")),
        ..postgres::config(&schema)
    })
    .unwrap();
    trusted
        .prepare()
        .await
        .expect("TLS with the trusted certificate");
    let server = TestServer::builder()
        .start_with_store(Arc::new(trusted))
        .await;
    let mut client = server.client().await;
    assert_eq!(
        outcome(&claim(&mut client, claim_request("over-tls")).await),
        pb::ClaimOutcome::Claimed
    );
    server.stop().await.unwrap();

    let stranger = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let distrusting = PostgresStore::new(&dedupd::store::postgres::PostgresConfig {
        url,
        ca_pem: Some(stranger.cert.pem().into_bytes()),
        ..postgres::config(&schema)
    })
    .unwrap();
    let refused = distrusting.prepare().await.unwrap_err();
    assert!(
        matches!(refused, dedupd::Error::Unavailable(_)),
        "an untrusted certificate is no server: {refused:?}"
    );
    postgres::drop_schema(&schema).await;
}
