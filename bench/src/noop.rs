//! A gRPC server that answers the dedup API without touching any store: the
//! ceiling the real sidecar is measured against (`dedupd-bench
//! noop-server`). It decodes and encodes the same messages, so the difference to
//! dedupd is the state machine, the store and durability.

use std::{future::Future, net::SocketAddr};

use tokio::net::TcpListener;
use tonic::{
    transport::{server::TcpIncoming, Server},
    Request, Response, Status,
};

use dedupd::proto::v1::{
    self as pb,
    claim_and_commit_server::{ClaimAndCommit, ClaimAndCommitServer},
};

/// Answers every call with the success outcome.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopService;

const NOOP_LEASE_TOKEN: &str = "00000000000000000000000000000001";

fn claimed() -> pb::ClaimResponse {
    pb::ClaimResponse {
        outcome: pb::ClaimOutcome::Claimed as i32,
        lease_token: NOOP_LEASE_TOKEN.to_owned(),
        fencing_token: 1,
        attempt: 1,
        ..Default::default()
    }
}

fn committed() -> pb::CommitResponse {
    pb::CommitResponse {
        outcome: pb::CommitOutcome::Committed as i32,
        record: None,
    }
}

fn released() -> pb::ReleaseResponse {
    pb::ReleaseResponse {
        outcome: pb::ReleaseOutcome::Released as i32,
    }
}

type Answer<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl ClaimAndCommit for NoopService {
    async fn claim(&self, _: Request<pb::ClaimRequest>) -> Answer<pb::ClaimResponse> {
        Ok(Response::new(claimed()))
    }

    async fn commit(&self, _: Request<pb::CommitRequest>) -> Answer<pb::CommitResponse> {
        Ok(Response::new(committed()))
    }

    async fn release(&self, _: Request<pb::ReleaseRequest>) -> Answer<pb::ReleaseResponse> {
        Ok(Response::new(released()))
    }

    async fn renew(&self, _: Request<pb::RenewRequest>) -> Answer<pb::RenewResponse> {
        Ok(Response::new(pb::RenewResponse::default()))
    }

    async fn lookup(&self, _: Request<pb::LookupRequest>) -> Answer<pb::LookupResponse> {
        Ok(Response::new(pb::LookupResponse::default()))
    }

    async fn forget(&self, _: Request<pb::ForgetRequest>) -> Answer<pb::ForgetResponse> {
        Ok(Response::new(pb::ForgetResponse::default()))
    }

    async fn rekey(&self, _: Request<pb::RekeyRequest>) -> Answer<pb::RekeyResponse> {
        Ok(Response::new(pb::RekeyResponse::default()))
    }

    async fn claim_batch(
        &self,
        request: Request<pb::ClaimBatchRequest>,
    ) -> Answer<pb::ClaimBatchResponse> {
        let results = request.get_ref().items.iter().map(|_| claimed()).collect();
        Ok(Response::new(pb::ClaimBatchResponse { results }))
    }

    async fn commit_batch(
        &self,
        request: Request<pb::CommitBatchRequest>,
    ) -> Answer<pb::CommitBatchResponse> {
        let results = request
            .get_ref()
            .items
            .iter()
            .map(|_| committed())
            .collect();
        Ok(Response::new(pb::CommitBatchResponse { results }))
    }

    async fn release_batch(
        &self,
        request: Request<pb::ReleaseBatchRequest>,
    ) -> Answer<pb::ReleaseBatchResponse> {
        let results = request.get_ref().items.iter().map(|_| released()).collect();
        Ok(Response::new(pb::ReleaseBatchResponse { results }))
    }
}

/// Serves the no-op service on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let address: Option<SocketAddr> = listener.local_addr().ok();
    if let Some(address) = address {
        tracing::info!(%address, "no-op server serving");
    }
    Server::builder()
        .add_service(
            ClaimAndCommitServer::new(NoopService)
                .max_decoding_message_size(16 << 20)
                .max_encoding_message_size(16 << 20),
        )
        .serve_with_incoming_shutdown(
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown,
        )
        .await
}
