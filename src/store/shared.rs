//! What the shared stores (PostgreSQL, Redis) have in common besides the
//! [`Store`](super::Store) trait: whether the server answered last (for
//! health), the memory of this sidecar's own last writes (so a Commit after
//! our own Claim can write at once), and the feed of deleted keys that keeps
//! every sidecar's local tier ([`super::tiered`]) honest.

use std::{collections::HashMap, future::Future, sync::Mutex, time::Duration};

use tokio::sync::mpsc;

use crate::{domain::Key, error::Error};

/// How often a deletion feed proves its connection alive: a feed that went
/// silent is given up after at most about three times this (PostgreSQL's
/// probe has two heartbeats to come back; Redis's PING one, with a deadline
/// of one more), and the local tier cleared.
pub const HEARTBEAT: Duration = Duration::from_secs(1);

/// Deleted keys a subscriber has not taken yet; past this the feed waits
/// (the connection's own buffers then hold the rest).
pub const FEED_BUFFER: usize = 1024;

/// Keys deleted from a shared store by any sidecar (a Forget: a Release
/// never deletes, it keeps the record released), delivered to every
/// sidecar subscribed.
pub trait DeletionFeed: Send + Sync + 'static {
    /// Subscribes, and resolves once the subscription is in place: every
    /// deletion committed from then on arrives on the receiver. The receiver
    /// closes when the subscription is lost (connection dropped, or a
    /// heartbeat unanswered for [`HEARTBEAT`]); deletions may have been
    /// missed from then on.
    fn subscribe(&self) -> impl Future<Output = Result<mpsc::Receiver<Key>, Error>> + Send;
}

/// A deleted key as a notification's text: `namespace/correlation_id`
/// (a namespace holds no `/`).
pub fn deletion_message(key: &Key) -> String {
    key.to_string()
}

/// Inverse of [`deletion_message`].
pub fn parse_deletion(message: &str) -> Option<Key> {
    let (namespace, correlation_id) = message.split_once('/')?;
    Some(Key::new_unchecked(
        namespace.to_owned(),
        correlation_id.to_owned(),
    ))
}

/// Whether the server answered the last call, and if not, why: the shared
/// stores' `writable()`. Nothing here is permanent: it passes by itself.
#[derive(Debug)]
pub struct Reachability(Mutex<Option<String>>);

impl Default for Reachability {
    fn default() -> Self {
        Reachability(Mutex::new(Some("not connected yet".into())))
    }
}

impl Reachability {
    /// Notes how a call to the server went, and passes its result on.
    pub fn observe<T>(&self, result: Result<T, Error>) -> Result<T, Error> {
        let mut unreachable = self.0.lock().expect("reachability lock");
        match &result {
            Ok(_) => *unreachable = None,
            Err(Error::Unavailable(reason)) => *unreachable = Some(reason.clone()),
            Err(_) => {}
        }
        result
    }

    /// `Ok` while the last call reached the server.
    pub fn check(&self) -> Result<(), Error> {
        match &*self.0.lock().expect("reachability lock") {
            Some(reason) => Err(Error::Unavailable(reason.clone())),
            None => Ok(()),
        }
    }
}

/// Most keys remembered in [`RecentWrites`]; past it the memory starts over.
const RECENT_KEYS: usize = 16_384;

/// What this sidecar last wrote under each key, with whatever the store
/// needs to write again conditionally (a revision, the bytes written). Only
/// ever a guess for a write the store's condition verifies, never the source
/// of an answer that changes nothing.
#[derive(Debug)]
pub struct RecentWrites<V>(Mutex<HashMap<Key, V>>);

impl<V> Default for RecentWrites<V> {
    fn default() -> Self {
        RecentWrites(Mutex::new(HashMap::new()))
    }
}

impl<V> RecentWrites<V> {
    /// Takes what was remembered for `key`.
    pub fn recall(&self, key: &Key) -> Option<V> {
        self.0.lock().expect("recent writes lock").remove(key)
    }

    /// Remembers our write of `key`.
    pub fn remember(&self, key: &Key, written: V) {
        let mut recent = self.0.lock().expect("recent writes lock");
        if recent.len() >= RECENT_KEYS {
            recent.clear();
        }
        recent.insert(key.clone(), written);
    }

    /// Forgets `key` (someone else changed it, or it was deleted).
    pub fn forget(&self, key: &Key) {
        self.0.lock().expect("recent writes lock").remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deletion_messages_round_trip() {
        let key = Key::new_unchecked("pay:ments".into(), "evt/1 with spaces".into());
        assert_eq!(parse_deletion(&deletion_message(&key)), Some(key));
        assert_eq!(parse_deletion("no separator"), None);
    }

    #[test]
    fn reachability_follows_the_last_call() {
        let reach = Reachability::default();
        assert!(reach.check().is_err(), "not connected yet");
        let _ = reach.observe(Ok::<_, Error>(()));
        assert!(reach.check().is_ok());
        let _ = reach.observe::<()>(Err(Error::Unavailable("gone".into())));
        assert!(matches!(reach.check(), Err(Error::Unavailable(reason)) if reason == "gone"));
        // A refusal by a server that answered is not an outage.
        let _ = reach.observe(Ok::<_, Error>(()));
        let _ = reach.observe::<()>(Err(Error::Store("syntax".into())));
        assert!(reach.check().is_ok());
    }
}
