//! The operations surface: Prometheus metrics after real calls, /healthz and
//! /readyz, a Unix-socket listener beside TCP, bearer tokens (and the admin
//! token for Forget), load shedding and the request timeout.

mod common;

use std::{collections::HashMap, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use common::*;
use dedupd::{
    cli::{channel, BearerToken},
    guard::Tokens,
    listen::{ListenAddr, Listener},
    proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient},
    server::ServerConfig,
    store::sled::{SledConfig, SledStore, SyncMode},
    Listeners,
};
use tempfile::TempDir;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    sync::oneshot,
};
use tonic::Code;

struct OpsServer {
    grpc: SocketAddr,
    ops: SocketAddr,
    socket: PathBuf,
    _dir: TempDir,
    shutdown: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), dedupd::Error>>,
}

/// A server on TCP, a Unix socket and an ops port.
async fn start(adjust: impl FnOnce(&mut ServerConfig)) -> OpsServer {
    let dir = tempfile::tempdir().unwrap();
    let mut config = ServerConfig::default();
    adjust(&mut config);
    // The store reports group commits into the server's metrics.
    let store = SledStore::open_with_metrics(
        &SledConfig {
            path: dir.path().join("data"),
            sync: SyncMode::Always,
            cache_capacity_bytes: 16 << 20,
        },
        Some(Arc::clone(&config.metrics)),
    )
    .unwrap();
    let store = Arc::new(store);
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc = tcp.local_addr().unwrap();
    let socket = dir.path().join("dedupd.sock");
    let unix = Listener::bind(&ListenAddr::Unix(socket.clone()))
        .await
        .unwrap();
    let ops_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ops = ops_listener.local_addr().unwrap();
    let listeners = Listeners {
        grpc: vec![Listener::Tcp(tcp), unix],
        ops: Some(ops_listener),
    };
    let (shutdown, stop) = oneshot::channel::<()>();
    let task = tokio::spawn(dedupd::run(listeners, store, config, async {
        let _ = stop.await;
    }));
    OpsServer {
        grpc,
        ops,
        socket,
        _dir: dir,
        shutdown,
        task,
    }
}

impl OpsServer {
    async fn stop(self) {
        let _ = self.shutdown.send(());
        self.task.await.unwrap().unwrap();
        assert!(
            !self.socket.exists(),
            "the socket file is removed on shutdown"
        );
    }
}

async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: dedupd\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("status line");
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
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
    let mut client = ClaimAndCommitClient::new(channel(&server.grpc.to_string()).await.unwrap());
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

    let (status, text) = http_get(server.ops, "/metrics").await;
    assert_eq!(status, 200);
    let metrics = samples(&text);
    let get = |series: &str| {
        metrics
            .get(series)
            .copied()
            .unwrap_or_else(|| panic!("{series} missing from:\n{text}"))
    };
    assert_eq!(
        get(r#"dedupd_outcomes_total{namespace="default",outcome="claimed"}"#),
        1.0
    );
    assert_eq!(
        get(r#"dedupd_outcomes_total{namespace="default",outcome="in_progress"}"#),
        1.0
    );
    assert_eq!(
        get(r#"dedupd_outcomes_total{namespace="default",outcome="committed"}"#),
        1.0
    );
    assert_eq!(
        get(r#"dedupd_outcomes_total{namespace="default",outcome="duplicate"}"#),
        2.0
    );
    assert_eq!(
        get(r#"dedupd_outcomes_total{namespace="billing",outcome="claimed"}"#),
        1.0
    );
    assert_eq!(
        get(r#"dedupd_outcomes_total{namespace="billing",outcome="released"}"#),
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

    assert_eq!(http_get(server.ops, "/healthz").await.0, 200);
    assert_eq!(http_get(server.ops, "/readyz").await.0, 200);
    assert_eq!(http_get(server.ops, "/nope").await.0, 404);
    server.stop().await;
}

#[tokio::test]
async fn unix_socket_serves_the_same_api_beside_tcp() {
    let server = start(|_| {}).await;
    let address = format!("unix://{}", server.socket.display());
    let mut over_unix = ClaimAndCommitClient::new(channel(&address).await.unwrap());
    let mut over_tcp = ClaimAndCommitClient::new(channel(&server.grpc.to_string()).await.unwrap());
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
    server.stop().await;
}

#[tokio::test]
async fn tokens_are_required_and_forget_needs_the_admin_token() {
    const CLIENT: &str = "client-token-0123456789";
    const ADMIN: &str = "admin-token-0123456789";
    let server = start(|config| config.guard.tokens = Some(Tokens::new(CLIENT, Some(ADMIN)))).await;
    let connect = |token: Option<&'static str>| {
        let address = server.grpc.to_string();
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
        channel(&server.grpc.to_string()).await.unwrap(),
    );
    health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    server.stop().await;
}

#[tokio::test]
async fn overload_is_shed_with_resource_exhausted() {
    let server = start(|config| config.guard.max_concurrent_requests = 1).await;
    let channel = channel(&server.grpc.to_string()).await.unwrap();
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
    server.stop().await;
}

#[tokio::test]
async fn slow_calls_time_out_with_unavailable() {
    let server = start(|config| config.guard.request_timeout = Duration::from_millis(1)).await;
    let mut client = ClaimAndCommitClient::new(channel(&server.grpc.to_string()).await.unwrap());
    let items = (0..1000)
        .map(|i| claim_request(&format!("slow-{i}")))
        .collect();
    let status = client
        .claim_batch(pb::ClaimBatchRequest { items })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("--request-timeout"), "{status:?}");
    server.stop().await;
}
