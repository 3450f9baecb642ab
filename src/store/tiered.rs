//! The local tier: in front of a shared store, each sidecar keeps the
//! committed records it has seen in a sled of its own and answers calls that
//! such a record settles (a DUPLICATE, an idempotent Commit, a Lookup)
//! without a network round trip. Everything that changes a record goes to
//! the shared store.
//!
//! Why a committed record may be kept: the state machine never changes a
//! live one (protocol §2) — it only expires (a kept copy is used only while
//! live by the engine's clock: after that the key may be claimed again) or
//! is deleted by Forget. (A rekey pass re-seals a committed record's answer
//! under a newer key: a kept copy under the old key still opens, as no key
//! is dropped before a restart, which empties the tier.) Deletions reach every
//! sidecar through the shared store's [`DeletionFeed`]; while the feed is
//! not connected the tier is cleared and off, so a deletion missed while
//! disconnected can never be answered from it. What remains is the feed's
//! delivery time: a Forget's answer may reach its caller a few milliseconds
//! before another sidecar has dropped its copy (at most about 3 × [`HEARTBEAT`]
//! when the feed's connection dies silently).
//!
//! Bounded by bytes and age with two generations (sled trees): new entries
//! go to the current one; when it holds half the byte budget or is half the
//! age budget old, the previous one is dropped whole and the current one
//! takes its place. No index, no per-entry expiry; nothing of it survives a
//! restart (deletions made while the sidecar was down were never seen).

use std::{
    fmt,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::SeqCst},
        Arc, RwLock,
    },
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

use super::{
    codec,
    shared::{DeletionFeed, HEARTBEAT},
    Attempt, ReapReport, ScanCursor, ScanPage, Store, StoreObserver, StoreStats,
};
use crate::{
    clock::{Clock, UnixMillis},
    domain::{FencingToken, Key, OrderingScope, Record, RecordState},
    error::Error,
    machine::{self, Change, SequenceMark},
};

/// Where and how big the local tier is.
#[derive(Debug, Clone)]
pub struct LocalTierConfig {
    /// Its own directory (emptied at start).
    pub path: PathBuf,
    /// Bytes of records (key and encoded record) kept at most.
    pub max_bytes: u64,
    /// Its page cache (at most `max_bytes`).
    pub cache_bytes: u64,
    /// Longest a record is kept after it was learnt.
    pub max_age: Duration,
}

impl LocalTierConfig {
    /// The page cache sled is given: `cache_bytes`, at most `max_bytes`,
    /// at least 1 MiB.
    pub fn cache_capacity(&self) -> u64 {
        self.cache_bytes.min(self.max_bytes).max(1 << 20)
    }
}

/// A shared store with this sidecar's local tier in front.
pub struct Tiered<S> {
    shared: Arc<S>,
    tier: Arc<LocalTier>,
    clock: Arc<dyn Clock>,
}

impl<S> fmt::Debug for Tiered<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tiered")
            .field("enabled", &self.tier.enabled.load(SeqCst))
            .finish()
    }
}

impl<S> Clone for Tiered<S> {
    fn clone(&self) -> Self {
        Tiered {
            shared: Arc::clone(&self.shared),
            tier: Arc::clone(&self.tier),
            clock: Arc::clone(&self.clock),
        }
    }
}

/// What a call through the shared store taught about the key.
enum Lesson {
    Keep(Box<Record>),
    Drop,
}

impl<S: Store + DeletionFeed> Tiered<S> {
    /// `shared` with a local tier at `config.path`, telling time by `clock`
    /// (the engine's). The tier stays off until [`Tiered::keep_current`] has
    /// subscribed to the deletion feed.
    pub fn open(
        shared: Arc<S>,
        config: &LocalTierConfig,
        clock: Arc<dyn Clock>,
        observer: Option<Arc<dyn StoreObserver>>,
    ) -> Result<Self, Error> {
        Ok(Tiered {
            shared,
            tier: Arc::new(LocalTier::open(config, observer)?),
            clock,
        })
    }

    /// Whether the tier answers now (its deletion feed is connected).
    pub fn tier_enabled(&self) -> bool {
        self.tier.enabled.load(SeqCst)
    }

    /// Keeps the tier in step with the shared store for as long as it lives:
    /// subscribes to the deletion feed (retrying with backoff), turns the
    /// tier on, drops every deleted key from it, and clears it and turns it
    /// off whenever the feed is lost. Also rotates the tier's generations.
    pub fn keep_current(&self) -> tokio::task::JoinHandle<()> {
        let (shared, tier) = (Arc::clone(&self.shared), Arc::clone(&self.tier));
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                tier.switch_off().await;
                let mut deleted = match shared.subscribe().await {
                    Ok(deleted) => deleted,
                    Err(error) => {
                        tracing::warn!(%error, ?backoff, "local tier off: no deletion feed; retrying");
                        tier.rotate_while(tokio::time::sleep(backoff)).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                };
                backoff = Duration::from_millis(100);
                tier.switch_on();
                tracing::info!("local tier on: deletion feed connected");
                tier.rotate_while(async {
                    while let Some(key) = deleted.recv().await {
                        tier.invalidate(&key);
                    }
                })
                .await;
                tracing::warn!("local tier cleared and off: deletion feed lost; reconnecting");
            }
        })
    }
}

impl<S> Tiered<S> {
    /// The kept record of `key`, if the tier is on and the record live: a
    /// committed record is immutable only until its retention ends (then
    /// the key may be claimed again, here or elsewhere).
    fn kept(&self, key: &Key) -> Option<Record> {
        let kept = self.tier.get(key)?;
        machine::live(Some(&kept), self.clock.interval())
            .is_some()
            .then_some(kept)
    }
}

impl<S: Store> Store for Tiered<S> {
    fn kind(&self) -> &'static str {
        self.shared.kind()
    }

    async fn update<T, F>(&self, key: &Key, mut apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
    {
        if let Some(kept) = self.kept(key) {
            let mut issued = false;
            let (change, answer) = apply(
                Some(&kept),
                Attempt::new(&mut || {
                    issued = true;
                    Ok(FencingToken(0))
                }),
            )?;
            if matches!(change, Change::Keep) && !issued {
                self.tier.observe(true);
                return Ok(answer);
            }
        }
        self.tier.observe_miss();
        let epoch = self.tier.epoch.load(SeqCst);
        let mut lesson = None;
        let answer = self
            .shared
            .update(key, |current, issue| {
                let (change, answer) = apply(current, issue)?;
                lesson = match (&change, current) {
                    (Change::Put(next), _) if next.state == RecordState::Committed => {
                        Some(Lesson::Keep(Box::new(next.clone())))
                    }
                    (Change::Keep, Some(record)) if record.state == RecordState::Committed => {
                        Some(Lesson::Keep(Box::new(record.clone())))
                    }
                    // A claim over an expired commit, or a deletion.
                    (Change::Put(_) | Change::Delete, _) => Some(Lesson::Drop),
                    (Change::Keep, _) => None,
                };
                Ok((change, answer))
            })
            .await?;
        match lesson {
            Some(Lesson::Keep(record)) => self.tier.learn(key, &record, epoch),
            Some(Lesson::Drop) => self.tier.invalidate(key),
            None => {}
        }
        Ok(answer)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        if let Some(kept) = self.kept(key) {
            self.tier.observe(true);
            return Ok(Some(kept));
        }
        self.tier.observe_miss();
        let epoch = self.tier.epoch.load(SeqCst);
        let record = self.shared.get(key).await?;
        if let Some(record) = &record {
            if record.state == RecordState::Committed {
                self.tier.learn(key, record, epoch);
            }
        }
        Ok(record)
    }

    async fn update_mark<F>(&self, scope: &OrderingScope, apply: F) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        self.shared.update_mark(scope, apply).await
    }

    async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
        self.shared.get_mark(scope).await
    }

    /// The shared store's records (the local tier holds a subset of them).
    async fn scan(&self, cursor: &ScanCursor, limit: usize) -> Result<ScanPage, Error> {
        self.shared.scan(cursor, limit).await
    }

    async fn durable(&self) -> Result<(), Error> {
        self.shared.durable().await
    }

    async fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        self.shared.reap(now, budget).await
    }

    fn health(&self) -> Result<(), Error> {
        self.shared.health()
    }

    fn writable(&self) -> Result<(), Error> {
        self.shared.writable()
    }

    async fn stats(&self) -> StoreStats {
        StoreStats {
            local_tier_on: Some(self.tier.enabled.load(SeqCst)),
            ..self.shared.stats().await
        }
    }

    async fn close(&self) -> Result<(), Error> {
        self.shared.close().await
    }
}

/// The sled half: two generations of committed records.
struct LocalTier {
    db: sled::Db,
    generations: RwLock<Generations>,
    /// Bytes learnt into the current generation.
    current_bytes: AtomicU64,
    /// On only while the deletion feed is connected.
    enabled: AtomicBool,
    /// Moves on every deletion and every clearing: a record read from the
    /// shared store before the epoch moved may be one a deletion overtook,
    /// so it is not kept.
    epoch: AtomicU64,
    /// Wakes the rotation early when the current generation is full.
    full: Notify,
    max_bytes: u64,
    max_age: Duration,
    observer: Option<Arc<dyn StoreObserver>>,
}

struct Generations {
    current: sled::Tree,
    previous: sled::Tree,
    /// Names trees; the next generation's is one more.
    number: u64,
    started: Instant,
}

fn tree_name(number: u64) -> String {
    format!("generation-{number}")
}

impl LocalTier {
    fn open(
        config: &LocalTierConfig,
        observer: Option<Arc<dyn StoreObserver>>,
    ) -> Result<Self, Error> {
        // What an earlier run kept may have been deleted meanwhile.
        match std::fs::remove_dir_all(&config.path) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::Io(error))
            }
            _ => {}
        }
        let db = sled::Config::new()
            .path(&config.path)
            .cache_capacity(config.cache_capacity())
            .mode(sled::Mode::HighThroughput)
            // A cache: nothing of it needs to reach the disk in time, nor
            // at all — temporary, sled neither syncs its writes (our copy
            // makes the main store's durable: vendor/sled/DEDUPD.md) nor
            // keeps anything after it is dropped.
            .flush_every_ms(None)
            .temporary(true)
            .open()
            .map_err(|error| Error::Store(format!("local tier: {error}")))?;
        let generations = Generations {
            previous: open_tree(&db, 0)?,
            current: open_tree(&db, 1)?,
            number: 1,
            started: Instant::now(),
        };
        Ok(LocalTier {
            db,
            generations: RwLock::new(generations),
            current_bytes: AtomicU64::new(0),
            enabled: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            full: Notify::new(),
            max_bytes: config.max_bytes,
            max_age: config.max_age,
            observer,
        })
    }

    fn trees(&self) -> (sled::Tree, sled::Tree) {
        let generations = self.generations.read().expect("local tier lock");
        (generations.current.clone(), generations.previous.clone())
    }

    /// The kept record of `key`, while the tier is on.
    fn get(&self, key: &Key) -> Option<Record> {
        if !self.enabled.load(SeqCst) {
            return None;
        }
        let (current, previous) = self.trees();
        let key = key.to_bytes();
        let bytes = match current.get(&key) {
            Ok(Some(bytes)) => bytes,
            _ => previous.get(&key).ok()??,
        };
        codec::decode_record(&bytes).ok()
    }

    fn observe(&self, hit: bool) {
        if let Some(observer) = &self.observer {
            observer.local_tier(hit);
        }
    }

    fn observe_miss(&self) {
        if self.enabled.load(SeqCst) {
            self.observe(false);
        }
    }

    /// Keeps `record`, read from the shared store when the epoch was
    /// `epoch`, unless a deletion or a clearing came since.
    fn learn(&self, key: &Key, record: &Record, epoch: u64) {
        if !self.enabled.load(SeqCst) {
            return;
        }
        let key = key.to_bytes();
        let bytes = codec::encode_record(record);
        let size = (key.len() + bytes.len()) as u64;
        if self.current_bytes.load(SeqCst) + size > self.max_bytes / 2 {
            self.full.notify_one();
            return;
        }
        let (current, previous) = self.trees();
        if current.insert(&key, bytes).is_err() {
            return; // A generation being dropped: nothing to keep.
        }
        self.current_bytes.fetch_add(size, SeqCst);
        // The epoch moves before a deletion removes: either that removal
        // comes after our insert, or we see the move here and undo it.
        if self.epoch.load(SeqCst) != epoch {
            let _ = current.remove(&key);
            let _ = previous.remove(&key);
        }
    }

    fn invalidate(&self, key: &Key) {
        self.epoch.fetch_add(1, SeqCst);
        let (current, previous) = self.trees();
        let key = key.to_bytes();
        let _ = current.remove(&key);
        let _ = previous.remove(&key);
    }

    /// Turns the tier on, once the deletion feed is subscribed. The epoch
    /// moves first: a read of the shared store that began while the tier was
    /// off may hold a record whose deletion was announced before the
    /// subscription was in place — a notice this sidecar never gets — so
    /// what such a read brings back must not be kept.
    fn switch_on(&self) {
        self.epoch.fetch_add(1, SeqCst);
        self.enabled.store(true, SeqCst);
    }

    /// Turns the tier off and forgets everything in it.
    async fn switch_off(self: &Arc<Self>) {
        self.enabled.store(false, SeqCst);
        self.epoch.fetch_add(1, SeqCst);
        let tier = Arc::clone(self);
        let _ = tokio::task::spawn_blocking(move || {
            tier.rotate();
            tier.rotate();
        })
        .await;
    }

    /// Runs `until` while rotating the generations when they are full or
    /// old; returns when `until` does.
    async fn rotate_while(self: &Arc<Self>, until: impl std::future::Future<Output = ()>) {
        tokio::pin!(until);
        let period = (self.max_age / 4).clamp(Duration::from_millis(10), HEARTBEAT);
        let mut tick = tokio::time::interval(period);
        loop {
            let due = tokio::select! {
                () = &mut until => return,
                _ = tick.tick() => {
                    let generations = self.generations.read().expect("local tier lock");
                    generations.started.elapsed() >= self.max_age / 2
                }
                () = self.full.notified() => true,
            };
            if due {
                let tier = Arc::clone(self);
                let _ = tokio::task::spawn_blocking(move || tier.rotate()).await;
            }
        }
    }

    /// A fresh current generation; the previous one is dropped whole.
    fn rotate(&self) {
        let dropped = {
            let mut generations = self.generations.write().expect("local tier lock");
            let next = generations.number + 1;
            let Ok(fresh) = open_tree(&self.db, next) else {
                return;
            };
            let current = std::mem::replace(&mut generations.current, fresh);
            let previous = std::mem::replace(&mut generations.previous, current);
            generations.number = next;
            generations.started = Instant::now();
            self.current_bytes.store(0, SeqCst);
            previous
        };
        // Dropping walks the tree; it is at most half the byte budget.
        if let Err(error) = self.db.drop_tree(dropped.name()) {
            tracing::debug!(%error, "local tier: dropping a generation failed");
        }
    }
}

fn open_tree(db: &sled::Db, number: u64) -> Result<sled::Tree, Error> {
    db.open_tree(tree_name(number))
        .map_err(|error| Error::Store(format!("local tier: {error}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(dir: &std::path::Path, max_bytes: u64, max_age: Duration) -> Arc<LocalTier> {
        let tier = LocalTier::open(
            &LocalTierConfig {
                path: dir.join("tier"),
                max_bytes,
                cache_bytes: max_bytes,
                max_age,
            },
            None,
        )
        .unwrap();
        tier.enabled.store(true, SeqCst);
        Arc::new(tier)
    }

    fn committed(response_bytes: usize) -> Record {
        Record::committed_for_tests(vec![1; response_bytes])
    }

    fn key(i: usize) -> Key {
        Key::new_unchecked("tier".into(), format!("evt-{i}"))
    }

    /// Bytes held in both generations.
    fn held(tier: &LocalTier) -> u64 {
        let (current, previous) = tier.trees();
        [current, previous]
            .iter()
            .flat_map(|tree| tree.iter())
            .map(|entry| {
                let (key, value) = entry.unwrap();
                (key.len() + value.len()) as u64
            })
            .sum()
    }

    #[test]
    fn never_holds_more_than_its_byte_budget() {
        use futures_util::FutureExt;

        let dir = tempfile::tempdir().unwrap();
        let tier = tier(dir.path(), 64 << 10, Duration::from_secs(600));
        let epoch = tier.epoch.load(SeqCst);
        let mut rotations = 0;
        for i in 0..1000 {
            tier.learn(&key(i), &committed(1000), epoch);
            // What the upkeep task does when told the generation is full.
            if tier.full.notified().now_or_never().is_some() {
                tier.rotate();
                rotations += 1;
                tier.learn(&key(i), &committed(1000), epoch);
            }
            assert!(held(&tier) <= 64 << 10, "{} bytes after {i}", held(&tier));
        }
        assert!(rotations > 10, "{rotations}");
        // The latest records are the ones kept.
        assert!(tier.get(&key(999)).is_some());
        assert!(tier.get(&key(0)).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn forgets_records_older_than_its_age_budget() {
        let dir = tempfile::tempdir().unwrap();
        let tier = tier(dir.path(), 8 << 20, Duration::from_secs(60));
        let rotating = {
            let tier = Arc::clone(&tier);
            tokio::spawn(async move { tier.rotate_while(std::future::pending()).await })
        };
        let tick = Duration::from_secs(1);
        for round in 0..3 {
            tier.learn(&key(round), &committed(10), tier.epoch.load(SeqCst));
            tokio::time::sleep(Duration::from_secs(29)).await;
            assert!(tier.get(&key(round)).is_some(), "kept while young");
            // Never past the budget (and one rotation tick).
            tokio::time::sleep(Duration::from_secs(31) + tick).await;
            assert!(
                tier.get(&key(round)).is_none(),
                "round {round}: kept past 60 s"
            );
        }
        rotating.abort();
    }

    #[test]
    fn a_record_read_before_a_deletion_arrived_is_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let tier = tier(dir.path(), 8 << 20, Duration::from_secs(600));
        let read_at = tier.epoch.load(SeqCst);
        // The deletion notice arrives while the shared store's answer is on
        // its way: the answer may predate the deletion.
        tier.invalidate(&key(1));
        tier.learn(&key(1), &committed(10), read_at);
        assert!(tier.get(&key(1)).is_none());
        tier.learn(&key(1), &committed(10), tier.epoch.load(SeqCst));
        assert!(tier.get(&key(1)).is_some());
    }

    /// The shared store of [`a_read_begun_before_the_feed_came_back_is_not_kept`]:
    /// the reference model, with a deletion feed, a gate on `subscribe` and
    /// a gate on `get` (held after the read, before the answer returns).
    struct GatedShared {
        records: crate::store::memory::MemoryStore,
        feed: std::sync::Mutex<Option<tokio::sync::mpsc::Sender<Key>>>,
        subscriptions: tokio::sync::Semaphore,
        answers: tokio::sync::Semaphore,
        reads: tokio::sync::Semaphore,
    }

    impl Default for GatedShared {
        fn default() -> Self {
            GatedShared {
                records: crate::store::memory::MemoryStore::new(),
                feed: std::sync::Mutex::new(None),
                subscriptions: tokio::sync::Semaphore::new(0),
                answers: tokio::sync::Semaphore::new(0),
                reads: tokio::sync::Semaphore::new(0),
            }
        }
    }

    impl DeletionFeed for GatedShared {
        async fn subscribe(&self) -> Result<tokio::sync::mpsc::Receiver<Key>, Error> {
            self.subscriptions.acquire().await.unwrap().forget();
            let (sender, receiver) = tokio::sync::mpsc::channel(16);
            *self.feed.lock().unwrap() = Some(sender);
            Ok(receiver)
        }
    }

    impl Store for GatedShared {
        async fn update<T, F>(&self, key: &Key, apply: F) -> Result<T, Error>
        where
            T: Send,
            F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
        {
            self.records.update(key, apply).await
        }
        async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
            let read = self.records.get(key).await;
            self.reads.add_permits(1);
            self.answers.acquire().await.unwrap().forget();
            read
        }
        async fn update_mark<F>(&self, scope: &OrderingScope, apply: F) -> Result<(), Error>
        where
            F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
        {
            self.records.update_mark(scope, apply).await
        }
        async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
            self.records.get_mark(scope).await
        }
        async fn durable(&self) -> Result<(), Error> {
            Ok(())
        }
        async fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
            self.records.reap(now, budget).await
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

    #[tokio::test]
    async fn a_read_begun_before_the_feed_came_back_is_not_kept() {
        use crate::clock::ManualClock;

        let dir = tempfile::tempdir().unwrap();
        let shared = Arc::new(GatedShared::default());
        let config = LocalTierConfig {
            path: dir.path().join("tier"),
            max_bytes: 8 << 20,
            cache_bytes: 8 << 20,
            max_age: Duration::from_secs(600),
        };
        let tiered = Tiered::open(
            Arc::clone(&shared),
            &config,
            Arc::new(ManualClock::new(UnixMillis(1_000))),
            None,
        )
        .unwrap();
        let upkeep = tiered.keep_current();
        let until = |on: bool| {
            let tiered = tiered.clone();
            async move {
                while tiered.tier_enabled() != on {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        };
        shared.subscriptions.add_permits(1);
        tokio::time::timeout(Duration::from_secs(5), until(true))
            .await
            .expect("the tier comes on");
        // A committed record in the shared store.
        let key = key(1);
        shared
            .records
            .update(&key, |_, _| Ok((Change::Put(committed(10)), ())))
            .await
            .unwrap();
        // The feed is lost: the tier goes off, and the next subscription
        // waits (a reconnecting LISTEN or SUBSCRIBE).
        drop(shared.feed.lock().unwrap().take());
        tokio::time::timeout(Duration::from_secs(5), until(false))
            .await
            .expect("the tier goes off");
        // While it is off, a lookup reads the record from the shared store…
        let lookup = {
            let (tiered, key) = (tiered.clone(), key.clone());
            tokio::spawn(async move { tiered.get(&key).await })
        };
        shared.reads.acquire().await.unwrap().forget();
        // …another sidecar forgets the key, announced while this one is not
        // subscribed (a notice it never gets)…
        shared
            .records
            .update(&key, |_, _| Ok((Change::Delete, ())))
            .await
            .unwrap();
        // …the feed comes back, and only then the lookup's answer arrives.
        shared.subscriptions.add_permits(1);
        tokio::time::timeout(Duration::from_secs(5), until(true))
            .await
            .expect("the tier comes back on");
        shared.answers.add_permits(1);
        let stale = lookup.await.unwrap().unwrap();
        assert!(stale.is_some(), "the lookup read before the Forget");
        // The stale record must not be kept: the key is gone.
        assert!(
            tiered.tier.get(&key).is_none(),
            "a forgotten record was kept"
        );
        shared.answers.add_permits(1);
        assert!(tiered.get(&key).await.unwrap().is_none());
        upkeep.abort();
    }

    #[tokio::test]
    async fn switched_off_it_answers_nothing_and_forgets_everything() {
        let dir = tempfile::tempdir().unwrap();
        let tier = tier(dir.path(), 8 << 20, Duration::from_secs(600));
        tier.learn(&key(1), &committed(10), tier.epoch.load(SeqCst));
        tier.switch_off().await;
        assert!(tier.get(&key(1)).is_none());
        tier.learn(&key(2), &committed(10), tier.epoch.load(SeqCst));
        tier.enabled.store(true, SeqCst);
        assert!(tier.get(&key(1)).is_none(), "cleared, not just hidden");
        assert!(tier.get(&key(2)).is_none(), "nothing learnt while off");
        assert_eq!(held(&tier), 0);
    }
}
