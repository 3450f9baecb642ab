//! Bad input always gets INVALID_ARGUMENT with a BadRequest naming the field,
//! and changes nothing; plus the health and reflection services.

mod common;

use common::*;
use dedupd::proto::v1 as pb;
use tonic::{Code, Status};
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
    for (request, expected) in cases {
        let id = request.correlation_id.clone();
        let answer = client.claim(request).await;
        if expected.is_empty() {
            assert!(answer.is_ok(), "{id:?} should be accepted: {answer:?}");
            continue;
        }
        let status = answer.expect_err("must be rejected");
        assert_eq!(violated_fields(&status), expected, "for id {id:?}");
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

    let malformed = client
        .commit(commit_request("pay-1", "not-a-token"))
        .await
        .unwrap_err();
    assert_eq!(violated_fields(&malformed), vec!["lease_token"]);
    let missing = client
        .commit(commit_request("pay-1", ""))
        .await
        .unwrap_err();
    assert_eq!(violated_fields(&missing), vec!["lease_token"]);

    let unknown = client
        .commit(commit_request("pay-1", &"0".repeat(32)))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::FailedPrecondition);
    assert_eq!(
        unknown.get_error_details().error_info().unwrap().reason,
        "LEASE_LOST"
    );

    let oversized = client
        .commit(pb::CommitRequest {
            response: vec![7; (64 << 10) + 1],
            ..commit_request("pay-1", &held.lease_token)
        })
        .await
        .unwrap_err();
    assert_eq!(violated_fields(&oversized), vec!["response"]);

    // None of that touched the claim: the holder commits normally.
    let committed = client
        .commit(pb::CommitRequest {
            response: vec![7; 64 << 10],
            ..commit_request("pay-1", &held.lease_token)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(committed.record.unwrap().response.len(), 64 << 10);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn bad_batch_items_are_named_by_index_and_nothing_is_claimed() {
    let server = TestServer::start_with(|config| config.limits.max_batch_size = 10).await;
    let mut client = server.client().await;
    let mut items: Vec<pb::ClaimRequest> =
        (0..5).map(|i| claim_request(&format!("b-{i}"))).collect();
    items[3].correlation_id.clear();
    let status = client
        .claim_batch(pb::ClaimBatchRequest { items })
        .await
        .unwrap_err();
    assert_eq!(violated_fields(&status), vec!["items[3].correlation_id"]);
    let first = claim(&mut client, claim_request("b-0")).await;
    assert_eq!(
        outcome(&first),
        pb::ClaimOutcome::Claimed,
        "the batch claimed nothing"
    );

    let too_many = (0..11).map(|i| claim_request(&format!("c-{i}"))).collect();
    let status = client
        .claim_batch(pb::ClaimBatchRequest { items: too_many })
        .await
        .unwrap_err();
    assert_eq!(violated_fields(&status), vec!["items"]);
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
    let refused = client
        .commit(pb::CommitRequest {
            retention: Some(prost_types::Duration {
                seconds: 0,
                nanos: 1,
            }),
            ..commit_request("tiny", &claimed.lease_token)
        })
        .await
        .unwrap_err();
    assert_eq!(violated_fields(&refused), vec!["retention"]);
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
