//! The gRPC face: each handler converts protobuf to a validated domain
//! request ([`crate::api`]), calls the [`Engine`] and converts the outcome
//! back. No rule lives here.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::{
    api::{self, Limits},
    engine::Engine,
    guard::Role,
    proto::v1::{self as pb, claim_and_commit_server::ClaimAndCommit},
    store::Store,
};

/// The `dedup.v1.ClaimAndCommit` service.
#[derive(Debug)]
pub struct DedupService<S> {
    engine: Engine<S>,
    limits: Arc<Limits>,
}

impl<S: Store> DedupService<S> {
    /// A service answering from `engine` under `limits`.
    pub fn new(engine: Engine<S>, limits: Arc<Limits>) -> Self {
        DedupService { engine, limits }
    }
}

type Answer<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl<S: Store> ClaimAndCommit for DedupService<S> {
    async fn claim(&self, request: Request<pb::ClaimRequest>) -> Answer<pb::ClaimResponse> {
        let claim = self.limits.claim(request.into_inner())?;
        let outcome = self.engine.claim(&claim).await?;
        tracing::debug!(key = %claim.key, outcome = outcome.kind().as_str(), "claim");
        Ok(Response::new(api::claim_response(&claim.key, outcome)))
    }

    async fn commit(&self, request: Request<pb::CommitRequest>) -> Answer<pb::CommitResponse> {
        let commit = self.limits.commit(request.into_inner())?;
        let outcome = self.engine.commit(&commit).await?;
        tracing::debug!(key = %commit.key, "commit");
        Ok(Response::new(api::commit_response(
            &commit.key,
            Ok(outcome),
        )))
    }

    async fn release(&self, request: Request<pb::ReleaseRequest>) -> Answer<pb::ReleaseResponse> {
        let release = self.limits.release(request.into_inner())?;
        let outcome = self.engine.release(&release).await?;
        tracing::debug!(key = %release.key, ?outcome, "release");
        Ok(Response::new(api::release_response(Ok(outcome))))
    }

    async fn renew(&self, request: Request<pb::RenewRequest>) -> Answer<pb::RenewResponse> {
        let renew = self.limits.renew(request.into_inner())?;
        let lease_expires_at = self.engine.renew(&renew).await?;
        Ok(Response::new(pb::RenewResponse {
            lease_expires_at: Some(api::timestamp(lease_expires_at)),
        }))
    }

    async fn lookup(&self, request: Request<pb::LookupRequest>) -> Answer<pb::LookupResponse> {
        let request = request.into_inner();
        let key = self
            .limits
            .key(&request.namespace, &request.correlation_id)?;
        let record = self.engine.lookup(&key).await?;
        Ok(Response::new(pb::LookupResponse {
            found: record.is_some(),
            record: record.map(|record| api::record(&key, record)),
        }))
    }

    async fn forget(&self, request: Request<pb::ForgetRequest>) -> Answer<pb::ForgetResponse> {
        Role::require_admin(&request)?;
        let request = request.into_inner();
        let key = self
            .limits
            .key(&request.namespace, &request.correlation_id)?;
        let existed = self.engine.forget(&key).await?;
        tracing::info!(%key, existed, "forget");
        Ok(Response::new(pb::ForgetResponse { existed }))
    }

    async fn rekey(&self, request: Request<pb::RekeyRequest>) -> Answer<pb::RekeyResponse> {
        Role::require_admin(&request)?;
        let (cursor, page_size, retire) = self.limits.rekey(request.into_inner())?;
        let page = self.engine.rekey(&cursor, page_size, retire).await?;
        tracing::info!(
            examined = page.examined,
            resealed = page.resealed,
            erased = page.erased,
            unreadable = page.unreadable,
            through = page.next.is_none(),
            "rekey page"
        );
        Ok(Response::new(api::rekey_response(page)))
    }

    async fn claim_batch(
        &self,
        request: Request<pb::ClaimBatchRequest>,
    ) -> Answer<pb::ClaimBatchResponse> {
        let claims = self.limits.claim_batch(request.into_inner().items)?;
        let outcomes = self.engine.claim_batch(&claims).await?;
        let results = claims
            .iter()
            .zip(outcomes)
            .map(|(claim, outcome)| api::claim_response(&claim.key, outcome))
            .collect();
        Ok(Response::new(pb::ClaimBatchResponse { results }))
    }

    async fn commit_batch(
        &self,
        request: Request<pb::CommitBatchRequest>,
    ) -> Answer<pb::CommitBatchResponse> {
        let commits = self.limits.commit_batch(request.into_inner().items)?;
        let outcomes = self.engine.commit_batch(&commits).await?;
        let results = commits
            .iter()
            .zip(outcomes)
            .map(|(commit, outcome)| api::commit_response(&commit.key, outcome))
            .collect();
        Ok(Response::new(pb::CommitBatchResponse { results }))
    }

    async fn release_batch(
        &self,
        request: Request<pb::ReleaseBatchRequest>,
    ) -> Answer<pb::ReleaseBatchResponse> {
        let releases = self.limits.release_batch(request.into_inner().items)?;
        let outcomes = self.engine.release_batch(&releases).await?;
        let results = outcomes.into_iter().map(api::release_response).collect();
        Ok(Response::new(pb::ReleaseBatchResponse { results }))
    }
}
