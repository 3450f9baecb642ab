//! The store's clock: Redis's `TIME`, on a cluster from one primary every
//! sidecar agrees on (with the same fallbacks for all), and never from
//! another node in its place.

use redis::{
    cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr},
    FromRedisValue,
};

use super::RedisStore;
use crate::{
    error::Error,
    time_policy::{ClockReading, TimeSource},
};

impl TimeSource for RedisStore {
    async fn read_clock(&self) -> Result<ClockReading, Error> {
        // On a cluster, the same node's clock (slot 0's primary) while it
        // serves, so readings do not jump between nodes' clocks; while it
        // does not (its replica not promoted yet, or none), the primary of
        // slot 8192, then of slot 16383: the same fallback for every
        // sidecar, so they keep reading one clock.
        if !self.is_cluster() {
            return self
                .time_from(
                    redis::cmd("TIME"),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                )
                .await;
        }
        let mut unanswered = None;
        for (slot, key) in CLOCK_SLOTS.iter().zip(CLOCK_KEYS.iter()) {
            let primary = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                *slot,
                SlotAddr::Master,
            )));
            // `TIME` itself names no key, and a route to a slot whose
            // primary is not connected goes to any node, a replica
            // included: another clock, taken as a step. Asked in a script
            // that names a key of the slot, any node but the slot's
            // primary answers MOVED, which the client follows.
            let mut time = redis::cmd("EVAL");
            time.arg(TIME_SCRIPT)
                .arg(1)
                .arg(format!("{}:clock:{key}", self.inner.prefix));
            match self.time_from(time, primary).await {
                Err(Error::Unavailable(error)) => {
                    tracing::debug!(%error, slot, "the primary of a slot did not tell the time");
                    unanswered = Some(error);
                }
                read => return read,
            }
        }
        Err(Error::Unavailable(unanswered.unwrap_or_default()))
    }
}

/// The slots whose primaries tell a cluster's time, in order of preference.
const CLOCK_SLOTS: [u16; 3] = [0, 8192, 16383];

/// `TIME` in a script naming a key (`<prefix>:clock:{<n>}`, within the
/// keys an ACL grants dedupd, never written), so that only its slot's
/// primary runs it. Without flags (a script as before Redis 7), it runs at
/// `maxmemory` too: only a write would be refused.
const TIME_SCRIPT: &str = "return redis.call('TIME')";

/// A hash tag for each of [`CLOCK_SLOTS`]: the first `{<n>}` that hashes
/// there.
static CLOCK_KEYS: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(|| {
    CLOCK_SLOTS
        .iter()
        .map(|slot| {
            let wanted = Route::new(*slot, SlotAddr::Master);
            (0u64..)
                .map(|number| format!("{{{number}}}"))
                .find(|key| Route::with_key(key, SlotAddr::Master) == wanted)
                .expect("every slot has a key")
        })
        .collect()
});

impl RedisStore {
    /// The store's time by `command` (`TIME`, or a script calling it) where
    /// `node` routes it (on one primary, there).
    async fn time_from(
        &self,
        command: redis::Cmd,
        node: RoutingInfo,
    ) -> Result<ClockReading, Error> {
        let sent = std::time::Instant::now();
        let answer = self
            .call(|mut connection| {
                let (command, node) = (command.clone(), node.clone());
                async move { connection.route(command, node).await }
            })
            .await?;
        let (seconds, micros) = <(u64, u64)>::from_redis_value(answer)
            .map_err(|error| Error::Store(format!("Redis's TIME: {error}")))?;
        Ok(ClockReading {
            sent,
            store_micros: seconds.saturating_mul(1_000_000).saturating_add(micros),
            received: std::time::Instant::now(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::redis::tests::{cluster_store, ON_THE_CLUSTER};

    /// Each clock key routes to its slot, so only that slot's primary
    /// runs the script that tells the time.
    #[test]
    fn each_clock_key_lies_in_its_slot() {
        for (slot, key) in CLOCK_SLOTS.iter().zip(CLOCK_KEYS.iter()) {
            assert_eq!(
                Route::with_key(format!("dedupd:clock:{key}"), SlotAddr::Master),
                Route::new(*slot, SlotAddr::Master),
                "{key}"
            );
        }
        assert_eq!(CLOCK_KEYS.len(), CLOCK_SLOTS.len());
    }

    /// While slot 0's primary does not answer, the cluster's time comes
    /// from another primary.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_tells_the_time_while_slot_0s_primary_is_silent() {
        let Some(url) = dedupd_testkit::services::require_redis_cluster() else {
            return;
        };
        let _alone = ON_THE_CLUSTER.lock().await;
        let store = cluster_store(url, Duration::from_millis(500), 0);
        let mut inspect = store.inspection_connection();
        store
            .read_clock()
            .await
            .expect("slot 0's primary tells the time");
        let slot_0 = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
            0,
            SlotAddr::Master,
        )));
        // Its clients paused (the cluster bus is not a client: no
        // failover) for far longer than the reading may take (its store
        // timeout: 500 ms), so a slow machine cannot mistake the paused
        // node's late answer for another's. (A pause of ALL cannot be lifted
        // early: CLIENT UNPAUSE waits with the rest.)
        let pause = Duration::from_secs(6);
        inspect
            .route(
                redis::cmd("CLIENT")
                    .arg("PAUSE")
                    .arg(pause.as_millis() as u64)
                    .arg("ALL")
                    .clone(),
                slot_0.clone(),
            )
            .await
            .unwrap();
        let asked = std::time::Instant::now();
        let reading = store.read_clock().await;
        let waited = asked.elapsed();
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        // The next test finds the node answering again.
        let _ = inspect
            .route(redis::cmd("CLIENT").arg("UNPAUSE").clone(), slot_0.clone())
            .await;
        while inspect
            .route(redis::cmd("PING").clone(), slot_0.clone())
            .await
            .is_err()
        {
            assert!(asked.elapsed() < pause * 3, "slot 0's primary stays paused");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let reading = reading.expect("another primary told the time");
        assert!(
            waited < pause - Duration::from_secs(1),
            "answered after {waited:?}: by the paused node"
        );
        assert!(
            reading.store_micros.abs_diff(wall) < 5_000_000,
            "{} is not this machine's time ({wall})",
            reading.store_micros
        );
    }
}
