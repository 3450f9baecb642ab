//! The operations surface: Prometheus metrics after real calls, /healthz and
//! /readyz, a Unix-socket listener beside TCP, bearer tokens (and the admin
//! token for Forget), load shedding and the request timeout.

mod common;

use std::{collections::HashMap, sync::Arc, time::Duration};

use common::*;
use dedupd::{
    cli::{channel, BearerToken},
    proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient},
    server::ServerConfig,
    store::Store,
    Tokens,
};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

/// A server on TCP, a Unix socket and an ops port.
async fn start(adjust: impl FnOnce(&mut ServerConfig)) -> TestServer {
    TestServer::builder()
        .config(adjust)
        .unix_socket()
        .ops()
        .start()
        .await
}

/// Stops `server` cleanly and checks it removed its socket file.
async fn stop<S: Store + TestSpace>(server: TestServer<S>) {
    let socket = server.socket.clone().expect("a unix socket");
    server.stop().await.expect("clean stop");
    assert!(!socket.exists(), "the socket file is removed on shutdown");
}

/// `name{labels} value` lines of an OpenMetrics text, keyed by `name{labels}`.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[tokio::test]
async fn metrics_count_real_calls_and_probes_answer() {
    let server = start(|_| {}).await;
    // The records gauge is the count of the sweep a fresh store runs once,
    // moved by every change since; a record created during that sweep at
    // a key it had not reached yet would be counted twice (and stay so: a
    // whole expiry index means no further sweep). Create records after it.
    let passes_before = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, text) = common::ops_http::get(server.ops.unwrap(), "/metrics").await;
        if samples(&text)
            .get("dedupd_reaper_passes_total")
            .copied()
            .unwrap_or(0.0)
            >= 1.0
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < passes_before,
            "no reaper pass:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut client = ClaimAndCommitClient::new(channel(&server.addr.to_string()).await.unwrap());
    let first = claim(&mut client, claim_request("m-1")).await;
    assert_eq!(
        outcome(&claim(&mut client, claim_request("m-1")).await),
        pb::ClaimOutcome::InProgress
    );
    client
        .commit(commit_request("m-1", &first.lease_token))
        .await
        .unwrap();
    for _ in 0..2 {
        assert_eq!(
            outcome(&claim(&mut client, claim_request("m-1")).await),
            pb::ClaimOutcome::Duplicate
        );
    }
    let other = claim(
        &mut client,
        pb::ClaimRequest {
            namespace: "billing".into(),
            ..claim_request("m-2")
        },
    )
    .await;
    client
        .release(pb::ReleaseRequest {
            namespace: "billing".into(),
            correlation_id: "m-2".into(),
            lease_token: other.lease_token,
        })
        .await
        .unwrap();

    let (status, text) = common::ops_http::get(server.ops.unwrap(), "/metrics").await;
    assert_eq!(status, 200);
    let metrics = samples(&text);
    let get = |series: &str| {
        metrics
            .get(series)
            .copied()
            .unwrap_or_else(|| panic!("{series} missing from:\n{text}"))
    };
    assert_eq!(
        get(r#"dedupd_outcomes_total{dedup_namespace="default",outcome="claimed"}"#),
        1.0
    );
    assert_eq!(
        get(r#"dedupd_outcomes_total{dedup_namespace="default",outcome="in_progress"}"#),
        1.0
    );
    assert_eq!(
        get(r#"dedupd_outcomes_total{dedup_namespace="default",outcome="committed"}"#),
        1.0
    );
    assert_eq!(
        get(r#"dedupd_outcomes_total{dedup_namespace="default",outcome="duplicate"}"#),
        2.0
    );
    assert_eq!(
        get(r#"dedupd_outcomes_total{dedup_namespace="billing",outcome="claimed"}"#),
        1.0
    );
    assert_eq!(
        get(r#"dedupd_outcomes_total{dedup_namespace="billing",outcome="released"}"#),
        1.0
    );
    assert_eq!(
        get(r#"dedupd_rpc_duration_seconds_count{rpc="Claim"}"#),
        5.0
    );
    assert_eq!(
        get(r#"dedupd_rpc_duration_seconds_count{rpc="Commit"}"#),
        1.0
    );
    assert!(get("dedupd_group_commit_size_count") >= 1.0);
    assert!(get("dedupd_sync_duration_seconds_count") >= 1.0);
    assert_eq!(get("dedupd_records"), 2.0);
    assert!(get("dedupd_store_disk_bytes") > 0.0);

    assert_eq!(
        common::ops_http::get(server.ops.unwrap(), "/healthz")
            .await
            .0,
        200
    );
    assert_eq!(
        common::ops_http::get(server.ops.unwrap(), "/readyz")
            .await
            .0,
        200
    );
    assert_eq!(
        common::ops_http::get(server.ops.unwrap(), "/nope").await.0,
        404
    );
    stop(server).await;
}

#[tokio::test]
async fn unix_socket_serves_the_same_api_beside_tcp() {
    let server = start(|_| {}).await;
    let address = format!("unix://{}", server.socket.as_ref().unwrap().display());
    let mut over_unix = ClaimAndCommitClient::new(channel(&address).await.unwrap());
    let mut over_tcp = ClaimAndCommitClient::new(channel(&server.addr.to_string()).await.unwrap());
    let claimed = claim(&mut over_unix, claim_request("uds-1")).await;
    assert_eq!(outcome(&claimed), pb::ClaimOutcome::Claimed);
    // One store behind both listeners.
    assert_eq!(
        outcome(&claim(&mut over_tcp, claim_request("uds-1")).await),
        pb::ClaimOutcome::InProgress
    );
    over_unix
        .commit(commit_request("uds-1", &claimed.lease_token))
        .await
        .unwrap();
    assert_eq!(
        outcome(&claim(&mut over_tcp, claim_request("uds-1")).await),
        pb::ClaimOutcome::Duplicate
    );
    stop(server).await;
}

#[tokio::test]
async fn tokens_are_required_and_forget_needs_the_admin_token() {
    const CLIENT: &str = "client-token-0123456789";
    const ADMIN: &str = "admin-token-0123456789";
    let server = start(|config| config.guard.tokens = Some(Tokens::new(CLIENT, Some(ADMIN)))).await;
    let connect = |token: Option<&'static str>| {
        let address = server.addr.to_string();
        async move {
            ClaimAndCommitClient::with_interceptor(
                channel(&address).await.unwrap(),
                BearerToken::new(token).unwrap(),
            )
        }
    };
    let denied = connect(None)
        .await
        .claim(claim_request("t-1"))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::Unauthenticated);
    let wrong = connect(Some("wrong-token-0123456789"))
        .await
        .claim(claim_request("t-1"))
        .await
        .unwrap_err();
    assert_eq!(wrong.code(), Code::Unauthenticated);

    let mut client = connect(Some(CLIENT)).await;
    let claimed = client
        .claim(claim_request("t-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(outcome(&claimed), pb::ClaimOutcome::Claimed);
    let forget = pb::ForgetRequest {
        namespace: String::new(),
        correlation_id: "t-1".into(),
    };
    let refused = client.forget(forget.clone()).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    let mut admin = connect(Some(ADMIN)).await;
    assert!(admin.forget(forget).await.unwrap().into_inner().existed);
    // The admin token opens every call.
    admin.claim(claim_request("t-2")).await.unwrap();

    // Probes carry no token and still work.
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        channel(&server.addr.to_string()).await.unwrap(),
    );
    health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    stop(server).await;
}

#[tokio::test]
async fn overload_is_shed_with_resource_exhausted() {
    let server = start(|config| config.guard.max_concurrent_requests = 1).await;
    let channel = channel(&server.addr.to_string()).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..64 {
        let mut client = ClaimAndCommitClient::new(channel.clone());
        tasks.push(tokio::spawn(async move {
            client
                .claim(claim_request(&format!("shed-{i}")))
                .await
                .map(|_| ())
                .map_err(|s| s.code())
        }));
    }
    let mut answered = 0;
    let mut shed = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(()) => answered += 1,
            Err(Code::ResourceExhausted) => shed += 1,
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert!(answered >= 1, "some calls get through");
    assert!(
        shed >= 1,
        "64 concurrent calls against a limit of 1 must shed some"
    );
    stop(server).await;
}

#[tokio::test]
async fn slow_calls_time_out_with_unavailable() {
    // A store whose durability wait never ends: the call is certainly
    // slower than the timeout (a batch on a fast disk could beat 1 ms).
    let store = GatedStore::closed();
    let server = TestServer::builder()
        .config(|config| config.guard.request_timeout = Duration::from_millis(50))
        .unix_socket()
        .start_with_store(Arc::clone(&store))
        .await;
    let mut client = ClaimAndCommitClient::new(channel(&server.addr.to_string()).await.unwrap());
    let items = (0..10)
        .map(|i| claim_request(&format!("slow-{i}")))
        .collect();
    let status = client
        .claim_batch(pb::ClaimBatchRequest { items })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("--request-timeout"), "{status:?}");
    store.open();
    stop(server).await;
}

/// Defects 1 and 2 of the review: the concurrency limit is one for the
/// process (not one per listener), and health checks and reflection are
/// never shed and never need a token.
#[tokio::test]
async fn one_limit_for_every_listener_and_probes_are_never_shed() {
    const CLIENT: &str = "client-token-0123456789";
    let store = GatedStore::closed();
    let server = TestServer::builder()
        .config(|config| {
            config.guard.max_concurrent_requests = 2;
            config.guard.tokens = Some(Tokens::new(CLIENT, None));
        })
        .unix_socket()
        .start_with_store(Arc::clone(&store))
        .await;
    let connect = |address: String| async move {
        ClaimAndCommitClient::with_interceptor(
            channel(&address).await.unwrap(),
            BearerToken::new(Some(CLIENT)).unwrap(),
        )
    };
    let unix = format!("unix://{}", server.socket.as_ref().unwrap().display());
    // One call in flight on each listener: the limit of 2 is reached.
    let mut in_flight = Vec::new();
    for (i, address) in [server.addr.to_string(), unix.clone()]
        .into_iter()
        .enumerate()
    {
        let mut client = connect(address).await;
        in_flight.push(tokio::spawn(async move {
            client.claim(claim_request(&format!("held-{i}"))).await
        }));
    }
    store.until_waiting(2).await;
    for address in [server.addr.to_string(), unix] {
        let refused = tokio::time::timeout(
            Duration::from_secs(5),
            connect(address).await.claim(claim_request("third")),
        )
        .await
        .expect("a refusal is immediate, not queued")
        .unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    }

    // At saturation, with tokens required, probes and reflection carry no
    // token and are still answered.
    let plain = channel(&server.addr.to_string()).await.unwrap();
    let serving = tonic_health::pb::health_client::HealthClient::new(plain.clone())
        .check(tonic_health::pb::HealthCheckRequest {
            service: "dedup.v1.ClaimAndCommit".into(),
        })
        .await
        .expect("health is not shed")
        .into_inner();
    assert_eq!(
        serving.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let services = list_services(plain).await;
    assert!(
        services.contains(&"dedup.v1.ClaimAndCommit".to_owned()),
        "{services:?}"
    );

    store.open();
    for call in in_flight {
        let claimed = call.await.unwrap().expect("held calls finish").into_inner();
        assert_eq!(outcome(&claimed), pb::ClaimOutcome::Claimed);
    }
    stop(server).await;
}

/// Asks server reflection (v1) for the services it offers.
async fn list_services(channel: tonic::transport::Channel) -> Vec<String> {
    use tonic_reflection::pb::v1::{
        server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
        ServerReflectionRequest,
    };
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("reflection is not shed and needs no token")
        .into_inner();
    match answers.message().await.unwrap().unwrap().message_response {
        Some(MessageResponse::ListServicesResponse(list)) => list
            .service
            .into_iter()
            .map(|service| service.name)
            .collect(),
        other => panic!("unexpected reflection answer {other:?}"),
    }
}

/// Defect 3: a path under the service that is no method is labelled
/// `other`, so clients cannot grow the metric's label set.
#[tokio::test]
async fn unknown_methods_share_one_metric_label() {
    let server = start(|_| {}).await;
    let mut grpc = tonic::client::Grpc::new(channel(&server.addr.to_string()).await.unwrap());
    for method in ["Bogus1", "Bogus2"] {
        grpc.ready().await.unwrap();
        let path = format!("/dedup.v1.ClaimAndCommit/{method}");
        let status = grpc
            .unary::<pb::LookupRequest, pb::LookupResponse, _>(
                tonic::Request::new(pb::LookupRequest::default()),
                path.parse().unwrap(),
                tonic_prost::ProstCodec::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unimplemented);
    }
    let (_, text) = common::ops_http::get(server.ops.unwrap(), "/metrics").await;
    let metrics = samples(&text);
    assert_eq!(
        metrics.get(r#"dedupd_rpc_duration_seconds_count{rpc="other"}"#),
        Some(&2.0),
        "{text}"
    );
    assert!(!text.contains("Bogus"), "{text}");
    stop(server).await;
}

/// Found by `dedupd-reliability hostile` (issue 16): hyper waits for the
/// HTTP/2 preface forever, so connections that sent nothing — or a few bytes
/// of it — held their connection slots for good; at --max-connections of
/// them no new client got in. Now a connection that has not sent its first
/// 24 bytes within the handshake timeout is closed.
#[tokio::test]
async fn connections_that_never_send_a_preface_lose_their_slots() {
    let server = TestServer::builder()
        .unix_socket()
        .config(|config| {
            config.connections.max_connections = 2;
            config.connections.handshake_timeout = Duration::from_millis(300);
        })
        .start()
        .await;
    let mut silent = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let mut trickling = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    trickling
        .write_all(&b"PRI * HTTP/2.0\r\n"[..])
        .await
        .unwrap();
    // Both slots are taken: a new client gets in only once they are closed.
    let started = std::time::Instant::now();
    let mut client = tokio::time::timeout(Duration::from_secs(5), async {
        let mut client = server.client().await;
        client
            .lookup(pb::LookupRequest {
                namespace: String::new(),
                correlation_id: "after-the-idle-ones".into(),
            })
            .await
            .map(|_| client)
    })
    .await
    .expect("a new client got a slot once the silent connections were closed")
    .expect("its call is answered");
    assert!(started.elapsed() >= Duration::from_millis(250));
    for socket in [&mut silent, &mut trickling] {
        // The server's SETTINGS, perhaps, then the end of the stream.
        let mut rest = Vec::new();
        // (A reset instead of an orderly close is a close too.)
        let _closed = tokio::time::timeout(Duration::from_secs(2), socket.read_to_end(&mut rest))
            .await
            .expect("the server closed the connection");
    }
    // A connection that sent its preface in time is kept past the deadline.
    for pause in [Duration::ZERO, Duration::from_millis(500)] {
        tokio::time::sleep(pause).await;
        let answer = client
            .lookup(pb::LookupRequest {
                namespace: String::new(),
                correlation_id: "still-here".into(),
            })
            .await;
        assert!(answer.is_ok(), "{answer:?}");
    }
    stop(server).await;
}

/// Defect 4: one connection sending header-only calls used to take every
/// admission slot until --request-timeout, refusing everyone else (health
/// included). Now each connection has a stream limit, the server says so in
/// its SETTINGS, a call is admitted only once its message has arrived, and a
/// stalled one is answered DEADLINE_EXCEEDED after --request-read-timeout.
#[tokio::test]
async fn a_connection_that_stalls_its_calls_holds_no_admission_slot() {
    const STREAMS: u32 = 48;
    let server = TestServer::builder()
        .unix_socket()
        .config(|config| {
            config.guard.max_concurrent_requests = 4;
            config.guard.request_read_timeout = Duration::from_millis(500);
            config.connections.max_streams_per_connection = STREAMS;
        })
        .start()
        .await;
    let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let (send, mut connection) = h2::client::handshake(tcp).await.unwrap();
    // Drive the connection until the server's SETTINGS have arrived.
    tokio::time::timeout(Duration::from_secs(5), async {
        while connection.max_concurrent_send_streams() != STREAMS as usize {
            tokio::select! {
                _ = &mut connection => panic!("the connection closed"),
                () = tokio::time::sleep(Duration::from_millis(5)) => {}
            }
        }
    })
    .await
    .expect("the server advertises MAX_CONCURRENT_STREAMS");
    tokio::spawn(connection);

    let call = |method: &str| grpc_request_head(server.addr, method);
    let mut stalled = Vec::new();
    for _ in 1..STREAMS {
        let mut ready = send.clone().ready().await.unwrap();
        // Headers only: the message never comes.
        stalled.push(ready.send_request(call("Claim"), false).unwrap());
    }
    // A complete call behind them on the same connection: once it is
    // answered, the server has taken up every stalled one before it.
    let mut ready = send.clone().ready().await.unwrap();
    let (barrier, mut message) = ready.send_request(call("Lookup"), false).unwrap();
    let lookup = pb::LookupRequest {
        namespace: String::new(),
        correlation_id: "barrier".into(),
    }
    .encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(lookup.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&lookup);
    message.send_data(frame.into(), true).unwrap();
    let barrier = tokio::time::timeout(Duration::from_secs(5), barrier)
        .await
        .expect("the complete call is answered")
        .unwrap();
    assert_eq!(barrier.status(), 200);

    let mut client = server.client().await;
    for i in 0..10 {
        let answer = claim(&mut client, claim_request(&format!("legit-{i}"))).await;
        assert_eq!(outcome(&answer), pb::ClaimOutcome::Claimed);
    }

    let (response, _body) = stalled.pop().unwrap();
    let response = tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .expect("a stalled call is answered")
        .unwrap();
    assert_eq!(
        response
            .headers()
            .get("grpc-status")
            .and_then(|code| code.to_str().ok()),
        Some("4"),
        "DEADLINE_EXCEEDED: {response:?}"
    );
    stop(server).await;
}

/// Prometheus asks for OpenMetrics and gets it; anything else (curl,
/// promtool) gets the Prometheus text format, with the same samples and
/// each counter's metadata on its `_total` series.
#[tokio::test]
async fn metrics_speak_openmetrics_to_who_asks_and_the_text_format_to_others() {
    let server = start(|_| {}).await;
    let mut client = ClaimAndCommitClient::new(channel(&server.addr.to_string()).await.unwrap());
    claim(&mut client, claim_request("fmt-1")).await;
    let ops = server.ops.unwrap();
    let prometheus_accept = "Accept: application/openmetrics-text;version=1.0.0,\
        application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n";
    let (status, head, openmetrics) =
        common::ops_http::exchange(ops, "/metrics", prometheus_accept).await;
    assert_eq!(status, 200);
    assert!(
        head.contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    assert!(openmetrics.ends_with("# EOF\n"), "{openmetrics}");
    assert!(openmetrics.contains("# TYPE dedupd_outcomes counter\n"));

    let (status, head, text) = common::ops_http::exchange(ops, "/metrics", "").await;
    assert_eq!(status, 200);
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(!text.contains("# EOF"), "{text}");
    assert!(
        text.contains("# TYPE dedupd_outcomes_total counter\n"),
        "{text}"
    );
    assert_eq!(
        samples(&text).get(r#"dedupd_outcomes_total{dedup_namespace="default",outcome="claimed"}"#),
        Some(&1.0)
    );
    server.stop().await.unwrap();
}

/// What the alerts watch: the probes' state as gauges, and every call the
/// guard refused counted by its reason.
#[tokio::test]
async fn the_state_and_refusals_are_metrics() {
    let server = start(|config| {
        config.guard.request_read_timeout = Duration::from_millis(200);
    })
    .await;
    let ops = server.ops.unwrap();
    let (_, text) = common::ops_http::get(ops, "/metrics").await;
    let metrics = samples(&text);
    for (series, value) in [
        ("dedupd_serving", 1.0),
        ("dedupd_store_healthy", 1.0),
        ("dedupd_store_writable", 1.0),
        ("dedupd_store_full", 0.0),
    ] {
        assert_eq!(metrics.get(series), Some(&value), "{series} in:\n{text}");
    }
    // A shared store has a local tier in front (on once its feed is up);
    // sled has none, so no series.
    let shared = matches!(
        std::env::var("DEDUPD_TEST_STORE").as_deref(),
        Ok("postgres" | "redis" | "redis-cluster")
    );
    assert_eq!(
        text.contains(r#"dedupd_local_tier_on{tier="local"}"#),
        shared,
        "{text}"
    );

    // A call whose message never comes is refused after the read timeout.
    let tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut ready = send.ready().await.unwrap();
    let call = grpc_request_head(server.addr, "Claim");
    let (response, _message) = ready.send_request(call, false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .expect("the stalled call is answered")
        .unwrap();
    assert_eq!(
        response
            .headers()
            .get("grpc-status")
            .map(|code| code.as_bytes()),
        Some(&b"4"[..])
    );
    let (_, text) = common::ops_http::get(ops, "/metrics").await;
    assert_eq!(
        samples(&text).get(r#"dedupd_refusals_total{reason="read_timeout"}"#),
        Some(&1.0),
        "{text}"
    );
    stop(server).await;
}
