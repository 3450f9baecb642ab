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
    /// Not `namespace`: Prometheus (and the Operator's ServiceMonitor)
    /// give every series the Kubernetes namespace under that name.
    dedup_namespace: String,
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
struct TraceDropLabels {
    reason: &'static str,
}

/// Why a span was not exported: the queue was full, the export failed (or
/// timed out), or it ended after shutdown.
const TRACE_DROP_REASONS: [&str; 3] = ["queue_full", "export_failed", "shut_down"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    reason: &'static str,
}

/// The local tier's state is a series only where there is a local tier
/// (a family's member appears once set), so "0" always means "off".
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NamespaceLabels {
    dedup_namespace: String,
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
    answers_erased: Family<NamespaceLabels, Counter>,
    rpc_seconds: Family<RpcLabels, Histogram, fn() -> Histogram>,
    group_commit_size: Histogram,
    sync_seconds: Histogram,
    live_records: Gauge,
    disk_bytes: Gauge,
    clock_offset: Gauge<f64, std::sync::atomic::AtomicU64>,
    clock_uncertainty: Gauge<f64, std::sync::atomic::AtomicU64>,
    clock_steps: Counter,
    /// The steps already counted in `clock_steps`.
    clock_steps_seen: std::sync::atomic::AtomicU64,
    reaped: Counter,
    reaper_passes: Counter,
    reaper_examined: Counter,
    resident_memory: Gauge,
    local_tier: Family<LocalTierLabels, Counter>,
    proxy_requests: Family<ProxyLabels, Counter>,
    proxy_added_seconds: Histogram,
    refusals: Family<RefusalLabels, Counter>,
    serving: Gauge,
    store_healthy: Gauge,
    store_writable: Gauge,
    store_full: Gauge,
    local_tier_on: Family<TierLabels, Gauge>,
    trace_spans_exported: Counter,
    trace_spans_dropped: Family<TraceDropLabels, Counter>,
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
            "Answers by dedup namespace and outcome (claimed, recovered, duplicate, in_progress, fingerprint_mismatch, stale, committed, lease_lost, released)",
            outcomes.clone(),
        );
        let answers_erased = Family::<NamespaceLabels, Counter>::default();
        registry.register(
            "answers_erased",
            "Stored answers read whose key was declared destroyed (--erased-key-id), answered with response_erased, by dedup namespace",
            answers_erased.clone(),
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
        let clock_steps = Counter::default();
        registry.register(
            "store_clock_steps",
            "Steps of the shared store's clock seen (each widens the time interval for the longest lease; shared stores only)",
            clock_steps.clone(),
        );
        let reaped = Counter::default();
        registry.register(
            "reaped_records",
            "Expired records and ordering marks removed by the reaper",
            reaped.clone(),
        );
        let reaper_passes = Counter::default();
        registry.register("reaper_passes", "Reaper passes run", reaper_passes.clone());
        let reaper_examined = Counter::default();
        registry.register(
            "reaper_examined_entries",
            "Entries the reaper read to find what expired (what a pass costs, beside what it removed)",
            reaper_examined.clone(),
        );
        let resident_memory = Gauge::default();
        registry.register(
            "resident_memory_bytes",
            "Resident memory of the dedupd process (RSS, read at scrape time)",
            resident_memory.clone(),
        );
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
        // The series alerts watch exist from the start at 0, so their first
        // increment is a rise `rate()` and `increase()` can see.
        let refusals = Family::<RefusalLabels, Counter>::default();
        for reason in [
            "overloaded",
            "read_budget",
            "read_timeout",
            "too_large",
            "stream_broken",
            "request_timeout",
            "internal",
        ] {
            drop(refusals.get_or_create(&RefusalLabels { reason }));
        }
        drop(proxy_requests.get_or_create(&ProxyLabels {
            result: "outcome_unknown",
        }));
        registry.register(
            "refusals",
            "Calls of the dedup service refused before it answered, by reason (overloaded, read_budget, read_timeout, too_large, stream_broken, request_timeout, internal)",
            refusals.clone(),
        );
        let serving = Gauge::default();
        registry.register(
            "serving",
            "1 while ready (/readyz 200): not draining, the store healthy and taking writes, a shared store's clock measured",
            serving.clone(),
        );
        let store_healthy = Gauge::default();
        registry.register(
            "store_healthy",
            "1 while the store works (/healthz 200); 0 after a failure that needs a restart",
            store_healthy.clone(),
        );
        let store_writable = Gauge::default();
        registry.register(
            "store_writable",
            "1 while the store takes writes (a shared store reachable, its clock measured, space left)",
            store_writable.clone(),
        );
        let store_full = Gauge::default();
        registry.register(
            "store_full",
            "1 while writes are refused for want of space (sled's disk reserve reached, Redis at maxmemory)",
            store_full.clone(),
        );
        let local_tier_on = Family::<TierLabels, Gauge>::default();
        registry.register(
            "local_tier_on",
            "1 while the local tier (tier=local) answers, its deletion feed connected; 0 while it is off; absent without a local tier",
            local_tier_on.clone(),
        );
        let trace_spans_exported = Counter::default();
        registry.register(
            "trace_spans_exported",
            "Spans the OTLP collector accepted (traces on: --otlp-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT)",
            trace_spans_exported.clone(),
        );
        let trace_spans_dropped = Family::<TraceDropLabels, Counter>::default();
        for reason in TRACE_DROP_REASONS {
            let _ = trace_spans_dropped.get_or_create(&TraceDropLabels { reason });
        }
        registry.register(
            "trace_spans_dropped",
            "Spans not exported, by reason (queue_full: the collector is slower than the calls; export_failed: it refused or did not answer; shut_down)",
            trace_spans_dropped.clone(),
        );
        Metrics {
            registry,
            outcomes,
            answers_erased,
            rpc_seconds,
            group_commit_size,
            sync_seconds,
            live_records,
            disk_bytes,
            clock_offset,
            clock_uncertainty,
            clock_steps,
            clock_steps_seen: std::sync::atomic::AtomicU64::new(0),
            reaped,
            reaper_passes,
            reaper_examined,
            resident_memory,
            local_tier,
            proxy_requests,
            proxy_added_seconds,
            refusals,
            serving,
            store_healthy,
            store_writable,
            store_full,
            local_tier_on,
            trace_spans_exported,
            trace_spans_dropped,
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
        self.outcomes
            .get_or_create(&OutcomeLabels {
                dedup_namespace: self.namespace_label(namespace),
                outcome: outcome.as_str(),
            })
            .inc();
    }

    /// Counts one stored answer of `namespace` read as erased.
    pub fn answer_erased(&self, namespace: &str) {
        self.answers_erased
            .get_or_create(&NamespaceLabels {
                dedup_namespace: self.namespace_label(namespace),
            })
            .inc();
    }

    /// `namespace` as a label: the first namespaces seen keep their name,
    /// later ones share one label, so callers cannot grow the series
    /// without bound.
    fn namespace_label(&self, namespace: &str) -> String {
        let mut seen = self.namespaces.lock().expect("metrics lock poisoned");
        if seen.contains(namespace) {
            namespace.to_owned()
        } else if seen.len() < MAX_NAMESPACE_LABELS {
            seen.insert(namespace.to_owned());
            namespace.to_owned()
        } else {
            OTHER_NAMESPACE.to_owned()
        }
    }

    /// Records how long one RPC took; `rpc` is a label from the fixed
    /// method list (see `guard::rpc_label`).
    pub fn rpc(&self, rpc: &'static str, elapsed: Duration) {
        self.rpc_seconds
            .get_or_create(&RpcLabels { rpc })
            .observe(elapsed.as_secs_f64());
    }

    /// Records one reaper pass: what it removed and what it read.
    pub fn reaper_pass(&self, removed: usize, examined: usize) {
        self.reaper_passes.inc();
        self.reaped.inc_by(removed as u64);
        self.reaper_examined.inc_by(examined as u64);
    }

    /// Sets the resident-memory gauge from `/proc/self/status` (left as it
    /// was where there is none).
    pub fn read_resident_memory(&self) {
        if let Some(bytes) = resident_bytes() {
            self.resident_memory
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
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

    /// Counts spans the collector accepted.
    pub fn trace_spans_exported(&self, spans: u64) {
        self.trace_spans_exported.inc_by(spans);
    }

    /// Counts spans that were not exported (`reason` from a fixed list).
    pub fn trace_spans_dropped(&self, reason: &'static str, spans: u64) {
        self.trace_spans_dropped
            .get_or_create(&TraceDropLabels { reason })
            .inc_by(spans);
    }

    /// Counts one call refused before the dedup service answered it.
    pub fn refusal(&self, reason: &'static str) {
        self.refusals.get_or_create(&RefusalLabels { reason }).inc();
    }

    /// Sets the state gauges (read at scrape time, from what the probes
    /// answer): ready, the store healthy, writable (or why not), and the
    /// local tier on (`None`: there is none).
    pub fn store_state(
        &self,
        serving: bool,
        healthy: bool,
        writable: Result<(), &crate::Error>,
        local_tier_on: Option<bool>,
    ) {
        self.serving.set(i64::from(serving));
        self.store_healthy.set(i64::from(healthy));
        self.store_writable.set(i64::from(writable.is_ok()));
        self.store_full.set(i64::from(matches!(
            writable,
            Err(crate::Error::DiskFull(_))
        )));
        if let Some(on) = local_tier_on {
            self.local_tier_on
                .get_or_create(&TierLabels { tier: "local" })
                .set(i64::from(on));
        }
    }

    /// Sets the store-clock gauges (read at scrape time).
    pub fn store_clock(&self, report: crate::clock::ClockReport) {
        self.clock_offset.set(report.local_offset_seconds);
        self.clock_uncertainty.set(report.uncertainty_seconds);
        // fetch_max: a scrape holding an older report counts nothing twice.
        let seen = self
            .clock_steps_seen
            .fetch_max(report.steps, std::sync::atomic::Ordering::Relaxed);
        self.clock_steps.inc_by(report.steps.saturating_sub(seen));
    }

    /// The OpenMetrics text of every metric.
    pub fn render(&self) -> String {
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }
}

/// The process's resident memory: `VmRSS` in `/proc/self/status` (in KiB
/// whatever the kernel's page size).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// A `/metrics` answer: OpenMetrics for a scraper that asks for it
/// (Prometheus does), the Prometheus text format for any other (curl,
/// `promtool check metrics`, older agents).
pub fn exposition(
    request: &axum::http::HeaderMap,
    openmetrics: String,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    let content_type = axum::http::header::CONTENT_TYPE;
    let asked_for_openmetrics = request
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|accept| accept.to_str().ok())
        .any(|accept| accept.contains("application/openmetrics-text"));
    if asked_for_openmetrics {
        (
            [(
                content_type,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            openmetrics,
        )
    } else {
        (
            [(content_type, "text/plain; version=0.0.4; charset=utf-8")],
            prometheus_text(&openmetrics),
        )
    }
}

/// The Prometheus text format (0.0.4) of an OpenMetrics text, for scrapers
/// that do not ask for OpenMetrics (curl, `promtool check metrics`, older
/// agents). The samples are the same lines; what differs is metadata: a
/// counter's `# HELP` and `# TYPE` name its `_total` series, `unknown` is
/// `untyped`, and `# UNIT` and `# EOF` do not exist.
pub fn prometheus_text(openmetrics: &str) -> String {
    let counters: HashSet<&str> = openmetrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut text = String::with_capacity(openmetrics.len() + 8 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let metadata = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|kind| Some((kind, line.strip_prefix(kind)?)));
        match metadata {
            Some((kind, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let suffix = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                let tail = if kind == "# TYPE " && tail == "unknown" {
                    "untyped"
                } else {
                    tail
                };
                text.push_str(&format!("{kind}{name}{suffix} {tail}"));
            }
            None => text.push_str(line),
        }
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_prometheus_text_names_counters_by_their_total_series() {
        let openmetrics = "# HELP dedupd_outcomes Answers.\n\
            # TYPE dedupd_outcomes counter\n\
            dedupd_outcomes_total{outcome=\"claimed\"} 1\n\
            # HELP dedupd_records Records.\n\
            # TYPE dedupd_records gauge\n\
            # UNIT dedupd_records records\n\
            dedupd_records 3\n\
            # TYPE odd unknown\n\
            odd 1\n\
            # EOF\n";
        assert_eq!(
            super::prometheus_text(openmetrics),
            "# HELP dedupd_outcomes_total Answers.\n\
             # TYPE dedupd_outcomes_total counter\n\
             dedupd_outcomes_total{outcome=\"claimed\"} 1\n\
             # HELP dedupd_records Records.\n\
             # TYPE dedupd_records gauge\n\
             dedupd_records 3\n\
             # TYPE odd untyped\n\
             odd 1\n"
        );
    }
}
