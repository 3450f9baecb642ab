//! The HTTP idempotency proxy: a real upstream that counts its calls, the
//! proxy on the sled store, real HTTP/1.1 and HTTP/2 clients; and the
//! `dedupd` binary with `--http-proxy-listen`, killed with SIGKILL between
//! a request and its retry, and in the middle of one. The promise under
//! test: a keyed request reaches the upstream at most once, whatever the
//! client retries and whatever fails.

mod common;

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use dedupd::proxy::{
    idempotency::{CallerScope, KeySyntax, RoutePattern},
    server::AfterUnknownOutcome,
};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioExecutor;

use common::proxy::*;

#[tokio::test]
async fn twenty_identical_posts_reach_the_upstream_once() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let body = r#"{"amount":10,"currency":"EUR"}"#;
    let answers = futures_util::future::join_all(
        (0..20).map(|_| post(proxy.address, "/orders", "\"order-1\"", body)),
    )
    .await;
    assert_eq!(
        upstream.calls.get("/orders"),
        1,
        "the upstream saw one request"
    );
    let originals = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED && !replayed(a))
        .count();
    assert_eq!(originals, 1);
    for answer in &answers {
        match answer.status {
            StatusCode::CREATED => assert_eq!(answer.body, "{\"order\":1}"),
            StatusCode::CONFLICT => {
                assert_eq!(answer.headers["content-type"], "application/problem+json");
                assert!(answer.headers.contains_key("retry-after"));
                assert!(answer.body.contains("request-in-progress"));
            }
            other => panic!("unexpected {other}: {}", answer.body),
        }
    }

    let retry = post(proxy.address, "/orders", "\"order-1\"", body).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(replayed(&retry));
    assert_eq!(retry.body, "{\"order\":1}");
    assert_eq!(
        retry.headers["x-upstream-call"], "1",
        "the upstream's headers are replayed"
    );
    assert!(retry.headers.contains_key("idempotency-key-expires"));
    assert_eq!(upstream.calls.get("/orders"), 1);
}

#[tokio::test]
async fn json_key_order_does_not_matter_but_another_payload_is_refused() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let first = post(proxy.address, "/echo", "\"k\"", r#"{"a":1,"b":[1,2]}"#).await;
    assert_eq!(first.status, StatusCode::OK);
    let reordered = send(
        proxy.address,
        Method::POST,
        "/echo",
        Some("\"k\""),
        Some(CALLER),
        "{ \"b\": [1, 2], \"a\": 1 }",
    )
    .await;
    assert_eq!(reordered.status, StatusCode::OK);
    assert!(replayed(&reordered));
    assert_eq!(reordered.body, r#"{"a":1,"b":[1,2]}"#);
    let other = post(proxy.address, "/echo", "\"k\"", r#"{"a":2,"b":[1,2]}"#).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.headers["content-type"], "application/problem+json");
    assert!(other.body.contains("idempotency-key-reused"));
    assert_eq!(upstream.calls.get("/echo"), 1);
}

#[tokio::test]
async fn callers_keys_never_collide() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for caller in ["Bearer alice", "Bearer bob"] {
        let answer = send(
            proxy.address,
            Method::POST,
            "/echo",
            Some("\"same\""),
            Some(caller),
            "{}",
        )
        .await;
        assert!(!replayed(&answer), "{caller} got another caller's replay");
    }
    assert_eq!(upstream.calls.get("/echo"), 2);
}

/// Issue 40 item 1: a service that did the work and then failed (500) is
/// not run again by a retry — the 500 is the outcome, replayed; only an
/// answer that says it did not act (429 by default) releases the key.
#[tokio::test]
async fn a_server_error_after_the_work_is_replayed_and_a_429_releases_the_key() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let first = post(proxy.address, "/flaky", "\"f\"", "{}").await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    for _ in 0..2 {
        let retry = post(proxy.address, "/flaky", "\"f\"", "{}").await;
        assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(replayed(&retry), "a retry after a 500 is a replay");
        assert_eq!(retry.body, "boom");
    }
    assert_eq!(upstream.calls.get("/flaky"), 1, "the work ran once");

    let busy = post(proxy.address, "/busy", "\"b\"", "{}").await;
    assert_eq!(busy.status, StatusCode::TOO_MANY_REQUESTS);
    let retry = post(proxy.address, "/busy", "\"b\"", "{}").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!replayed(&retry));
    assert_eq!(upstream.calls.get("/busy"), 2);
    let again = post(proxy.address, "/busy", "\"b\"", "{}").await;
    assert!(replayed(&again));
    assert_eq!(again.body, "{\"call\":2}");

    let text = proxy.metrics.render();
    for (result, count) in [("released", 1), ("forwarded", 2), ("replayed", 3)] {
        let line = format!("dedupd_http_proxy_requests_total{{result=\"{result}\"}} {count}");
        assert!(text.contains(&line), "no {line:?} in\n{text}");
    }
    assert!(
        text.contains("dedupd_http_proxy_added_seconds_count 6"),
        "{text}"
    );
}

/// The operator's "did not act" set replaces the default: a service that
/// sheds load with its own 503 (no gateway in front) releases with
/// `--release-on-status 503`; 429 is then an outcome like any other. (By
/// default a 503 is a gateway's: `a_gateway_timeout_is_an_unknown_outcome`.)
#[tokio::test]
async fn the_release_statuses_are_the_operators() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.release_on.statuses = vec![StatusCode::SERVICE_UNAVAILABLE];
    })
    .await;
    let shed = post(proxy.address, "/shed", "\"s\"", "{}").await;
    assert_eq!(shed.status, StatusCode::SERVICE_UNAVAILABLE);
    let retry = post(proxy.address, "/shed", "\"s\"", "{}").await;
    assert_eq!(
        (retry.status, replayed(&retry)),
        (StatusCode::CREATED, false)
    );
    let busy = post(proxy.address, "/busy", "\"b\"", "{}").await;
    assert_eq!(busy.status, StatusCode::TOO_MANY_REQUESTS);
    let retry = post(proxy.address, "/busy", "\"b\"", "{}").await;
    assert_eq!(
        (retry.status, replayed(&retry)),
        (StatusCode::TOO_MANY_REQUESTS, true)
    );
    assert_eq!(upstream.calls.get("/shed"), 2);
    assert_eq!(upstream.calls.get("/busy"), 1);
}

/// Issue 40 item 4: two `Idempotency-Key` lines are one invalid value
/// (RFC 8941), refused before anything is sent — even when both lines
/// agree, and over gRPC metadata too.
#[tokio::test]
async fn a_key_header_given_twice_is_400_and_not_forwarded() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for (first, second) in [("\"a\"", "\"b\""), ("\"a\"", "\"a\"")] {
        let request = Request::builder()
            .method(Method::POST)
            .header("authorization", "Bearer alice")
            .header("idempotency-key", first)
            .header("idempotency-key", second);
        let answer = exchange(proxy.address, request, "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.body);
        assert_eq!(problem_type(&answer), "invalid-idempotency-key");
        assert!(answer.body.contains("more than once"), "{}", answer.body);
    }
    let request = Request::builder()
        .method(Method::POST)
        .header("content-type", "application/grpc")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b");
    let answer = exchange(proxy.address, request, "").await;
    assert_eq!(
        answer
            .headers
            .get("grpc-status")
            .map(|v| v.to_str().unwrap()),
        Some("3"),
        "INVALID_ARGUMENT"
    );
    assert_eq!(upstream.calls.get("/cookie"), 0, "nothing was forwarded");
}

#[tokio::test]
async fn bad_or_missing_keys_are_400_and_other_requests_pass_through() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for bad in ["two words", "a,b", "\"open", "\"\""] {
        let answer = post(proxy.address, "/echo", bad, "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bad}");
        assert!(answer.body.contains("invalid-idempotency-key"));
    }
    let long = format!("\"{}\"", "k".repeat(256));
    let answer = post(proxy.address, "/echo", &long, "{}").await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        upstream.calls.get("/echo"),
        0,
        "refused requests never reach the upstream"
    );

    // No key, or a method that is not deduplicated: straight through, each time.
    for _ in 0..2 {
        send(proxy.address, Method::POST, "/echo", None, None, "{}").await;
        send(
            proxy.address,
            Method::PUT,
            "/echo",
            Some("\"k\""),
            None,
            "{}",
        )
        .await;
    }
    assert_eq!(upstream.calls.get("/echo"), 4);

    // Required on POST /echo/** and on /orders/*/refunds, for any
    // deduplicated method; nowhere else.
    let strict = proxy_with(&upstream, |config| {
        config.require_key = ["POST /echo/**", "/orders/*/refunds"]
            .iter()
            .map(|pattern| RoutePattern::parse(pattern).unwrap())
            .collect();
    })
    .await;
    let mut refused = Vec::new();
    for (method, path) in [
        (Method::POST, "/echo"),
        (Method::POST, "/echo/deeper/still"),
        (Method::PATCH, "/orders/7/refunds"),
        (Method::POST, "/orders/7/refunds"),
    ] {
        let missing = send(strict.address, method.clone(), path, None, None, "{}").await;
        assert_eq!(missing.status, StatusCode::BAD_REQUEST, "{method} {path}");
        assert!(missing.body.contains("missing-idempotency-key"));
        refused.push(path);
    }
    assert_eq!(upstream.calls.get("/echo"), 4, "refused: {refused:?}");
    for (method, path) in [
        (Method::PATCH, "/echo"),
        (Method::PUT, "/orders/7/refunds"),
        (Method::POST, "/orders/7/refunds/1"),
        (Method::POST, "/other"),
    ] {
        let before = upstream.calls.get(path);
        let passed = send(strict.address, method.clone(), path, None, None, "{}").await;
        assert_ne!(passed.status, StatusCode::BAD_REQUEST, "{method} {path}");
        assert_eq!(upstream.calls.get(path), before + 1, "{method} {path}");
    }
}

#[tokio::test]
async fn an_http2_client_is_deduplicated_too() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let client = http2_client();
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let request = Request::post(format!("http://{}/echo", proxy.address))
            .header("idempotency-key", "\"h2\"")
            .header("authorization", CALLER)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"x\":1}")))
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        statuses.push((
            response.status(),
            response.headers().contains_key("idempotent-replayed"),
        ));
    }
    assert_eq!(statuses, [(StatusCode::OK, false), (StatusCode::OK, true)]);
    assert_eq!(upstream.calls.get("/echo"), 1);
}

#[tokio::test]
async fn a_client_that_disconnects_still_gets_its_result_committed() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    // Give up long before the upstream's 200 ms answer.
    let abandoned = tokio::time::timeout(
        Duration::from_millis(50),
        post(proxy.address, "/orders", "\"gone\"", "{}"),
    )
    .await;
    assert!(abandoned.is_err());
    let mut replay = None;
    // Long enough to outlast the lease (5 s) if the claim were orphaned.
    for _ in 0..300 {
        let answer = post(proxy.address, "/orders", "\"gone\"", "{}").await;
        if answer.status == StatusCode::CREATED {
            replay = Some(answer);
            break;
        }
        assert_eq!(answer.status, StatusCode::CONFLICT);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let replay = replay.expect("the abandoned request was committed");
    assert!(replayed(&replay));
    assert_eq!(upstream.calls.get("/orders"), 1);
}

/// The record survives the sidecar: a request answered, the binary killed
/// with SIGKILL, restarted on the same store with `flags`, and the retry is
/// a replay.
async fn record_survives_a_kill_9(flags: &[&str]) {
    let upstream = upstream().await;
    let data = tempfile::tempdir().unwrap();
    let upstream_url = format!("http://{}", upstream.address);
    let mut flags = flags.to_vec();
    flags.push(&upstream_url);
    let sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let first = post(proxy_address(&sidecar), "/orders", "\"k9\"", "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    sidecar.kill_9();

    let sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let retry = post(proxy_address(&sidecar), "/orders", "\"k9\"", "{}").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(replayed(&retry), "{:?}", retry.headers);
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.calls.get("/orders"), 1);
}

#[tokio::test]
async fn the_record_survives_a_kill_9_between_request_and_retry_on_sled() {
    record_survives_a_kill_9(&[
        "--http-proxy-listen",
        "127.0.0.1:0",
        "--http-proxy-upstream",
    ])
    .await;
}

/// The same through `dedupd http-proxy` (its `--listen` is the proxy's; the
/// sidecar helper's `--listen 127.0.0.1:0` lands there) on PostgreSQL.
#[tokio::test]
async fn the_record_survives_a_kill_9_between_request_and_retry_on_postgres() {
    if !common::postgres::available() {
        return;
    }
    let schema = common::postgres::fresh_schema();
    record_survives_a_kill_9(&[
        "http-proxy",
        "--grpc-listen",
        "127.0.0.1:0",
        "--store",
        "postgres",
        "--store-url",
        common::postgres::url(),
        "--store-schema",
        &schema,
        "--upstream",
    ])
    .await;
    common::postgres::drop_schema(&schema).await;
}

#[test]
fn bad_proxy_flags_exit_64_with_one_line() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--http-proxy-listen", "127.0.0.1:0"],
            "http-proxy-upstream",
        ),
        (
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "https://x:1",
            ],
            "http://HOST:PORT",
        ),
        (
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "http://127.0.0.1:1",
                "--http-proxy-methods",
                "PO ST",
            ],
            "not an HTTP method",
        ),
        (
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "http://127.0.0.1:1",
                "--http-proxy-retention",
                "900days",
            ],
            "http-proxy-retention",
        ),
        (
            &["http-proxy", "--upstream", "http://127.0.0.1:1"],
            "--listen",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--retention",
                "900days",
            ],
            "--retention must be at most 365days, got 900days",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--require-key",
                "GET /reports/**",
            ],
            "--require-key \"GET /reports/**\": GET is not in --methods",
        ),
        (
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "http://127.0.0.1:1",
                "--http-proxy-require-key",
                "payments/**",
            ],
            "--http-proxy-require-key \"payments/**\": \"payments/**\" is neither * nor a path",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--release-on-status",
                "429,200",
            ],
            "--release-on-status \"200\": a status of 400-599",
        ),
        (
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "http://127.0.0.1:1",
                "--http-proxy-release-on-status",
                "none,429",
            ],
            "--http-proxy-release-on-status none cannot be given with other values",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--release-on-grpc-code",
                "ABORTED,ok",
            ],
            "--release-on-grpc-code \"ok\": a gRPC code other than OK",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--max-response-bytes",
                "1000000000",
            ],
            "--max-response-bytes must be at most 67108864",
        ),
        (
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
                "--fingerprint-header",
                "stripe account",
            ],
            "--fingerprint-header \"stripe account\" is not a header name",
        ),
    ];
    for (flags, expected) in cases {
        let output = std::process::Command::new(common::sidecar::BINARY)
            .args(*flags)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(64), "{flags:?}");
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(expected), "{flags:?}: {stderr}");
    }
}

/// An HTTP/1.0 upstream (Python's http.server, say): the client still gets
/// an HTTP/1.1 answer on its keep-alive connection, first and replayed.
#[tokio::test]
async fn an_http_1_0_upstream_is_answered_in_the_clients_version() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                // Headers, then the 2-byte body the tests send.
                while !request.windows(4).any(|w| w == b"\r\n\r\n") || !request.ends_with(b"{}") {
                    let read = stream.read(&mut buffer).await.unwrap();
                    if read == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..read]);
                }
                let _ = stream
                    .write_all(b"HTTP/1.0 201 Created\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\r\n{\"id\":1}")
                    .await;
            });
        }
    });
    let upstream = Upstream::elsewhere(address);
    let proxy = proxy(&upstream).await;
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    for replay in [false, true] {
        let request = Request::post(format!("http://{}/orders", proxy.address))
            .header("idempotency-key", "\"v10\"")
            .header("authorization", CALLER)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let response = client.request(request).await.unwrap();
        if response.status() != StatusCode::CREATED {
            let body = response.into_body().collect().await.unwrap().to_bytes();
            panic!("replay {replay}: {}", String::from_utf8_lossy(&body));
        }
        assert_eq!(
            response.version(),
            http::Version::HTTP_11,
            "replay: {replay}"
        );
        assert_eq!(
            response.headers().contains_key("idempotent-replayed"),
            replay
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"{\"id\":1}");
    }
}

/// A response over the size kept for replay still reaches the client; the
/// key is committed, and a retry is told the result cannot be replayed
/// (never runs the request again).
#[tokio::test]
async fn a_response_too_large_to_keep_is_answered_once_and_not_replayed() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| config.max_response_bytes = 8).await;
    let body = r#"{"a long":"body of more than eight bytes"}"#;
    let first = post(proxy.address, "/echo", "\"big\"", body).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body, body);
    let retry = post(proxy.address, "/echo", "\"big\"", body).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert!(
        retry.body.contains("response-not-replayable"),
        "{}",
        retry.body
    );
    assert_eq!(upstream.calls.get("/echo"), 1);
}

/// gRPC unary calls carrying `idempotency-key` metadata: the answer —
/// message and trailers, or an error status — is replayed without calling
/// the service again; another request under the same key is
/// INVALID_ARGUMENT. The service here is a real dedupd.
#[tokio::test]
async fn grpc_unary_calls_are_replayed_with_their_status() {
    use dedupd::proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient};
    let service = common::TestServer::start().await;
    let upstream = Upstream::elsewhere(service.addr);
    let proxy = proxy(&upstream).await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", proxy.address))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = ClaimAndCommitClient::new(channel);
    fn keyed<T>(message: T, key: &str) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
        request
            .metadata_mut()
            .insert("authorization", "Bearer grpc-client".parse().unwrap());
        request
    }

    let first = client
        .claim(keyed(common::claim_request("grpc-1"), "claim-1"))
        .await
        .unwrap();
    assert!(!first.metadata().contains_key("idempotent-replayed"));
    let first = first.into_inner();
    assert_eq!(common::outcome(&first), pb::ClaimOutcome::Claimed);
    let replay = client
        .claim(keyed(common::claim_request("grpc-1"), "claim-1"))
        .await
        .unwrap();
    assert_eq!(
        replay.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(
        replay.into_inner(),
        first,
        "the same answer, lease token and all"
    );
    // The service saw one Claim: called directly, the key is still held.
    let direct = service
        .client()
        .await
        .claim(common::claim_request("grpc-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(common::outcome(&direct), pb::ClaimOutcome::InProgress);

    // An error the request itself caused is kept and replayed, status,
    // message and details.
    let wrong_token = common::commit_request("grpc-1", &"0".repeat(32));
    let refused = client
        .commit(keyed(wrong_token.clone(), "commit-1"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let replayed_refusal = client
        .commit(keyed(wrong_token, "commit-1"))
        .await
        .unwrap_err();
    assert_eq!(replayed_refusal.code(), tonic::Code::FailedPrecondition);
    assert_eq!(replayed_refusal.message(), refused.message());
    assert_eq!(replayed_refusal.details(), refused.details());
    assert_eq!(
        replayed_refusal
            .metadata()
            .get("idempotent-replayed")
            .unwrap(),
        "true"
    );

    // The same key with another request.
    let mismatch = client
        .claim(keyed(common::claim_request("grpc-2"), "claim-1"))
        .await
        .unwrap_err();
    assert_eq!(mismatch.code(), tonic::Code::InvalidArgument);
    assert!(
        mismatch.message().contains("different request"),
        "{}",
        mismatch.message()
    );

    // Without a key, calls pass straight through (the service answers
    // IN_PROGRESS: it holds grpc-1).
    let passed = client
        .claim(common::claim_request("grpc-1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(common::outcome(&passed), pb::ClaimOutcome::InProgress);
}

/// With a wait for in-flight requests, a retry arriving while the first
/// runs gets its result instead of a 409.
#[tokio::test]
async fn a_retry_can_wait_for_the_first_requests_result() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.wait_in_flight = Duration::from_secs(5);
    })
    .await;
    let first = post(proxy.address, "/orders", "\"w\"", "{}");
    let retry = async {
        // Sent while the upstream (200 ms) still works on the first.
        tokio::time::sleep(Duration::from_millis(50)).await;
        post(proxy.address, "/orders", "\"w\"", "{}").await
    };
    let (first, retry) = tokio::join!(first, retry);
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.body);
    // Whichever claimed first (on a slow machine the "retry" may), the
    // other waited and got its answer replayed.
    assert_eq!(
        [replayed(&first), replayed(&retry)]
            .iter()
            .filter(|r| **r)
            .count(),
        1
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.calls.get("/orders"), 1);
}

/// The upstream takes 2.5 s, the proxy waits 1 s: the client gets 502
/// outcome-unknown, and every retry — at once, while the upstream still
/// works, and after it finished — gets the same, never a second send.
#[tokio::test]
async fn a_slow_upstream_runs_once_whatever_the_client_retries() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.upstream_timeout = Duration::from_secs(1);
    })
    .await;
    let first = post(proxy.address, "/slow", "s-1", "{}").await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{}", first.body);
    assert_eq!(problem_type(&first), "outcome-unknown");
    assert!(
        first.body.contains("did not answer within 1s"),
        "{}",
        first.body
    );
    let during = post(proxy.address, "/slow", "s-1", "{}").await;
    assert_eq!(during.status, StatusCode::BAD_GATEWAY);
    assert_eq!(problem_type(&during), "outcome-unknown");
    // The upstream finishes its one call.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    for _ in 0..3 {
        let after = post(proxy.address, "/slow", "s-1", "{}").await;
        assert_eq!(after.status, StatusCode::BAD_GATEWAY);
        assert_eq!(problem_type(&after), "outcome-unknown");
    }
    assert_eq!(upstream.calls.get("/slow"), 1);
    let text = proxy.metrics.render();
    assert!(
        text.contains("dedupd_http_proxy_requests_total{result=\"outcome_unknown\"} 5"),
        "{text}"
    );
}

/// `--after-unknown-outcome retry` is the opt-in to at-least-once: the same
/// timeout releases the key and the retry is sent again.
#[tokio::test]
async fn after_unknown_outcome_retry_sends_the_retry_again() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.upstream_timeout = Duration::from_secs(1);
        config.after_unknown_outcome = AfterUnknownOutcome::Retry;
    })
    .await;
    let first = post(proxy.address, "/slow", "r-1", "{}").await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    assert_eq!(problem_type(&first), "upstream-failed");
    let retry = post(proxy.address, "/slow", "r-1", "{}").await;
    assert_eq!(problem_type(&retry), "upstream-failed");
    assert_eq!(upstream.calls.get("/slow"), 2);
}

/// A connection closed after the request was sent is an unknown outcome;
/// a connection that could not be made at all (nothing sent) releases the
/// key.
#[tokio::test]
async fn a_reset_is_an_unknown_outcome_but_a_refused_connection_releases() {
    let upstream = hanging_up_upstream().await;
    let proxy = proxy(&upstream).await;
    for _ in 0..3 {
        let answer = post(proxy.address, "/orders", "reset-1", "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{}", answer.body);
        assert_eq!(problem_type(&answer), "outcome-unknown");
    }
    assert_eq!(upstream.calls.get("/hang-up"), 1);

    // A port nobody listens on.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let nowhere = Upstream::elsewhere(closed.local_addr().unwrap());
    drop(closed);
    let refusing = self::proxy(&nowhere).await;
    for _ in 0..2 {
        let answer = post(refusing.address, "/orders", "refused-1", "{}").await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
        assert_eq!(
            problem_type(&answer),
            "upstream-failed",
            "released, so the retry is tried again: {}",
            answer.body
        );
    }
}

/// By default a record is scoped by the caller's credentials: two callers
/// with the same key (and body, and route) never see each other's body or
/// session cookie, and a caller's own retry never gets its cookie back.
#[tokio::test]
async fn two_callers_never_see_each_others_body_or_cookie() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let as_caller = |credentials: (&'static str, &'static str)| {
        Request::post("/")
            .header("idempotency-key", "shared-key")
            .header(credentials.0, credentials.1)
    };
    let alice = exchange(
        proxy.address,
        as_caller(("authorization", "Bearer alice")),
        "{}",
    )
    .await;
    assert_eq!(alice.status, StatusCode::CREATED);
    assert_eq!(alice.headers["set-cookie"], "session=Bearer-alice");
    let bob = exchange(
        proxy.address,
        as_caller(("authorization", "Bearer bob")),
        "{}",
    )
    .await;
    assert!(!replayed(&bob), "bob got alice's record: {}", bob.body);
    assert!(bob.body.contains("Bearer bob"), "{}", bob.body);
    assert_eq!(bob.headers["set-cookie"], "session=Bearer-bob");
    // Cookie-only callers are told apart by their cookies.
    let carol = exchange(proxy.address, as_caller(("cookie", "sid=carol")), "{}").await;
    let dave = exchange(proxy.address, as_caller(("cookie", "sid=dave")), "{}").await;
    assert!(!replayed(&carol) && !replayed(&dave));
    assert_eq!(upstream.calls.get("/cookie"), 4);

    let alice_again = exchange(
        proxy.address,
        as_caller(("authorization", "Bearer alice")),
        "{}",
    )
    .await;
    assert!(replayed(&alice_again));
    assert_eq!(alice_again.body, alice.body);
    assert!(
        !alice_again.headers.contains_key("set-cookie"),
        "a replay never hands out a session"
    );
    assert_eq!(upstream.calls.get("/cookie"), 4);

    // A second Authorization value is part of the identity: it cannot be
    // used to step into alice's record.
    let smuggled = exchange(
        proxy.address,
        as_caller(("authorization", "Bearer alice")).header("authorization", "Bearer mallory"),
        "{}",
    )
    .await;
    assert!(!replayed(&smuggled));

    // Named scope headers: every value of each, in order.
    let by_tenant = proxy_with(&upstream, |config| {
        config.scope = CallerScope::Headers(vec![http::HeaderName::from_static("x-tenant")]);
        config.never_store = vec![http::HeaderName::from_static("x-upstream-call")];
    })
    .await;
    let t1 = exchange(by_tenant.address, as_caller(("x-tenant", "t1")), "{}").await;
    let t1_t2 = exchange(
        by_tenant.address,
        as_caller(("x-tenant", "t1")).header("x-tenant", "t2"),
        "{}",
    )
    .await;
    assert!(!replayed(&t1_t2), "a second value chose another scope");
    let t1_again = exchange(by_tenant.address, as_caller(("x-tenant", "t1")), "{}").await;
    assert!(replayed(&t1_again));
    assert!(t1.headers.contains_key("x-upstream-call"));
    assert!(
        !t1_again.headers.contains_key("x-upstream-call"),
        "--never-store-header is neither stored nor replayed"
    );
}

/// Stripe's bare keys and the draft's quoted ones are the same key;
/// `--strict-key-syntax` accepts only the draft's.
#[tokio::test]
async fn bare_and_quoted_keys_dedupe_together() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let bare = post(proxy.address, "/orders", uuid, "{}").await;
    assert_eq!(bare.status, StatusCode::CREATED, "{}", bare.body);
    let quoted = post(proxy.address, "/orders", &format!("\"{uuid}\""), "{}").await;
    assert!(replayed(&quoted));
    assert_eq!(quoted.body, bare.body);
    assert_eq!(upstream.calls.get("/orders"), 1);

    let strict = proxy_with(&upstream, |config| config.key_syntax = KeySyntax::Strict).await;
    let refused = post(strict.address, "/orders", uuid, "{}").await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(problem_type(&refused), "invalid-idempotency-key");
    assert_eq!(upstream.calls.get("/orders"), 1);
}

/// Issue 40 item 2: tenants identified by `X-API-Key` alone never share a
/// record; a keyed request that names no caller is refused before its
/// body is read (unless the operator said `--scope none`); an account
/// header named with `--fingerprint-header` makes the same key and body
/// for another account a mismatch, never the first account's answer.
#[tokio::test]
async fn callers_are_always_told_apart_and_anonymous_keyed_requests_are_refused() {
    let upstream = upstream().await;
    let proxy = proxy_with(&upstream, |config| {
        config.fingerprint_headers = vec![http::HeaderName::from_static("stripe-account")];
    })
    .await;
    let keyed = |headers: &[(&'static str, &'static str)]| {
        let mut request = Request::post("/").header("idempotency-key", "card-charge");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request
    };
    let tenant_a = exchange(proxy.address, keyed(&[("x-api-key", "key-a")]), "{}").await;
    let tenant_b = exchange(proxy.address, keyed(&[("x-api-key", "key-b")]), "{}").await;
    assert_eq!(tenant_a.status, StatusCode::CREATED);
    assert_eq!(tenant_b.status, StatusCode::CREATED);
    assert!(
        !replayed(&tenant_b),
        "tenant B got tenant A's stored answer"
    );
    assert_eq!(upstream.calls.get("/cookie"), 2);

    let anonymous = exchange(proxy.address, keyed(&[]), "{}").await;
    assert_eq!(
        anonymous.status,
        StatusCode::BAD_REQUEST,
        "{}",
        anonymous.body
    );
    assert_eq!(problem_type(&anonymous), "caller-unidentified");
    assert!(anonymous.body.contains("X-API-Key"), "{}", anonymous.body);
    assert_eq!(upstream.calls.get("/cookie"), 2, "not forwarded");

    let account = |id: &'static str| {
        Request::post("/")
            .header("idempotency-key", "payout")
            .header("x-api-key", "key-a")
            .header("stripe-account", id)
    };
    let first = exchange(proxy.address, account("acct_1"), "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = exchange(proxy.address, account("acct_2"), "{}").await;
    assert_eq!(
        other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        other.body
    );
    assert_eq!(problem_type(&other), "idempotency-key-reused");
    assert_eq!(upstream.calls.get("/cookie"), 3);

    let shared = proxy_with(&upstream, |config| config.scope = CallerScope::Shared).await;
    let anonymous = exchange(shared.address, keyed(&[]), "{}").await;
    assert_eq!(anonymous.status, StatusCode::CREATED);
    assert_eq!(upstream.calls.get("/cookie"), 4);
}

/// Two IDs a double cannot tell apart are two payloads: the second is 422,
/// not the first one's answer.
#[tokio::test]
async fn numbers_beyond_2_pow_53_are_not_confused() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    let first = post(
        proxy.address,
        "/echo",
        "big-id",
        r#"{"id":9007199254740993}"#,
    )
    .await;
    assert_eq!(first.status, StatusCode::OK);
    let other = post(
        proxy.address,
        "/echo",
        "big-id",
        r#"{"id":9007199254740992}"#,
    )
    .await;
    assert_eq!(
        other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        other.body
    );
    let same = post(
        proxy.address,
        "/echo",
        "big-id",
        r#"{ "id": 9007199254740993 }"#,
    )
    .await;
    assert!(replayed(&same));
    assert_eq!(upstream.calls.get("/echo"), 1);
}

/// Issue 40 item 5: the store applies the claim but its answers are lost
/// (the proxy answers 503, nothing sent). The claim is given back in the
/// background once the store answers again, so the client's retry is sent
/// — it used to find the key held (409) for the lease, then "outcome
/// unknown" for the retention, though nothing was ever sent.
#[tokio::test]
async fn a_claim_whose_answer_was_lost_is_given_back_and_the_retry_is_sent() {
    let upstream = upstream().await;
    let lose = Arc::new(AtomicBool::new(true));
    let store = common::FailingStore::losing_answers(Arc::default(), Arc::clone(&lose));
    let proxy = proxy_on(&upstream, store, tempfile::tempdir().unwrap(), |config| {
        config.lease_ttl = Duration::from_secs(8);
    })
    .await;
    let first = post(proxy.address, "/orders", "lost-claim", "{}").await;
    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        first.body
    );
    assert_eq!(problem_type(&first), "store-unavailable");
    lose.store(false, Ordering::SeqCst);
    let started = Instant::now();
    let mut retry = post(proxy.address, "/orders", "lost-claim", "{}").await;
    while retry.status == StatusCode::CONFLICT && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        retry = post(proxy.address, "/orders", "lost-claim", "{}").await;
    }
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.body);
    assert!(!replayed(&retry));
    assert_eq!(upstream.calls.get("/orders"), 1, "sent once, by the retry");
}

/// The store stops taking writes the moment the upstream answers. A short
/// outage: the commit is retried (the lease renewed) and the answer is
/// replayable. A long one: the client gets the answer marked
/// `idempotency-replayable: false`, and a retry — once the store is back
/// and the lease over — is answered outcome-unknown, not sent again.
#[tokio::test]
async fn a_store_outage_between_the_answer_and_the_commit() {
    let upstream = upstream().await;
    let store = common::FailingStore::new(Arc::clone(&upstream.store_down));
    let proxy = proxy_on(&upstream, store, tempfile::tempdir().unwrap(), |config| {
        config.lease_ttl = Duration::from_secs(2);
    })
    .await;
    let heal = |after: Duration| {
        let down = Arc::clone(&upstream.store_down);
        tokio::spawn(async move {
            while !down.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(after).await;
            down.store(false, Ordering::SeqCst);
        })
    };

    let healing = heal(Duration::from_millis(400));
    let first = post(proxy.address, "/outage", "brief", "{}").await;
    healing.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.headers.contains_key("idempotency-replayable"));
    let retry = post(proxy.address, "/outage", "brief", "{}").await;
    assert!(replayed(&retry), "{}", retry.body);
    assert_eq!(upstream.calls.get("/outage"), 1);

    let healing = heal(Duration::from_secs(3));
    let first = post(proxy.address, "/outage", "long", "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.headers["idempotency-replayable"], "false");
    healing.await.unwrap();
    // The claim's lease (2 s) has ended by now: the retry recovers it.
    let mut retry = post(proxy.address, "/outage", "long", "{}").await;
    for _ in 0..100 {
        if retry.status != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        retry = post(proxy.address, "/outage", "long", "{}").await;
    }
    assert_eq!(retry.status, StatusCode::BAD_GATEWAY, "{}", retry.body);
    assert_eq!(problem_type(&retry), "outcome-unknown");
    assert_eq!(upstream.calls.get("/outage"), 2, "one call per key");
}

/// Issue 40 item 9: under Kubernetes, the proxy on the embedded store warns
/// at start that replicas do not share its records (a retry sent to
/// another pod is forwarded again); elsewhere it says nothing of it.
#[test]
fn the_proxy_on_the_embedded_store_warns_under_kubernetes() {
    // Empty, not unset: the tests may themselves run in a pod.
    for (host, warned) in [("10.96.0.1", true), ("", false)] {
        let environment = [("KUBERNETES_SERVICE_HOST", host)];
        let data = tempfile::tempdir().unwrap();
        let mut sidecar = common::sidecar::Sidecar::start_in_environment(
            &[],
            data.path(),
            &[
                "--http-proxy-listen",
                "127.0.0.1:0",
                "--http-proxy-upstream",
                "http://127.0.0.1:1",
            ],
            &environment,
        );
        common::sidecar::terminate(&mut sidecar, Duration::from_secs(20));
        let log = sidecar.log_after_exit();
        assert_eq!(
            log.contains("a retry that reaches another pod is forwarded again"),
            warned,
            "{log}"
        );
    }
}

/// Issue 40 item 9, decided: the route is the path as sent —
/// `/echo` and `/echo/` are two records, as they may be two resources to
/// the service (one may redirect, and its 308 is what a retry of it gets).
#[tokio::test]
async fn a_trailing_slash_is_another_route() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for path in ["/echo", "/echo/", "/echo"] {
        post(proxy.address, path, "\"slash\"", "{}").await;
    }
    assert_eq!(upstream.calls.get("/echo"), 1);
    assert_eq!(upstream.calls.get("/echo/"), 1);
}

/// Through the binary on `store_flags`: the slow upstream's request is
/// sent once whatever the client retries, and a proxy killed with SIGKILL
/// while the upstream works leaves a claim the next proxy answers
/// outcome-unknown instead of sending again.
async fn at_most_once_through_the_binary(store_flags: &[&str]) {
    let upstream = upstream().await;
    let data = tempfile::tempdir().unwrap();
    let upstream_url = format!("http://{}", upstream.address);
    let mut flags = store_flags.to_vec();
    flags.extend([
        "--http-proxy-listen",
        "127.0.0.1:0",
        "--http-proxy-upstream",
        &upstream_url,
        "--http-proxy-upstream-timeout",
        "1s",
        "--default-lease-ttl",
        "2s",
    ]);
    let sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let address = proxy_address(&sidecar);
    for attempt in 0..3 {
        let answer = post(address, "/slow", "timed-out", "{}").await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_GATEWAY,
            "attempt {attempt}: {}",
            answer.body
        );
        assert_eq!(problem_type(&answer), "outcome-unknown");
    }
    assert_eq!(upstream.calls.get("/slow"), 1);

    // Killed while the upstream works on the request (well within the
    // proxy's 1 s timeout).
    let in_flight = tokio::spawn(async move {
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .build_http::<Full<Bytes>>();
        let request = Request::post(format!("http://{address}/slow"))
            .header("idempotency-key", "killed")
            .header("authorization", CALLER)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        client
            .request(request)
            .await
            .map(|response| response.status())
    });
    tokio::time::timeout(Duration::from_secs(5), async {
        while upstream.calls.get("/slow") < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the request reached the upstream");
    sidecar.kill_9();
    assert!(
        in_flight.await.unwrap().is_err(),
        "the killed proxy answered nothing"
    );

    let sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let address = proxy_address(&sidecar);
    let mut answer = post(address, "/slow", "killed", "{}").await;
    // In progress until the dead proxy's lease (2 s) ends.
    for _ in 0..100 {
        if answer.status != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        answer = post(address, "/slow", "killed", "{}").await;
    }
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "{}", answer.body);
    assert_eq!(problem_type(&answer), "outcome-unknown");
    assert!(answer.body.contains("earlier attempt"), "{}", answer.body);
    let again = post(address, "/slow", "killed", "{}").await;
    assert_eq!(problem_type(&again), "outcome-unknown");
    // Whatever the killed proxy's upstream call did, it was the only one.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(upstream.calls.get("/slow"), 2);
    drop(sidecar);
}

#[tokio::test]
async fn at_most_once_across_timeouts_and_a_kill_9_on_sled() {
    at_most_once_through_the_binary(&[]).await;
}

#[tokio::test]
async fn at_most_once_across_timeouts_and_a_kill_9_on_postgres() {
    if !common::postgres::available() {
        return;
    }
    let schema = common::postgres::fresh_schema();
    at_most_once_through_the_binary(&[
        "--store",
        "postgres",
        "--store-url",
        common::postgres::url(),
        "--store-schema",
        &schema,
    ])
    .await;
    common::postgres::drop_schema(&schema).await;
}

/// A 504 (or, by default, a 503: Envoy's "upstream reset before headers")
/// from a gateway in front of the service means the service may have
/// acted: the first client gets that answer, retries get outcome-unknown.
#[tokio::test]
async fn a_gateway_timeout_is_an_unknown_outcome() {
    let upstream = upstream().await;
    let proxy = proxy(&upstream).await;
    for (path, status, body) in [
        (
            "/gateway-timeout",
            StatusCode::GATEWAY_TIMEOUT,
            "upstream request timeout",
        ),
        ("/shed", StatusCode::SERVICE_UNAVAILABLE, "shedding"),
    ] {
        let first = post(proxy.address, path, "gw-1", "{}").await;
        assert_eq!(first.status, status);
        assert_eq!(first.body, body);
        let retry = post(proxy.address, path, "gw-1", "{}").await;
        assert_eq!(retry.status, StatusCode::BAD_GATEWAY);
        assert_eq!(problem_type(&retry), "outcome-unknown");
        assert!(retry.body.contains(status.as_str()), "{}", retry.body);
        assert_eq!(upstream.calls.get(path), 1);
    }
}

/// Issue 40, items 1–4 and 6–8 as the payments team tried them: against
/// the real binary, one scenario after another on one sidecar, then its
/// shutdown and a restart on the same data. (Item 5, a claim whose answer
/// the store lost, needs a store that loses one on demand: in-process,
/// `a_claim_whose_answer_was_lost_is_given_back_and_the_retry_is_sent`.)
#[tokio::test]
async fn the_issues_scenarios_through_the_binary() {
    let upstream = upstream().await;
    let data = tempfile::tempdir().unwrap();
    let upstream_url = format!("http://{}", upstream.address);
    let flags = [
        "--http-proxy-listen",
        "127.0.0.1:0",
        "--http-proxy-upstream",
        &upstream_url,
        "--http-proxy-header-timeout",
        "1s",
        "--max-connection-age",
        "2s",
        "--shutdown-grace",
        "8s",
        "--http-proxy-upstream-idle-timeout",
        "200ms",
    ];
    let mut sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let address = proxy_address(&sidecar);

    // 1. A 500 after the work is the outcome: retries are replays.
    assert_eq!(
        post(address, "/flaky", "charge-1", "{}").await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    for _ in 0..2 {
        let retry = post(address, "/flaky", "charge-1", "{}").await;
        assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(replayed(&retry), "{:?}", retry.headers);
    }
    assert_eq!(upstream.calls.get("/flaky"), 1, "the work ran once");

    // 2. Tenants told apart by X-API-Key alone; no identity at all is 400.
    let tenant = |api_key: &'static str| {
        Request::post("/")
            .header("x-api-key", api_key)
            .header("idempotency-key", "same-key")
    };
    let a = exchange_at(address, "/orders", tenant("tenant-a"), "{}").await;
    let b = exchange_at(address, "/orders", tenant("tenant-b"), "{}").await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(
        !replayed(&b),
        "tenant B was given tenant A's answer: {}",
        b.body
    );
    assert_ne!(a.body, b.body);
    let a_again = exchange_at(address, "/orders", tenant("tenant-a"), "{}").await;
    assert!(replayed(&a_again));
    assert_eq!(a_again.body, a.body);
    let anonymous = exchange_at(
        address,
        "/orders",
        Request::post("/").header("idempotency-key", "same-key"),
        "{}",
    )
    .await;
    assert_eq!(anonymous.status, StatusCode::BAD_REQUEST);
    assert_eq!(problem_type(&anonymous), "caller-unidentified");
    assert_eq!(upstream.calls.get("/orders"), 2);

    // 3. Eight slow 8 MiB bodies from one caller: another's payment goes
    // through.
    let (held, _) = slow_bodies(address).await;
    let payment = payment(address).await;
    assert_eq!(payment.status, StatusCode::OK, "{}", payment.body);
    drop(held);

    // 4. Two key lines: 400, never forwarded.
    let twice = exchange_at(
        address,
        "/orders",
        Request::post("/")
            .header("authorization", CALLER)
            .header("idempotency-key", "k1")
            .header("idempotency-key", "k2"),
        "{}",
    )
    .await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST);
    assert_eq!(upstream.calls.get("/orders"), 2);

    // 6. An idle upstream connection is dropped after the idle timeout,
    // before the upstream's own keep-alive could close it under a request:
    // two requests 700 ms apart open two connections.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let connections = upstream.calls.get(CONNECTIONS);
    post(address, "/echo", "idle-1", "{}").await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    post(address, "/echo", "idle-2", "{}").await;
    assert_eq!(upstream.calls.get(CONNECTIONS), connections + 2);

    // 7. An HTTP/2 client that makes no room for its answer has its stream
    // reset after the header timeout (1 s); its connection, kept open and
    // answering PINGs, is closed at its age (2 s, give or take a tenth).
    let opened = Instant::now();
    let (mut client, connection) = h2_connection(address, 0).await;
    let request = Request::get(format!("http://{address}/big?mib=1"))
        .body(())
        .unwrap();
    let (response, _) = client.send_request(request, true).unwrap();
    let response = response.await.unwrap();
    let asked = Instant::now();
    let next = tokio::time::timeout(Duration::from_secs(10), response.into_body().data())
        .await
        .expect("the zero-window stream was still open after 10 s");
    let reset = next
        .expect("the stream ended")
        .expect_err("data through a zero window");
    assert_eq!(reset.reason(), Some(h2::Reason::CANCEL), "{reset}");
    assert!(asked.elapsed() >= Duration::from_millis(900));
    tokio::time::timeout(Duration::from_secs(10), connection)
        .await
        .expect("the HTTP/2 connection was still open past its age")
        .unwrap()
        .ok();
    assert!(opened.elapsed() >= Duration::from_millis(1800));
    drop(client);

    // 8. SIGTERM while a keyed request is with the service (2.5 s): it is
    // answered and committed within the grace; after a restart, replayed.
    let calls_before = upstream.calls.get("/slow");
    let in_flight = tokio::spawn(async move { post(address, "/slow", "at-shutdown", "{}").await });
    while upstream.calls.get("/slow") == calls_before {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Off the runtime: the upstream answers from this test's runtime.
    let (code, log) = tokio::task::spawn_blocking(move || {
        common::sidecar::terminate(&mut sidecar, Duration::from_secs(15))
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{log}");
    let answered = in_flight.await.unwrap();
    assert_eq!(answered.status, StatusCode::CREATED, "{}", answered.body);
    let sidecar = common::sidecar::Sidecar::start_with(data.path(), &flags);
    let retry = post(proxy_address(&sidecar), "/slow", "at-shutdown", "{}").await;
    assert!(replayed(&retry), "{} {}", retry.status, retry.body);
    assert_eq!(retry.body, answered.body);
    assert_eq!(upstream.calls.get("/slow"), calls_before + 1);
}

/// Sealed answers (issue 43): the proxy replays what the upstream answered
/// while its store's files hold no byte of it; without a key they do (so
/// the look would see it).
#[tokio::test]
async fn a_sealed_answer_is_replayed_and_never_stored_in_plaintext() {
    for sealed in [false, true] {
        let upstream = upstream().await;
        let keyring =
            sealed.then(|| Arc::new(dedupd::sealing::Keyring::from_bytes(&[[9; 32]]).unwrap()));
        let proxy = sealed_proxy(&upstream, tempfile::tempdir().unwrap(), keyring).await;
        let marker = format!("card-ending-{:016x}", rand::random::<u64>());
        let body = format!("{{\"secret\":\"{marker}\"}}");
        let first = post(proxy.address, "/echo", "\"pay-1\"", &body).await;
        let retry = post(proxy.address, "/echo", "\"pay-1\"", &body).await;
        assert_eq!(first.status, StatusCode::OK);
        assert_eq!(retry.body, body, "the retry gets the upstream's answer");
        assert!(replayed(&retry));
        assert_eq!(upstream.calls.get("/echo"), 1);
        let data = proxy._dir.path().to_owned();
        let _ = proxy.stop.send(());
        proxy.served.await.unwrap().unwrap();
        assert_eq!(
            common::files_hold(&data, marker.as_bytes()),
            !sealed,
            "sealed: {sealed}"
        );
    }
}

/// A committed key whose stored answer no longer opens — the proxy restarted
/// with another key, with none, or with the old key declared destroyed — is
/// answered "outcome unknown": never forwarded again, never "store
/// unavailable" to be retried for a day.
#[tokio::test]
async fn an_answer_that_no_longer_opens_is_outcome_unknown_never_forwarded() {
    use dedupd::sealing::Keyring;
    let upstream = upstream().await;
    let key = |byte| Keyring::from_bytes(&[[byte; 32]]).unwrap();
    let first_id = key(1).sealing_id();
    let proxy = sealed_proxy(
        &upstream,
        tempfile::tempdir().unwrap(),
        Some(Arc::new(key(1))),
    )
    .await;
    let first = post(proxy.address, "/echo", "\"pay-2\"", "{\"n\":1}").await;
    assert_eq!(first.status, StatusCode::OK);
    let _ = proxy.stop.send(());
    proxy.served.await.unwrap().unwrap();
    let mut dir = proxy._dir;
    // A key this proxy does not have (not mounted yet, removed too early):
    // 503, retry later; a key destroyed on purpose: 502 outcome unknown.
    for (case, keyring, status, reason) in [
        (
            "another key",
            Some(key(2)),
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
        ),
        (
            "no keys",
            None,
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
        ),
        (
            "destroyed",
            Some(key(2).with_erased(&[first_id]).unwrap()),
            StatusCode::BAD_GATEWAY,
            "outcome-unknown",
        ),
        (
            "sealing off, destroyed",
            Some(Keyring::erased_only(&[first_id])),
            StatusCode::BAD_GATEWAY,
            "outcome-unknown",
        ),
    ] {
        let proxy = sealed_proxy(&upstream, dir, keyring.map(Arc::new)).await;
        let retry = post(proxy.address, "/echo", "\"pay-2\"", "{\"n\":1}").await;
        assert_eq!(retry.status, status, "{case}: {}", retry.body);
        assert!(retry.body.contains(reason), "{case}: {}", retry.body);
        assert!(
            !retry.body.contains("\"n\""),
            "{case}: never the stored bytes: {}",
            retry.body
        );
        assert_eq!(
            upstream.calls.get("/echo"),
            1,
            "{case}: never forwarded again"
        );
        let _ = proxy.stop.send(());
        proxy.served.await.unwrap().unwrap();
        dir = proxy._dir;
    }
}
