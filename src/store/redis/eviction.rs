//! What Redis must not do: evict keys (any `maxmemory-policy` but
//! `noeviction` under a `maxmemory`), read from every primary's `INFO
//! memory` at start and every few seconds after; and whether it is full,
//! refusing writes.

use std::time::Duration;

use redis::{
    cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo},
    FromRedisValue,
};

use super::RedisStore;
use crate::error::Error;

/// How often the eviction policy is read again while running (an operator
/// or a managed service's parameter group can change it under us).
pub(super) const EVICTION_CHECK_EVERY: Duration = Duration::from_secs(5);

/// What Redis's memory settings allow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Eviction {
    /// Not read yet: nothing is written until it is.
    Unread,
    /// Redis never evicts (or the operator allowed it).
    Never,
    /// Redis may evict: refused, for this reason.
    Refused(String),
}

impl RedisStore {
    /// `INFO memory` of every primary, with the node's address (empty for
    /// one primary).
    async fn memory_reports(&self) -> Result<Vec<(String, String)>, Error> {
        let every_primary = RoutingInfo::MultiNode((
            MultipleNodeRoutingInfo::AllMasters,
            Some(ResponsePolicy::Special),
        ));
        let answer = self
            .call(|mut connection| {
                let every_primary = every_primary.clone();
                async move {
                    connection
                        .route(redis::cmd("INFO").arg("memory").clone(), every_primary)
                        .await
                }
            })
            .await?;
        let text = |value: redis::Value| {
            String::from_redis_value(value)
                .map_err(|error| Error::Store(format!("Redis's INFO memory: {error}")))
        };
        match answer {
            redis::Value::Map(by_node) => by_node
                .into_iter()
                .map(|(node, report)| Ok((text(node)?, text(report)?)))
                .collect(),
            report => Ok(vec![(String::new(), text(report)?)]),
        }
    }

    /// Why Redis must not be used, if it may evict keys (and the operator
    /// did not allow it): `Ok(None)` when it may not. Reads `INFO memory`,
    /// which managed services answer even where `CONFIG` is disabled.
    pub async fn eviction_refusal(&self) -> Result<Option<String>, Error> {
        if self.inner.allow_eviction {
            // Allowed: nothing to read (nor to need the INFO permission for).
            *self.inner.eviction.lock().expect("eviction lock") = Eviction::Never;
            return Ok(None);
        }
        // On a cluster every primary is asked: one that may evict is
        // enough to lose records in its slots.
        let mut refusal = None;
        let mut full = false;
        for (node, info) in self.memory_reports().await? {
            let field = |name: &str| {
                info.lines()
                    .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                    .map(str::trim)
                    .unwrap_or_default()
                    .to_owned()
            };
            let (maxmemory, policy) = (field("maxmemory"), field("maxmemory_policy"));
            // At its maxmemory a primary refuses every write (noeviction).
            if let (Ok(limit @ 1..), Ok(used)) = (
                maxmemory.parse::<u64>(),
                field("used_memory").parse::<u64>(),
            ) {
                full |= used >= limit;
            }
            if !(maxmemory == "0" || policy == "noeviction") {
                let which = if node.is_empty() {
                    String::new()
                } else {
                    format!(" primary {node}")
                };
                refusal = Some(format!(
                    "Redis{which} may evict dedupd's records (maxmemory {maxmemory}, maxmemory-policy {policy}): \
                     a live lease or commit evicted is an event processed twice; set maxmemory-policy \
                     noeviction, or accept the risk with --allow-redis-eviction"
                ));
                break;
            }
        }
        self.note_full(full);
        let now = match &refusal {
            Some(reason) => Eviction::Refused(reason.clone()),
            None => Eviction::Never,
        };
        let before = std::mem::replace(
            &mut *self.inner.eviction.lock().expect("eviction lock"),
            now.clone(),
        );
        // A change while serving is logged here; the first reading's
        // verdict by whoever asked for it (at start: one configuration
        // line and exit 64).
        match (&before, &now) {
            (Eviction::Refused(_), Eviction::Never) => {
                tracing::info!("Redis no longer evicts keys: serving again")
            }
            (Eviction::Never, Eviction::Refused(reason)) => {
                tracing::error!(reason = %reason, "Redis refused: NOT_SERVING")
            }
            _ => {}
        }
        Ok(refusal)
    }

    /// Notes that Redis is full (for the next two eviction checks: a
    /// reading of `INFO memory` below `maxmemory` clears it sooner), or not.
    pub(super) fn note_full(&self, full: bool) {
        *self.inner.full_until.lock().expect("full lock") =
            full.then(|| tokio::time::Instant::now() + 2 * EVICTION_CHECK_EVERY);
    }

    /// `Err` while Redis is refused for evicting keys; reads the policy
    /// first if nobody has yet.
    pub(super) async fn not_evicting(&self) -> Result<(), Error> {
        let known = self.inner.eviction.lock().expect("eviction lock").clone();
        let refusal = match known {
            Eviction::Never => None,
            Eviction::Refused(reason) => Some(reason),
            Eviction::Unread => self.eviction_refusal().await?,
        };
        match refusal {
            Some(reason) => Err(Error::Unavailable(reason)),
            None => Ok(()),
        }
    }
}
