//! The Redis store: the shared-store scenarios (tests/common/shared.rs),
//! fencing tokens across expiry, an outage (with the local tier cleared and
//! off while its deletion feed is gone), and what the store leaves in Redis.
//! Against the machine's Redis, each test under a key prefix of its own.

mod common;

use std::{sync::Arc, time::Duration};

use common::{redis, shared, *};
use dedupd::{
    clock::Clock,
    proto::v1 as pb,
    store::{redis::RedisStore, tiered::Tiered},
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sidecars_over_one_redis_behave_as_one() {
    shared::two_sidecars_behave_as_one(Space::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_tasks_on_three_sidecars_one_winner_per_round() {
    shared::sidecars_race_for_one_key(Space::redis()).await;
}

/// Redis expires a record by itself; the next claim of the key still gets a
/// fencing token above every earlier one, from any sidecar.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_after_a_record_expired() {
    let space = Space::redis();
    let Space::Redis(prefix) = &space else {
        unreachable!()
    };
    let (a, b) = (shared::sidecar(&space).await, shared::sidecar(&space).await);
    let (mut on_a, mut on_b) = (a.client().await, b.client().await);
    let mut connection = redis::connection().await;
    let mut last = 0;
    for round in 0..4 {
        let client = if round % 2 == 0 { &mut on_a } else { &mut on_b };
        let claimed = claim(client, claim_request("expiring")).await;
        assert_eq!(
            outcome(&claimed),
            pb::ClaimOutcome::Claimed,
            "round {round}"
        );
        assert_eq!(claimed.attempt, 1, "round {round}: the record was gone");
        assert!(
            claimed.fencing_token > last,
            "round {round}: {} after {last}",
            claimed.fencing_token
        );
        last = claimed.fencing_token;
        // Retention over, by Redis's own clock.
        let key = format!("{prefix}:r:default/expiring");
        let _: () = ::redis::cmd("PEXPIRE")
            .arg(&key)
            .arg(1)
            .query_async(&mut connection)
            .await
            .unwrap();
        for _ in 0..200 {
            let exists: bool = ::redis::cmd("EXISTS")
                .arg(&key)
                .query_async(&mut connection)
                .await
                .unwrap();
            if !exists {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// Redis unreachable at start and going away mid-run: calls are
/// UNAVAILABLE within the store timeout (never CLAIMED), health NOT_SERVING,
/// the local tier cleared and off; all of it recovers by itself when Redis is
/// back, the records intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_is_unavailable_and_recovers_by_itself() {
    let prefix = redis::fresh_prefix();
    let forwarder = Forwarder::start(6379).await;
    forwarder.cut();
    let dir = tempfile::tempdir().unwrap();
    let clock = dedupd::clock::ManualClock::new(START);
    let store = RedisStore::new(
        &dedupd::store::redis::RedisConfig {
            url: format!("redis://127.0.0.1:{}", forwarder.port),
            timeout: Duration::from_secs(1),
            ..redis::config(&prefix)
        },
        Arc::new(clock.clone()) as Arc<dyn Clock>,
    )
    .unwrap();
    let _reconnect = store.keep_connected();
    let tiered = Tiered::open(
        Arc::new(store),
        &shared::local_tier(dir.path()),
        Arc::new(clock.clone()),
        None,
    )
    .unwrap();
    let upkeep = tiered.keep_current();
    let server = TestServer::builder()
        .in_dir(Arc::new(dir), clock)
        .start_with_store(Arc::new(tiered.clone()))
        .await;
    let mut client = server.client().await;

    // Down from the start: NOT_SERVING, calls UNAVAILABLE, the tier off.
    until_health(server.addr, NOT_SERVING).await;
    let refused = client.claim(claim_request("early")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(!tiered.tier_enabled());

    forwarder.restore();
    until_health(server.addr, SERVING).await;
    shared::until_tier_on(&tiered).await;
    let claimed = claim(&mut client, claim_request("pay-1")).await;
    assert_eq!(outcome(&claimed), pb::ClaimOutcome::Claimed);
    claim_and_commit(&mut client, "pay-0", b"done".to_vec())
        .await
        .unwrap();

    // Gone mid-run: within the timeout, UNAVAILABLE; the tier goes off
    // (it can no longer hear deletions) rather than answer from memory.
    forwarder.cut();
    let started = std::time::Instant::now();
    let refused = client.claim(claim_request("pay-2")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    until_health(server.addr, NOT_SERVING).await;
    let off_by = std::time::Instant::now() + 2 * shared::FORGET_WINDOW;
    while tiered.tier_enabled() {
        assert!(std::time::Instant::now() < off_by, "the tier stayed on");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = client.claim(claim_request("pay-0")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");

    // Back: serving again without a restart, the claim still held, the
    // commit still there.
    forwarder.restore();
    until_health(server.addr, SERVING).await;
    shared::until_tier_on(&tiered).await;
    assert_eq!(
        outcome(&claim(&mut client, claim_request("pay-1")).await),
        pb::ClaimOutcome::InProgress
    );
    let duplicate = claim(&mut client, claim_request("pay-0")).await;
    assert_eq!(outcome(&duplicate), pb::ClaimOutcome::Duplicate);
    assert_eq!(duplicate.record.unwrap().response, b"done");
    assert_eq!(
        outcome(&claim(&mut client, claim_request("pay-2")).await),
        pb::ClaimOutcome::Claimed
    );
    server.stop().await.unwrap();
    upkeep.abort();
    redis::drop_prefix(&prefix).await;
}

/// What the store leaves in Redis: one hash per record under the prefix,
/// expiring when its retention ends, nothing else but ordering marks; a
/// Forget removes the record's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_one_expiring_hash_each() {
    let space = Space::redis();
    let Space::Redis(prefix) = &space else {
        unreachable!()
    };
    let server = shared::sidecar(&space).await;
    let mut client = server.client().await;
    let claimed = claim(
        &mut client,
        pb::ClaimRequest {
            lease_ttl: seconds(30),
            retention: seconds(3600),
            ..claim_request("pay-1")
        },
    )
    .await;
    let mut connection = redis::connection().await;
    let key = format!("{prefix}:r:default/pay-1");
    let (bytes, token): (Vec<u8>, String) = ::redis::cmd("HMGET")
        .arg(&key)
        .arg("r")
        .arg("f")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert!(!bytes.is_empty());
    assert_eq!(token, claimed.fencing_token.to_string());
    let ttl: i64 = ::redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut connection)
        .await
        .unwrap();
    // Lease (30 s) plus retention (1 h), by the sidecar's clock.
    assert!((3_629_000..=3_630_000).contains(&ttl), "{ttl}");
    assert_eq!(redis::keys(prefix).await, vec![key.clone()]);
    client
        .forget(pb::ForgetRequest {
            namespace: String::new(),
            correlation_id: "pay-1".into(),
        })
        .await
        .unwrap();
    assert!(redis::keys(prefix).await.is_empty());
    server.stop().await.unwrap();
}

/// `rediss://` with rustls against a redis-server of the test's own
/// speaking TLS only: works when its certificate is trusted
/// (`--store-ca-file`), and is refused — as an unreachable store, never
/// silently in plaintext — when another CA is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_redis_is_verified() {
    let dir = tempfile::tempdir().unwrap();
    let server = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, server.cert.pem()).unwrap();
    std::fs::write(&key, server.signing_key.serialize_pem()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut redis_tls = std::process::Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--tls-port", &port.to_string(), "--tls-auth-clients", "no"])
        .arg("--tls-cert-file")
        .arg(&cert)
        .arg("--tls-key-file")
        .arg(&key)
        .arg("--tls-ca-cert-file")
        .arg(&cert)
        .arg("--dir")
        .arg(dir.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server on PATH");
    let url = format!("rediss://localhost:{port}");
    let clock: Arc<dyn Clock> = Arc::new(dedupd::clock::ManualClock::new(START));
    let trusted = RedisStore::new(
        &dedupd::store::redis::RedisConfig {
            url: url.clone(),
            ca_pem: Some(server.cert.pem().into_bytes()),
            ..redis::config("tls")
        },
        Arc::clone(&clock),
    )
    .unwrap();
    let started = std::time::Instant::now();
    while trusted.ping().await.is_err() {
        assert!(started.elapsed() < Duration::from_secs(10), "no TLS answer");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
    let distrusting = RedisStore::new(
        &dedupd::store::redis::RedisConfig {
            url,
            ca_pem: Some(stranger.cert.pem().into_bytes()),
            ..redis::config("tls")
        },
        clock,
    )
    .unwrap();
    let refused = distrusting.ping().await.unwrap_err();
    assert!(
        matches!(refused, dedupd::Error::Unavailable(_)),
        "an untrusted certificate is no server: {refused:?}"
    );
    redis_tls.kill().unwrap();
    redis_tls.wait().unwrap();
}
