//! The engine: runs each validated request through the state machine on the
//! store and waits for durability before answering, and marks the call's
//! span with the decision (`telemetry`). Handlers for every face (gRPC, the
//! HTTP proxy) call only this.

use std::{
    borrow::Cow,
    collections::HashMap,
    fmt,
    future::Future,
    sync::{Arc, Mutex},
    time::Duration,
};

use tracing::Instrument;

use crate::{
    clock::{Clock, Now, UnixMillis},
    domain::{
        ClaimOutcome, ClaimRequest, CommitOutcome, CommitRequest, Key, LeaseLost, LeaseToken,
        OrderingScope, OutcomeKind, Record, RecordState, ReleaseOutcome, ReleaseRequest,
        RenewRequest,
    },
    error::{Error, FieldViolation},
    hashed_ids::IdHasher,
    key_registry, machine,
    metrics::Metrics,
    sealing::{self, Binding, KeyId, Keyring, KeyringSlot, Unsealable},
    store::{Attempt, ScanCursor, Store},
    telemetry,
};

/// The deduplication engine over one store.
pub struct Engine<S> {
    store: Arc<S>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    /// Seals every answer before the store sees it ([`crate::sealing`]);
    /// the keyring in force is taken per call (files may be reloaded).
    keyring: Option<Arc<KeyringSlot>>,
    /// Hashes every correlation ID before the store sees it
    /// ([`crate::hashed_ids`]).
    ids: Option<Arc<IdHasher>>,
    /// The sealing keys this engine registered in the store, and when
    /// ([`crate::key_registry`]).
    registered: Arc<Mutex<HashMap<KeyId, UnixMillis>>>,
}

impl<S> fmt::Debug for Engine<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("clock", &self.clock)
            .field("keyring", &self.keyring)
            .field("hashed_ids", &self.ids.is_some())
            .finish()
    }
}

impl<S> Clone for Engine<S> {
    fn clone(&self) -> Self {
        Engine {
            store: Arc::clone(&self.store),
            clock: Arc::clone(&self.clock),
            metrics: Arc::clone(&self.metrics),
            keyring: self.keyring.clone(),
            ids: self.ids.clone(),
            registered: Arc::clone(&self.registered),
        }
    }
}

impl<S: Store> Engine<S> {
    /// An engine over `store`, telling time by `clock`.
    pub fn new(store: Arc<S>, clock: Arc<dyn Clock>) -> Self {
        Engine {
            store,
            clock,
            metrics: Arc::new(Metrics::new()),
            keyring: None,
            ids: None,
            registered: Arc::default(),
        }
    }

    /// The same engine, sealing every answer it stores with `keyring` and
    /// opening every answer it reads (none is stored or answered in
    /// plaintext from then on).
    pub fn with_keyring(self, keyring: Option<Arc<Keyring>>) -> Self {
        Engine {
            keyring: keyring.map(|keyring| Arc::new(KeyringSlot::new(keyring))),
            ..self
        }
    }

    /// The same engine, taking its keyring from `slot` for each call (a
    /// slot whose key files are watched).
    pub fn with_keyring_slot(self, slot: Option<Arc<KeyringSlot>>) -> Self {
        Engine {
            keyring: slot,
            ..self
        }
    }

    /// The keyring in force now.
    fn keyring(&self) -> Option<Arc<Keyring>> {
        self.keyring.as_ref().map(|slot| slot.current())
    }

    /// The same engine, handing the store a keyed hash of each correlation
    /// ID instead of the ID.
    pub fn with_hashed_ids(self, ids: Option<Arc<IdHasher>>) -> Self {
        Engine { ids, ..self }
    }

    /// The key the store holds `key` under: `key` itself, or its ID hashed.
    /// Everything else — sealing's binding, messages, metrics — uses `key`.
    fn stored_key<'k>(&self, key: &'k Key) -> Cow<'k, Key> {
        match &self.ids {
            Some(ids) => Cow::Owned(ids.stored(key)),
            None => Cow::Borrowed(key),
        }
    }

    /// The same engine, counting its outcomes in `metrics`.
    pub fn with_metrics(self, metrics: Arc<Metrics>) -> Self {
        Engine { metrics, ..self }
    }

    /// The metrics the engine counts in.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// The moment every record that has ended has surely ended: what the
    /// reaper deletes up to (the interval's `earliest`, so nothing is
    /// deleted that another pod's reckoning still holds).
    pub fn now(&self) -> UnixMillis {
        self.clock.interval().earliest
    }

    /// The time a decision is taken at: the clock's interval, if it can be
    /// trusted (on a shared store, the store's clock measured recently and
    /// closely enough: [`crate::time_policy`]); otherwise the call is
    /// UNAVAILABLE. Read before a call's store work and again for each of
    /// its write attempts ([`Engine::attempt_time`]).
    fn decision_time(&self) -> Result<Now, Error> {
        self.clock.verify().map_err(Error::Unavailable)?;
        Ok(self.clock.interval())
    }

    /// The time one run of an update decides at. Each new attempt (the
    /// first, or a retry after a conflict) reads it afresh, so a write that
    /// lands late sets its ends from when it was tried, not from when the
    /// call began; the run that repeats an attempt with the fencing token
    /// its write drew keeps that attempt's time, so it reaches the decision
    /// the write was made from. `at` holds the time of the last attempt.
    fn attempt_time(&self, at: &mut Now, attempt: &Attempt<'_>) -> Result<Now, Error> {
        if !attempt.repeats {
            *at = self.decision_time()?;
        }
        Ok(*at)
    }

    /// `Ok` while calls can be answered: the store takes writes and the
    /// clock can be trusted. Health and readiness follow it.
    pub fn writable(&self) -> Result<(), Error> {
        self.store.writable()?;
        self.clock.verify().map_err(Error::Unavailable)
    }

    /// The engine's clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Claim one key.
    pub async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, Error> {
        telemetry::record_call(&request.key, self.store.kind());
        let outcome = self.durably(request).await?;
        telemetry::record_claim(&outcome);
        Ok(outcome)
    }

    /// Claim many keys, in order, with one wait for durability.
    pub async fn claim_batch(&self, requests: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, Error> {
        telemetry::record_batch(requests.len(), self.store.kind());
        self.in_order(requests).await
    }

    /// Commit one claim; a lost lease is an error.
    pub async fn commit(&self, request: &CommitRequest) -> Result<CommitOutcome, Error> {
        telemetry::record_call(&request.key, self.store.kind());
        let outcome = self.durably(request).await?;
        telemetry::record_commit(&outcome);
        outcome.map_err(|LeaseLost| lease_lost(&request.key))
    }

    /// Commit many claims, in order, with one wait for durability; a lost
    /// lease is an item's outcome.
    pub async fn commit_batch(
        &self,
        requests: &[CommitRequest],
    ) -> Result<Vec<Result<CommitOutcome, LeaseLost>>, Error> {
        telemetry::record_batch(requests.len(), self.store.kind());
        self.in_order(requests).await
    }

    /// Release one claim; a lost lease is an error.
    pub async fn release(&self, request: &ReleaseRequest) -> Result<ReleaseOutcome, Error> {
        telemetry::record_call(&request.key, self.store.kind());
        let outcome = self.durably(request).await?;
        telemetry::record_release(&outcome);
        outcome.map_err(|LeaseLost| lease_lost(&request.key))
    }

    /// Release many claims, in order, with one wait for durability.
    pub async fn release_batch(
        &self,
        requests: &[ReleaseRequest],
    ) -> Result<Vec<Result<ReleaseOutcome, LeaseLost>>, Error> {
        telemetry::record_batch(requests.len(), self.store.kind());
        self.in_order(requests).await
    }

    /// Applies one request and waits until its change is durable.
    async fn durably<R: Step>(&self, request: &R) -> Result<R::Outcome, Error> {
        let outcome = request
            .apply(self)
            .instrument(telemetry::store_span(self.store.kind()))
            .await?;
        self.wait_durable().await?;
        Ok(outcome)
    }

    /// Waits until every change made so far is durable.
    async fn wait_durable(&self) -> Result<(), Error> {
        self.store
            .durable()
            .instrument(telemetry::durability_span())
            .await
    }

    /// Applies `requests` one after the other (a batch's items apply in
    /// order), then waits once for durability: one disk sync for the batch.
    async fn in_order<R: Step>(&self, requests: &[R]) -> Result<Vec<R::Outcome>, Error> {
        let mut outcomes = Vec::with_capacity(requests.len());
        let store_round_trips = telemetry::store_span(self.store.kind());
        for request in requests {
            match request
                .apply(self)
                .instrument(store_round_trips.clone())
                .await
            {
                Ok(outcome) => outcomes.push(outcome),
                Err(error) => {
                    // The call fails: what earlier items took is given back
                    // — unless the store itself failed, where giving back
                    // would wait out its timeout per item, and the leases
                    // end by themselves.
                    if !error.may_pass() {
                        for (done, outcome) in requests.iter().zip(&outcomes) {
                            done.undo(self, outcome).await;
                        }
                    }
                    return Err(error);
                }
            }
        }
        drop(store_round_trips);
        self.wait_durable().await?;
        Ok(outcomes)
    }

    /// Extend a claim's lease; returns the new expiry.
    pub async fn renew(&self, request: &RenewRequest) -> Result<UnixMillis, Error> {
        telemetry::record_call(&request.key, self.store.kind());
        let mut at = self.decision_time()?;
        let outcome = self
            .store
            .update(&self.stored_key(&request.key), |current, attempt| {
                let now = self.attempt_time(&mut at, &attempt)?;
                Ok(machine::renew(current, request, now))
            })
            .instrument(telemetry::store_span(self.store.kind()))
            .await?;
        if outcome.is_err() {
            self.count(&request.key, OutcomeKind::LeaseLost);
        }
        self.wait_durable().await?;
        outcome.map_err(|LeaseLost| lease_lost(&request.key))
    }

    /// The live record of `key`, if any.
    pub async fn lookup(&self, key: &Key) -> Result<Option<Record>, Error> {
        telemetry::record_call(key, self.store.kind());
        let now = self.decision_time()?;
        let record = self
            .store
            .get(&self.stored_key(key))
            .instrument(telemetry::store_span(self.store.kind()))
            .await?;
        // What we read may be someone's not yet durable write.
        self.wait_durable().await?;
        machine::live(record.as_ref(), now)
            .cloned()
            .map(|record| self.opened(key, record))
            .transpose()
    }

    /// Delete `key`; true if a live record existed.
    pub async fn forget(&self, key: &Key) -> Result<bool, Error> {
        telemetry::record_call(key, self.store.kind());
        let mut at = self.decision_time()?;
        let existed = self
            .store
            .update(&self.stored_key(key), |current, attempt| {
                let now = self.attempt_time(&mut at, &attempt)?;
                Ok(machine::forget(current, now))
            })
            .instrument(telemetry::store_span(self.store.kind()))
            .await?;
        self.wait_durable().await?;
        Ok(existed)
    }

    /// Registers `id` as sealing answers from `now` on, unless this engine
    /// did within [`key_registry::REGISTRATION_REFRESH`].
    async fn register_sealing_key(&self, id: KeyId, now: UnixMillis) -> Result<(), Error> {
        let fresh = |registered: &HashMap<KeyId, UnixMillis>| {
            registered
                .get(&id)
                .is_some_and(|at| now < at.saturating_add(key_registry::REGISTRATION_REFRESH))
        };
        if fresh(&self.registered.lock().expect("registered keys lock")) {
            return Ok(());
        }
        self.store
            .update(&key_registry::registry_key(), |current, _| {
                Ok((key_registry::register(current, id, now)?, ()))
            })
            .await?;
        self.registered
            .lock()
            .expect("registered keys lock")
            .insert(id, now);
        Ok(())
    }

    /// The start-up check: every key the store holds answers under that
    /// may still be read (sealed within `longest_retention`) is configured
    /// or declared erased. `Err` is one line for the operator (exit 64). A
    /// store that cannot be read now is not a configuration error: the
    /// check is skipped, and each answer is checked as it is read.
    pub async fn check_sealing_keys(&self, longest_retention: Duration) -> Result<(), String> {
        let registry = match self.store.get(&key_registry::registry_key()).await {
            Ok(registry) => registry,
            Err(error) => {
                tracing::warn!(%error, "the store's sealing keys could not be read; not checked at start");
                return Ok(());
            }
        };
        let keys = match key_registry::registered(registry.as_ref()) {
            Ok(keys) => keys,
            Err(error) => {
                tracing::error!(%error, "the store's sealing-key registry is damaged; not checked at start");
                return Ok(());
            }
        };
        let keyring = self.keyring();
        let known = |id| keyring.as_ref().is_some_and(|keyring| keyring.knows(id));
        let now = self.clock.interval().earliest;
        let missing = key_registry::missing(&keys, now, longest_retention, known);
        if missing.is_empty() {
            return Ok(());
        }
        let ids: Vec<String> = missing.iter().map(|(id, _)| id.to_string()).collect();
        Err(format!(
            "the store holds answers sealed with key {} that this sidecar does not have: mount \
             it (--encryption-key-file or --decryption-key-file), or, only if it was destroyed \
             on purpose, declare it (--erased-key-id {})",
            ids.join(", "),
            ids.join(",")
        ))
    }

    /// `record` (read under `stored_key`) with its answer sealed anew under
    /// its namespace's current key, when it is a live committed answer
    /// under another key: opened, sealed, and swapped in only while the
    /// record is still the one read ([`machine::reseal`]). The rule a rekey
    /// pass and the lazy re-seal of a replayed answer share.
    async fn reseal(
        &self,
        keyring: &Keyring,
        stored_key: &Key,
        record: &Record,
        now: Now,
    ) -> Result<Resealed, Error> {
        // Keys as the store holds them: a sealed answer is bound to those
        // (see `commit_unsynced`), hashed IDs included.
        let answered = machine::live(Some(record), now)
            .is_some_and(|record| record.state == RecordState::Committed);
        if !answered || !sealing::looks_sealed(&record.response) {
            return Ok(Resealed::NotSealed);
        }
        let current = keyring.sealing_id_for(stored_key.namespace());
        if Keyring::key_id(&record.response).is_ok_and(|id| id == current) {
            return Ok(Resealed::Current);
        }
        let binding = Binding {
            key: stored_key,
            lease_token: record.lease_token,
        };
        let answer = match keyring.open(&binding, &record.response) {
            Ok(answer) => answer,
            Err(Unsealable::Erased(_)) => return Ok(Resealed::Erased),
            Err(problem) => {
                tracing::warn!(key = %stored_key, %problem, "an answer that cannot be opened is not re-sealed");
                return Ok(Resealed::Unreadable);
            }
        };
        let resealed = keyring.seal(&binding, &answer);
        let mut at = now;
        let replaced = self
            .store
            .update(stored_key, |current, attempt| {
                let now = self.attempt_time(&mut at, &attempt)?;
                Ok(machine::reseal(current, record, &resealed, now))
            })
            .await?;
        Ok(if replaced {
            Resealed::Replaced
        } else {
            Resealed::Current
        })
    }

    /// Whether `record`'s answer is sealed under a key other than the one
    /// that seals `key`'s namespace now.
    fn under_older_key(&self, key: &Key, record: &Record) -> bool {
        let Some(keyring) = self.keyring().filter(|keyring| keyring.seals()) else {
            return false;
        };
        let current = keyring.sealing_id_for(key.namespace());
        Keyring::key_id(&record.response).is_ok_and(|id| id != current)
    }

    /// A replayed answer found under an older key is re-sealed under the
    /// current one as it is read (a committed record is never written
    /// again otherwise): one compare-and-swap on that duplicate's path,
    /// synced with its answer; a failure only leaves it for the next replay
    /// or a rekey pass, never fails the call.
    async fn reseal_replayed(&self, stored_key: &Key, record: &Record) {
        let Some(keyring) = self.keyring().filter(|keyring| keyring.seals()) else {
            return;
        };
        let resealed = match self.decision_time() {
            Ok(now) => self.reseal(&keyring, stored_key, record, now).await,
            Err(error) => Err(error),
        };
        if let Err(error) = resealed {
            tracing::debug!(%error, "a replayed answer was not re-sealed; left for later");
        }
    }

    /// The start-up check of ID hashing: the store remembers the check value
    /// of the key its correlation IDs are hashed with (written by the first
    /// sidecar that hashes them); a sidecar with another key, or without
    /// one, would find no stored record and process every event within
    /// retention again — `Err` is one line for the operator (exit 64). A
    /// store that cannot be read or written now is not checked.
    pub async fn check_id_hashing(&self) -> Result<(), String> {
        let key = key_registry::id_hashing_key();
        let mine = self.ids.as_ref().map(|ids| ids.check_value());
        let now = self.clock.interval().latest;
        let stored = match &mine {
            // The first to hash them says so; a record already there wins.
            Some(check) => {
                self.store
                    .update(&key, |current, _| {
                        Ok(match current {
                            Some(current) => {
                                (machine::Change::Keep, Some(current.response.clone()))
                            }
                            None => (
                                machine::Change::Put(key_registry::id_hashing_record(check, now)),
                                None,
                            ),
                        })
                    })
                    .await
            }
            None => self
                .store
                .get(&key)
                .await
                .map(|record| record.map(|record| record.response)),
        };
        let stored = match stored {
            Ok(stored) => stored.map(|bytes| String::from_utf8_lossy(&bytes).into_owned()),
            Err(error) => {
                tracing::warn!(%error, "the store's ID hashing could not be checked at start");
                return Ok(());
            }
        };
        match (stored, mine) {
            (None, _) => Ok(()),
            (Some(stored), Some(mine)) if stored == mine => Ok(()),
            (Some(_), Some(_)) => Err(
                "the store's correlation IDs are hashed with another key than \
                 --hash-correlation-ids gives: no stored record would be found, and every event \
                 within retention would be processed again; give the key they were hashed with"
                    .into(),
            ),
            (Some(_), None) => Err(
                "the store's correlation IDs are hashed (--hash-correlation-ids): without that key \
                 no stored record would be found, and every event within retention would be \
                 processed again; give it"
                    .into(),
            ),
        }
    }

    /// One page of a rekey pass: every committed answer among about
    /// `limit` stored records from `cursor` on that is sealed with a key
    /// other than its namespace's sealing key is opened and sealed anew with
    /// that key, by compare-and-swap (a record changed meanwhile is left as
    /// it is). Once a pass is through, no live answer is under an old key,
    /// and the old keys can be removed. Answers that cannot be opened are
    /// counted, not changed.
    pub async fn rekey(
        &self,
        cursor: &ScanCursor,
        limit: usize,
        retire_old_keys: bool,
    ) -> Result<RekeyPage, Error> {
        let Some(keyring) = self.keyring().filter(|keyring| keyring.seals()) else {
            return Err(Error::FailedPrecondition(
                "rekey needs a sealing key (--encryption-key-file)".into(),
            ));
        };
        let now = self.decision_time()?;
        let scanned = self
            .store
            .scan(cursor, limit)
            .instrument(telemetry::store_span(self.store.kind()))
            .await?;
        let mut page = RekeyPage {
            examined: scanned.keys.len() as u64,
            next: scanned.next,
            ..RekeyPage::default()
        };
        for stored_key in &scanned.keys {
            // One record read at a time: a page's memory does not grow with
            // the answers stored.
            let Some(record) = self.store.get(stored_key).await? else {
                continue;
            };
            match self.reseal(&keyring, stored_key, &record, now).await? {
                Resealed::NotSealed => {}
                Resealed::Current => page.current += 1,
                Resealed::Replaced => page.resealed += 1,
                Resealed::Erased => page.erased += 1,
                Resealed::Unreadable => page.unreadable += 1,
            }
        }
        if retire_old_keys && page.next.is_none() && page.unreadable == 0 {
            // The pass is through and every answer opened: nothing needs an
            // old key any more (see `check_sealing_keys`).
            let current = keyring.sealing_ids();
            self.store
                .update(&key_registry::registry_key(), |registry, _| {
                    Ok((key_registry::keep_only(registry, &current)?, ()))
                })
                .await?;
            page.retired_old_keys = true;
        }
        self.wait_durable().await?;
        Ok(page)
    }

    async fn claim_unsynced(&self, request: &ClaimRequest) -> Result<ClaimOutcome, Error> {
        let mut at = self.decision_time()?;
        let highest_committed_sequence = match &request.ordering {
            Some(position) => {
                let scope = OrderingScope {
                    namespace: request.key.namespace().to_owned(),
                    ordering_key: position.ordering_key.clone(),
                };
                let mark = self.store.get_mark(&scope).await?;
                machine::live_mark(mark, at).map(|mark| mark.highest)
            }
            None => None,
        };
        let lease_token = LeaseToken::random();
        let outcome = self
            .store
            .update(&self.stored_key(&request.key), |current, attempt| {
                let now = self.attempt_time(&mut at, &attempt)?;
                machine::claim(
                    current,
                    request,
                    now,
                    lease_token,
                    highest_committed_sequence,
                    attempt.issue_fencing,
                )
            })
            .await?;
        self.count(&request.key, outcome.kind());
        match outcome {
            ClaimOutcome::Duplicate { record } => {
                // Copied only when it is under an older key (rare after a
                // rotation): the copy is what the re-seal swaps against.
                let stale = self
                    .under_older_key(&request.key, &record)
                    .then(|| record.clone());
                let opened = self.opened(&request.key, record)?;
                if let Some(stale) = stale.filter(|_| !opened.response_erased) {
                    self.reseal_replayed(&self.stored_key(&request.key), &stale)
                        .await;
                }
                Ok(ClaimOutcome::Duplicate { record: opened })
            }
            ClaimOutcome::FingerprintMismatch { record } => Ok(ClaimOutcome::FingerprintMismatch {
                record: self.opened(&request.key, record)?,
            }),
            // A claim's record holds no answer yet.
            outcome => Ok(outcome),
        }
    }

    fn count(&self, key: &Key, outcome: OutcomeKind) {
        self.metrics.outcome(key.namespace(), outcome);
    }

    async fn commit_unsynced(
        &self,
        request: &CommitRequest,
    ) -> Result<Result<CommitOutcome, LeaseLost>, Error> {
        let keyring = self.keyring();
        let sealer = keyring.as_ref().filter(|keyring| keyring.seals());
        if sealer.is_none() && sealing::looks_sealed(&request.response) {
            // It would be refused when read back (see `opened`): say so now.
            return Err(Error::InvalidArgument(vec![FieldViolation::new(
                "response",
                "starts with the bytes of a sealed answer (D5 ED FF 01), which a sidecar without \
                 --encryption-key-file cannot tell from one: prefix it with another byte",
            )]));
        }
        let mut at = self.decision_time()?;
        if let Some(keyring) = sealer {
            // Before the first answer it seals: a sidecar started later
            // without this key is refused at start, not answer by answer.
            let id = keyring.sealing_id_for(request.key.namespace());
            self.register_sealing_key(id, at.latest).await?;
        }
        let sealed = sealer.map(|keyring| CommitRequest {
            response: keyring.seal(
                &Binding {
                    // The key the store holds it under (its ID hashed, when
                    // IDs are): what a pass over the store can re-seal.
                    key: &self.stored_key(&request.key),
                    lease_token: request.lease_token,
                },
                &request.response,
            ),
            key: request.key.clone(),
            ..*request
        });
        let outcome = self
            .store
            .update(&self.stored_key(&request.key), |current, attempt| {
                let now = self.attempt_time(&mut at, &attempt)?;
                Ok(machine::commit(
                    current,
                    sealed.as_ref().unwrap_or(request),
                    now,
                ))
            })
            .await?;
        match &outcome {
            Ok(CommitOutcome::Committed(_)) => self.count(&request.key, OutcomeKind::Committed),
            Ok(CommitOutcome::AlreadyCommitted(_)) => {}
            Err(LeaseLost) => self.count(&request.key, OutcomeKind::LeaseLost),
        }
        if let Ok(committed) = &outcome {
            // Also on ALREADY_COMMITTED: if we crashed between the record and
            // the mark, the client's retry is what raises the mark.
            self.raise_mark(&request.key, committed.record(), at)
                .await?;
        }
        Ok(match outcome {
            // Sealed just now from this request: its answer, not opened again.
            Ok(CommitOutcome::Committed(record)) if sealed.is_some() => {
                Ok(CommitOutcome::Committed(Record {
                    response: request.response.clone(),
                    ..record
                }))
            }
            // Committed before: the answer stored then (a retry may carry another).
            Ok(CommitOutcome::AlreadyCommitted(record)) => Ok(CommitOutcome::AlreadyCommitted(
                self.opened(&request.key, record)?,
            )),
            outcome => outcome,
        })
    }

    /// `record` with its answer opened, when it holds a sealed one (or
    /// answers are sealed). One sealed with a key declared destroyed
    /// (`--erased-key-id`) is erased ([`Record::response_erased`], counted);
    /// one that does not open — a key neither configured nor declared
    /// erased, altered, moved, or plaintext where answers are sealed — is an
    /// error of the call (logged where it is answered), so a wrong or
    /// missing key never reads as empty answers. Neither is ever replayed
    /// as it is, nor claimed afresh.
    fn opened(&self, key: &Key, record: Record) -> Result<Record, Error> {
        if record.state != RecordState::Committed || record.response.is_empty() {
            // An empty answer (committed before sealing was on, with none):
            // nothing was kept that sealing would protect (a sealed answer
            // is never empty), so the many consumers that store none switch
            // freely.
            return Ok(record);
        }
        let keyring = self.keyring();
        let seals = keyring.as_ref().is_some_and(|keyring| keyring.seals());
        if !seals && !sealing::looks_sealed(&record.response) {
            // Sealing is off and this answer was stored as it is.
            return Ok(record);
        }
        let stored_key = self.stored_key(key);
        let binding = Binding {
            key: &stored_key,
            lease_token: record.lease_token,
        };
        let opened = match &keyring {
            Some(keyring) => keyring.open(&binding, &record.response),
            None => {
                Keyring::key_id(&record.response).and_then(|id| Err(Unsealable::UnknownKey(id)))
            }
        };
        match opened {
            Ok(response) => Ok(Record { response, ..record }),
            // Its key was destroyed on purpose (crypto-shredding): a
            // documented state, not an error — the event was processed, its
            // answer is not to be had.
            Err(Unsealable::Erased(_)) => {
                self.metrics.answer_erased(key.namespace());
                Ok(Record {
                    response: Vec::new(),
                    response_erased: true,
                    ..record
                })
            }
            Err(problem @ Unsealable::UnknownKey(_)) => Err(Error::KeyNotConfigured(format!(
                "the stored answer of {key} {problem}"
            ))),
            Err(problem) => Err(Error::Corrupt(format!(
                "the stored answer of {key} {problem}"
            ))),
        }
    }

    async fn release_unsynced(
        &self,
        request: &ReleaseRequest,
    ) -> Result<Result<ReleaseOutcome, LeaseLost>, Error> {
        let mut at = self.decision_time()?;
        let outcome = self
            .store
            .update(&self.stored_key(&request.key), |current, attempt| {
                let now = self.attempt_time(&mut at, &attempt)?;
                Ok(machine::release(current, request, now))
            })
            .await?;
        match outcome {
            Ok(ReleaseOutcome::Released) => self.count(&request.key, OutcomeKind::Released),
            Ok(ReleaseOutcome::AlreadyReleased | ReleaseOutcome::NotFound) => {}
            Err(LeaseLost) => self.count(&request.key, OutcomeKind::LeaseLost),
        }
        Ok(outcome)
    }

    async fn raise_mark(&self, key: &Key, committed: &Record, now: Now) -> Result<(), Error> {
        let Some(position) = &committed.ordering else {
            return Ok(());
        };
        let scope = OrderingScope {
            namespace: key.namespace().to_owned(),
            ordering_key: position.ordering_key.clone(),
        };
        self.store
            .update_mark(&scope, |current| {
                machine::raise_mark(current, committed, now)
            })
            .await
    }
}

/// What [`Engine::reseal`] did with one record.
enum Resealed {
    /// No live committed answer in the sealed format: nothing to do.
    NotSealed,
    /// Under its namespace's current key already (or changed meanwhile).
    Current,
    /// Sealed anew under the current key.
    Replaced,
    /// Under a key declared destroyed: left erased.
    Erased,
    /// Would not open: left as it is (logged).
    Unreadable,
}

/// What one page of a rekey pass did ([`Engine::rekey`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RekeyPage {
    /// Records looked at.
    pub examined: u64,
    /// Answers sealed anew with their namespace's sealing key.
    pub resealed: u64,
    /// Answers already under it (or changed by a call meanwhile).
    pub current: u64,
    /// Answers under a key declared destroyed: they stay erased.
    pub erased: u64,
    /// Answers that would not open (a key not configured, altered): left
    /// as they are, each logged.
    pub unreadable: u64,
    /// Where the next page starts; `None` once the pass is through.
    pub next: Option<ScanCursor>,
    /// The store's record of sealing keys now names only the current ones.
    pub retired_old_keys: bool,
}

/// A request that a batch applies without waiting for durability.
trait Step: Sync {
    type Outcome: Send + Sync;
    fn apply<S: Store>(
        &self,
        engine: &Engine<S>,
    ) -> impl Future<Output = Result<Self::Outcome, Error>> + Send;

    /// Gives back what `outcome` holds when a later item of its batch fails
    /// the call: the caller never learns of it, so nothing else would.
    fn undo<S: Store>(
        &self,
        engine: &Engine<S>,
        outcome: &Self::Outcome,
    ) -> impl Future<Output = ()> + Send {
        let _ = (engine, outcome);
        async {}
    }
}

impl Step for ClaimRequest {
    type Outcome = ClaimOutcome;
    fn apply<S: Store>(
        &self,
        engine: &Engine<S>,
    ) -> impl Future<Output = Result<ClaimOutcome, Error>> + Send {
        engine.claim_unsynced(self)
    }

    /// A claim granted to a batch that then failed: its lease token never
    /// reached the caller, whose retry would find the key IN_PROGRESS until
    /// the lease ends. Released (best effort: if this fails too, the lease
    /// ends by itself).
    async fn undo<S: Store>(&self, engine: &Engine<S>, outcome: &ClaimOutcome) {
        // A claim that recovered a dead holder's stays: released, the next
        // claim would no longer say the previous holder may have done the
        // work (`recovered` is told only over a claimed record).
        let ClaimOutcome::Claimed {
            record,
            recovered: false,
        } = outcome
        else {
            return;
        };
        let release = ReleaseRequest {
            key: self.key.clone(),
            lease_token: record.lease_token,
        };
        if let Err(error) = engine.release_unsynced(&release).await {
            tracing::warn!(key = %self.key, %error, "a claim of a failed batch was not given back; its lease will end");
        }
    }
}

impl Step for CommitRequest {
    type Outcome = Result<CommitOutcome, LeaseLost>;
    fn apply<S: Store>(
        &self,
        engine: &Engine<S>,
    ) -> impl Future<Output = Result<Self::Outcome, Error>> + Send {
        engine.commit_unsynced(self)
    }
}

impl Step for ReleaseRequest {
    type Outcome = Result<ReleaseOutcome, LeaseLost>;
    fn apply<S: Store>(
        &self,
        engine: &Engine<S>,
    ) -> impl Future<Output = Result<Self::Outcome, Error>> + Send {
        engine.release_unsynced(self)
    }
}

fn lease_lost(key: &Key) -> Error {
    Error::LeaseLost {
        key: key.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        clock::ManualClock,
        domain::{ClaimOutcome, ClaimRequest, FencingToken, Key},
        machine::{Change, SequenceMark},
        store::{
            memory::MemoryStore,
            optimistic::{self, Conditional, Swapped, Versioned},
            ReapReport, StoreStats,
        },
    };

    fn key(id: &str) -> Key {
        Key::from_bytes(format!("default\0{id}").as_bytes()).unwrap()
    }

    fn claim(id: &str) -> ClaimRequest {
        ClaimRequest::plain(key(id), Duration::from_secs(30), Duration::from_secs(3600))
    }

    /// A ClaimBatch failing on a later item gives back the claims earlier
    /// items took — but not one that recovered a dead holder's key, whose
    /// next claim must still say so.
    #[tokio::test]
    async fn a_failed_batch_gives_back_its_claims_but_keeps_a_recovered_one() {
        let clock = ManualClock::new(UnixMillis(1_800_000_000_000));
        let store = Arc::new(MemoryStore::new());
        let sealing = |byte| {
            Engine::new(Arc::clone(&store), Arc::new(clock.clone()))
                .with_keyring(Some(Arc::new(Keyring::from_bytes(&[[byte; 32]]).unwrap())))
        };
        let (old, new) = (sealing(1), sealing(2));
        // "paid": committed under a key the second engine does not have.
        let ClaimOutcome::Claimed { record, .. } = old.claim(&claim("paid")).await.unwrap() else {
            panic!("claimed")
        };
        old.commit(&crate::domain::CommitRequest {
            key: key("paid"),
            lease_token: record.lease_token,
            response: b"receipt".to_vec(),
            retention: None,
        })
        .await
        .unwrap();
        // "dead": claimed by a holder that dies, maybe after its write.
        new.claim(&claim("dead")).await.unwrap();
        clock.advance(Duration::from_secs(31));
        let failed = new
            .claim_batch(&[claim("fresh"), claim("dead"), claim("paid")])
            .await;
        assert!(
            matches!(failed, Err(Error::KeyNotConfigured(_))),
            "{failed:?}"
        );
        let fresh = new.claim(&claim("fresh")).await.unwrap();
        assert!(
            matches!(
                fresh,
                ClaimOutcome::Claimed {
                    recovered: false,
                    ..
                }
            ),
            "given back: {fresh:?}"
        );
        clock.advance(Duration::from_secs(31));
        let dead = new.claim(&claim("dead")).await.unwrap();
        assert!(
            matches!(
                dead,
                ClaimOutcome::Claimed {
                    recovered: true,
                    ..
                }
            ),
            "still told the holder died: {dead:?}"
        );
    }

    /// A pod's estimate of the store's clock: the true time (`truth`) plus
    /// `offset_ms`, uncertain by `doubt_ms` — a pod at one end of its bound.
    #[derive(Debug)]
    struct Estimate {
        truth: ManualClock,
        offset_ms: i64,
        doubt_ms: u64,
    }

    impl Clock for Estimate {
        fn now(&self) -> UnixMillis {
            UnixMillis(self.truth.now().0.saturating_add_signed(self.offset_ms))
        }

        fn interval(&self) -> Now {
            let estimate = self.now().0;
            Now {
                earliest: UnixMillis(estimate - self.doubt_ms),
                latest: UnixMillis(estimate + self.doubt_ms),
            }
        }
    }

    /// Two pods on one store, their estimates at opposite ends of ±u: the
    /// second may not take the key until the first's lease has surely
    /// ended by both reckonings. (With point estimates it was CLAIMED at
    /// L − 2u + 1 ms: two holders for up to 2u.)
    #[tokio::test]
    async fn pods_at_opposite_ends_of_the_bound_never_both_hold_a_key() {
        const U: u64 = 500;
        let lease = Duration::from_secs(30);
        let truth = ManualClock::new(UnixMillis(1_800_000_000_000));
        let store = Arc::new(MemoryStore::new());
        let behind = Engine::new(
            Arc::clone(&store),
            Arc::new(Estimate {
                truth: truth.clone(),
                offset_ms: -(U as i64),
                doubt_ms: U,
            }),
        );
        let ahead = Engine::new(
            store,
            Arc::new(Estimate {
                truth: truth.clone(),
                offset_ms: U as i64,
                doubt_ms: U,
            }),
        );
        let request = ClaimRequest::plain(
            Key::new_unchecked("orders".into(), "o-1".into()),
            lease,
            Duration::from_secs(3600),
        );
        let first = behind.claim(&request).await.unwrap();
        assert!(matches!(first, ClaimOutcome::Claimed { .. }), "{first:?}");

        truth.advance(lease - Duration::from_millis(2 * U) + Duration::from_millis(1));
        let second = ahead.claim(&request).await.unwrap();
        assert!(
            matches!(second, ClaimOutcome::InProgress { .. }),
            "a second holder while the first's lease may run: {second:?}"
        );
        // Once the lease has ended by every reckoning, the key is free.
        truth.advance(Duration::from_millis(2 * U));
        let third = ahead.claim(&request).await.unwrap();
        assert!(
            matches!(
                third,
                ClaimOutcome::Claimed {
                    recovered: true,
                    ..
                }
            ),
            "{third:?}"
        );
    }

    /// A shared store whose writes each take `lag` of the clock: the first
    /// conflicts (someone deleted the record meanwhile), the second lands
    /// and draws fencing token 7. Everything else is out of the test.
    #[derive(Debug)]
    struct LateWrites {
        clock: ManualClock,
        lag: Duration,
        writes: std::sync::Mutex<u32>,
        written: std::sync::Mutex<Option<Record>>,
    }

    impl Conditional for LateWrites {
        type Version = ();

        async fn read(&self, _: &Key) -> Result<Option<Versioned<()>>, Error> {
            Ok(None)
        }

        async fn write_if(
            &self,
            _: &Key,
            _: Option<&Versioned<()>>,
            change: &Change,
            draw_token: bool,
        ) -> Result<Swapped<()>, Error> {
            self.clock.advance(self.lag);
            let mut writes = self.writes.lock().unwrap();
            *writes += 1;
            if *writes == 1 {
                return Ok(Swapped::Conflict(None));
            }
            let Change::Put(record) = change else {
                panic!("a claim writes its record: {change:?}");
            };
            assert!(draw_token, "the write draws the token");
            let token = FencingToken(7);
            *self.written.lock().unwrap() = Some(optimistic::with_token(record, token));
            Ok(Swapped::Done {
                token: Some(token),
                version: Some(()),
            })
        }
    }

    impl Store for LateWrites {
        async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
        where
            T: Send,
            F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
        {
            Ok(optimistic::update(self, key, None, apply).await?.0)
        }
        async fn get(&self, _: &Key) -> Result<Option<Record>, Error> {
            unreachable!("not read")
        }
        async fn update_mark<F>(&self, _: &OrderingScope, _: F) -> Result<(), Error>
        where
            F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
        {
            unreachable!("no ordering")
        }
        async fn get_mark(&self, _: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
            unreachable!("no ordering")
        }
        async fn durable(&self) -> Result<(), Error> {
            Ok(())
        }
        async fn reap(&self, _: UnixMillis, _: usize) -> Result<ReapReport, Error> {
            Ok(ReapReport::default())
        }
        fn health(&self) -> Result<(), Error> {
            Ok(())
        }
        async fn stats(&self) -> StoreStats {
            StoreStats::default()
        }
        async fn close(&self) -> Result<(), Error> {
            Ok(())
        }
    }

    /// A claim's lease is set from the time its write was tried, not from
    /// when the call began (a conflict retried, or a write that lands late,
    /// would shorten it); and the run after the write, which learns the
    /// drawn token, answers with the lease that was written. Reading the
    /// time once per call fails the first check; reading it on every run,
    /// the second.
    #[tokio::test]
    async fn a_lease_is_set_from_the_time_its_write_was_tried() {
        let lag = Duration::from_secs(4);
        let lease = Duration::from_secs(30);
        let clock = ManualClock::new(UnixMillis(1_800_000_000_000));
        let start = clock.now();
        let store = Arc::new(LateWrites {
            clock: clock.clone(),
            lag,
            writes: std::sync::Mutex::new(0),
            written: std::sync::Mutex::new(None),
        });
        let engine = Engine::new(Arc::clone(&store), Arc::new(clock));
        let request = ClaimRequest::plain(
            Key::new_unchecked("orders".into(), "o-1".into()),
            lease,
            Duration::from_secs(3600),
        );
        let ClaimOutcome::Claimed { record, .. } = engine.claim(&request).await.unwrap() else {
            panic!("claimed");
        };
        let second_attempt = start.saturating_add(lag);
        assert_eq!(
            record.lease_expires_at,
            second_attempt.saturating_add(lease),
            "the lease runs from the attempt that wrote it"
        );
        assert_eq!(record.fencing_token, FencingToken(7));
        assert_eq!(
            store.written.lock().unwrap().as_ref(),
            Some(&record),
            "the answer is the record written"
        );
    }
}
