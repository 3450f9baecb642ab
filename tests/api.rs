//! Every outcome of the API over the wire, against the real server on
//! 127.0.0.1:0 with a sled store in a temporary directory and a manual clock.

mod common;

use std::{collections::HashSet, time::Duration};

use common::*;
use dedupd::proto::v1 as pb;
use pb::ClaimOutcome as Outcome;
use tonic::Code;
use tonic_types::StatusExt;

#[tokio::test]
async fn claim_commit_then_redelivery_is_duplicate_with_cached_response() {
    let server = TestServer::start().await;
    let mut client = server.client().await;

    let first = claim(&mut client, claim_request("pay-1")).await;
    assert_eq!(outcome(&first), Outcome::Claimed);
    assert_eq!(first.attempt, 1);
    assert!(!first.recovered);
    assert_eq!(first.lease_token.len(), 32);
    assert!(first.fencing_token > 0);

    let committed = client
        .commit(pb::CommitRequest {
            response: b"transfer 42".to_vec(),
            ..commit_request("pay-1", &first.lease_token)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(committed.outcome, pb::CommitOutcome::Committed as i32);

    let redelivered = claim(&mut client, claim_request("pay-1")).await;
    assert_eq!(outcome(&redelivered), Outcome::Duplicate);
    assert_eq!(redelivered.fencing_token, first.fencing_token);
    let record = redelivered.record.expect("duplicate carries the record");
    assert_eq!(record.response, b"transfer 42");
    assert_eq!(record.state, pb::RecordState::Committed as i32);
    assert_eq!(record.event_type, "PaymentReceived");
    assert_eq!(record.consumer_version, "1.4.2");
    assert!(record.committed_at.is_some());

    // Commit is idempotent: a client retrying after a lost answer is fine.
    let retried = client
        .commit(commit_request("pay-1", &first.lease_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(retried.outcome, pb::CommitOutcome::AlreadyCommitted as i32);
    assert_eq!(retried.record.unwrap().response, b"transfer 42");

    // The article's processed_events columns, through Lookup.
    let lookup = client
        .lookup(pb::LookupRequest {
            namespace: String::new(),
            correlation_id: "pay-1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(lookup.found);
    let record = lookup.record.unwrap();
    assert_eq!(record.namespace, "default");
    assert_eq!(record.correlation_id, "pay-1");
    assert_eq!(record.event_type, "PaymentReceived");
    assert_eq!(record.consumer_version, "1.4.2");
    assert_eq!(record.owner, "pod-a");
    let processed_at = record.committed_at.expect("processed_at");
    assert_eq!(processed_at.seconds as u64 * 1000, START.0);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn live_lease_is_in_progress_and_expired_lease_is_recovered() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let request = pb::ClaimRequest {
        lease_ttl: seconds(10),
        ..claim_request("pay-2")
    };
    let first = claim(&mut client, request.clone()).await;
    assert_eq!(outcome(&first), Outcome::Claimed);

    server.clock.advance(Duration::from_secs(4));
    let busy = claim(&mut client, request.clone()).await;
    assert_eq!(outcome(&busy), Outcome::InProgress);
    assert_eq!(busy.retry_after, seconds(6));
    assert!(
        busy.lease_token.is_empty(),
        "no token leaks to a refused claimer"
    );

    // The holder dies; its lease runs out.
    server.clock.advance(Duration::from_secs(6));
    let second = claim(&mut client, request.clone()).await;
    assert_eq!(outcome(&second), Outcome::Claimed);
    assert!(second.recovered, "the previous holder may have written");
    assert_eq!(second.attempt, 2);
    assert!(second.fencing_token > first.fencing_token);
    assert_ne!(second.lease_token, first.lease_token);

    // The zombie wakes up and tries to commit: refused, with LEASE_LOST.
    let zombie = client
        .commit(commit_request("pay-2", &first.lease_token))
        .await
        .unwrap_err();
    assert_eq!(zombie.code(), Code::FailedPrecondition);
    let info = zombie.get_error_details();
    assert_eq!(info.error_info().unwrap().reason, "LEASE_LOST");

    let committed = client
        .commit(commit_request("pay-2", &second.lease_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(committed.record.unwrap().attempt, 2);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn late_commit_by_the_holder_wins_if_nobody_reclaimed() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let first = claim(&mut client, claim_request("pay-3")).await;
    server.clock.advance(Duration::from_secs(120));
    let committed = client
        .commit(commit_request("pay-3", &first.lease_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(committed.outcome, pb::CommitOutcome::Committed as i32);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn release_makes_the_key_claimable_at_once_and_keeps_attempts() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let first = claim(&mut client, claim_request("pay-4")).await;
    let release = |token: &str| pb::ReleaseRequest {
        namespace: String::new(),
        correlation_id: "pay-4".into(),
        lease_token: token.to_owned(),
    };
    let released = client
        .release(release(&first.lease_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(released.outcome, pb::ReleaseOutcome::Released as i32);
    let again = client
        .release(release(&first.lease_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.outcome, pb::ReleaseOutcome::AlreadyReleased as i32);

    let second = claim(&mut client, claim_request("pay-4")).await;
    assert_eq!(outcome(&second), Outcome::Claimed);
    assert_eq!(second.attempt, 2);
    assert!(!second.recovered, "a release is not a crash");

    // Releasing someone else's claim is refused.
    let stolen = client
        .release(release(&first.lease_token))
        .await
        .unwrap_err();
    assert_eq!(stolen.code(), Code::FailedPrecondition);
    // ALREADY_RELEASED is for the token that released it, not for any token.
    client.release(release(&second.lease_token)).await.unwrap();
    let other_token = client
        .release(release(&first.lease_token))
        .await
        .unwrap_err();
    assert_eq!(other_token.code(), Code::FailedPrecondition);

    let absent = client
        .release(pb::ReleaseRequest {
            correlation_id: "never-claimed".into(),
            ..release(&first.lease_token)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(absent.outcome, pb::ReleaseOutcome::NotFound as i32);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn renew_keeps_a_long_job_from_being_reclaimed() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let request = pb::ClaimRequest {
        lease_ttl: seconds(10),
        ..claim_request("pay-5")
    };
    let first = claim(&mut client, request.clone()).await;
    server.clock.advance(Duration::from_secs(8));
    let renewed = client
        .renew(pb::RenewRequest {
            namespace: String::new(),
            correlation_id: "pay-5".into(),
            lease_token: first.lease_token.clone(),
            lease_ttl: seconds(10),
        })
        .await
        .unwrap()
        .into_inner();
    let expires = renewed.lease_expires_at.unwrap();
    assert_eq!(expires.seconds as u64 * 1000, START.0 + 18_000);

    server.clock.advance(Duration::from_secs(5));
    assert_eq!(
        outcome(&claim(&mut client, request.clone()).await),
        Outcome::InProgress
    );
    server.clock.advance(Duration::from_secs(5));
    let taken = claim(&mut client, request).await;
    assert_eq!(outcome(&taken), Outcome::Claimed);
    assert!(taken.recovered);

    let lost = client
        .renew(pb::RenewRequest {
            namespace: String::new(),
            correlation_id: "pay-5".into(),
            lease_token: first.lease_token,
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(lost.code(), Code::FailedPrecondition);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn reused_correlation_id_with_other_payload_is_fingerprint_mismatch() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let with = |fingerprint: &str| pb::ClaimRequest {
        payload_fingerprint: fingerprint.to_owned(),
        ..claim_request("pay-6")
    };
    let first = claim(&mut client, with("sha256:aaa")).await;
    client
        .commit(commit_request("pay-6", &first.lease_token))
        .await
        .unwrap();
    let other = claim(&mut client, with("sha256:bbb")).await;
    assert_eq!(outcome(&other), Outcome::FingerprintMismatch);
    assert_eq!(other.record.unwrap().payload_fingerprint, "sha256:aaa");
    let same = claim(&mut client, with("sha256:aaa")).await;
    assert_eq!(outcome(&same), Outcome::Duplicate);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn ordering_trap_late_degraded_after_failed_is_stale() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let status = |id: &str, sequence: u64| pb::ClaimRequest {
        event_type: "StatusUpdated".into(),
        ordering_key: "link-42".into(),
        sequence: Some(sequence),
        ..claim_request(id)
    };
    // StatusUpdated:failed (seq 2) arrives first and is processed.
    let failed = claim(&mut client, status("status-failed", 2)).await;
    assert_eq!(outcome(&failed), Outcome::Claimed);
    client
        .commit(commit_request("status-failed", &failed.lease_token))
        .await
        .unwrap();
    // StatusUpdated:degraded (seq 1) arrives late: refused, nothing claimed.
    let degraded = claim(&mut client, status("status-degraded", 1)).await;
    assert_eq!(outcome(&degraded), Outcome::Stale);
    assert_eq!(degraded.highest_committed_sequence, 2);
    let lookup = client
        .lookup(pb::LookupRequest {
            namespace: String::new(),
            correlation_id: "status-degraded".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!lookup.found, "a stale claim leaves no record");
    // The same sequence again is stale too; a later one goes through.
    assert_eq!(
        outcome(&claim(&mut client, status("status-x", 2)).await),
        Outcome::Stale
    );
    assert_eq!(
        outcome(&claim(&mut client, status("status-y", 3)).await),
        Outcome::Claimed
    );
    // Ordering keys are per namespace.
    let elsewhere = claim(
        &mut client,
        pb::ClaimRequest {
            namespace: "other".into(),
            ..status("status-degraded", 1)
        },
    )
    .await;
    assert_eq!(outcome(&elsewhere), Outcome::Claimed);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn retention_expiry_makes_a_key_new_and_forget_does_it_on_purpose() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let first = claim(&mut client, claim_request("pay-7")).await;
    client
        .commit(pb::CommitRequest {
            retention: seconds(3600),
            ..commit_request("pay-7", &first.lease_token)
        })
        .await
        .unwrap();
    server.clock.advance(Duration::from_secs(3599));
    assert_eq!(
        outcome(&claim(&mut client, claim_request("pay-7")).await),
        Outcome::Duplicate
    );
    server.clock.advance(Duration::from_secs(1));
    let fresh = claim(&mut client, claim_request("pay-7")).await;
    assert_eq!(outcome(&fresh), Outcome::Claimed);
    assert_eq!(fresh.attempt, 1, "an expired record is absent");

    let forget = pb::ForgetRequest {
        namespace: String::new(),
        correlation_id: "pay-7".into(),
    };
    assert!(
        client
            .forget(forget.clone())
            .await
            .unwrap()
            .into_inner()
            .existed
    );
    assert!(!client.forget(forget).await.unwrap().into_inner().existed);
    let again = claim(&mut client, claim_request("pay-7")).await;
    assert_eq!((outcome(&again), again.attempt), (Outcome::Claimed, 1));
    server.stop().await.unwrap();
}

#[tokio::test]
async fn namespaces_keep_consumers_apart_and_have_their_own_retention() {
    let server = TestServer::start_with(|config| {
        config
            .limits
            .namespace_retention
            .insert("short".into(), Duration::from_secs(60));
    })
    .await;
    let mut client = server.client().await;
    for namespace in ["", "billing", "short"] {
        let response = claim(
            &mut client,
            pb::ClaimRequest {
                namespace: namespace.into(),
                ..claim_request("shared-id")
            },
        )
        .await;
        assert_eq!(
            outcome(&response),
            Outcome::Claimed,
            "namespace {namespace:?}"
        );
        let committed = client
            .commit(pb::CommitRequest {
                namespace: namespace.into(),
                ..commit_request("shared-id", &response.lease_token)
            })
            .await
            .unwrap()
            .into_inner();
        let record = committed.record.unwrap();
        let retained = record.retain_until.unwrap().seconds - record.committed_at.unwrap().seconds;
        let expected = if namespace == "short" {
            60
        } else {
            7 * 24 * 3600
        };
        assert_eq!(retained, expected, "namespace {namespace:?}");
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn batches_of_500_claim_commit_and_release_in_one_call_each() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let ids: Vec<String> = (0..500).map(|i| format!("batch-{i}")).collect();
    let claims = pb::ClaimBatchRequest {
        items: ids.iter().map(|id| claim_request(id)).collect(),
    };
    let claimed = client
        .claim_batch(claims.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(claimed.results.len(), 500);
    assert!(claimed
        .results
        .iter()
        .all(|r| outcome(r) == Outcome::Claimed));
    let fencing: HashSet<u64> = claimed.results.iter().map(|r| r.fencing_token).collect();
    assert_eq!(fencing.len(), 500, "fencing tokens never repeat");

    // Commit the first 400 (one with a wrong token), release the rest.
    let mut commits: Vec<pb::CommitRequest> = ids[..400]
        .iter()
        .zip(&claimed.results)
        .map(|(id, r)| commit_request(id, &r.lease_token))
        .collect();
    commits[7].lease_token = claimed.results[8].lease_token.clone();
    let committed = client
        .commit_batch(pb::CommitBatchRequest { items: commits })
        .await
        .unwrap()
        .into_inner();
    let lost: Vec<usize> = committed
        .results
        .iter()
        .enumerate()
        .filter(|(_, r)| r.outcome == pb::CommitOutcome::LeaseLost as i32)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        lost,
        vec![7],
        "a lost lease is an item outcome, not an error"
    );

    let releases = ids[400..]
        .iter()
        .zip(&claimed.results[400..])
        .map(|(id, r)| pb::ReleaseRequest {
            namespace: String::new(),
            correlation_id: id.clone(),
            lease_token: r.lease_token.clone(),
        })
        .collect();
    let released = client
        .release_batch(pb::ReleaseBatchRequest { items: releases })
        .await
        .unwrap()
        .into_inner();
    assert!(released
        .results
        .iter()
        .all(|r| r.outcome == pb::ReleaseOutcome::Released as i32));

    let again = client.claim_batch(claims).await.unwrap().into_inner();
    let outcomes: Vec<Outcome> = again.results.iter().map(outcome).collect();
    assert!(outcomes[..400].iter().enumerate().all(|(i, o)| *o
        == if i == 7 {
            Outcome::InProgress
        } else {
            Outcome::Duplicate
        }));
    assert!(outcomes[400..].iter().all(|o| *o == Outcome::Claimed));
    server.stop().await.unwrap();
}

#[tokio::test]
async fn sixty_four_racing_claimers_get_exactly_one_claim() {
    let server = TestServer::start().await;
    let channel = server.channel().await;
    for round in 0..3 {
        let id = format!("race-{round}");
        let mut tasks = Vec::new();
        for _ in 0..64 {
            let mut client =
                pb::claim_and_commit_client::ClaimAndCommitClient::new(channel.clone());
            let id = id.clone();
            tasks.push(tokio::spawn(async move {
                claim(&mut client, claim_request(&id)).await
            }));
        }
        let mut claimed = Vec::new();
        let mut in_progress = 0;
        for task in tasks {
            let response = task.await.unwrap();
            match outcome(&response) {
                Outcome::Claimed => claimed.push(response),
                Outcome::InProgress => in_progress += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(claimed.len(), 1, "round {round}");
        assert_eq!(in_progress, 63);
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn concurrent_consumers_commit_every_event_exactly_once() {
    let server = TestServer::start().await;
    let channel = server.channel().await;
    // 16 consumers each see all 100 events (redelivered to everyone).
    let mut tasks = Vec::new();
    for consumer in 0..16 {
        let mut client = pb::claim_and_commit_client::ClaimAndCommitClient::new(channel.clone());
        tasks.push(tokio::spawn(async move {
            let mut processed = Vec::new();
            for event in 0..100 {
                let id = format!("event-{}", (event + consumer * 7) % 100);
                let response = claim(&mut client, claim_request(&id)).await;
                if outcome(&response) == Outcome::Claimed {
                    client
                        .commit(commit_request(&id, &response.lease_token))
                        .await
                        .expect("holder commits");
                    processed.push(id);
                }
            }
            processed
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let unique: HashSet<&String> = all.iter().collect();
    assert_eq!(all.len(), 100, "each event processed once");
    assert_eq!(unique.len(), 100);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn restart_keeps_records_and_fencing_order() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let committed = claim(&mut client, claim_request("kept")).await;
    client
        .commit(pb::CommitRequest {
            response: b"ok".to_vec(),
            ..commit_request("kept", &committed.lease_token)
        })
        .await
        .unwrap();
    let held = claim(&mut client, claim_request("held")).await;
    let highest_before = held.fencing_token.max(committed.fencing_token);

    let server = server.restart().await;
    let mut client = server.client().await;
    let duplicate = claim(&mut client, claim_request("kept")).await;
    assert_eq!(outcome(&duplicate), Outcome::Duplicate);
    assert_eq!(duplicate.record.unwrap().response, b"ok");
    assert_eq!(
        outcome(&claim(&mut client, claim_request("held")).await),
        Outcome::InProgress
    );
    let fresh = claim(&mut client, claim_request("new-after-restart")).await;
    assert!(
        fresh.fencing_token > highest_before,
        "fencing went backwards: {} after {highest_before}",
        fresh.fencing_token
    );
    // The holder from before the restart can still commit.
    client
        .commit(commit_request("held", &held.lease_token))
        .await
        .unwrap();
    server.stop().await.unwrap();
}

#[tokio::test]
async fn reaper_removes_expired_records_from_disk() {
    let server = TestServer::start_with(|config| {
        config.reaper_interval = Duration::from_millis(20);
    })
    .await;
    let mut client = server.client().await;
    let first_sent = std::time::Instant::now();
    for i in 0..50 {
        let id = format!("reap-{i}");
        let response = claim(&mut client, claim_request(&id)).await;
        client
            .commit(pb::CommitRequest {
                retention: seconds(60),
                ..commit_request(&id, &response.lease_token)
            })
            .await
            .unwrap();
    }
    if let common::TestStore::Redis { prefix, .. } = &*server.store {
        // Redis expires records itself, on its own clock: each one is set
        // to go when its retention ends, 60 s from its commit.
        // (Each at most 60 s away, and less only by as long as it has been
        // since the first commit was sent, however slow the machine, and
        // the sidecar's measure of Redis's clock: a second at most here.)
        let mut redis = common::redis::connection().await;
        let keys = common::redis::keys(&format!("{prefix}:r")).await;
        assert_eq!(keys.len(), 50);
        for key in keys {
            let ttl: i64 = ::redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut redis)
                .await
                .unwrap();
            let since_first = first_sent.elapsed().as_millis() as i64;
            assert!(
                (60_000 - since_first - 1_000..=60_000).contains(&ttl),
                "{key} expires in {ttl} ms, {since_first} ms after the first commit was sent"
            );
        }
    }
    server.clock.advance(Duration::from_secs(61));
    // The reaper runs on real time; wait for it (bounded) to empty the store.
    // (Redis expires records itself: they already read as absent by the
    // machine's rule, and go by Redis's clock, as checked above.)
    if !server.store.expires_natively() {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if server.store.records().await == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            server.store.records().await,
            0,
            "the reaper left records behind"
        );
    }
    let lookup = client
        .lookup(pb::LookupRequest {
            namespace: String::new(),
            correlation_id: "reap-0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!lookup.found);
    server.stop().await.unwrap();
}

/// Responses of 1 MiB (the most a Commit may cache when so configured) come
/// back whole after a restart. What this proves is the round trip through
/// sled's separate blob files, on every store; a graceful restart reads
/// them back from the page cache, so that they are synced before the
/// answer is proven by faults.rs's `a_large_response_is_synced_before_its_answer`.
#[tokio::test]
async fn one_mebibyte_responses_survive_a_restart() {
    let server = TestServer::start_with(|config| config.limits.max_response_bytes = 1 << 20).await;
    let mut client = server.client().await;
    let response: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    for id in ["big-1", "big-2"] {
        let claimed = claim(&mut client, claim_request(id)).await;
        client
            .commit(pb::CommitRequest {
                response: response.clone(),
                ..commit_request(id, &claimed.lease_token)
            })
            .await
            .unwrap();
    }
    if server.store.is_sled() {
        let blobs = std::fs::read_dir(server.dir.path().join("data").join("blobs"))
            .unwrap()
            .count();
        assert!(blobs > 0, "the test must exercise sled's blob files");
    }
    let server = server.restart().await;
    let mut client = server.client().await;
    for id in ["big-1", "big-2"] {
        let duplicate = claim(&mut client, claim_request(id)).await;
        assert_eq!(outcome(&duplicate), Outcome::Duplicate);
        assert!(
            duplicate.record.unwrap().response == response,
            "{id} response corrupted"
        );
    }
    server.stop().await.unwrap();
}

/// A Claim whose answer was lost is retried with the same request_id: the
/// same claim comes back (AIP-155), never a second holder.
#[tokio::test]
async fn a_retried_claim_with_its_request_id_gets_its_claim_back() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let request = pb::ClaimRequest {
        request_id: "7d0c3a5e-delivery".into(),
        ..claim_request("lost-answer")
    };
    let first = claim(&mut client, request.clone()).await;
    let again = claim(&mut client, request.clone()).await;
    assert_eq!(outcome(&again), Outcome::Claimed);
    assert_eq!(again.lease_token, first.lease_token);
    assert_eq!(again.fencing_token, first.fencing_token);
    assert_eq!(again.attempt, 1);
    let stranger = claim(
        &mut client,
        pb::ClaimRequest {
            request_id: "another-delivery".into(),
            ..claim_request("lost-answer")
        },
    )
    .await;
    assert_eq!(outcome(&stranger), Outcome::InProgress);
    client
        .commit(commit_request("lost-answer", &again.lease_token))
        .await
        .unwrap();
    assert_eq!(
        outcome(&claim(&mut client, request).await),
        Outcome::Duplicate
    );
    server.stop().await.unwrap();
}

/// The memory of request messages is bounded over every connection and
/// stream, not per stream: a client holding most of the read budget with a
/// message it never finishes makes a further large message RESOURCE_EXHAUSTED
/// as it arrives (before admission), and once that client goes the same
/// message is read and answered.
#[tokio::test]
async fn request_messages_share_one_read_budget() {
    const MESSAGE_LIMIT: usize = 1 << 20;
    let server = TestServer::start_with(|config| {
        config.max_message_bytes = MESSAGE_LIMIT;
        // Raised to one largest message (1 MiB + 5): two do not fit.
        config.guard.read_budget_bytes = 0;
    })
    .await;

    // A raw HTTP/2 client sends 60 KiB of a 1000 KiB message (within
    // HTTP/2's first flow-control window) and stalls.
    let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(connection);
    let mut h2 = h2.ready().await.unwrap();
    let request = grpc_request_head(server.addr, "Claim");
    let (_response, mut stalled) = h2.send_request(request, false).unwrap();
    let mut partial = vec![0u8];
    partial.extend_from_slice(&(1000u32 << 10).to_be_bytes());
    partial.resize(60 << 10, b'x');
    stalled.send_data(partial.into(), false).unwrap();

    // Until the server has read it, the budget is not held yet.
    let mut client = server.client().await;
    // 980 KiB: alone it fits the budget, beside the stalled 60 KiB not.
    let big = pb::ClaimRequest {
        owner: "o".repeat(980 << 10),
        ..claim_request("big")
    };
    let started = std::time::Instant::now();
    let refused = loop {
        match client.claim(big.clone()).await {
            Err(status) if status.code() == Code::ResourceExhausted => break status,
            other => {
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "a second large message was always read: {:?}",
                    other.map(|_| ())
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert!(
        refused.message().contains("request messages in progress"),
        "{refused:?}"
    );
    // A small call still fits.
    assert_eq!(
        outcome(&claim(&mut client, claim_request("small")).await),
        Outcome::Claimed
    );

    // The stalled client goes: its bytes are given back.
    stalled.send_reset(h2::Reason::CANCEL);
    drop((stalled, h2));
    driver.abort();
    let started = std::time::Instant::now();
    loop {
        match client.claim(big.clone()).await {
            Err(status) if status.code() == Code::ResourceExhausted => {
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "the budget was never given back"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // Read, and judged on its content (an owner that long is
            // refused by validation, or taken).
            _ => break,
        }
    }
    server.stop().await.unwrap();
}
