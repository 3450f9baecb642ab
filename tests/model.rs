//! Property tests: random sequences of calls (with time moving) run through
//! the engine on every store — memory, sled, PostgreSQL, Redis, two
//! sidecars over one PostgreSQL or one Redis taking turns, and Redis behind a
//! local tier — and each is checked against a small independent model of
//! protocol §2 (docs/protocol.md) kept in a BTreeMap.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use dedupd::{
    clock::{ManualClock, UnixMillis},
    domain::{
        ClaimOutcome, ClaimRequest, CommitOutcome, CommitRequest, Key, LeaseToken, OrderingScope,
        Record, RecordState, ReleaseOutcome, ReleaseRequest,
    },
    engine::Engine,
    machine::{Change, SequenceMark},
    store::{
        memory::MemoryStore,
        sled::{SledConfig, SledStore},
        tiered::Tiered,
        Attempt, ReapReport, Store, StoreStats,
    },
    Error,
};
use proptest::prelude::*;

mod common;

const LEASE_SECS: u64 = 10;
const RETENTION_SECS: u64 = 100;
const KEYS: usize = 3;

#[derive(Debug, Clone, Copy)]
enum TokenChoice {
    Latest,
    Previous,
}

#[derive(Debug, Clone)]
enum Op {
    /// A claim of a key, with a request ID from a small set (or none), so
    /// retried claims meet the claims they made.
    Claim(usize, Option<u8>),
    Commit(usize, TokenChoice),
    Release(usize, TokenChoice),
    Advance(u64),
    Forget(usize),
    Reap,
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS;
    let choice = prop_oneof![3 => Just(TokenChoice::Latest), 1 => Just(TokenChoice::Previous)];
    prop_oneof![
        4 => (key.clone(), prop_oneof![Just(None), Just(Some(1u8)), Just(Some(2u8))])
            .prop_map(|(k, r)| Op::Claim(k, r)),
        3 => (key.clone(), choice.clone()).prop_map(|(k, c)| Op::Commit(k, c)),
        2 => (key.clone(), choice).prop_map(|(k, c)| Op::Release(k, c)),
        3 => prop_oneof![Just(1u64), Just(9), Just(10), Just(11), Just(60), Just(111)].prop_map(Op::Advance),
        1 => key.prop_map(Op::Forget),
        1 => Just(Op::Reap),
    ]
}

/// The model: protocol §2 (docs/protocol.md) restated as plainly as possible.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ModelState {
    Claimed,
    Committed,
    Released,
}

#[derive(Debug, Clone, Copy)]
struct ModelRecord {
    state: ModelState,
    /// Which claim of this key holds it (1 = the first claim ever made).
    claim_number: usize,
    lease_until: u64,
    retain_until: u64,
    attempt: u32,
    request_id: Option<u8>,
    recovered: bool,
}

#[derive(Debug, Default)]
struct Model {
    now: u64,
    records: BTreeMap<usize, ModelRecord>,
    claims_made: BTreeMap<usize, usize>,
}

impl Model {
    fn live(&self, key: usize) -> Option<ModelRecord> {
        self.records
            .get(&key)
            .copied()
            .filter(|r| self.now < r.retain_until)
    }

    fn token_claim_number(&self, key: usize, choice: TokenChoice) -> usize {
        let made = self.claims_made.get(&key).copied().unwrap_or(0);
        match choice {
            TokenChoice::Latest => made,
            TokenChoice::Previous => made.saturating_sub(1),
        }
    }

    fn apply(&mut self, op: &Op) -> String {
        let now = self.now;
        match *op {
            Op::Claim(key, request_id) => match self.live(key) {
                Some(r) if r.state == ModelState::Committed => "DUPLICATE".into(),
                Some(r)
                    if r.state == ModelState::Claimed
                        && now < r.lease_until
                        && request_id.is_some()
                        && request_id == r.request_id =>
                {
                    format!("CLAIMED attempt={} recovered={}", r.attempt, r.recovered)
                }
                Some(r) if r.state == ModelState::Claimed && now < r.lease_until => {
                    "IN_PROGRESS".into()
                }
                live => {
                    let recovered = live.is_some_and(|r| r.state == ModelState::Claimed);
                    let attempt = live.map_or(0, |r| r.attempt) + 1;
                    let claim_number = self.claims_made.get(&key).copied().unwrap_or(0) + 1;
                    self.claims_made.insert(key, claim_number);
                    self.records.insert(
                        key,
                        ModelRecord {
                            state: ModelState::Claimed,
                            claim_number,
                            lease_until: now + LEASE_SECS * 1000,
                            retain_until: now + (LEASE_SECS + RETENTION_SECS) * 1000,
                            attempt,
                            request_id,
                            recovered,
                        },
                    );
                    format!("CLAIMED attempt={attempt} recovered={recovered}")
                }
            },
            Op::Commit(key, choice) => {
                let number = self.token_claim_number(key, choice);
                match self.live(key) {
                    Some(r) if r.claim_number == number && number > 0 => match r.state {
                        ModelState::Claimed => {
                            self.records.insert(
                                key,
                                ModelRecord {
                                    state: ModelState::Committed,
                                    retain_until: now + RETENTION_SECS * 1000,
                                    ..r
                                },
                            );
                            "COMMITTED".into()
                        }
                        ModelState::Committed => "ALREADY_COMMITTED".into(),
                        ModelState::Released => "LEASE_LOST".into(),
                    },
                    _ => "LEASE_LOST".into(),
                }
            }
            Op::Release(key, choice) => {
                let number = self.token_claim_number(key, choice);
                match self.live(key) {
                    None => "NOT_FOUND".into(),
                    Some(r) if r.state == ModelState::Released && r.claim_number == number => {
                        "ALREADY_RELEASED".into()
                    }
                    Some(r)
                        if r.state == ModelState::Claimed
                            && r.claim_number == number
                            && number > 0 =>
                    {
                        self.records.insert(
                            key,
                            ModelRecord {
                                state: ModelState::Released,
                                lease_until: now,
                                retain_until: now + RETENTION_SECS * 1000,
                                ..r
                            },
                        );
                        "RELEASED".into()
                    }
                    Some(_) => "LEASE_LOST".into(),
                }
            }
            Op::Advance(seconds) => {
                self.now += seconds * 1000;
                String::new()
            }
            Op::Forget(key) => {
                let existed = self.live(key).is_some();
                self.records.remove(&key);
                format!("FORGOT existed={existed}")
            }
            Op::Reap => String::new(),
        }
    }

    fn view(&self, key: usize) -> String {
        match self.live(key) {
            None => "absent".into(),
            Some(r) => format!("{:?} attempt={}", r.state, r.attempt),
        }
    }
}

/// One engine under test, with the lease tokens it handed out per key.
struct Subject<S> {
    engine: Engine<S>,
    tokens: BTreeMap<usize, Vec<LeaseToken>>,
    last_fencing: u64,
}

fn key(index: usize) -> Key {
    // Keys are built through the API's validation, as the server does.
    dedupd::api::Limits::default()
        .key("model", &format!("event-{index}"))
        .unwrap()
}

impl<S: Store> Subject<S> {
    fn new(store: S, clock: &ManualClock) -> Self {
        Subject {
            engine: Engine::new(Arc::new(store), Arc::new(clock.clone())),
            tokens: BTreeMap::new(),
            last_fencing: 0,
        }
    }

    fn token(&self, index: usize, choice: TokenChoice) -> LeaseToken {
        let issued = self.tokens.get(&index).map(Vec::as_slice).unwrap_or(&[]);
        let position = match choice {
            TokenChoice::Latest => issued.len().checked_sub(1),
            TokenChoice::Previous => issued.len().checked_sub(2),
        };
        position.map_or(LeaseToken(u128::MAX), |p| issued[p])
    }

    async fn apply(&mut self, op: &Op) -> Result<String, Error> {
        Ok(match *op {
            Op::Claim(index, request_id) => {
                let request = ClaimRequest {
                    request_id: request_id.map(|id| format!("req-{id}")).unwrap_or_default(),
                    ..ClaimRequest::plain(
                        key(index),
                        Duration::from_secs(LEASE_SECS),
                        Duration::from_secs(RETENTION_SECS),
                    )
                };
                match self.engine.claim(&request).await? {
                    ClaimOutcome::Claimed { record, recovered } => {
                        let issued = self.tokens.entry(index).or_default();
                        if issued.last() == Some(&record.lease_token) {
                            // A retried claim answered again: the same one.
                            assert!(
                                request_id.is_some(),
                                "a claim came back without a request ID"
                            );
                        } else {
                            assert!(
                                record.fencing_token.0 > self.last_fencing,
                                "fencing token went from {} to {}",
                                self.last_fencing,
                                record.fencing_token.0
                            );
                            self.last_fencing = record.fencing_token.0;
                            issued.push(record.lease_token);
                        }
                        format!("CLAIMED attempt={} recovered={recovered}", record.attempt)
                    }
                    ClaimOutcome::Duplicate { .. } => "DUPLICATE".into(),
                    ClaimOutcome::InProgress { .. } => "IN_PROGRESS".into(),
                    other => panic!("not generated: {other:?}"),
                }
            }
            Op::Commit(index, choice) => {
                let request = CommitRequest {
                    key: key(index),
                    lease_token: self.token(index, choice),
                    response: Vec::new(),
                    retention: None,
                };
                match self.engine.commit(&request).await {
                    Ok(CommitOutcome::Committed(_)) => "COMMITTED".into(),
                    Ok(CommitOutcome::AlreadyCommitted(_)) => "ALREADY_COMMITTED".into(),
                    Err(Error::LeaseLost { .. }) => "LEASE_LOST".into(),
                    Err(other) => return Err(other),
                }
            }
            Op::Release(index, choice) => {
                let request = ReleaseRequest {
                    key: key(index),
                    lease_token: self.token(index, choice),
                };
                match self.engine.release(&request).await {
                    Ok(ReleaseOutcome::Released) => "RELEASED".into(),
                    Ok(ReleaseOutcome::AlreadyReleased) => "ALREADY_RELEASED".into(),
                    Ok(ReleaseOutcome::NotFound) => "NOT_FOUND".into(),
                    Err(Error::LeaseLost { .. }) => "LEASE_LOST".into(),
                    Err(other) => return Err(other),
                }
            }
            Op::Advance(_) => String::new(),
            Op::Forget(index) => {
                let existed = self.engine.forget(&key(index)).await?;
                format!("FORGOT existed={existed}")
            }
            Op::Reap => {
                self.engine.store().reap(self.engine.now(), 1000).await?;
                String::new()
            }
        })
    }

    async fn view(&self, index: usize) -> Result<String, Error> {
        Ok(match self.engine.lookup(&key(index)).await? {
            None => "absent".into(),
            Some(record) => {
                let state = match record.state {
                    RecordState::Claimed => "Claimed",
                    RecordState::Committed => "Committed",
                    RecordState::Released => "Released",
                };
                format!("{state} attempt={}", record.attempt)
            }
        })
    }
}

/// The embedded store's expiry index files by this much time.
const EXPIRY_BUCKET_MS: u64 = 1_000;

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_store_follows_the_model(ops in proptest::collection::vec(op(), 1..40)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let clock = ManualClock::new(UnixMillis(1_000_000));
            let shared_clock: Arc<dyn dedupd::clock::Clock> = Arc::new(clock.clone());
            let mut model = Model { now: 1_000_000, ..Model::default() };
            let sled_store = SledStore::open(&SledConfig {
                cache_capacity_bytes: 4 << 20,
                expiry_bucket: Duration::from_millis(EXPIRY_BUCKET_MS),
                ..SledConfig::new(dir.path())
            })
            .unwrap();
            // The shared stores' subjects run where the tests have them
            // (a missing one is reported once, as a skip).
            static SHARED: std::sync::OnceLock<(bool, bool)> = std::sync::OnceLock::new();
            let (with_postgres, with_redis) = *SHARED.get_or_init(|| {
                (common::postgres::available(), common::redis::available())
            });
            let schemas = [common::postgres::fresh_schema(), common::postgres::fresh_schema()];
            let prefixes = [
                common::redis::fresh_prefix(),
                common::redis::fresh_prefix(),
                common::redis::fresh_prefix(),
            ];
            let mut subjects: Vec<(&str, Subject<AnyStore>)> = vec![
                ("memory", Subject::new(AnyStore::Memory(MemoryStore::new()), &clock)),
                ("sled", Subject::new(AnyStore::Sled(sled_store), &clock)),
            ];
            if with_postgres {
                subjects.push(("postgres", Subject::new(AnyStore::Postgres(common::postgres::store(&schemas[0]).await), &clock)));
                // Two sidecars over one schema, taking turns: each one's
                // memory of its own writes must never make an answer wrong.
                subjects.push(("two sidecars on postgres", Subject::new(AnyStore::PostgresTurns(TakingTurns::new(
                    common::postgres::store(&schemas[1]).await,
                    common::postgres::store(&schemas[1]).await,
                )), &clock)));
            }
            let mut upkeep = None;
            if with_redis {
                let tiered = Tiered::open(
                    Arc::new(common::redis::store(&prefixes[2], Arc::clone(&shared_clock)).await),
                    &common::shared::local_tier(dir.path()),
                    Arc::clone(&shared_clock),
                    None,
                )
                .unwrap();
                upkeep = Some(tiered.keep_current());
                common::shared::until_tier_on(&tiered).await;
                subjects.push(("redis", Subject::new(AnyStore::Redis(
                    common::redis::store(&prefixes[0], Arc::clone(&shared_clock)).await,
                ), &clock)));
                subjects.push(("two sidecars on redis", Subject::new(AnyStore::RedisTurns(TakingTurns::new(
                    common::redis::store(&prefixes[1], Arc::clone(&shared_clock)).await,
                    common::redis::store(&prefixes[1], Arc::clone(&shared_clock)).await,
                )), &clock)));
                subjects.push(("redis behind a local tier", Subject::new(AnyStore::Tiered(tiered), &clock)));
            }
            for (step, op) in ops.iter().enumerate() {
                if let Op::Advance(seconds) = op {
                    clock.advance(Duration::from_secs(*seconds));
                }
                let expected = model.apply(op);
                for (name, subject) in &mut subjects {
                    let answer = subject.apply(op).await.unwrap();
                    prop_assert_eq!(&answer, &expected, "{}, step {} {:?}", name, step, op);
                }
                if let Op::Reap = op {
                    // The reaper leaves everything that has not expired,
                    // and nothing whose second in the expiry index is over
                    // (the embedded store counts what it holds).
                    let live = model.records.values().filter(|r| model.now < r.retain_until).count();
                    let not_due = model
                        .records
                        .values()
                        .filter(|r| model.now < (r.retain_until / EXPIRY_BUCKET_MS + 1) * EXPIRY_BUCKET_MS)
                        .count();
                    for (name, subject) in &subjects {
                        if let AnyStore::Sled(store) = &**subject.engine.store() {
                            let count = store.record_count();
                            prop_assert!(
                                (live..=not_due).contains(&count),
                                "{} after the reaper, step {}: {} records, {} live, {} not due",
                                name, step, count, live, not_due
                            );
                        }
                    }
                }
                for index in 0..KEYS {
                    let expected = model.view(index);
                    for (name, subject) in &subjects {
                        prop_assert_eq!(&subject.view(index).await.unwrap(), &expected, "{} view of {}", name, index);
                    }
                }
            }
            if let Some(upkeep) = upkeep {
                upkeep.abort();
            }
            if with_postgres {
                for schema in &schemas {
                    common::postgres::drop_schema(schema).await;
                }
            }
            if with_redis {
                for prefix in &prefixes {
                    common::redis::drop_prefix(prefix).await;
                }
            }
            Ok(())
        })?;
    }
}

/// Every store under test, as one type, so one loop runs them all.
enum AnyStore {
    Memory(MemoryStore),
    Sled(SledStore),
    Postgres(dedupd::store::postgres::PostgresStore),
    PostgresTurns(TakingTurns<dedupd::store::postgres::PostgresStore>),
    Redis(dedupd::store::redis::RedisStore),
    RedisTurns(TakingTurns<dedupd::store::redis::RedisStore>),
    Tiered(Tiered<dedupd::store::redis::RedisStore>),
}

macro_rules! on_any {
    ($self:expr, $store:ident => $call:expr) => {
        match $self {
            AnyStore::Memory($store) => $call,
            AnyStore::Sled($store) => $call,
            AnyStore::Postgres($store) => $call,
            AnyStore::PostgresTurns($store) => $call,
            AnyStore::Redis($store) => $call,
            AnyStore::RedisTurns($store) => $call,
            AnyStore::Tiered($store) => $call,
        }
    };
}

impl Store for AnyStore {
    async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
    {
        on_any!(self, store => store.update(key, apply).await)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        on_any!(self, store => store.get(key).await)
    }

    async fn update_mark<F>(&self, scope: &OrderingScope, apply: F) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        on_any!(self, store => store.update_mark(scope, apply).await)
    }

    async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
        on_any!(self, store => store.get_mark(scope).await)
    }

    async fn durable(&self) -> Result<(), Error> {
        on_any!(self, store => store.durable().await)
    }

    async fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        on_any!(self, store => store.reap(now, budget).await)
    }

    fn health(&self) -> Result<(), Error> {
        on_any!(self, store => store.health())
    }

    async fn stats(&self) -> StoreStats {
        on_any!(self, store => store.stats().await)
    }

    async fn close(&self) -> Result<(), Error> {
        on_any!(self, store => store.close().await)
    }
}

/// Two stores over one database, each call going to the next in turn: two
/// sidecars serving one client alternately.
struct TakingTurns<S> {
    stores: [S; 2],
    next: std::sync::atomic::AtomicUsize,
}

impl<S> TakingTurns<S> {
    fn new(a: S, b: S) -> Self {
        TakingTurns {
            stores: [a, b],
            next: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    fn turn(&self) -> &S {
        let turn = self.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        &self.stores[turn % 2]
    }
}

impl<S: Store> Store for TakingTurns<S> {
    fn update<T, F>(
        &self,
        key: &Key,
        apply: F,
    ) -> impl std::future::Future<Output = Result<T, Error>> + Send
    where
        T: Send,
        F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
    {
        self.turn().update(key, apply)
    }

    fn get(
        &self,
        key: &Key,
    ) -> impl std::future::Future<Output = Result<Option<Record>, Error>> + Send {
        self.turn().get(key)
    }

    fn update_mark<F>(
        &self,
        scope: &OrderingScope,
        apply: F,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        self.turn().update_mark(scope, apply)
    }

    fn get_mark(
        &self,
        scope: &OrderingScope,
    ) -> impl std::future::Future<Output = Result<Option<SequenceMark>, Error>> + Send {
        self.turn().get_mark(scope)
    }

    fn durable(&self) -> impl std::future::Future<Output = Result<(), Error>> + Send {
        self.turn().durable()
    }

    fn reap(
        &self,
        now: UnixMillis,
        budget: usize,
    ) -> impl std::future::Future<Output = Result<ReapReport, Error>> + Send {
        self.turn().reap(now, budget)
    }

    fn health(&self) -> Result<(), Error> {
        self.stores[0].health().and(self.stores[1].health())
    }

    fn stats(&self) -> impl std::future::Future<Output = StoreStats> + Send {
        self.turn().stats()
    }

    fn close(&self) -> impl std::future::Future<Output = Result<(), Error>> + Send {
        self.turn().close()
    }
}
