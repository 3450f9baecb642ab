//! OpenTelemetry traces from the real binary to a collector of the tests'
//! own (tests/common/otlp.rs): a Claim carrying a W3C `traceparent` comes
//! back as a span of the caller's trace, under the caller's span, with the
//! decision's attributes and child spans; both OTLP transports; the
//! standard `OTEL_*` variables; the proxy's span and the context it hands
//! the upstream; and a collector that is down or silent costs spans
//! (counted), never an answer.

mod common;

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use common::{
    otlp::{self, hex, traceparent, Received},
    sidecar::Sidecar,
};
use dedupd::proto::v1 as pb;
use http_body_util::Full;
use hyper::{body::Incoming, server::conn::http1, service::service_fn, Request, Response};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN_ID: &str = "00f067aa0ba902b7";
const SPAN_KIND_SERVER: i32 = 2;
const SPAN_KIND_CLIENT: i32 = 3;

/// Spans leave 50 ms after they end, not the default 5 s.
const PROMPT: (&str, &str) = ("OTEL_BSP_SCHEDULE_DELAY", "50");

fn claim(correlation_id: &str) -> pb::ClaimRequest {
    pb::ClaimRequest {
        namespace: "orders".into(),
        correlation_id: correlation_id.into(),
        event_type: "OrderPlaced".into(),
        ..Default::default()
    }
}

/// `request` with the caller's trace context in its metadata.
fn traced<T>(request: T, trace_id: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(request);
    let metadata = request.metadata_mut();
    metadata.insert(
        "traceparent",
        traceparent(trace_id, CALLER_SPAN_ID).parse().unwrap(),
    );
    metadata.insert("tracestate", "vendor=opaque".parse().unwrap());
    metadata.insert("baggage", "tenant=acme".parse().unwrap());
    request
}

fn children_of<'a>(spans: &'a [Received], parent: &Received) -> Vec<&'a Received> {
    spans
        .iter()
        .filter(|span| span.span.parent_span_id == parent.span.span_id)
        .collect()
}

/// The decision, its trace and its children, as a collector sees them.
async fn a_claim_is_a_span_of_the_callers_trace(
    collector_spans: &otlp::Spans,
    sidecar: &Sidecar,
    service_name: &str,
) {
    let mut client = sidecar.client().await;
    let first = client
        .claim(traced(claim("order-1"), TRACE_ID))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.outcome(), pb::ClaimOutcome::Claimed);
    client
        .commit(traced(
            pb::CommitRequest {
                namespace: "orders".into(),
                correlation_id: "order-1".into(),
                lease_token: first.lease_token.clone(),
                ..Default::default()
            },
            TRACE_ID,
        ))
        .await
        .unwrap();
    let again_trace = "0af7651916cd43dd8448eb211c80319c";
    let again = client
        .claim(traced(claim("order-1"), again_trace))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.outcome(), pb::ClaimOutcome::Duplicate);

    let claimed = collector_spans
        .until_in_trace("dedup.v1.ClaimAndCommit/Claim", TRACE_ID)
        .await;
    assert_eq!(hex(&claimed.span.parent_span_id), CALLER_SPAN_ID);
    assert_eq!(claimed.span.kind, SPAN_KIND_SERVER);
    assert_eq!(claimed.service_name, service_name);
    assert_eq!(claimed.text("dedup.outcome"), Some("claimed"));
    assert_eq!(claimed.text("dedup.namespace"), Some("orders"));
    assert_eq!(claimed.text("dedup.store"), Some("sled"));
    assert_eq!(claimed.int("dedup.attempt"), Some(1));
    assert_eq!(claimed.flag("dedup.recovered"), Some(false));
    assert_eq!(
        claimed.int("dedup.fencing_token"),
        Some(i64::try_from(first.fencing_token).unwrap())
    );
    assert_eq!(claimed.int("rpc.grpc.status_code"), Some(0));
    assert_eq!(claimed.text("rpc.system"), Some("grpc"));
    assert_eq!(claimed.text("rpc.method"), Some("Claim"));
    assert_eq!(
        claimed.span.trace_state, "vendor=opaque",
        "the caller's tracestate is kept"
    );

    let duplicate = collector_spans
        .until_in_trace("dedup.v1.ClaimAndCommit/Claim", again_trace)
        .await;
    assert_eq!(duplicate.text("dedup.outcome"), Some("duplicate"));
    assert_eq!(
        duplicate.int("dedup.fencing_token"),
        claimed.int("dedup.fencing_token")
    );

    let committed = collector_spans
        .until("for the Commit", |received| {
            received.span.name == "dedup.v1.ClaimAndCommit/Commit"
        })
        .await;
    assert_eq!(hex(&committed.span.trace_id), TRACE_ID);
    assert_eq!(committed.text("dedup.outcome"), Some("committed"));

    // The store round trip and the durability wait, under the call's span.
    collector_spans
        .until("for the Claim's durability wait", |received| {
            received.span.name == "durability wait"
                && received.span.parent_span_id == claimed.span.span_id
        })
        .await;
    let all = collector_spans.all();
    let children = children_of(&all, &claimed);
    let store = children
        .iter()
        .find(|child| child.span.name == "store round trip")
        .unwrap_or_else(|| panic!("no store span under the Claim: {children:#?}"));
    assert_eq!(store.span.kind, SPAN_KIND_CLIENT);
    assert_eq!(store.text("db.system.name"), Some("sled"));
    assert_eq!(hex(&store.span.trace_id), TRACE_ID);
}

/// OTLP/gRPC, configured by the flags.
#[tokio::test]
async fn a_claim_joins_the_callers_trace_over_otlp_grpc() {
    let (collector, spans) = otlp::grpc_collector().await;
    let data = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{collector}");
    let sidecar = Sidecar::start_in_environment(
        &[],
        data.path(),
        &["--otlp-endpoint", &endpoint, "--otlp-protocol", "grpc"],
        &[PROMPT],
    );
    a_claim_is_a_span_of_the_callers_trace(&spans, &sidecar, "dedupd").await;
    // Counted once the collector's answer is back, a moment after it kept
    // the spans.
    until_metric(&sidecar, "dedupd_trace_spans_exported_total", |exported| {
        exported >= 4.0
    })
    .await;
}

/// Waits (bounded: 20 s) until `series` on the sidecar's /metrics satisfies
/// `wanted`.
async fn until_metric(sidecar: &Sidecar, series: &str, wanted: impl Fn(f64) -> bool) {
    let started = std::time::Instant::now();
    loop {
        let value = sidecar.metric(series).await;
        if value.is_some_and(&wanted) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{series} is {value:?} after 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// OTLP/HTTP with protobuf, configured by the standard variables alone,
/// and a parent-based sampler that records no trace of its own.
#[tokio::test]
async fn the_standard_variables_configure_otlp_http() {
    let (collector, spans) = otlp::http_collector().await;
    let data = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{collector}");
    let sidecar = Sidecar::start_in_environment(
        &[],
        data.path(),
        &[],
        &[
            PROMPT,
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_SERVICE_NAME", "orders-dedupd"),
            ("OTEL_TRACES_SAMPLER", "parentbased_always_off"),
        ],
    );
    // No caller context: not sampled, so never sent.
    let mut client = sidecar.client().await;
    client.claim(claim("untraced")).await.unwrap();
    a_claim_is_a_span_of_the_callers_trace(&spans, &sidecar, "orders-dedupd").await;
    let untraced: Vec<_> = spans
        .all()
        .into_iter()
        .filter(|received| {
            received.span.name == "dedup.v1.ClaimAndCommit/Claim"
                && received.span.parent_span_id.is_empty()
        })
        .collect();
    assert!(
        untraced.is_empty(),
        "a root span was sampled: {untraced:#?}"
    );
}

/// An upstream that answers 201 and keeps the `traceparent` it was sent.
async fn upstream() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let kept = Arc::clone(&kept);
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let parent = request
                        .headers()
                        .get("traceparent")
                        .and_then(|value| value.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    kept.lock().unwrap().push(parent);
                    async move {
                        Ok::<_, hyper::Error>(
                            Response::builder()
                                .status(201)
                                .body(Full::new(Bytes::from_static(b"{\"id\":1}")))
                                .unwrap(),
                        )
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (address, seen)
}

/// One HTTP/1.1 POST with an idempotency key and a trace context; the
/// status.
async fn post(proxy: SocketAddr, key: &str, trace: &str) -> u16 {
    let mut stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let body = "{\"item\":1}";
    let request = format!(
        "POST /orders HTTP/1.1\r\nHost: shop\r\nConnection: close\r\nContent-Type: application/json\r\nIdempotency-Key: \"{key}\"\r\nAuthorization: Bearer telemetry\r\ntraceparent: {}\r\nContent-Length: {}\r\n\r\n{body}",
        traceparent(trace, CALLER_SPAN_ID),
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("a status line")
}

/// The proxy's span joins the caller's trace, wraps the upstream call, and
/// the upstream is told the proxy's client span as its parent.
#[tokio::test]
async fn the_proxy_span_wraps_the_upstream_call_and_propagates_the_context() {
    let (collector, spans) = otlp::grpc_collector().await;
    let (upstream, parents_seen) = upstream().await;
    let data = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{collector}");
    let upstream_url = format!("http://{upstream}");
    let sidecar = Sidecar::start_in_environment(
        &[],
        data.path(),
        &[
            "--otlp-endpoint",
            &endpoint,
            "--otlp-protocol",
            "grpc",
            "--http-proxy-listen",
            "127.0.0.1:0",
            "--http-proxy-upstream",
            &upstream_url,
        ],
        &[PROMPT],
    );
    let proxy: SocketAddr = sidecar.ready["http_proxy"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(post(proxy, "order-7", TRACE_ID).await, 201);

    let server = spans
        .until("for the proxied request", |received| {
            received.span.kind == SPAN_KIND_SERVER && received.text("dedup.proxy.result").is_some()
        })
        .await;
    assert_eq!(hex(&server.span.trace_id), TRACE_ID);
    assert_eq!(hex(&server.span.parent_span_id), CALLER_SPAN_ID);
    assert_eq!(server.text("http.request.method"), Some("POST"));
    assert_eq!(server.int("http.response.status_code"), Some(201));
    assert_eq!(server.text("dedup.proxy.result"), Some("forwarded"));
    // The claim and the commit of the answer: steps of their own, each key
    // once.
    for (step, outcome) in [("dedup claim", "claimed"), ("dedup commit", "committed")] {
        let found = spans
            .until(step, |received| {
                received.span.name == step && received.span.parent_span_id == server.span.span_id
            })
            .await;
        assert_eq!(found.text("dedup.outcome"), Some(outcome), "{step}");
        assert_eq!(found.text("dedup.store"), Some("sled"), "{step}");
        let keys: Vec<_> = found.span.attributes.iter().map(|kv| &kv.key).collect();
        let mut unique = keys.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(keys.len(), unique.len(), "{step} repeats a key: {keys:?}");
    }
    let client = spans
        .until("for the upstream call", |received| {
            received.span.kind == SPAN_KIND_CLIENT
                && received.span.parent_span_id == server.span.span_id
                && received.text("http.request.method") == Some("POST")
        })
        .await;
    assert_eq!(client.int("http.response.status_code"), Some(201));
    let told = parents_seen.lock().unwrap().clone();
    assert_eq!(
        told,
        vec![format!("00-{TRACE_ID}-{}-01", hex(&client.span.span_id))],
        "the upstream's parent is the proxy's client span"
    );
}

/// With export off, the proxy hands the caller's context on untouched.
#[tokio::test]
async fn without_traces_the_proxy_passes_the_callers_context_on() {
    let (upstream, parents_seen) = upstream().await;
    let data = tempfile::tempdir().unwrap();
    let upstream_url = format!("http://{upstream}");
    let sidecar = Sidecar::start_with(
        data.path(),
        &[
            "--http-proxy-listen",
            "127.0.0.1:0",
            "--http-proxy-upstream",
            &upstream_url,
        ],
    );
    let proxy: SocketAddr = sidecar.ready["http_proxy"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(post(proxy, "order-8", TRACE_ID).await, 201);
    assert_eq!(
        parents_seen.lock().unwrap().clone(),
        vec![traceparent(TRACE_ID, CALLER_SPAN_ID)]
    );
}

/// A collector that refuses connections, or takes them and never answers:
/// every call is answered, and the spans that could not go are counted.
#[tokio::test]
async fn a_collector_down_or_silent_costs_spans_not_answers() {
    // Bound, never listening: connections are refused, and no other test
    // can take the port meanwhile.
    let reserved = tokio::net::TcpSocket::new_v4().unwrap();
    reserved.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let refused = reserved.local_addr().unwrap();
    let silent = otlp::silent_collector().await;
    for (collector, reason, environment) in [
        (refused, "export_failed", vec![PROMPT]),
        (
            silent,
            "queue_full",
            vec![
                PROMPT,
                ("OTEL_BSP_MAX_QUEUE_SIZE", "4"),
                ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2"),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "30000"),
            ],
        ),
    ] {
        let data = tempfile::tempdir().unwrap();
        let endpoint = format!("http://{collector}");
        let sidecar = Sidecar::start_in_environment(
            &[],
            data.path(),
            &["--otlp-endpoint", &endpoint, "--otlp-protocol", "grpc"],
            &environment,
        );
        let mut client = sidecar.client().await;
        for n in 0..50 {
            let answer = tokio::time::timeout(
                Duration::from_secs(10),
                client.claim(traced(claim(&format!("event-{n}")), TRACE_ID)),
            )
            .await
            .unwrap_or_else(|_| panic!("claim {n} waited on the collector at {collector}"))
            .unwrap()
            .into_inner();
            assert_eq!(answer.outcome(), pb::ClaimOutcome::Claimed);
        }
        let series = format!("dedupd_trace_spans_dropped_total{{reason=\"{reason}\"}}");
        until_metric(&sidecar, &series, |dropped| dropped > 0.0).await;
        assert_eq!(
            sidecar.metric("dedupd_trace_spans_exported_total").await,
            Some(0.0)
        );
    }
}

/// Bad trace settings stop the start with exit 64 and one line.
#[test]
fn bad_trace_settings_exit_64_with_one_line() {
    let data = tempfile::tempdir().unwrap();
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: &[Case] = &[
        (
            &["--otlp-endpoint", "collector:4317"],
            &[],
            "not an http:// or https:// URL",
        ),
        (
            &["--otlp-endpoint", "http://127.0.0.1:4318"],
            &[("OTEL_TRACES_SAMPLER", "sometimes")],
            "OTEL_TRACES_SAMPLER",
        ),
        (
            &[
                "--otlp-endpoint",
                "http://127.0.0.1:4318",
                "--otlp-protocol",
                "http/json",
            ],
            &[],
            "grpc or http/protobuf",
        ),
    ];
    for (flags, environment, expected) in cases {
        let mut command = std::process::Command::new(common::sidecar::BINARY);
        for (name, _) in std::env::vars_os() {
            if name.to_str().is_some_and(common::sidecar::is_trace_setting) {
                command.env_remove(&name);
            }
        }
        let output = command
            .args(*flags)
            .arg("--data-dir")
            .arg(data.path())
            .envs(environment.iter().copied())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{flags:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains(expected),
            "{stderr:?} should say {expected:?}"
        );
    }
}
