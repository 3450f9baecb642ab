//! The deletion feed: the script that deletes publishes on
//! `<prefix>:deleted`; each sidecar subscribes (on a cluster, on one seed
//! node, the next after a loss) and hands the deleted keys to its local
//! tier; probes, published where the writes go, find notices that stopped
//! arriving (a cluster bus's dropped ones, a subscription left on an old
//! primary).

use std::{sync::atomic::Ordering::Relaxed, time::Duration};

use futures_util::StreamExt;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use tokio::sync::mpsc;

use super::{cluster::Topology, redis_error, RedisStore};
use crate::{
    domain::Key,
    error::Error,
    store::shared::{parse_deletion, DeletionFeed, FEED_BUFFER, HEARTBEAT},
};

impl DeletionFeed for RedisStore {
    async fn subscribe(&self) -> Result<mpsc::Receiver<Key>, Error> {
        let client = match &self.inner.topology {
            Topology::Primary { client } => client.clone(),
            Topology::Sentinel { sentinel } => sentinel.primary().await.map_err(redis_error)?,
            Topology::Cluster {
                seeds, next_seed, ..
            } => seeds[next_seed.fetch_add(1, Relaxed) % seeds.len()].clone(),
        };
        let pubsub = tokio::time::timeout(self.inner.timeout, client.get_async_pubsub())
            .await
            .map_err(|_| Error::Unavailable("Redis did not answer the subscription".into()))?
            .map_err(redis_error);
        let mut pubsub = self.inner.reachability.observe(pubsub)?;
        let subscribed = tokio::time::timeout(self.inner.timeout, pubsub.subscribe(self.channel()))
            .await
            .map_err(|_| Error::Unavailable("Redis did not answer the subscription".into()))?
            .map_err(redis_error);
        self.inner.reachability.observe(subscribed)?;
        // Notices can stop arriving without a word. On a cluster, one
        // published on another primary reaches this node over the cluster
        // bus, which drops what it cannot deliver while a link is down. On
        // one primary, after a failover behind a name or address, this
        // subscription can stay on the old server while the writes (and
        // their notices) go to the promoted one. So every heartbeat also
        // publishes a probe where the writes go — on every primary — on a
        // channel of this subscription's own; a probe not heard back from
        // every primary within two heartbeats means notices may have been
        // lost, and the feed ends (the local tier clears and resubscribes).
        let probe_channel = format!("{}:probe:{:016x}", self.inner.prefix, rand::random::<u64>());
        let subscribed = tokio::time::timeout(self.inner.timeout, pubsub.subscribe(&probe_channel))
            .await
            .map_err(|_| Error::Unavailable("Redis did not answer the subscription".into()))?
            .map_err(redis_error);
        self.inner.reachability.observe(subscribed)?;
        let (sink, mut messages) = pubsub.split();
        let (deleted, receiver) = mpsc::channel(FEED_BUFFER);
        let store = self.clone();
        tokio::spawn(async move {
            let mut sink = sink;
            let mut heartbeat = tokio::time::interval(HEARTBEAT);
            // Ticks missed while busy are not made up in a burst: each
            // check must come after the messages that arrived before it.
            heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut probes = Probes::default();
            loop {
                tokio::select! {
                    // Messages first: a probe's echo waiting to be read is
                    // not a probe lost.
                    biased;
                    message = messages.next() => {
                        let Some(message) = message else { break };
                        let Ok(text) = message.get_payload::<String>() else { continue };
                        if message.get_channel_name() == probe_channel {
                            probes.heard(&text);
                            continue;
                        }
                        match parse_deletion(&text) {
                            Some(key) => {
                                if deleted.send(key).await.is_err() {
                                    break;
                                }
                            }
                            None => tracing::warn!(message = %text, "unreadable deletion notice"),
                        }
                    }
                    _ = heartbeat.tick() => {
                        // A connection that died without a word is found here.
                        match tokio::time::timeout(HEARTBEAT, sink.ping::<()>()).await {
                            Ok(Ok(())) => {}
                            _ => break,
                        }
                        if let Err(lost) = probes.check(tokio::time::Instant::now()) {
                            tracing::warn!(%lost, "deletion feed: a primary's notices stopped arriving");
                            break;
                        }
                        // Bounded by the store's timeout, as any call.
                        match store.publish_probe(&probe_channel, probes.next).await {
                            Ok(primaries) => probes.sent(primaries, tokio::time::Instant::now()),
                            Err(error) => {
                                tracing::warn!(%error, "deletion feed: cannot probe every primary");
                                break;
                            }
                        }
                    }
                    () = deleted.closed() => break,
                }
            }
        });
        Ok(receiver)
    }
}

impl RedisStore {
    /// Publishes probe `sequence` on every primary (the one, or each of the
    /// cluster's): how many took it.
    async fn publish_probe(&self, channel: &str, sequence: u64) -> Result<usize, Error> {
        let every_primary = RoutingInfo::MultiNode((
            MultipleNodeRoutingInfo::AllMasters,
            Some(ResponsePolicy::Special),
        ));
        let publish = redis::cmd("PUBLISH").arg(channel).arg(sequence).clone();
        let answer = self
            .call(|mut connection| {
                let (publish, every_primary) = (publish.clone(), every_primary.clone());
                async move { connection.route(publish, every_primary).await }
            })
            .await?;
        Ok(match answer {
            redis::Value::Map(by_node) => by_node.len(),
            _ => 1,
        })
    }
}

/// The deletion feed's probes (see [`RedisStore::subscribe`]): each sent
/// to every primary, each to be heard back from all of them within
/// [`PROBE_WITHIN`].
#[derive(Debug, Default)]
struct Probes {
    /// The sequence number of the next probe.
    next: u64,
    /// Probes sent and not yet heard back from every primary.
    pending: std::collections::VecDeque<Probe>,
}

/// One probe on its way.
#[derive(Debug)]
struct Probe {
    sequence: u64,
    /// Primaries that took it.
    primaries: usize,
    /// Echoes heard.
    heard: usize,
    sent: tokio::time::Instant,
}

/// How long a probe's echoes may take: the cluster bus carries a message
/// in milliseconds, so past this some were dropped.
const PROBE_WITHIN: Duration = HEARTBEAT.saturating_mul(2);

impl Probes {
    /// Notes an echo heard.
    fn heard(&mut self, text: &str) {
        let Ok(sequence) = text.parse::<u64>() else {
            return;
        };
        if let Some(probe) = self
            .pending
            .iter_mut()
            .find(|probe| probe.sequence == sequence)
        {
            probe.heard += 1;
        }
        self.pending.retain(|probe| probe.heard < probe.primaries);
    }

    /// Notes probe `next` taken by `primaries` primaries at `now`.
    fn sent(&mut self, primaries: usize, now: tokio::time::Instant) {
        self.pending.push_back(Probe {
            sequence: self.next,
            primaries,
            heard: 0,
            sent: now,
        });
        self.next += 1;
    }

    /// `Err` if a probe sent more than [`PROBE_WITHIN`] before `now` is
    /// still not heard back from every primary.
    fn check(&self, now: tokio::time::Instant) -> Result<(), String> {
        match self.pending.front() {
            Some(probe) if now.duration_since(probe.sent) > PROBE_WITHIN => Err(format!(
                "probe {} heard from {} of {} primaries within {PROBE_WITHIN:?}",
                probe.sequence, probe.heard, probe.primaries
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_not_heard_from_every_primary_in_time_ends_the_feed() {
        let start = tokio::time::Instant::now();
        let at = |millis: u64| start + Duration::from_millis(millis);
        let mut probes = Probes::default();
        // Probe 0 taken by three primaries, heard from all: nothing pending.
        probes.check(at(0)).unwrap();
        probes.sent(3, at(0));
        for _ in 0..3 {
            probes.heard("0");
        }
        assert!(probes.pending.is_empty());
        // Probe 1 heard from two of three; a stray or old text ignored.
        probes.sent(3, at(1000));
        probes.heard("1");
        probes.heard("1");
        probes.heard("0");
        probes.heard("not a number");
        probes.sent(3, at(2000));
        for sequence in ["2", "2", "2"] {
            probes.heard(sequence);
        }
        probes.check(at(3000)).unwrap();
        let lost = probes.check(at(3001)).unwrap_err();
        assert!(lost.contains("probe 1 heard from 2 of 3"), "{lost}");
    }
}
