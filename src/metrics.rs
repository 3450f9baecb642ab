//! Prometheus metrics: outcomes per namespace, RPC latency, group commits,
//! store size, reaper work and local-tier hits. Rendered in the OpenMetrics text format by the
//! ops HTTP server (`/metrics`).

use std::{collections::HashSet, fmt, sync::Mutex, time::Duration};

use crate::{domain::OutcomeKind, store::StoreObserver};
use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};

/// Namespaces are chosen by clients: past this many, new ones are counted
/// under `_other` so a client cannot grow the metrics without bound.
const MAX_NAMESPACE_LABELS: usize = 256;
const OTHER_NAMESPACE: &str = "_other";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    namespace: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LocalTierLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProxyLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    rpc: &'static str,
}

fn latency_histogram() -> Histogram {
    // 50 µs .. ~13 s
    Histogram::new(exponential_buckets(0.000_05, 2.0, 19))
}

/// Every metric dedupd exports.
pub struct Metrics {
    registry: Registry,
    outcomes: Family<OutcomeLabels, Counter>,
    rpc_seconds: Family<RpcLabels, Histogram, fn() -> Histogram>,
    group_commit_size: Histogram,
    sync_seconds: Histogram,
    live_records: Gauge,
    disk_bytes: Gauge,
    clock_offset: Gauge<f64, std::sync::atomic::AtomicU64>,
    clock_uncertainty: Gauge<f64, std::sync::atomic::AtomicU64>,
    reaped: Counter,
    reaper_passes: Counter,
    local_tier: Family<LocalTierLabels, Counter>,
    proxy_requests: Family<ProxyLabels, Counter>,
    proxy_added_seconds: Histogram,
    namespaces: Mutex<HashSet<String>>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Metrics")
    }
}

impl StoreObserver for Metrics {
    fn group_commit(&self, callers: usize, elapsed: Duration) {
        self.group_commit_size.observe(callers as f64);
        self.sync_seconds.observe(elapsed.as_secs_f64());
    }

    fn local_tier(&self, hit: bool) {
        let result = if hit { "hit" } else { "miss" };
        self.local_tier
            .get_or_create(&LocalTierLabels { result })
            .inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh set of metrics in its own registry.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("dedupd");
        let outcomes = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "outcomes",
            "Answers by namespace and outcome (claimed, recovered, duplicate, in_progress, fingerprint_mismatch, stale, committed, lease_lost, released)",
            outcomes.clone(),
        );
        let rpc_seconds = Family::<RpcLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram,
        );
        registry.register(
            "rpc_duration_seconds",
            "Time to answer each gRPC method, durability wait included",
            rpc_seconds.clone(),
        );
        let group_commit_size = Histogram::new(exponential_buckets(1.0, 2.0, 12));
        registry.register(
            "group_commit_size",
            "Callers answered by one disk sync (group commit)",
            group_commit_size.clone(),
        );
        let sync_seconds = latency_histogram();
        registry.register(
            "sync_duration_seconds",
            "Time of one group commit: sled flush plus fdatasync",
            sync_seconds.clone(),
        );
        let live_records = Gauge::default();
        registry.register(
            "records",
            "Records in the store, expired ones not yet reaped included",
            live_records.clone(),
        );
        let disk_bytes = Gauge::default();
        registry.register(
            "store_disk_bytes",
            "Bytes the store uses on disk",
            disk_bytes.clone(),
        );
        let clock_offset = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "store_clock_offset_seconds",
            "This pod's wall clock minus the shared store's clock (only the store's decides; shared stores only)",
            clock_offset.clone(),
        );
        let clock_uncertainty = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "store_clock_uncertainty_seconds",
            "How far the estimate of the shared store's clock may be off (shared stores only)",
            clock_uncertainty.clone(),
        );
        let reaped = Counter::default();
        registry.register(
            "reaped_records",
            "Expired records and ordering marks removed by the reaper",
            reaped.clone(),
        );
        let reaper_passes = Counter::default();
        registry.register("reaper_passes", "Reaper passes run", reaper_passes.clone());
        let local_tier = Family::<LocalTierLabels, Counter>::default();
        registry.register(
            "local_tier_lookups",
            "Calls the local tier answered (result=hit) or sent on to the shared store (result=miss)",
            local_tier.clone(),
        );
        let proxy_requests = Family::<ProxyLabels, Counter>::default();
        registry.register(
            "http_proxy_requests",
            "Requests the HTTP idempotency proxy answered, by result (passed_through, forwarded, replayed, released, outcome_unknown, in_progress, mismatch, invalid_key, missing_key, bad_target, body_incomplete, not_replayable, too_large, overloaded, store_unavailable, upstream_failed, internal)",
            proxy_requests.clone(),
        );
        let proxy_added_seconds = latency_histogram();
        registry.register(
            "http_proxy_added_seconds",
            "Time the HTTP proxy added to a keyed request, the upstream's own time excluded",
            proxy_added_seconds.clone(),
        );
        Metrics {
            registry,
            outcomes,
            rpc_seconds,
            group_commit_size,
            sync_seconds,
            live_records,
            disk_bytes,
            clock_offset,
            clock_uncertainty,
            reaped,
            reaper_passes,
            local_tier,
            proxy_requests,
            proxy_added_seconds,
            namespaces: Mutex::new(HashSet::new()),
        }
    }

    /// Counts one request the HTTP proxy answered, by what became of it
    /// (`passed_through`, `forwarded`, `replayed`, `released`,
    /// `in_progress`, `mismatch`, `invalid_key`, `missing_key`, ...).
    pub fn proxy_request(&self, result: &'static str) {
        self.proxy_requests
            .get_or_create(&ProxyLabels { result })
            .inc();
    }

    /// Records the time the proxy added to one keyed request (its own work
    /// and the store's, not the upstream's).
    pub fn proxy_added(&self, added: Duration) {
        self.proxy_added_seconds.observe(added.as_secs_f64());
    }

    /// Counts one answer in `namespace`.
    pub fn outcome(&self, namespace: &str, outcome: OutcomeKind) {
        let namespace = {
            let mut seen = self.namespaces.lock().expect("metrics lock poisoned");
            if seen.contains(namespace) {
                namespace
            } else if seen.len() < MAX_NAMESPACE_LABELS {
                seen.insert(namespace.to_owned());
                namespace
            } else {
                OTHER_NAMESPACE
            }
        };
        self.outcomes
            .get_or_create(&OutcomeLabels {
                namespace: namespace.to_owned(),
                outcome: outcome.as_str(),
            })
            .inc();
    }

    /// Records how long one RPC took; `rpc` is a label from the fixed
    /// method list (see `guard::rpc_label`).
    pub fn rpc(&self, rpc: &'static str, elapsed: Duration) {
        self.rpc_seconds
            .get_or_create(&RpcLabels { rpc })
            .observe(elapsed.as_secs_f64());
    }

    /// Records one reaper pass.
    pub fn reaper_pass(&self, removed: usize) {
        self.reaper_passes.inc();
        self.reaped.inc_by(removed as u64);
    }

    /// Sets the store-size gauges (read at scrape time).
    pub fn store_size(&self, records: Option<u64>, disk_bytes: Option<u64>) {
        if let Some(records) = records {
            self.live_records
                .set(i64::try_from(records).unwrap_or(i64::MAX));
        }
        if let Some(bytes) = disk_bytes {
            self.disk_bytes
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }

    /// Sets the store-clock gauges (read at scrape time).
    pub fn store_clock(&self, report: crate::clock::ClockReport) {
        self.clock_offset.set(report.local_offset_seconds);
        self.clock_uncertainty.set(report.uncertainty_seconds);
    }

    /// The OpenMetrics text of every metric.
    pub fn render(&self) -> String {
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }
}
