//! Shared set-up for integration tests: a real dedupd server on
//! `127.0.0.1:0` over a sled store in a temporary directory, told time by a
//! manual clock, and shut down through the same future production uses.

#![allow(dead_code)]

use std::{net::SocketAddr, path::Path, sync::Arc, time::Duration};

use dedupd::{
    clock::{ManualClock, UnixMillis},
    proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient},
    server::ServerConfig,
    store::sled::{SledConfig, SledStore, SyncMode},
    Error,
};
use tempfile::TempDir;
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;

/// 2026-01-01T00:00:00Z: tests start here and move time by hand.
pub const START: UnixMillis = UnixMillis(1_767_225_600_000);

pub type Client = ClaimAndCommitClient<Channel>;

pub struct TestServer {
    pub addr: SocketAddr,
    pub clock: ManualClock,
    pub dir: Arc<TempDir>,
    pub store: Arc<SledStore>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), Error>>>,
}

impl TestServer {
    /// A server with default limits on a fresh directory.
    pub async fn start() -> TestServer {
        TestServer::start_with(|_| {}).await
    }

    /// A server whose configuration `adjust` may change.
    pub async fn start_with(adjust: impl FnOnce(&mut ServerConfig)) -> TestServer {
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        let clock = ManualClock::new(START);
        TestServer::start_in(dir, clock, adjust).await
    }

    /// A server over the store in `dir` (e.g. after a restart).
    pub async fn start_in(
        dir: Arc<TempDir>,
        clock: ManualClock,
        adjust: impl FnOnce(&mut ServerConfig),
    ) -> TestServer {
        let store = Arc::new(open_store(dir.path()));
        let mut config = ServerConfig {
            clock: Arc::new(clock.clone()),
            shutdown_grace: Duration::from_secs(5),
            ..ServerConfig::default()
        };
        adjust(&mut config);
        // Bind before spawning: the port is ready before the first call.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = tokio::spawn(dedupd::run(listener, Arc::clone(&store), config, async {
            let _ = stop.await;
        }));
        TestServer {
            addr,
            clock,
            dir,
            store,
            shutdown: Some(shutdown),
            task: Some(task),
        }
    }

    pub async fn client(&self) -> Client {
        ClaimAndCommitClient::new(self.channel().await)
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .expect("uri")
            .connect()
            .await
            .expect("connect")
    }

    /// Graceful shutdown; returns what `run` returned.
    pub async fn stop(mut self) -> Result<(), Error> {
        self.stop_in_place().await
    }

    async fn stop_in_place(&mut self) -> Result<(), Error> {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        match self.task.take() {
            Some(task) => task.await.expect("server task"),
            None => Ok(()),
        }
    }

    /// Stops and starts again on the same directory and clock.
    pub async fn restart(mut self) -> TestServer {
        self.stop_in_place().await.expect("clean stop");
        let TestServer {
            dir, clock, store, ..
        } = self;
        drop(store);
        TestServer::start_in(dir, clock, |_| {}).await
    }
}

pub fn open_store(path: &Path) -> SledStore {
    SledStore::open(&SledConfig {
        path: path.to_path_buf(),
        sync: SyncMode::Always,
        cache_capacity_bytes: 16 << 20,
    })
    .expect("open sled store")
}

pub fn claim_request(correlation_id: &str) -> pb::ClaimRequest {
    pb::ClaimRequest {
        correlation_id: correlation_id.to_owned(),
        event_type: "PaymentReceived".into(),
        consumer_version: "1.4.2".into(),
        owner: "pod-a".into(),
        ..Default::default()
    }
}

pub fn commit_request(correlation_id: &str, lease_token: &str) -> pb::CommitRequest {
    pb::CommitRequest {
        correlation_id: correlation_id.to_owned(),
        lease_token: lease_token.to_owned(),
        ..Default::default()
    }
}

pub fn seconds(seconds: i64) -> Option<prost_types::Duration> {
    Some(prost_types::Duration { seconds, nanos: 0 })
}

pub fn outcome(response: &pb::ClaimResponse) -> pb::ClaimOutcome {
    pb::ClaimOutcome::try_from(response.outcome).expect("known outcome")
}

pub async fn claim(client: &mut Client, request: pb::ClaimRequest) -> pb::ClaimResponse {
    client
        .claim(request)
        .await
        .expect("claim call")
        .into_inner()
}
