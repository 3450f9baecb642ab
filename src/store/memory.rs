//! An in-memory store over `BTreeMap`s: the reference model the sled store is
//! property-tested against, and a fast store for engine tests. Nothing is
//! durable; it is never offered by the server.

use std::{
    collections::BTreeMap,
    sync::{Mutex, MutexGuard},
};

use super::{Attempt, ReapReport, ScanCursor, ScanPage, Store, StoreStats};
use crate::{
    clock::UnixMillis,
    domain::{FencingToken, Key, OrderingScope, Record},
    error::Error,
    machine::{Change, SequenceMark},
};

/// The in-memory store.
#[derive(Debug, Default)]
pub struct MemoryStore {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    records: BTreeMap<Key, Record>,
    marks: BTreeMap<OrderingScope, SequenceMark>,
    last_fencing_token: u64,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        MemoryStore::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("memory store lock poisoned")
    }
}

impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn scan(&self, cursor: &ScanCursor, limit: usize) -> Result<ScanPage, Error> {
        let state = self.lock();
        let after = Key::from_bytes(&cursor.0);
        let limit = limit.max(1);
        let keys: Vec<Key> = state
            .records
            .keys()
            .filter(|key| after.as_ref().is_none_or(|after| *key > after))
            .take(limit)
            .cloned()
            .collect();
        let next = (keys.len() == limit)
            .then(|| keys.last().map(|key| ScanCursor(key.to_bytes())))
            .flatten();
        Ok(ScanPage { keys, next })
    }

    async fn update<T, F>(&self, key: &Key, mut apply: F) -> Result<T, Error>
    where
        T: Send,
        F: FnMut(Option<&Record>, Attempt<'_>) -> Result<(Change, T), Error> + Send,
    {
        let mut state = self.lock();
        let State {
            records,
            last_fencing_token,
            ..
        } = &mut *state;
        let mut issue = || {
            *last_fencing_token += 1;
            Ok(FencingToken(*last_fencing_token))
        };
        let (change, answer) = apply(records.get(key), Attempt::new(&mut issue))?;
        match change {
            Change::Keep => {}
            Change::Put(record) => {
                records.insert(key.clone(), record);
            }
            Change::Delete => {
                records.remove(key);
            }
        }
        Ok(answer)
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        Ok(self.lock().records.get(key).cloned())
    }

    async fn update_mark<F>(&self, scope: &OrderingScope, mut apply: F) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        let mut state = self.lock();
        if let Some(mark) = apply(state.marks.get(scope).copied()) {
            state.marks.insert(scope.clone(), mark);
        }
        Ok(())
    }

    async fn get_mark(&self, scope: &OrderingScope) -> Result<Option<SequenceMark>, Error> {
        Ok(self.lock().marks.get(scope).copied())
    }

    async fn durable(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn reap(&self, now: UnixMillis, budget: usize) -> Result<ReapReport, Error> {
        let mut state = self.lock();
        let expired: Vec<Key> = state
            .records
            .iter()
            .filter(|(_, record)| record.retain_until <= now)
            .map(|(key, _)| key.clone())
            .take(budget)
            .collect();
        for key in &expired {
            state.records.remove(key);
        }
        let marks_before = state.marks.len();
        state.marks.retain(|_, mark| mark.retain_until > now);
        let removed = expired.len() + (marks_before - state.marks.len());
        Ok(ReapReport {
            removed,
            examined: removed,
        })
    }

    fn health(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn stats(&self) -> StoreStats {
        StoreStats {
            records: Some(self.lock().records.len() as u64),
            disk_bytes: None,
            local_tier_on: None,
        }
    }

    async fn close(&self) -> Result<(), Error> {
        Ok(())
    }
}
