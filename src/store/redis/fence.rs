//! The replication fence of `--store-replicas`: before an answer leaves,
//! the witness key the operation's last call wrote is written again and
//! `WAIT N` run after it, on a connection of its own (see
//! [`RedisStore::fence`]) — so the wait runs on the server that took the
//! call, on one primary as on a cluster.

use std::{cell::RefCell, collections::HashMap, sync::atomic::Ordering::Relaxed};

use redis::{
    cluster_routing::{Route, SlotAddr},
    ScriptInvocation,
};

use super::{cluster::Topology, RedisStore};
use crate::error::Error;

/// How much longer than two store timeouts (their call's and their
/// fence's) a witness key lives: it only has to outlive the `WAIT` after
/// its fence (see [`RedisStore::fence`]), and then expires by itself.
pub(super) const FENCE_TTL_MS: u64 = 10_000;

tokio::task_local! {
    /// The witness key of the last call the current store operation made,
    /// for its fence to find (see [`RedisStore::fence`]); set only with
    /// `--store-replicas`.
    pub(super) static WITNESS: RefCell<Option<String>>;
}

/// A hash tag for each of the cluster's 16 384 slots: the shortest decimal
/// numbers that hash there, found by trying them in turn (about 180 000
/// CRC16s, once at start).
pub(super) fn fence_tags() -> HashMap<Route, String> {
    const SLOTS: usize = 16_384;
    let mut tags = HashMap::with_capacity(SLOTS);
    let mut number: u64 = 0;
    while tags.len() < SLOTS {
        let tag = number.to_string();
        tags.entry(Route::with_key(format!("{{{tag}}}"), SlotAddr::Master))
            .or_insert(tag);
        number += 1;
    }
    tags
}

impl RedisStore {
    /// Whether calls leave a witness for their fence: with
    /// `--store-replicas`.
    pub(super) fn witnessing(&self) -> bool {
        self.inner.replicas > 0
    }

    /// When [`RedisStore::witnessing`]: gives a script (its own arguments
    /// all given) a fresh witness key in `redis_key`'s slot as `KEYS[2]`,
    /// noted as the operation's last call's for [`RedisStore::fence`] (see
    /// `witness_lua!`).
    pub(super) fn add_witness(
        &self,
        invocation: &mut ScriptInvocation<'_>,
        redis_key: &str,
    ) -> Result<(), Error> {
        if !self.witnessing() {
            return Ok(());
        }
        let witness = self.witness_key(redis_key)?;
        invocation.key(&witness).arg(self.inner.witness_ttl_ms);
        WITNESS
            .try_with(|last| last.replace(Some(witness)))
            .map_err(|_| {
                Error::Store(format!(
                    "a call on {redis_key} made outside a store operation could not be fenced"
                ))
            })?;
        Ok(())
    }

    /// A fresh witness key: `<fence key>:<nonce>` on one primary, and on a
    /// cluster `<fence key>:<nonce>:{<tag>}`, in `redis_key`'s slot (its
    /// hash tag hashes there).
    fn witness_key(&self, redis_key: &str) -> Result<String, Error> {
        let Topology::Cluster { fence_tags, .. } = &self.inner.topology else {
            return Ok(format!(
                "{}:{:016x}",
                self.inner.fence_key,
                rand::random::<u64>()
            ));
        };
        let tag = fence_tags
            .get(&Route::with_key(redis_key, SlotAddr::Master))
            .ok_or_else(|| Error::Store(format!("no fence tag for the slot of {redis_key}")))?;
        Ok(format!(
            "{}:{:016x}:{{{tag}}}",
            self.inner.fence_key,
            rand::random::<u64>()
        ))
    }

    /// With `--store-replicas N`: proves that N replicas hold everything
    /// this operation wrote or read, `redis_key` being the key it touched.
    /// `WAIT` counts the replicas that have the last write *of its own
    /// connection*, and replicas apply the primary's stream in order; so a
    /// write followed by `WAIT N`, in one round trip on a connection of
    /// their own, covers every write the primary made before it — this
    /// operation's, on any connection, and the ones its reads revealed (a
    /// DUPLICATE of a commit a failover would lose). The fence connections
    /// are apart from the others: Redis serves nothing else on a
    /// connection while it is blocked in `WAIT`.
    ///
    /// It must run on the very server that served the call: a failover
    /// between the call and the fence — a cluster's, a slot move, or one
    /// primary's behind a name or address that now leads to the promoted
    /// replica while the call's connection still stood on the old primary
    /// — would otherwise send the fence to a server that never had the
    /// call's write, whose `WAIT` proves nothing about it. So each call, in
    /// its own script, writes a fresh witness key (on a cluster in its
    /// key's slot: a hash tag keeps both in one slot; it expires by itself,
    /// two store timeouts and 10 s later), and the fence's write is `SET
    /// <witness> fenced XX KEEPTTL GET` for the operation's last witness:
    /// it writes (and answers the old value) only on a server that holds
    /// that call's effects — the primary that ran it, or a replica promoted
    /// after receiving it — and finding none is UNAVAILABLE (not
    /// acknowledged; the call may stand). The write is a script that also
    /// names `redis_key`, so that while its slot moves between cluster
    /// nodes it runs where both keys are, never on a node that received
    /// the witness and not yet the record (a node holding some of a
    /// command's keys answers TRYAGAIN, not ASK). It is repeatable: a fence
    /// sent again after a lost answer still finds the witness.
    pub(super) async fn fence(&self, redis_key: &str) -> Result<(), Error> {
        let replicas = self.inner.replicas;
        if replicas == 0 {
            return Ok(());
        }
        let witness = WITNESS
            .try_with(|last| last.borrow_mut().take())
            .ok()
            .flatten()
            .ok_or_else(|| Error::Store(format!("no witnessed call on {redis_key} to fence")))?;
        let wait_ms = u64::try_from((self.inner.timeout / 2).as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let turn = self.inner.next.fetch_add(1, Relaxed);
        let connection = self.inner.fences[turn % self.inner.fences.len()].clone();
        let witness = &witness;
        let (found, acknowledged): (bool, u32) = self
            .call_on(connection, |mut connection| async move {
                let (written, acknowledged): (redis::Value, u32) = redis::pipe()
                    .cmd("EVAL")
                    .arg(FENCE_SCRIPT)
                    .arg(2)
                    .arg(witness)
                    .arg(redis_key)
                    .cmd("WAIT")
                    .arg(replicas)
                    .arg(wait_ms)
                    .query_async(&mut connection)
                    .await?;
                // The old value: nil where the witness is not.
                Ok((written != redis::Value::Nil, acknowledged))
            })
            .await?;
        if !found {
            return Err(Error::Unavailable(format!(
                "the primary of {redis_key} does not hold this call's effects (a failover or a slot move since; --store-replicas): not acknowledged, though it may stand"
            )));
        }
        if acknowledged < replicas {
            return Err(Error::Unavailable(format!(
                "{acknowledged} of {replicas} replicas confirmed within {wait_ms} ms (--store-replicas): not acknowledged, though it may stand on the primary"
            )));
        }
        Ok(())
    }
}

/// The fence's write (see [`RedisStore::fence`]): `KEYS[1]` the witness,
/// `KEYS[2]` the key the call touched, only named.
const FENCE_SCRIPT: &str = "return redis.call('SET', KEYS[1], 'fenced', 'XX', 'KEEPTTL', 'GET')";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use redis::{
        cluster_routing::{RoutingInfo, SingleNodeRoutingInfo},
        FromRedisValue,
    };

    use super::*;
    use crate::{
        domain::Key,
        store::redis::{
            scripts::{Swap, Write},
            tests::{cluster_store, ON_THE_CLUSTER},
            Connection,
        },
    };

    #[test]
    fn every_slot_has_a_fence_tag_that_hashes_to_it() {
        let tags = fence_tags();
        assert_eq!(tags.len(), 16_384);
        for key in ["dedupd:r:payments/pay-1", "x:{tagged}:y", "dedupd:m:n/o"] {
            let route = Route::with_key(key, SlotAddr::Master);
            let fence = format!("dedupd:fence:0123:{{{}}}", tags[&route]);
            assert_eq!(Route::with_key(&fence, SlotAddr::Master), route, "{key}");
        }
    }

    /// A command routed to the node at `address` (`host:port`).
    async fn on_node(
        connection: &mut Connection,
        address: &str,
        command: &redis::Cmd,
    ) -> redis::RedisResult<redis::Value> {
        let (host, port) = address.rsplit_once(':').expect("host:port");
        connection
            .route(
                command.clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.to_owned(),
                    port: port.parse().expect("a port"),
                }),
            )
            .await
    }

    /// The primary serving `redis_key`'s slot and a replica of it, by
    /// `CLUSTER NODES`.
    async fn primary_and_replica(connection: &mut Connection, redis_key: &str) -> (String, String) {
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(redis_key)
            .query_async(connection)
            .await
            .unwrap();
        let nodes = connection
            .route(
                redis::cmd("CLUSTER").arg("NODES").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            )
            .await
            .unwrap();
        let nodes = String::from_redis_value(nodes).unwrap();
        let lines: Vec<Vec<&str>> = nodes
            .lines()
            .map(|line| line.split_whitespace().collect())
            .collect();
        let address = |fields: &[&str]| fields[1].split('@').next().unwrap().to_owned();
        let serves = |range: &&str| {
            let (low, high) = range.split_once('-').unwrap_or((range, range));
            (low.parse::<u16>().ok()..=high.parse::<u16>().ok()).contains(&Some(slot))
        };
        let primary = lines
            .iter()
            .find(|fields| {
                fields[2].contains("master")
                    && !fields[2].contains("fail")
                    && fields[8..].iter().any(&serves)
            })
            .expect("a primary serves the slot");
        let replica = lines
            .iter()
            .find(|fields| fields[2].contains("slave") && fields[3] == primary[0])
            .expect("the primary has a replica");
        (address(primary), address(replica))
    }

    /// Writes the absent `key`, inside a witness scope: its Redis key and
    /// the call's witness key.
    async fn write_new(store: &RedisStore, key: &Key) -> (String, String) {
        let redis_key = store.record_key(key);
        let write = Write::Put {
            bytes: b"claimed".to_vec(),
            token: None,
            retain_until: store
                .inner
                .clock
                .now()
                .saturating_add(Duration::from_secs(60)),
        };
        let swapped = store.swap(key, &redis_key, None, &write).await.unwrap();
        assert!(matches!(swapped.answer, Swap::Done(_)), "{key} is new");
        let witness = WITNESS
            .with(|last| last.borrow().clone())
            .expect("the call left its witness");
        (redis_key, witness)
    }

    /// The fence of a cluster call runs on a node holding that call's
    /// effects: it follows a failover to the replica that received them,
    /// and refuses a node without them (as a replica promoted before the
    /// write reached it would be).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_fence_passes_only_where_the_call_landed() {
        let Some(url) = dedupd_testkit::services::require_redis_cluster() else {
            return;
        };
        let _alone = ON_THE_CLUSTER.lock().await;
        let store = cluster_store(url, Duration::from_secs(5), 1);
        let mut inspect = store.inspection_connection();
        // Fenced where it landed: passes, and takes its witness away.
        let key = Key::from_bytes(b"payments\0fenced").unwrap();
        WITNESS
            .scope(RefCell::new(None), async {
                let (redis_key, witness) = write_new(&store, &key).await;
                let slot = |key: &str| Route::with_key(key, SlotAddr::Master);
                assert_eq!(
                    slot(&witness),
                    slot(&redis_key),
                    "{witness}: not in {redis_key}'s slot"
                );
                let held: bool = redis::cmd("EXISTS")
                    .arg(&witness)
                    .query_async(&mut inspect)
                    .await
                    .unwrap();
                assert!(held, "the script wrote {witness}");
                store.fence(&redis_key).await.unwrap();
                let held: bool = redis::cmd("EXISTS")
                    .arg(&witness)
                    .query_async(&mut inspect)
                    .await
                    .unwrap();
                assert!(held, "the fence keeps {witness} (it expires by itself)");
                let fenced: String = redis::cmd("GET")
                    .arg(&witness)
                    .query_async(&mut inspect)
                    .await
                    .unwrap();
                assert_eq!(fenced, "fenced");
                // A fence sent again (its answer lost) still finds it.
                WITNESS.with(|last| last.replace(Some(witness.clone())));
                store.fence(&redis_key).await.unwrap();
            })
            .await;

        // A node without the call's effects: refused, not acknowledged.
        let key = Key::from_bytes(b"payments\0lost").unwrap();
        WITNESS
            .scope(RefCell::new(None), async {
                let (redis_key, witness) = write_new(&store, &key).await;
                let _: u32 = redis::cmd("DEL")
                    .arg(&witness)
                    .query_async(&mut inspect)
                    .await
                    .unwrap();
                match store.fence(&redis_key).await {
                    Err(Error::Unavailable(reason)) => {
                        assert!(reason.contains("does not hold"), "{reason}")
                    }
                    other => panic!("fenced on a node without the write: {other:?}"),
                }
            })
            .await;

        // A failover between the call and its fence: the promoted replica
        // received the call (a graceful CLUSTER FAILOVER waits for that),
        // the fence follows the slot there and passes.
        let key = Key::from_bytes(b"payments\0failed-over").unwrap();
        WITNESS
            .scope(RefCell::new(None), async {
                let (redis_key, _) = write_new(&store, &key).await;
                let (primary, replica) = primary_and_replica(&mut inspect, &redis_key).await;
                on_node(
                    &mut inspect,
                    &replica,
                    redis::cmd("CLUSTER").arg("FAILOVER"),
                )
                .await
                .unwrap();
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                loop {
                    let role = on_node(
                        &mut inspect,
                        &replica,
                        &redis::cmd("INFO").arg("replication").clone(),
                    )
                    .await;
                    let promoted = role.ok().map(String::from_redis_value).and_then(Result::ok);
                    if promoted.is_some_and(|info| {
                        info.contains("role:master") && info.contains("connected_slaves:1")
                    }) {
                        break;
                    }
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{replica} not promoted over {primary} within 20 s"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                store.fence(&redis_key).await.unwrap();
            })
            .await;
        let stored: Option<Vec<u8>> = redis::cmd("HGET")
            .arg(store.record_key(&key))
            .arg("r")
            .query_async(&mut inspect)
            .await
            .unwrap();
        assert_eq!(
            stored.as_deref(),
            Some(&b"claimed"[..]),
            "the record survived the failover"
        );
        for key in ["fenced", "lost", "failed-over"] {
            let key = Key::from_bytes(format!("payments\0{key}").as_bytes()).unwrap();
            let _: () = redis::cmd("DEL")
                .arg(store.record_key(&key))
                .query_async(&mut inspect)
                .await
                .unwrap();
        }
    }
}
