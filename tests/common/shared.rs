//! Scenarios every shared store must pass (tests/postgres.rs and
//! tests/redis.rs run them): sidecars with their own processes' worth of
//! state (own server, own connections, own local tier) over one space behave
//! as one.

use std::time::{Duration, Instant};

use dedupd::{
    proto::v1 as pb,
    store::{shared::DeletionFeed, tiered::LocalTierConfig},
};

use super::*;

/// A local tier of 8 MiB in `dir`.
pub fn local_tier(dir: &Path) -> LocalTierConfig {
    LocalTierConfig {
        path: dir.join("local-tier"),
        max_bytes: 8 << 20,
        cache_bytes: 8 << 20,
        max_age: Duration::from_secs(600),
    }
}

/// Waits (bounded) until the local tier of `store` is on.
pub async fn until_tier_on<S: Store + DeletionFeed>(store: &Tiered<S>) {
    let started = Instant::now();
    while !store.tier_enabled() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the local tier never came on"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `shared` behind a local tier in `dir`, its deletion feed connected; the
/// task keeping it current, to abort when done.
pub async fn tiered<S: Store + DeletionFeed>(
    shared: S,
    dir: &Path,
    clock: Arc<dyn Clock>,
    observer: Arc<dyn StoreObserver>,
) -> (Tiered<S>, JoinHandle<()>) {
    let store = Tiered::open(Arc::new(shared), &local_tier(dir), clock, Some(observer))
        .expect("local tier");
    let upkeep = store.keep_current();
    until_tier_on(&store).await;
    (store, upkeep)
}

/// A sidecar over `space`, its local tier on.
pub async fn sidecar(space: &Space) -> TestServer {
    TestServer::builder()
        .in_space(Some(space.clone()))
        .start()
        .await
}

/// How often the local tier of `server` answered, by `result` (hit/miss).
pub fn local_tier_lookups(server: &TestServer, result: &str) -> u64 {
    let needle = format!("dedupd_local_tier_lookups_total{{result=\"{result}\"}} ");
    server
        .metrics
        .render()
        .lines()
        .find_map(|line| line.strip_prefix(&needle))
        .map_or(0, |count| count.trim().parse().expect("a count"))
}

/// The longest the tests let a Forget on one sidecar go unseen by another's
/// local tier while the deletion feed is connected. The README promises
/// milliseconds (the notice's delivery) and about 3 s at worst (a silent
/// feed found by its probes); the tests allow more, for a loaded machine,
/// and still fail a tier that never hears the notice (it would answer
/// DUPLICATE until --local-tier-max-age, 10 minutes).
pub const FORGET_WINDOW: Duration = Duration::from_secs(15);

/// A claim on one is IN_PROGRESS on the other, a commit on one is DUPLICATE
/// with its response on the other (then from the other's local tier), a
/// Forget on one lets the other claim again within the window, fencing
/// tokens increase across both, and an expired lease is recovered across.
pub async fn two_sidecars_behave_as_one(space: Space) {
    let (a, b) = (sidecar(&space).await, sidecar(&space).await);
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
    let hits_before = local_tier_lookups(&b, "hit");
    for _ in 0..3 {
        let duplicate = claim(&mut on_b, claim_request("pay-1")).await;
        assert_eq!(outcome(&duplicate), pb::ClaimOutcome::Duplicate);
        let record = duplicate.record.expect("the committed record");
        assert_eq!(record.response, b"transfer 77");
        assert_eq!(record.fencing_token, claimed.fencing_token);
        assert_eq!(record.event_type, "PaymentReceived");
        assert_eq!(record.consumer_version, "1.4.2");
        assert!(record.committed_at.is_some());
    }
    // The first DUPLICATE came from the shared store, the others from B's
    // local tier.
    assert_eq!(local_tier_lookups(&b, "hit") - hits_before, 2);

    // Forget on A reaches B's local tier.
    let forgotten = on_a
        .forget(pb::ForgetRequest {
            namespace: String::new(),
            correlation_id: "pay-1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(forgotten.existed);
    let forgot_at = Instant::now();
    loop {
        let again = claim(&mut on_b, claim_request("pay-1")).await;
        match outcome(&again) {
            pb::ClaimOutcome::Claimed => {
                assert!(again.fencing_token > claimed.fencing_token);
                break;
            }
            pb::ClaimOutcome::Duplicate => assert!(
                forgot_at.elapsed() < FORGET_WINDOW,
                "B still answers from before the Forget after {:?}",
                forgot_at.elapsed()
            ),
            other => panic!("unexpected {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

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
    a.clock.advance(Duration::from_secs(6));
    b.clock.advance(Duration::from_secs(6));
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
}

/// 64 tasks spread over three sidecars race for one key, again and again
/// (the winner releases, the next round races): exactly one CLAIMED per
/// round, and each round's fencing token is above the last.
pub async fn sidecars_race_for_one_key(space: Space) {
    let sidecars = [
        sidecar(&space).await,
        sidecar(&space).await,
        sidecar(&space).await,
    ];
    let mut clients = Vec::new();
    for sidecar in &sidecars {
        clients.push(sidecar.client().await);
    }
    let mut last_fencing = 0;
    for round in 0..5 {
        let mut tasks = Vec::new();
        for i in 0..64 {
            let mut client = clients[i % clients.len()].clone();
            tasks.push(tokio::spawn(async move {
                claim(&mut client, claim_request("contended")).await
            }));
        }
        let mut winners = Vec::new();
        for task in tasks {
            let answer = task.await.unwrap();
            match outcome(&answer) {
                pb::ClaimOutcome::Claimed => winners.push(answer),
                pb::ClaimOutcome::InProgress => {}
                other => panic!("round {round}: unexpected {other:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: exactly one claim wins");
        let winner = winners.pop().unwrap();
        assert!(
            winner.fencing_token > last_fencing,
            "round {round}: fencing {} after {last_fencing}",
            winner.fencing_token
        );
        last_fencing = winner.fencing_token;
        clients[0]
            .release(pb::ReleaseRequest {
                namespace: String::new(),
                correlation_id: "contended".into(),
                lease_token: winner.lease_token,
            })
            .await
            .unwrap();
    }
    for sidecar in sidecars {
        sidecar.stop().await.unwrap();
    }
}
