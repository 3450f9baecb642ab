//! Bad input always gets INVALID_ARGUMENT with a BadRequest naming the field,
//! and changes nothing; plus the health and reflection services.

mod common;

use common::*;
use dedupd::proto::v1 as pb;
use tonic::{Code, Response, Status};
use tonic_types::StatusExt;

fn violated_fields(status: &Status) -> Vec<String> {
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let details = status.get_error_details();
    let bad_request = details.bad_request().expect("BadRequest details");
    bad_request
        .field_violations
        .iter()
        .map(|v| v.field.clone())
        .collect()
}

/// A key as (namespace, correlation ID); an empty namespace is the default.
type KeyOf<'a> = (&'a str, &'a str);

/// What Lookup answers for each key (INVALID_ARGUMENT for a key that is
/// not one).
async fn lookups(client: &mut Client, keys: &[KeyOf<'_>]) -> Vec<Result<pb::LookupResponse, Code>> {
    let mut answers = Vec::with_capacity(keys.len());
    for &(namespace, correlation_id) in keys {
        let answer = client
            .lookup(pb::LookupRequest {
                namespace: namespace.into(),
                correlation_id: correlation_id.into(),
            })
            .await;
        answers.push(
            answer
                .map(Response::into_inner)
                .map_err(|status| status.code()),
        );
    }
    answers
}

/// Makes `call`, which must be refused with INVALID_ARGUMENT naming exactly
/// `fields`, and checks that it changed nothing: every one of `keys` looks
/// up exactly as before (the clock is manual: nothing moves by itself).
async fn refused<T: std::fmt::Debug>(
    client: &mut Client,
    keys: &[KeyOf<'_>],
    fields: &[&str],
    call: impl AsyncFnOnce(&mut Client) -> Result<Response<T>, Status>,
) -> Status {
    let before = lookups(client, keys).await;
    let status = call(client).await.expect_err("must be refused");
    assert_eq!(violated_fields(&status), fields, "{status:?}");
    assert_eq!(
        lookups(client, keys).await,
        before,
        "the refused call ({}) changed {keys:?}",
        status.message()
    );
    status
}

/// The record of `id` in the default namespace, which must exist.
async fn record_of(client: &mut Client, id: &str) -> pb::Record {
    let answer = lookups(client, &[("", id)])
        .await
        .remove(0)
        .expect("lookup");
    assert!(answer.found, "{id} has a record");
    answer.record.expect("a found record")
}

/// Claims `key`: it must be CLAIMED as a first attempt (nothing refused
/// before claimed it).
async fn claim_first(client: &mut Client, (namespace, id): KeyOf<'_>) -> pb::ClaimResponse {
    let claimed = claim(
        client,
        pb::ClaimRequest {
            namespace: namespace.into(),
            ..claim_request(id)
        },
    )
    .await;
    assert_eq!(
        outcome(&claimed),
        pb::ClaimOutcome::Claimed,
        "{namespace}/{id}"
    );
    assert_eq!(
        (claimed.attempt, claimed.recovered),
        (1, false),
        "{namespace}/{id}"
    );
    claimed
}

#[tokio::test]
async fn malformed_claims_name_every_bad_field() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let cases: Vec<(pb::ClaimRequest, Vec<&str>)> = vec![
        (claim_request(""), vec!["correlation_id"]),
        (claim_request(&"x".repeat(257)), vec!["correlation_id"]),
        (claim_request("tab\there"), vec!["correlation_id"]),
        (claim_request(&"é".repeat(128)), vec![]), // 256 bytes: the limit is in bytes
        (claim_request(&"é".repeat(129)), vec!["correlation_id"]),
        (
            pb::ClaimRequest {
                namespace: "has space".into(),
                ..claim_request("ok")
            },
            vec!["namespace"],
        ),
        (
            pb::ClaimRequest {
                namespace: "n".repeat(129),
                ..claim_request("ok")
            },
            vec!["namespace"],
        ),
        (
            pb::ClaimRequest {
                lease_ttl: seconds(0),
                ..claim_request("ok")
            },
            vec!["lease_ttl"],
        ),
        (
            pb::ClaimRequest {
                lease_ttl: seconds(3601),
                ..claim_request("ok")
            },
            vec!["lease_ttl"],
        ),
        (
            pb::ClaimRequest {
                lease_ttl: seconds(-5),
                ..claim_request("ok")
            },
            vec!["lease_ttl"],
        ),
        (
            pb::ClaimRequest {
                retention: seconds(366 * 24 * 3600),
                ..claim_request("ok")
            },
            vec!["retention"],
        ),
        // Below a millisecond would become zero: the record would vanish.
        (
            pb::ClaimRequest {
                lease_ttl: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 1,
                }),
                ..claim_request("ok")
            },
            vec!["lease_ttl"],
        ),
        (
            pb::ClaimRequest {
                retention: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 999_999,
                }),
                ..claim_request("ok")
            },
            vec!["retention"],
        ),
        // Malformed google.protobuf.Durations, which prost would normalise.
        (
            pb::ClaimRequest {
                lease_ttl: Some(prost_types::Duration {
                    seconds: 30,
                    nanos: -1,
                }),
                ..claim_request("ok")
            },
            vec!["lease_ttl"],
        ),
        (
            pb::ClaimRequest {
                lease_ttl: Some(prost_types::Duration {
                    seconds: 1,
                    nanos: 1_000_000_000,
                }),
                ..claim_request("ok")
            },
            vec!["lease_ttl"],
        ),
        (
            pb::ClaimRequest {
                ordering_key: "entity-1".into(),
                ..claim_request("ok")
            },
            vec!["sequence"],
        ),
        (
            pb::ClaimRequest {
                sequence: Some(3),
                ..claim_request("ok")
            },
            vec!["ordering_key"],
        ),
        (
            pb::ClaimRequest {
                namespace: "bad namespace".into(),
                event_type: "e".repeat(129),
                lease_ttl: seconds(0),
                ..claim_request("")
            },
            vec!["namespace", "correlation_id", "lease_ttl", "event_type"],
        ),
    ];
    for (index, (mut request, expected)) in cases.into_iter().enumerate() {
        // A key of its own per case: what one refusal left is not the next's.
        if request.correlation_id == "ok" {
            request.correlation_id = format!("ok-{index}");
        }
        let id = request.correlation_id.clone();
        if expected.is_empty() {
            let answer = client.claim(request).await;
            assert!(answer.is_ok(), "{id:?} should be accepted: {answer:?}");
            continue;
        }
        let namespace = request.namespace.clone();
        let key = (namespace.as_str(), id.as_str());
        refused(&mut client, &[key], &expected, async |client| {
            client.claim(request).await
        })
        .await;
        // The key, when it is one, is claimed afresh as if nothing happened.
        if lookups(&mut client, &[key]).await[0].is_ok() {
            claim_first(&mut client, key).await;
        }
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_ten_megabyte_correlation_id_is_rejected_cleanly() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let status = client
        .claim(claim_request(&"x".repeat(10 << 20)))
        .await
        .unwrap_err();
    assert_eq!(violated_fields(&status), vec!["correlation_id"]);
    // Past the message limit the transport refuses it, and the server lives on.
    let huge = client
        .claim(claim_request(&"x".repeat(20 << 20)))
        .await
        .unwrap_err();
    assert_eq!(huge.code(), Code::OutOfRange, "{huge:?}");
    assert!(huge.message().contains("too large"), "{huge:?}");
    let mut client = server.client().await;
    let fine = claim(&mut client, claim_request("after-huge")).await;
    assert_eq!(outcome(&fine), pb::ClaimOutcome::Claimed);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn commits_with_bad_tokens_or_oversized_responses_change_nothing() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let held = claim(&mut client, claim_request("pay-1")).await;
    let pay_1 = [("", "pay-1")];

    for token in ["not-a-token", ""] {
        refused(&mut client, &pay_1, &["lease_token"], async |client| {
            client.commit(commit_request("pay-1", token)).await
        })
        .await;
    }
    // The holder's own token with a bad field: still nothing.
    let bad_retention = pb::CommitRequest {
        retention: seconds(366 * 24 * 3600),
        ..commit_request("pay-1", &held.lease_token)
    };
    refused(&mut client, &pay_1, &["retention"], async |client| {
        client.commit(bad_retention).await
    })
    .await;

    let unknown = client
        .commit(commit_request("pay-1", &"0".repeat(32)))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::FailedPrecondition);
    assert_eq!(
        unknown.get_error_details().error_info().unwrap().reason,
        "LEASE_LOST"
    );

    let oversized = pb::CommitRequest {
        response: vec![7; (64 << 10) + 1],
        ..commit_request("pay-1", &held.lease_token)
    };
    refused(&mut client, &pay_1, &["response"], async |client| {
        client.commit(oversized).await
    })
    .await;

    // None of that touched the claim: still CLAIMED on the same lease, and
    // the holder commits normally.
    let record = record_of(&mut client, "pay-1").await;
    assert_eq!(record.state, pb::RecordState::Claimed as i32);
    assert_eq!(record.lease_expires_at, held.lease_expires_at);
    assert_eq!(record.fencing_token, held.fencing_token);
    let committed = client
        .commit(pb::CommitRequest {
            response: vec![7; 64 << 10],
            ..commit_request("pay-1", &held.lease_token)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(committed.outcome, pb::CommitOutcome::Committed as i32);
    assert_eq!(committed.record.unwrap().response.len(), 64 << 10);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn bad_batch_items_are_named_by_index_and_nothing_is_claimed() {
    let server = TestServer::start_with(|config| config.limits.max_batch_size = 10).await;
    let mut client = server.client().await;
    let ids: Vec<String> = (0..5).map(|i| format!("b-{i}")).collect();
    let keys: Vec<KeyOf> = ids.iter().map(|id| ("", id.as_str())).collect();
    let mut items: Vec<pb::ClaimRequest> = ids.iter().map(|id| claim_request(id)).collect();
    items[3].correlation_id.clear();
    refused(
        &mut client,
        &keys,
        &["items[3].correlation_id"],
        async |client| client.claim_batch(pb::ClaimBatchRequest { items }).await,
    )
    .await;

    let ids: Vec<String> = (0..11).map(|i| format!("c-{i}")).collect();
    let too_many = ids.iter().map(|id| claim_request(id)).collect();
    let more_keys: Vec<KeyOf> = ids.iter().map(|id| ("", id.as_str())).collect();
    refused(&mut client, &more_keys, &["items"], async |client| {
        client
            .claim_batch(pb::ClaimBatchRequest { items: too_many })
            .await
    })
    .await;
    // The batches claimed nothing: every key is a first claim.
    for &key in keys.iter().chain(&more_keys) {
        claim_first(&mut client, key).await;
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn refused_commit_and_release_batches_change_nothing() {
    let server = TestServer::start_with(|config| config.limits.max_batch_size = 10).await;
    let mut client = server.client().await;
    let ids = ["k-0", "k-1", "k-2"];
    let keys: Vec<KeyOf> = ids.iter().map(|id| ("", *id)).collect();
    let mut held = Vec::new();
    for &key in &keys {
        held.push(claim_first(&mut client, key).await);
    }
    let commit = |i: usize| commit_request(ids[i], &held[i].lease_token);
    let release = |i: usize| pb::ReleaseRequest {
        correlation_id: ids[i].into(),
        lease_token: held[i].lease_token.clone(),
        ..Default::default()
    };

    // Valid commits ahead of a bad one: none is applied.
    let items = vec![
        commit(0),
        commit(1),
        pb::CommitRequest {
            response: vec![7; (64 << 10) + 1],
            ..commit(2)
        },
    ];
    refused(&mut client, &keys, &["items[2].response"], async |client| {
        client.commit_batch(pb::CommitBatchRequest { items }).await
    })
    .await;
    let items = vec![commit(0), commit_request("k-1", "not-a-token")];
    refused(
        &mut client,
        &keys,
        &["items[1].lease_token"],
        async |client| client.commit_batch(pb::CommitBatchRequest { items }).await,
    )
    .await;
    let items = (0..11).map(|i| commit(i % 3)).collect();
    refused(&mut client, &keys, &["items"], async |client| {
        client.commit_batch(pb::CommitBatchRequest { items }).await
    })
    .await;

    // Valid releases ahead of a bad one: none is applied.
    let items = vec![
        release(0),
        release(1),
        pb::ReleaseRequest {
            lease_token: String::new(),
            ..release(2)
        },
    ];
    refused(
        &mut client,
        &keys,
        &["items[2].lease_token"],
        async |client| {
            client
                .release_batch(pb::ReleaseBatchRequest { items })
                .await
        },
    )
    .await;
    let items = vec![
        release(0),
        pb::ReleaseRequest {
            namespace: "bad namespace".into(),
            ..release(1)
        },
    ];
    refused(
        &mut client,
        &keys,
        &["items[1].namespace"],
        async |client| {
            client
                .release_batch(pb::ReleaseBatchRequest { items })
                .await
        },
    )
    .await;

    // Every key is still its holder's, on the same lease: k-0 and k-1
    // commit afresh, k-2 is released afresh.
    for (i, id) in ids.iter().enumerate() {
        let record = record_of(&mut client, id).await;
        assert_eq!(record.state, pb::RecordState::Claimed as i32, "{id}");
        assert_eq!(record.lease_expires_at, held[i].lease_expires_at, "{id}");
    }
    let results = client
        .commit_batch(pb::CommitBatchRequest {
            items: vec![commit(0), commit(1)],
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    for result in results {
        assert_eq!(result.outcome, pb::CommitOutcome::Committed as i32);
    }
    let results = client
        .release_batch(pb::ReleaseBatchRequest {
            items: vec![release(2)],
        })
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(results[0].outcome, pb::ReleaseOutcome::Released as i32);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn refused_releases_and_renewals_change_nothing() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let key = [("", "lease-1")];
    let held = claim_first(&mut client, key[0]).await;
    let release = |lease_token: &str| pb::ReleaseRequest {
        correlation_id: "lease-1".into(),
        lease_token: lease_token.into(),
        ..Default::default()
    };
    let renew = |lease_token: &str, lease_ttl| pb::RenewRequest {
        correlation_id: "lease-1".into(),
        lease_token: lease_token.into(),
        lease_ttl,
        ..Default::default()
    };

    for token in ["not-a-token", ""] {
        refused(&mut client, &key, &["lease_token"], async |client| {
            client.release(release(token)).await
        })
        .await;
        refused(&mut client, &key, &["lease_token"], async |client| {
            client.renew(renew(token, seconds(60))).await
        })
        .await;
    }
    let bad_namespace = pb::ReleaseRequest {
        namespace: "bad namespace".into(),
        ..release(&held.lease_token)
    };
    refused(&mut client, &key, &["namespace"], async |client| {
        client.release(bad_namespace).await
    })
    .await;
    // The holder's own token with a lease out of bounds: the lease stays.
    for lease_ttl in [seconds(0), seconds(3601), seconds(-5)] {
        refused(&mut client, &key, &["lease_ttl"], async |client| {
            client.renew(renew(&held.lease_token, lease_ttl)).await
        })
        .await;
    }

    // Still the holder's, on the same lease: a Release releases it afresh,
    // and the next Claim is the second attempt.
    let record = record_of(&mut client, "lease-1").await;
    assert_eq!(record.state, pb::RecordState::Claimed as i32);
    assert_eq!(record.lease_expires_at, held.lease_expires_at);
    let released = client
        .release(release(&held.lease_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(released.outcome, pb::ReleaseOutcome::Released as i32);
    let again = claim(&mut client, claim_request("lease-1")).await;
    assert_eq!(outcome(&again), pb::ClaimOutcome::Claimed);
    assert_eq!((again.attempt, again.recovered), (2, false));
    server.stop().await.unwrap();
}

#[tokio::test]
async fn health_is_serving_and_reflection_lists_the_service() {
    use tonic_health::pb::{
        health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
    };
    use tonic_reflection::pb::v1::{
        server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
        ServerReflectionRequest,
    };

    let server = TestServer::start().await;
    let channel = server.channel().await;
    let mut health = HealthClient::new(channel.clone());
    for service in ["", "dedup.v1.ClaimAndCommit"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "service {service:?}");
    }

    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().expect("one answer");
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("unexpected reflection answer");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"dedup.v1.ClaimAndCommit".to_string()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_string()),
        "{names:?}"
    );
    server.stop().await.unwrap();
}

/// A retention below a millisecond used to be truncated to zero: the commit
/// vanished at once and the redelivery was CLAIMED again. It is refused, and
/// a proper commit afterwards still deduplicates.
#[tokio::test]
async fn a_sub_millisecond_retention_is_refused_not_truncated() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let claimed = claim(&mut client, claim_request("tiny")).await;
    let tiny = pb::CommitRequest {
        retention: Some(prost_types::Duration {
            seconds: 0,
            nanos: 1,
        }),
        ..commit_request("tiny", &claimed.lease_token)
    };
    let refused = refused(
        &mut client,
        &[("", "tiny")],
        &["retention"],
        async |client| client.commit(tiny).await,
    )
    .await;
    assert!(refused.message().contains("at least 1ms"), "{refused:?}");
    client
        .commit(commit_request("tiny", &claimed.lease_token))
        .await
        .unwrap();
    assert_eq!(
        outcome(&claim(&mut client, claim_request("tiny")).await),
        pb::ClaimOutcome::Duplicate
    );
    server.stop().await.unwrap();
}
