//! The Redis store: the shared-store scenarios (tests/common/shared.rs),
//! fencing tokens across expiry, an outage (with the local tier cleared and
//! off while its deletion feed is gone), and what the store leaves in Redis.
//! Against the tests' Redis (see `dedupd-testkit`), each test under a key
//! prefix of its own; TLS against a redis-server of the test's own.

mod common;

use std::{sync::Arc, time::Duration};

use common::{redis, shared, *};
use dedupd::{
    clock::Clock,
    proto::v1 as pb,
    store::{redis::RedisStore, tiered::Tiered, Store},
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sidecars_over_one_redis_behave_as_one() {
    if !redis::available() {
        return;
    }
    shared::two_sidecars_behave_as_one(Space::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_tasks_on_three_sidecars_one_winner_per_round() {
    if !redis::available() {
        return;
    }
    shared::sidecars_race_for_one_key(Space::redis()).await;
}

/// Redis expires a record by itself; the next claim of the key still gets a
/// fencing token above every earlier one, from any sidecar.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_after_a_record_expired() {
    if !redis::available() {
        return;
    }
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
    if !redis::available() {
        return;
    }
    let prefix = redis::fresh_prefix();
    let forwarder = Forwarder::start(redis::port()).await;
    forwarder.cut();
    let dir = tempfile::tempdir().unwrap();
    let clock = dedupd::clock::ManualClock::new(START);
    let store = redis::store_via(forwarder.port, &prefix, Arc::new(clock.clone()));
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

    // Gone mid-run: within the timeout (1 s; allowed 8 for a loaded
    // machine, still short of the 10 s request timeout that would answer
    // were the store's own timeout missing), UNAVAILABLE; the tier goes off
    // (it can no longer hear deletions) rather than answer from memory.
    forwarder.cut();
    let started = std::time::Instant::now();
    let refused = client.claim(claim_request("pay-2")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    until_health(server.addr, NOT_SERVING).await;
    let off_by = std::time::Instant::now() + shared::FORGET_WINDOW;
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
/// expiring when its retention ends, nothing else but ordering marks (and,
/// fenced on a cluster, witness keys that expire by themselves); a Forget
/// removes the record's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_one_expiring_hash_each() {
    if !redis::available() {
        return;
    }
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
    assert_eq!(
        records_and_marks(prefix, &mut connection).await,
        vec![key.clone()]
    );
    client
        .forget(pb::ForgetRequest {
            namespace: String::new(),
            correlation_id: "pay-1".into(),
        })
        .await
        .unwrap();
    assert!(records_and_marks(prefix, &mut connection).await.is_empty());
    server.stop().await.unwrap();
}

/// The keys under `prefix` but fence and witness keys, which exist only
/// with `--store-replicas`, each expiring within two store timeouts and
/// 10 s.
async fn records_and_marks(
    prefix: &str,
    connection: &mut dedupd::store::redis::Connection,
) -> Vec<String> {
    let (witnesses, others): (Vec<String>, Vec<String>) = redis::keys(prefix)
        .await
        .into_iter()
        .partition(|key| key.contains(":fence:"));
    if redis::replicas() == 0 {
        assert_eq!(witnesses, Vec::<String>::new(), "fence keys without fences");
    }
    for witness in witnesses {
        let ttl: i64 = ::redis::cmd("PTTL")
            .arg(&witness)
            .query_async(connection)
            .await
            .unwrap();
        // -2: expired since it was listed.
        assert!(
            ttl == -2 || (1..=20_000).contains(&ttl),
            "{witness} lives {ttl} ms"
        );
    }
    others
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
    let port = dedupd_testkit::services::free_port();
    let tls_only: Vec<std::ffi::OsString> = vec![
        "--port".into(),
        "0".into(),
        "--tls-port".into(),
        port.to_string().into(),
        "--tls-auth-clients".into(),
        "no".into(),
        "--tls-cert-file".into(),
        cert.clone().into(),
        "--tls-key-file".into(),
        key.clone().into(),
        "--tls-ca-cert-file".into(),
        cert.clone().into(),
    ];
    let redis_tls = match dedupd_testkit::services::spawn_redis(&tls_only) {
        Ok(Some(server)) => server,
        Ok(None) => {
            return dedupd_testkit::skip_for_store(
                "no redis-server binary to start one speaking TLS (install redis-server)",
            )
        }
        Err(error) => panic!("a redis-server speaking TLS: {error}"),
    };
    let url = format!("rediss://localhost:{port}");
    let clock: Arc<dyn Clock> = Arc::new(dedupd::clock::ManualClock::new(START));
    let trusted = RedisStore::new(
        &dedupd::store::redis::RedisConfig {
            url: url.clone(),
            ca_pem: Some(server.cert.pem().into_bytes()),
            ..tls_config()
        },
        Arc::clone(&clock),
    )
    .unwrap();
    let started = std::time::Instant::now();
    while trusted.ping().await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no TLS answer: {}",
            std::fs::read_to_string(redis_tls.dir.join("server.log")).unwrap_or_default()
        );
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
            ..tls_config()
        },
        clock,
    )
    .unwrap();
    let refused = distrusting.ping().await.unwrap_err();
    assert!(
        matches!(refused, dedupd::Error::Unavailable(_)),
        "an untrusted certificate is no server: {refused:?}"
    );
    tokio::task::spawn_blocking(move || drop(redis_tls))
        .await
        .unwrap();
}

/// Settings for a store on a server of the test's own (not the suite's).
fn tls_config() -> dedupd::store::redis::RedisConfig {
    dedupd::store::redis::RedisConfig {
        url: String::new(),
        prefix: "tls".into(),
        connections: 4,
        timeout: Duration::from_secs(5),
        ca_pem: None,
        replicas: 0,
        allow_eviction: false,
        cluster: false,
    }
}

/// Redis at its `maxmemory` under `noeviction` refuses every write: the
/// store is full — `RESOURCE_EXHAUSTED`, as on a full disk — not a fault
/// of its own; a claim that needs no write (a DUPLICATE) still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_at_its_maxmemory_is_full() {
    let redis_server = match dedupd_testkit::services::start_redis(&[]) {
        Ok(Some(server)) => server,
        Ok(None) => {
            return dedupd_testkit::skip_for_store(
                "no redis-server binary to start one of the test's own (install redis-server)",
            )
        }
        Err(error) => panic!("a redis-server of the test's own: {error}"),
    };
    let clock: Arc<dyn Clock> = Arc::new(dedupd::clock::ManualClock::new(START));
    let store = RedisStore::new(
        &dedupd::store::redis::RedisConfig {
            url: redis_server.url.clone(),
            ..tls_config()
        },
        clock,
    )
    .unwrap();
    assert_eq!(store.eviction_refusal().await.unwrap(), None);
    let sidecar = TestServer::builder()
        .start_with_store(Arc::new(store.clone()))
        .await;
    let mut client = sidecar.client().await;
    claim_and_commit(&mut client, "before-full", b"done".to_vec())
        .await
        .unwrap();

    // Full: Redis's memory is past a maxmemory of 1 byte.
    let mut admin = ::redis::Client::open(redis_server.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = ::redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(1)
        .query_async(&mut admin)
        .await
        .unwrap();
    let refused = client
        .claim(claim_request("while-full"))
        .await
        .expect_err("nothing can be written");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    // Not ready while full (as sled at its disk reserve): store_full = 1.
    assert!(
        matches!(store.writable(), Err(dedupd::Error::DiskFull(_))),
        "{:?}",
        store.writable()
    );
    assert_eq!(
        outcome(&claim(&mut client, claim_request("before-full")).await),
        pb::ClaimOutcome::Duplicate
    );

    let () = ::redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(0)
        .query_async(&mut admin)
        .await
        .unwrap();
    // The next reading of INFO memory (every 5 s) sees the room.
    assert_eq!(store.eviction_refusal().await.unwrap(), None);
    assert!(store.writable().is_ok());
    assert_eq!(
        outcome(&claim(&mut client, claim_request("while-full")).await),
        pb::ClaimOutcome::Claimed
    );
    sidecar.stop().await.unwrap();
    tokio::task::spawn_blocking(move || drop(redis_server))
        .await
        .unwrap();
}

/// Issue 41 item 6: on one primary too, the deletion feed must prove it
/// hears what is published where the writes go. The feed subscribed on a
/// server; the name then leads to another (a failover behind DNS or a
/// fixed address), and the store's connections reconnect there while the
/// subscription stays: every Forget would be published where nobody
/// listens, and the local tier answer DUPLICATE until its max age. The
/// feed's probes are not heard back, and it ends (the tier clears and
/// subscribes again) within a few heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_feed_left_on_an_old_primary_ends() {
    use dedupd::store::shared::DeletionFeed;

    if !redis::available() || redis::on_cluster() {
        return;
    }
    let other = match dedupd_testkit::services::start_redis(&[]) {
        Ok(Some(other)) => other,
        Ok(None) => {
            dedupd_testkit::skip::skip_for_store("no redis-server to start a second Redis");
            return;
        }
        Err(error) => panic!("cannot start a Redis: {error}"),
    };
    let prefix = redis::fresh_prefix();
    let forwarder = Forwarder::start(redis::port()).await;
    let clock = dedupd::clock::ManualClock::new(START);
    let store = redis::store_via(forwarder.port, &prefix, Arc::new(clock));
    let mut feed = store.subscribe().await.expect("subscribed");
    // The subscription is connection 0 (the feed's first probe may have
    // made a data connection already).
    assert!(forwarder.connections() >= 1, "the subscription came first");
    // All on one server: the feed lives (its probes are heard).
    assert!(
        tokio::time::timeout(Duration::from_secs(3), feed.recv())
            .await
            .is_err(),
        "the feed ended (or heard a deletion) while everything was on one server"
    );
    forwarder.switch_to(other.port);
    forwarder.drop_connections_from(1);
    let moved = std::time::Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(15), feed.recv()).await;
    assert!(
        matches!(ended, Ok(None)),
        "the feed still stands on the old primary 15 s after the writes moved: {ended:?}"
    );
    eprintln!(
        "the feed ended {:?} after the writes moved",
        moved.elapsed()
    );
    redis::drop_prefix(&prefix).await;
}
