//! A keyed request's life: its body read within the budgets, the claim,
//! the one forward (its lease renewed meanwhile), and how the answer — or
//! its absence — settles the record: committed, released, or "outcome
//! unknown" (the rules are the idempotency module's; this is their order).

use std::{
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::{Bytes, BytesMut};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tracing::Instrument;

use super::{
    answer::{
        body_with_trailers, client_response, full, grpc_messages, grpc_status, mark_unstored,
        replay, Answer, Protocol, ProxyBody, Rejection,
    },
    budget::{RequestShare, Spent},
    forward::{read_then_rest, ForwardError, Gathered},
    idempotency::{
        fingerprint, storable, CallerScope, Disposition, IdempotencyKey, Scope, Stored,
        StoredResponse,
    },
    server::{AfterUnknownOutcome, Proxy},
};
use crate::{
    domain::{
        ClaimOutcome, ClaimRequest, CommitRequest, Key, LeaseToken, RecordState, ReleaseRequest,
        RenewRequest,
    },
    error::Error,
    store::Store,
    telemetry,
};

/// Claims whose answers were lost that are given back at once (more are
/// left to their leases).
pub(super) const ORPHANS: usize = 256;
/// How long a claim whose answer was lost is looked for, at least.
const ORPHAN_PATIENCE: Duration = Duration::from_secs(60);

/// How often a waiting retry looks again while the first request runs.
pub(super) const IN_FLIGHT_POLL: Duration = Duration::from_millis(20);

/// How long a claim the store failed to answer is retried before the
/// client is told 503 (nothing forwarded).
pub(super) const CLAIM_RETRIES_FOR: Duration = Duration::from_secs(2);

/// A keyed request read whole, on its way to be claimed and forwarded.
pub(super) struct Keyed {
    parts: http::request::Parts,
    body: Bytes,
    /// The body's share of the request budget, held until it is forwarded.
    budget: RequestShare,
    key: IdempotencyKey,
    /// The caller's identity hash (`None`: callers share records).
    caller: Option<[u8; 32]>,
}

/// Renews a lease at a third of its time until dropped.
pub(super) struct Renewals(tokio::task::JoinHandle<()>);

impl Drop for Renewals {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<S: Store> Proxy<S> {
    pub(super) async fn keyed(
        self: Arc<Self>,
        request: Request<Incoming>,
        key: IdempotencyKey,
        protocol: Protocol,
    ) -> Answer {
        let (parts, body) = request.into_parts();
        // Before the body is read: an anonymous client holds no budget.
        let caller = self.config.scope.identity(&parts.headers);
        if caller.is_none() && self.config.scope != CallerScope::Shared {
            return Answer::rejected(
                Rejection::CallerUnidentified(self.config.scope.expected()),
                protocol,
            );
        }
        let (body, budget) = match self.read_keyed_body(body, caller).await {
            Ok(read) => read,
            Err(rejection) => return Answer::rejected(rejection, protocol),
        };
        // Detached from here on: a client that disconnects (or an HTTP/2
        // stream reset) cancels neither the claim — which may already be
        // stored — nor the upstream call nor its commit, so its retry finds
        // a settled record rather than an orphaned claim. The body's share
        // of the budget is given back once it has been forwarded.
        let proxy = Arc::clone(&self);
        let run = self.tasks.spawn(
            async move {
                let keyed = Keyed {
                    parts,
                    body,
                    budget,
                    key,
                    caller,
                };
                proxy.claim_and_forward(keyed, protocol).await
            }
            // Still this request's work: its decision and the upstream call
            // belong to the request's span.
            .in_current_span(),
        );
        match run.await {
            Ok(answer) => answer,
            Err(join) => {
                tracing::error!(%join, "proxy request task failed");
                Answer::rejected(Rejection::Internal("the proxy failed"), protocol)
            }
        }
    }

    /// Reads a keyed request's body (it is fingerprinted and may be sent
    /// again only as a whole): within `--max-request-bytes`, the body
    /// deadline, the proxy-wide request budget and `caller`'s share of it,
    /// whose bytes it holds until dropped.
    pub(super) async fn read_keyed_body(
        &self,
        mut body: Incoming,
        caller: Option<[u8; 32]>,
    ) -> Result<(Bytes, RequestShare), Rejection> {
        let deadline = tokio::time::Instant::now() + self.config.body_timeout;
        let mut held = self
            .budgets
            .request_share(caller)
            .ok_or(Rejection::Overloaded)?;
        let mut data = BytesMut::new();
        loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => return Err(Rejection::BodyTimeout(self.config.body_timeout)),
                Ok(None) => break,
                Ok(Some(Err(_))) => return Err(Rejection::BodyUnreadable),
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(chunk) = frame.into_data() else {
                continue;
            };
            if data.len() + chunk.len() > self.config.max_request_bytes {
                return Err(Rejection::RequestTooLarge(self.config.max_request_bytes));
            }
            held.grow(chunk.len()).map_err(|spent| match spent {
                Spent::Total => Rejection::Overloaded,
                Spent::Caller => Rejection::CallerOverloaded,
            })?;
            data.extend_from_slice(&chunk);
        }
        Ok((data.freeze(), held))
    }

    pub(super) async fn claim_and_forward(
        self: Arc<Self>,
        keyed: Keyed,
        protocol: Protocol,
    ) -> Answer {
        let Keyed {
            parts,
            body,
            budget,
            key,
            caller,
        } = keyed;
        let scope = Scope {
            method: &parts.method,
            route: parts.uri.path(),
            caller: caller.as_ref().map(|identity| &identity[..]),
        };
        // The namespace was checked with the configuration; the ID is 64 hex
        // characters.
        let record_key = Key::new_unchecked(self.config.namespace.clone(), scope.record_id(&key));
        let mut claim = ClaimRequest::plain(
            record_key.clone(),
            self.config.lease_ttl,
            self.config.retention,
        );
        claim.payload_fingerprint = fingerprint(
            &parts.method,
            parts.uri.path(),
            parts.uri.query(),
            &parts.headers,
            &body,
            &self.config.fingerprint_headers,
        );
        // This attempt's own ID: a claim retried after an error the store
        // may have applied anyway gets the same claim back instead of
        // finding it held (and later recovered, as if it had been sent).
        claim.request_id = format!("{:032x}", rand::random::<u128>());
        // With --wait-in-flight, a retry that finds the first request
        // running looks again until it ends (replayed, or released and so
        // ours to run) or the wait is over.
        let waiting_until = Instant::now() + self.config.wait_in_flight;
        let outcome = loop {
            let outcome = match self.claim(&claim).await {
                Ok(outcome) => outcome,
                Err(ClaimFailure::Unavailable) => {
                    self.release_orphan(claim);
                    return Answer::rejected(Rejection::StoreUnavailable, protocol);
                }
                // The key is committed and its answer sealed with a key this
                // proxy does not have (not mounted yet, removed too early):
                // retry later, never forwarded. Nothing was claimed (the
                // claim found the committed record), so nothing to give back.
                Err(ClaimFailure::KeyMissing) => {
                    return Answer::rejected(Rejection::StoreUnavailable, protocol);
                }
                // The key is committed but its stored answer does not open
                // (altered, moved from another record): the request was
                // sent once, so it is never forwarded again.
                Err(ClaimFailure::Unreadable) => {
                    return Answer::rejected(
                        Rejection::OutcomeUnknown("its stored answer cannot be read back".into()),
                        protocol,
                    );
                }
            };
            let left = waiting_until.saturating_duration_since(Instant::now());
            match outcome {
                ClaimOutcome::InProgress { .. } if !left.is_zero() => {
                    tokio::time::sleep(left.min(IN_FLIGHT_POLL)).await;
                }
                outcome => break outcome,
            }
        };
        match outcome {
            ClaimOutcome::Claimed { record, recovered } => {
                let token = record.lease_token;
                if recovered && self.config.after_unknown_outcome == AfterUnknownOutcome::Report {
                    // The previous holder died (or lost its lease) while it
                    // may have forwarded the request.
                    return self
                        .unknown_outcome(
                            record_key,
                            token,
                            "an earlier attempt's proxy stopped while the request may have been with the service".into(),
                            protocol,
                        )
                        .await;
                }
                let request = Request::from_parts(parts, full(body));
                self.first_request(record_key, token, (request, budget), protocol)
                    .await
            }
            // Sealed with a key destroyed since: the request was sent once.
            ClaimOutcome::Duplicate { record } if record.response_erased => Answer::rejected(
                Rejection::OutcomeUnknown("its stored answer was erased".into()),
                protocol,
            ),
            ClaimOutcome::Duplicate { record } => replay(
                &record.response,
                record.retain_until.0,
                protocol,
                &self.config.never_store,
            ),
            ClaimOutcome::InProgress { .. } => Answer::rejected(Rejection::InProgress, protocol),
            ClaimOutcome::FingerprintMismatch { .. } => {
                Answer::rejected(Rejection::PayloadMismatch, protocol)
            }
            ClaimOutcome::Stale { .. } => Answer::rejected(
                Rejection::Internal("an ordering answer for a request without an ordering key"),
                protocol,
            ),
        }
    }

    /// Claims, retrying (with the claim's own request ID) while the store
    /// does not answer, for up to [`CLAIM_RETRIES_FOR`]; `None`: it never
    /// did, and nothing was forwarded.
    pub(super) async fn claim(&self, claim: &ClaimRequest) -> Result<ClaimOutcome, ClaimFailure> {
        let give_up = Instant::now() + CLAIM_RETRIES_FOR.min(self.config.lease_ttl);
        let mut pause = Duration::from_millis(50);
        loop {
            let claimed = self
                .engine
                .claim(claim)
                .instrument(telemetry::step_span("dedup claim"))
                .await;
            match claimed {
                Ok(outcome) => return Ok(outcome),
                Err(error) if error.may_pass() && Instant::now() + pause < give_up => {
                    tracing::debug!(%error, "claim failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                Err(Error::Corrupt(problem)) => {
                    tracing::error!(%problem, "a committed key's answer cannot be read; answered outcome unknown");
                    return Err(ClaimFailure::Unreadable);
                }
                Err(Error::KeyNotConfigured(problem)) => {
                    tracing::warn!(%problem, "a committed key's answer is sealed with a key not configured; not forwarded");
                    return Err(ClaimFailure::KeyMissing);
                }
                Err(error) => {
                    tracing::warn!(%error, "the store did not answer; the request was not forwarded");
                    return Err(ClaimFailure::Unavailable);
                }
            }
        }
    }

    /// The store did not answer `claim`, which it may have applied all the
    /// same (its answer lost on the way). Nothing was forwarded, so a claim
    /// stored under this attempt's request ID is given back in the
    /// background once the store answers: looked up — again and again for
    /// the lease or [`ORPHAN_PATIENCE`] while it is not there, as a write
    /// stuck on its way can land after the first look — and released with
    /// its own token (a release needs no live lease, only that nobody
    /// claimed since) — left alone, the client's retry found the key held (409),
    /// then, once the lease ended, a recovered claim it had to call
    /// "outcome unknown". Only a claim of this attempt's request ID is
    /// touched, and nothing is ever claimed here; one that *recovered* an
    /// earlier holder's, which may have sent the request, is settled as any
    /// recovered claim is. At most [`ORPHANS`] at once: in an outage every
    /// failed claim would start one.
    pub(super) fn release_orphan(self: &Arc<Self>, claim: ClaimRequest) {
        let Ok(slot) = Arc::clone(&self.orphans).try_acquire_owned() else {
            tracing::warn!(
                "too many claims whose answers were lost are being given back; this one is \
                 left to end with its lease"
            );
            return;
        };
        let proxy = Arc::clone(self);
        self.tasks.spawn(
            async move {
                let _slot = slot;
                let give_up = Instant::now() + claim.lease_ttl.max(ORPHAN_PATIENCE);
                let mut pause = Duration::from_millis(100);
                let mut looked = false;
                while Instant::now() + pause < give_up {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                    let record = match proxy.engine.lookup(&claim.key).await {
                        Ok(record) => record,
                        Err(error) if error.may_pass() => {
                            tracing::debug!(%error, "orphaned claim: the store still fails");
                            if proxy.tasks.is_closed() {
                                return;
                            }
                            continue;
                        }
                        Err(error) => {
                            tracing::warn!(%error, "orphaned claim: not released");
                            return;
                        }
                    };
                    let record = match record {
                        Some(record)
                            if record.state == RecordState::Claimed
                                && record.request_id == claim.request_id =>
                        {
                            record
                        }
                        // Settled: a late claim of ours would find it so
                        // and change nothing.
                        Some(record) if record.state == RecordState::Committed => return,
                        // Not stored (yet), released, or another attempt's
                        // claim: ours may still be on its way (a stuck
                        // connection's bytes, a retransmitted segment) and
                        // land later, so it is looked for until patience
                        // runs out — or the proxy stops, not to hold its
                        // shutdown for a claim that most likely never was.
                        _ => {
                            looked = true;
                            if proxy.tasks.is_closed() {
                                return;
                            }
                            continue;
                        }
                    };
                    let (key, token) = (claim.key.clone(), record.lease_token);
                    if record.recovered {
                        let reason = "an earlier attempt's proxy stopped while the request may \
                                      have been with the service";
                        // The protocol only shapes an answer nobody reads.
                        proxy
                            .unknown_outcome(key, token, reason.into(), Protocol::Http)
                            .await;
                        return;
                    }
                    if proxy.release(key, token).await {
                        tracing::info!(
                            "a claim whose answer the store lost was released; the request \
                             was never sent"
                        );
                    }
                    // The claim was sent again with the same request ID
                    // while the store failed: a copy still on its way can
                    // land on the released record and claim it afresh, so
                    // it is looked for still.
                    looked = true;
                    if proxy.tasks.is_closed() {
                        return;
                    }
                }
                if !looked {
                    tracing::warn!(
                        "the store did not answer for as long as a claim whose answer was lost \
                         is looked for: if it holds one, its retry ends as a recovered claim \
                         (outcome unknown)"
                    );
                }
            }
            .in_current_span(),
        );
    }

    /// Keeps the lease of `key` alive until the returned guard is dropped.
    pub(super) fn renew_lease(self: &Arc<Self>, key: Key, token: LeaseToken) -> Renewals {
        let proxy = Arc::clone(self);
        Renewals(tokio::spawn(
            async move {
                let every = proxy.config.lease_ttl / 3;
                loop {
                    tokio::time::sleep(every).await;
                    let renew = RenewRequest {
                        key: key.clone(),
                        lease_token: token,
                        lease_ttl: proxy.config.lease_ttl,
                    };
                    let renewed = proxy
                        .engine
                        .renew(&renew)
                        .instrument(telemetry::step_span("dedup renew"))
                        .await;
                    if let Err(error) = renewed {
                        tracing::warn!(%error, "lease renewal failed");
                    }
                }
            }
            // The request's work: its renewals belong to its trace.
            .in_current_span(),
        ))
    }

    /// Forwards the first request of a key, renewing its lease meanwhile,
    /// then commits the answer (or releases the key, or records that the
    /// outcome is unknown) — before the answer is returned, unless it is
    /// too long to gather and streams.
    pub(super) async fn first_request(
        self: Arc<Self>,
        key: Key,
        token: LeaseToken,
        (request, budget): (Request<ProxyBody>, RequestShare),
        protocol: Protocol,
    ) -> Answer {
        let renewals = self.renew_lease(key.clone(), token);
        let upstream_started = Instant::now();
        let deadline = tokio::time::Instant::now() + self.config.upstream_timeout;
        let forwarded = tokio::time::timeout_at(deadline, self.forward(request, protocol)).await;
        // The body has been written (or never will be): its bytes go back
        // to the budget now, not when the answer is settled.
        drop(budget);
        let response = match forwarded {
            Ok(Ok(response)) => response,
            Ok(Err(ForwardError::Unsent(problem))) => {
                self.release(key, token).await;
                tracing::warn!(%problem, "upstream unreachable; the request was not sent and the key is released");
                return Answer {
                    upstream: upstream_started.elapsed(),
                    ..Answer::rejected(
                        Rejection::UpstreamFailed(
                            "the upstream service could not be reached; the request was not sent, retry later".into(),
                        ),
                        protocol,
                    )
                };
            }
            Ok(Err(ForwardError::MaybeSent(problem))) => {
                let answer = self
                    .unknown_outcome(
                        key,
                        token,
                        format!("the connection failed: {problem}"),
                        protocol,
                    )
                    .await;
                return Answer {
                    upstream: upstream_started.elapsed(),
                    ..answer
                };
            }
            Err(_) => {
                let reason = format!(
                    "the service did not answer within {}",
                    humantime::format_duration(self.config.upstream_timeout)
                );
                let answer = self.unknown_outcome(key, token, reason, protocol).await;
                return Answer {
                    upstream: upstream_started.elapsed(),
                    ..answer
                };
            }
        };
        let (parts, body) = response.into_parts();
        let gathered = self.gather(body, deadline).await;
        let upstream = upstream_started.elapsed();
        let (data, trailers, gathered_share) = match gathered {
            Gathered::Whole {
                data,
                trailers,
                share,
            } => (data, trailers, share),
            Gathered::Failed(problem) => {
                let reason = format!("its answer broke off: {problem}");
                let answer = self.unknown_outcome(key, token, reason, protocol).await;
                return Answer { upstream, ..answer };
            }
            Gathered::Over { read, rest } => {
                // The answer is long (or the gathering budget is spent): the
                // record says what it can before the answer streams on —
                // processed but not replayable, released, or unknown, by the
                // status (gRPC's comes last, in the trailers: processed).
                let disposition = match protocol {
                    Protocol::Http => self.config.release_on.http(parts.status),
                    Protocol::Grpc => Disposition::Keep,
                };
                let (result, stored) = self
                    .settle_answer(&key, token, disposition, parts.status, None, || {
                        self.stored_response(&parts, None, None)
                    })
                    .await;
                drop(renewals);
                let body = read_then_rest(read, rest, self.config.upstream_timeout);
                let mut response = client_response(Response::from_parts(parts, body));
                mark_unstored(&mut response, stored);
                return Answer {
                    response,
                    result,
                    upstream,
                };
            }
        };
        let grpc_code =
            (protocol == Protocol::Grpc).then(|| grpc_status(&parts.headers, trailers.as_ref()));
        let disposition = match grpc_code {
            None => self.config.release_on.http(parts.status),
            Some(code) => self.config.release_on.grpc(code),
        };
        let (result, stored) = self
            .settle_answer(&key, token, disposition, parts.status, grpc_code, || {
                // A unary call answers one message; a streaming one was
                // processed but is not kept.
                let kept =
                    (protocol == Protocol::Http || grpc_messages(&data) <= 1).then_some(&data);
                self.stored_response(&parts, kept, trailers.as_ref())
            })
            .await;
        drop(renewals);
        drop(gathered_share);
        let mut response = client_response(Response::from_parts(
            parts,
            body_with_trailers(data, trailers),
        ));
        mark_unstored(&mut response, stored);
        Answer {
            response,
            result,
            upstream,
        }
    }

    /// Settles the key after the upstream answered (`status`; for gRPC,
    /// `grpc_code` is `Some(grpc-status)`), by `disposition`: commits
    /// `kept()`, releases it, or records the outcome unknown (or, with
    /// `--after-unknown-outcome retry`, releases it). The metrics result,
    /// and whether the record could be stored.
    pub(super) async fn settle_answer(
        &self,
        key: &Key,
        token: LeaseToken,
        disposition: Disposition,
        status: StatusCode,
        grpc_code: Option<Option<u32>>,
        kept: impl FnOnce() -> Stored,
    ) -> (&'static str, bool) {
        match (disposition, self.config.after_unknown_outcome) {
            (Disposition::Keep, _) => ("forwarded", self.settle(key, token, &kept()).await),
            (Disposition::Release, _) | (Disposition::Unknown, AfterUnknownOutcome::Retry) => {
                // Not stored, by design: a failed release only delays the
                // retry until the lease ends.
                self.release(key.clone(), token).await;
                ("released", true)
            }
            (Disposition::Unknown, AfterUnknownOutcome::Report) => {
                let reason = match grpc_code {
                    None => format!("a gateway in front of the service answered {status}"),
                    Some(None) => "the call ended without a grpc-status".to_owned(),
                    Some(Some(code)) => format!(
                        "the call was cut off ({}) while the service may have gone on",
                        tonic::Code::from_i32(code as i32).description()
                    ),
                };
                tracing::warn!(%reason, "outcome unknown; the key will not be forwarded again");
                let stored = Stored::OutcomeUnknown { reason };
                ("outcome_unknown", self.settle(key, token, &stored).await)
            }
        }
    }

    pub(super) fn stored_response(
        &self,
        parts: &http::response::Parts,
        body: Option<&Bytes>,
        trailers: Option<&http::HeaderMap>,
    ) -> Stored {
        Stored::Response(StoredResponse {
            status: parts.status,
            headers: storable(&parts.headers, &self.config.never_store),
            body: body.map(|body| body.to_vec()),
            trailers: trailers
                .map(|trailers| storable(trailers, &self.config.never_store))
                .unwrap_or_default(),
        })
    }

    /// The request may have reached the upstream and no complete answer
    /// came back: record that (never forward it again) and tell the client
    /// — or, with `--after-unknown-outcome retry`, release the key.
    pub(super) async fn unknown_outcome(
        &self,
        key: Key,
        token: LeaseToken,
        reason: String,
        protocol: Protocol,
    ) -> Answer {
        match self.config.after_unknown_outcome {
            AfterUnknownOutcome::Report => {
                tracing::warn!(%reason, "outcome unknown; the key will not be forwarded again");
                let stored = Stored::OutcomeUnknown {
                    reason: reason.clone(),
                };
                // If it cannot be stored, the claim stays: once its lease
                // ends the next attempt is a recovered claim, answered the
                // same way.
                self.settle(&key, token, &stored).await;
                Answer::rejected(Rejection::OutcomeUnknown(reason), protocol)
            }
            AfterUnknownOutcome::Retry => {
                tracing::warn!(%reason, "outcome unknown; key released (--after-unknown-outcome retry)");
                self.release(key, token).await;
                Answer::rejected(
                    Rejection::UpstreamFailed(format!(
                        "{reason}; the key was released, so a retry sends the request again"
                    )),
                    protocol,
                )
            }
        }
    }

    /// Commits `stored` for the key, retrying while the store does not
    /// answer, for up to one lease time (the lease is renewed meanwhile, and
    /// a holder's commit holds even after it ends unless another claimed
    /// it). False if it could not be stored.
    pub(super) async fn settle(&self, key: &Key, token: LeaseToken, stored: &Stored) -> bool {
        let commit = CommitRequest {
            key: key.clone(),
            lease_token: token,
            response: stored.encode(),
            retention: None,
        };
        self.retrying("commit", || self.engine.commit(&commit))
            .instrument(telemetry::step_span("dedup commit"))
            .await
    }

    /// Releases the key (the request never left, or the upstream said it
    /// did not act), retrying like [`Proxy::settle`]; if that fails the
    /// key frees when its lease ends, and the next attempt is a recovered
    /// claim.
    pub(super) async fn release(&self, key: Key, token: LeaseToken) -> bool {
        let release = ReleaseRequest {
            key,
            lease_token: token,
        };
        self.retrying("release", || self.engine.release(&release))
            .instrument(telemetry::step_span("dedup release"))
            .await
    }

    pub(super) async fn retrying<T, Call, Answered>(&self, what: &str, mut call: Call) -> bool
    where
        Call: FnMut() -> Answered,
        Answered: Future<Output = Result<T, Error>>,
    {
        let give_up = Instant::now() + self.config.lease_ttl;
        let mut pause = Duration::from_millis(50);
        loop {
            match call().await {
                Ok(_) => return true,
                Err(error) if error.may_pass() && Instant::now() + pause < give_up => {
                    tracing::debug!(%error, what, "store call failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(error) => {
                    tracing::warn!(%error, what, "store call failed; giving up");
                    return false;
                }
            }
        }
    }
}
/// Why the proxy's claim has no outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClaimFailure {
    /// The store did not answer (and may have applied the claim).
    Unavailable,
    /// The key is committed and its stored answer does not open.
    Unreadable,
    /// The key is committed and its stored answer is sealed with a key
    /// that is not configured (nothing was applied).
    KeyMissing,
}
