//! OpenTelemetry traces: the spans dedupd makes, where their parents come
//! from, and how they leave the process.
//!
//! - Configuration: `--otlp-endpoint` and the standard `OTEL_*` variables,
//!   checked before anything starts ([`TraceArgs::validate`]); traces are off
//!   unless an endpoint is set.
//! - Spans: one per gRPC call ([`grpc_call_span`]) and per proxied HTTP
//!   request ([`proxy_span`]), with child spans for the store round trip and
//!   the durability wait ([`store_span`], [`durability_span`]) and the
//!   decision's attributes ([`record_claim`] …). They are `tracing` spans of
//!   target [`TARGET`] at DEBUG, so with traces off (and the default log
//!   filter) no subscriber is interested in them and they cost a branch.
//! - Propagation: W3C `traceparent`/`tracestate` and `baggage` read from
//!   gRPC metadata and HTTP headers ([`parent_from`]); the proxy writes its
//!   own span into the upstream request ([`inject_into`]).
//! - Export: OTLP over gRPC or HTTP/protobuf through [`BoundedExport`], a
//!   bounded queue that a span enters without waiting or is dropped from
//!   (counted in `dedupd_trace_spans_dropped_total`): a collector that is
//!   down or slow never slows an answer.

use std::{
    collections::HashMap,
    env,
    str::FromStr,
    sync::{Arc, OnceLock},
    time::Duration,
};

use clap::Args;
use opentelemetry::{
    propagation::{TextMapCompositePropagator, TextMapPropagator},
    trace::{Status as SpanStatus, TraceContextExt, TracerProvider as _},
    Context,
};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_otlp::{WithExportConfig, WithTonicConfig};
use opentelemetry_sdk::{
    error::{OTelSdkError, OTelSdkResult},
    propagation::{BaggagePropagator, TraceContextPropagator},
    trace::{Sampler, SdkTracerProvider, Span as SdkSpan, SpanData, SpanExporter, SpanProcessor},
    Resource,
};
use tokio::sync::{mpsc, watch};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{
    domain::{ClaimOutcome, CommitOutcome, Key, LeaseLost, ReleaseOutcome},
    metrics::Metrics,
};

/// The `tracing` target of every span meant for export.
pub const TARGET: &str = "dedupd::trace";

/// `--otlp-*`: where traces go. The standard `OTEL_*` variables configure
/// the rest (see [`TraceArgs::validate`]).
#[derive(Debug, Clone, Default, Args)]
pub struct TraceArgs {
    /// Export traces with OTLP to this collector, e.g.
    /// http://otel-collector:4318 (HTTP/protobuf; /v1/traces is appended) or
    /// http://otel-collector:4317 with --otlp-protocol grpc. Overrides
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and OTEL_EXPORTER_OTLP_ENDPOINT;
    /// without any of them traces are off.
    #[arg(long, env = "DEDUPD_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// OTLP transport: `grpc` or `http/protobuf`. Default: from
    /// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL,
    /// else http/protobuf (the OpenTelemetry default).
    #[arg(long, env = "DEDUPD_OTLP_PROTOCOL")]
    pub otlp_protocol: Option<String>,
}

/// How spans travel to the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (port 4317 by convention).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (port 4318 by convention).
    HttpProtobuf,
}

/// Validated trace settings: export is on.
#[derive(Debug, Clone)]
pub struct TraceSettings {
    /// The full URL spans are sent to.
    pub endpoint: String,
    /// The transport.
    pub protocol: OtlpProtocol,
    /// Which spans are recorded.
    pub sampler: SamplerChoice,
    /// `service.name`, when the environment does not set one.
    pub default_service_name: &'static str,
    /// Spans waiting for export at most; more are dropped.
    pub max_queue: usize,
    /// Spans per export call at most.
    pub max_batch: usize,
    /// Longest a span waits for a batch to fill.
    pub schedule_delay: Duration,
    /// Longest one request to the collector may take (the exporter's).
    pub export_timeout: Duration,
    /// Longest the export of one batch may take, whatever the exporter
    /// does (`OTEL_BSP_EXPORT_TIMEOUT`; default: the exporter's timeout).
    pub batch_export_timeout: Duration,
}

/// `OTEL_TRACES_SAMPLER` (+ `OTEL_TRACES_SAMPLER_ARG`), validated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SamplerChoice {
    /// Every span.
    AlwaysOn,
    /// None.
    AlwaysOff,
    /// This fraction of traces, by trace ID.
    Ratio(f64),
    /// The caller's decision when there is a parent, else the inner choice.
    ParentBased(RootSampler),
}

/// The root decision of a parent-based sampler.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RootSampler {
    /// Every root span.
    AlwaysOn,
    /// No root span.
    AlwaysOff,
    /// This fraction of root spans.
    Ratio(f64),
}

impl SamplerChoice {
    fn sampler(self) -> Sampler {
        let root = |root: RootSampler| match root {
            RootSampler::AlwaysOn => Sampler::AlwaysOn,
            RootSampler::AlwaysOff => Sampler::AlwaysOff,
            RootSampler::Ratio(ratio) => Sampler::TraceIdRatioBased(ratio),
        };
        match self {
            SamplerChoice::AlwaysOn => Sampler::AlwaysOn,
            SamplerChoice::AlwaysOff => Sampler::AlwaysOff,
            SamplerChoice::Ratio(ratio) => Sampler::TraceIdRatioBased(ratio),
            SamplerChoice::ParentBased(inner) => Sampler::ParentBased(Box::new(root(inner))),
        }
    }
}

/// Where configuration is read from: the process environment in
/// production, a map in tests.
pub trait Environment {
    /// The value of `name`, if set and not empty.
    fn var(&self, name: &str) -> Option<String>;
}

/// The process environment.
#[derive(Debug, Clone, Copy)]
pub struct ProcessEnvironment;

impl Environment for ProcessEnvironment {
    fn var(&self, name: &str) -> Option<String> {
        env::var(name).ok().filter(|value| !value.trim().is_empty())
    }
}

impl Environment for HashMap<&str, &str> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name)
            .map(|value| value.to_string())
            .filter(|value| !value.trim().is_empty())
    }
}

impl TraceArgs {
    /// The trace settings, `None` if traces are off, or one line saying
    /// what is wrong. Reads `OTEL_SDK_DISABLED`, `OTEL_TRACES_EXPORTER`,
    /// `OTEL_EXPORTER_OTLP_[TRACES_]{ENDPOINT,PROTOCOL,TIMEOUT}`,
    /// `OTEL_TRACES_SAMPLER[_ARG]` and `OTEL_BSP_*`; the exporter itself
    /// reads `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`, the resource
    /// `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`.
    pub fn validate(
        &self,
        environment: &impl Environment,
    ) -> Result<Option<TraceSettings>, String> {
        // A base URL gets the signal's path on HTTP (the OTLP exporter
        // specification); a traces-only URL is used as it is.
        let base = |source: &'static str, url: String| (source, url, true);
        let endpoint = self
            .otlp_endpoint
            .clone()
            .filter(|url| !url.trim().is_empty())
            .map(|url| base("--otlp-endpoint", url))
            .or_else(|| {
                environment
                    .var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    .map(|url| ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url, false))
            })
            .or_else(|| {
                environment
                    .var("OTEL_EXPORTER_OTLP_ENDPOINT")
                    .map(|url| base("OTEL_EXPORTER_OTLP_ENDPOINT", url))
            });
        // Without an endpoint traces are off, and the other OTEL_*
        // variables (the application's, in a shared environment) are not
        // dedupd's business.
        let Some((source, url, is_base)) = endpoint else {
            return Ok(None);
        };
        if let Some(disabled) = environment.var("OTEL_SDK_DISABLED") {
            match disabled.trim().to_ascii_lowercase().as_str() {
                "true" => return Ok(None),
                "false" => {}
                other => {
                    return Err(format!(
                        "OTEL_SDK_DISABLED={other:?} is neither true nor false"
                    ))
                }
            }
        }
        if let Some(exporter) = environment.var("OTEL_TRACES_EXPORTER") {
            match exporter.trim() {
                "none" => return Ok(None),
                "otlp" => {}
                other => {
                    return Err(format!(
                        "OTEL_TRACES_EXPORTER={other:?}: dedupd exports with otlp (or none)"
                    ))
                }
            }
        }
        let protocol = match self
            .otlp_protocol
            .as_ref()
            .map(|value| ("--otlp-protocol", value.clone()))
            .or_else(|| {
                environment
                    .var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    .map(|value| ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", value))
            })
            .or_else(|| {
                environment
                    .var("OTEL_EXPORTER_OTLP_PROTOCOL")
                    .map(|value| ("OTEL_EXPORTER_OTLP_PROTOCOL", value))
            }) {
            None => OtlpProtocol::HttpProtobuf,
            Some((source, value)) => match value.trim() {
                "grpc" => OtlpProtocol::Grpc,
                "http/protobuf" => OtlpProtocol::HttpProtobuf,
                other => {
                    return Err(format!(
                        "{source} {other:?} is not an OTLP protocol dedupd speaks: grpc or http/protobuf"
                    ))
                }
            },
        };
        let url = url.trim().to_owned();
        let uri = http::Uri::from_str(&url)
            .map_err(|error| format!("{source} {url:?} is not a URL: {error}"))?;
        match (uri.scheme_str(), protocol) {
            (Some("http"), _) | (Some("https"), OtlpProtocol::Grpc) => {}
            (Some("https"), OtlpProtocol::HttpProtobuf) => {
                return Err(format!(
                    "{source} {url:?}: OTLP over HTTP/protobuf is plain http (a collector on the node); use --otlp-protocol grpc for https"
                ))
            }
            _ => return Err(format!("{source} {url:?} is not an http:// or https:// URL")),
        }
        if uri.authority().is_none() {
            return Err(format!("{source} {url:?} names no host"));
        }
        if is_base && uri.query().is_some() {
            return Err(format!(
                "{source} {url:?}: a base URL takes no query (/v1/traces is appended to it)"
            ));
        }
        for name in [
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
            "OTEL_EXPORTER_OTLP_COMPRESSION",
        ] {
            if let Some(value) = environment.var(name).filter(|value| value.trim() != "none") {
                return Err(format!(
                    "{name}={value:?}: dedupd sends spans uncompressed (none)"
                ));
            }
        }
        for name in [
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
            "OTEL_EXPORTER_OTLP_HEADERS",
        ] {
            if let Some(value) = environment.var(name) {
                let malformed = value.split(',').any(|pair| {
                    pair.split_once('=')
                        .is_none_or(|(key, _)| key.trim().is_empty())
                });
                if malformed {
                    return Err(format!("{name} is not a comma-separated list of key=value"));
                }
            }
        }
        let endpoint = match protocol {
            OtlpProtocol::HttpProtobuf if is_base => {
                format!("{}/v1/traces", url.trim_end_matches('/'))
            }
            _ => url,
        };
        let export_timeout = match environment
            .var("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            .map(|value| ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", value))
            .or_else(|| {
                environment
                    .var("OTEL_EXPORTER_OTLP_TIMEOUT")
                    .map(|value| ("OTEL_EXPORTER_OTLP_TIMEOUT", value))
            }) {
            None => Duration::from_secs(10),
            Some((name, value)) => Duration::from_millis(milliseconds(name, &value, 1)?),
        };
        let max_queue = count(environment, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)?;
        let max_batch = count(environment, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)?;
        if max_batch > max_queue {
            return Err(format!(
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE {max_batch} is larger than OTEL_BSP_MAX_QUEUE_SIZE {max_queue}"
            ));
        }
        let batch_export_timeout = match environment.var("OTEL_BSP_EXPORT_TIMEOUT") {
            None => export_timeout,
            Some(value) => {
                Duration::from_millis(milliseconds("OTEL_BSP_EXPORT_TIMEOUT", &value, 1)?)
            }
        };
        let schedule_delay = match environment.var("OTEL_BSP_SCHEDULE_DELAY") {
            None => Duration::from_secs(5),
            Some(value) => {
                Duration::from_millis(milliseconds("OTEL_BSP_SCHEDULE_DELAY", &value, 1)?)
            }
        };
        Ok(Some(TraceSettings {
            endpoint,
            protocol,
            sampler: sampler(environment)?,
            default_service_name: "dedupd",
            max_queue,
            max_batch,
            schedule_delay,
            export_timeout,
            batch_export_timeout,
        }))
    }
}

fn milliseconds(name: &str, value: &str, min: u64) -> Result<u64, String> {
    value
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|value| *value >= min && *value <= 3_600_000)
        .ok_or_else(|| format!("{name}={value:?} is not a number of milliseconds (1 to 3600000)"))
}

fn count(environment: &impl Environment, name: &str, default: usize) -> Result<usize, String> {
    match environment.var(name) {
        None => Ok(default),
        Some(value) => value
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|count| (1..=1 << 20).contains(count))
            .ok_or_else(|| format!("{name}={value:?} is not a count from 1 to 1048576")),
    }
}

fn sampler(environment: &impl Environment) -> Result<SamplerChoice, String> {
    let ratio = || -> Result<f64, String> {
        match environment.var("OTEL_TRACES_SAMPLER_ARG") {
            None => Ok(1.0),
            Some(value) => value
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|ratio| (0.0..=1.0).contains(ratio))
                .ok_or_else(|| {
                    format!("OTEL_TRACES_SAMPLER_ARG={value:?} is not a ratio from 0 to 1")
                }),
        }
    };
    let Some(name) = environment.var("OTEL_TRACES_SAMPLER") else {
        return Ok(SamplerChoice::ParentBased(RootSampler::AlwaysOn));
    };
    Ok(match name.trim() {
        "always_on" => SamplerChoice::AlwaysOn,
        "always_off" => SamplerChoice::AlwaysOff,
        "traceidratio" => SamplerChoice::Ratio(ratio()?),
        "parentbased_always_on" => SamplerChoice::ParentBased(RootSampler::AlwaysOn),
        "parentbased_always_off" => SamplerChoice::ParentBased(RootSampler::AlwaysOff),
        "parentbased_traceidratio" => SamplerChoice::ParentBased(RootSampler::Ratio(ratio()?)),
        other => {
            return Err(format!(
                "OTEL_TRACES_SAMPLER={other:?} is not one of always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio"
            ))
        }
    })
}

/// Trace export, running: the tracer for the `tracing` layer and the
/// queue's worker, which [`TraceExport::finish`] drains on shutdown.
#[derive(Debug)]
pub struct TraceExport {
    provider: SdkTracerProvider,
    stop: watch::Sender<bool>,
    worker: tokio::task::JoinHandle<()>,
}

impl TraceExport {
    /// Builds the exporter and starts the queue's worker. Must run inside
    /// the Tokio runtime (the gRPC channel and the worker live on it).
    pub fn start(settings: &TraceSettings, metrics: Arc<Metrics>) -> Result<TraceExport, String> {
        let exporter = match settings.protocol {
            OtlpProtocol::Grpc => {
                let mut builder = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(settings.endpoint.clone())
                    .with_timeout(settings.export_timeout);
                if settings.endpoint.starts_with("https:") {
                    builder = builder.with_tls_config(
                        tonic::transport::ClientTlsConfig::new().with_native_roots(),
                    );
                }
                builder.build()
            }
            OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(settings.endpoint.clone())
                .with_timeout(settings.export_timeout)
                .build(),
        }
        .map_err(|error| {
            format!(
                "cannot set up OTLP export to {}: {error}",
                settings.endpoint
            )
        })?;
        let resource = resource(settings.default_service_name);
        let (processor, worker, stop) =
            BoundedExport::start(exporter, &resource, settings, metrics);
        let provider = SdkTracerProvider::builder()
            .with_resource(resource)
            .with_sampler(settings.sampler.sampler())
            .with_span_processor(processor)
            .build();
        Ok(TraceExport {
            provider,
            stop,
            worker,
        })
    }

    /// The `tracing` layer that turns dedupd's spans into OpenTelemetry
    /// spans (only those of [`TARGET`]; warnings and errors inside them
    /// become span events).
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + use<S>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        use tracing_subscriber::{filter::Targets, Layer};
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("dedupd"))
            .with_location(false)
            .with_threads(false)
            .with_tracked_inactivity(false)
            .with_filter(
                Targets::new()
                    .with_target(TARGET, tracing::Level::DEBUG)
                    .with_target("dedupd", tracing::Level::WARN),
            )
    }

    /// Exports what is queued, for at most `within`, and stops.
    pub async fn finish(self, within: Duration) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(within, self.worker).await.is_err() {
            tracing::warn!(
                ?within,
                "trace export did not finish in time; the rest is dropped"
            );
        }
        // The worker is gone: whatever ends now is counted as dropped.
        let _ = self.provider.shutdown();
    }
}

/// `service.name` from `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES`
/// (the SDK's detectors), else `default_service_name`.
fn resource(default_service_name: &'static str) -> Resource {
    let set = |name: &str| ProcessEnvironment.var(name);
    let named = set("OTEL_SERVICE_NAME").is_some()
        || set("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|attributes| {
            attributes
                .split(',')
                .any(|pair| pair.trim().starts_with("service.name="))
        });
    if named {
        Resource::builder().build()
    } else {
        Resource::builder()
            .with_service_name(default_service_name)
            .build()
    }
}

/// A span processor with a bounded queue: [`SpanProcessor::on_end`] puts a
/// finished span into it without waiting, or drops it (counted) when it is
/// full; one Tokio task exports from it in batches.
#[derive(Debug)]
struct BoundedExport {
    queue: mpsc::Sender<SpanData>,
    metrics: Arc<Metrics>,
    flush: Arc<tokio::sync::Notify>,
}

impl BoundedExport {
    fn start<E: SpanExporter + 'static>(
        mut exporter: E,
        resource: &Resource,
        settings: &TraceSettings,
        metrics: Arc<Metrics>,
    ) -> (
        BoundedExport,
        tokio::task::JoinHandle<()>,
        watch::Sender<bool>,
    ) {
        exporter.set_resource(resource);
        let (queue, spans) = mpsc::channel(settings.max_queue);
        let (stop, stopped) = watch::channel(false);
        let flush = Arc::new(tokio::sync::Notify::new());
        let worker = tokio::spawn(export_loop(
            exporter,
            spans,
            stopped,
            Arc::clone(&flush),
            ExportLimits {
                max_batch: settings.max_batch,
                schedule_delay: settings.schedule_delay,
                export_timeout: settings.batch_export_timeout,
            },
            Arc::clone(&metrics),
        ));
        (
            BoundedExport {
                queue,
                metrics,
                flush,
            },
            worker,
            stop,
        )
    }
}

impl SpanProcessor for BoundedExport {
    fn on_start(&self, _span: &mut SdkSpan, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        match self.queue.try_send(span) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.metrics.trace_spans_dropped("queue_full", 1)
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.metrics.trace_spans_dropped("shut_down", 1)
            }
        }
    }

    /// Asks the worker to export what is queued now; does not wait (the
    /// caller may be on a runtime thread).
    fn force_flush(&self) -> OTelSdkResult {
        self.flush.notify_one();
        Ok(())
    }

    /// The worker stops through [`TraceExport::finish`], which can wait
    /// without blocking a runtime thread; here the queue only stops taking
    /// spans once the last sender goes.
    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        if self.queue.is_closed() {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
struct ExportLimits {
    max_batch: usize,
    schedule_delay: Duration,
    export_timeout: Duration,
}

/// Collects spans into batches (full, or the schedule delay after the first
/// span) and exports each with a deadline; on stop, exports what is left.
async fn export_loop<E: SpanExporter>(
    exporter: E,
    mut spans: mpsc::Receiver<SpanData>,
    mut stop: watch::Receiver<bool>,
    flush: Arc<tokio::sync::Notify>,
    limits: ExportLimits,
    metrics: Arc<Metrics>,
) {
    let mut batch = Vec::with_capacity(limits.max_batch);
    let mut failing = false;
    loop {
        let stopping = tokio::select! {
            biased;
            _ = stop.wait_for(|stop| *stop) => true,
            received = spans.recv_many(&mut batch, limits.max_batch) => received == 0,
        };
        if !stopping {
            let deadline = tokio::time::sleep(limits.schedule_delay);
            tokio::pin!(deadline);
            while batch.len() < limits.max_batch {
                let room = limits.max_batch - batch.len();
                tokio::select! {
                    biased;
                    _ = stop.wait_for(|stop| *stop) => break,
                    () = &mut deadline => break,
                    () = flush.notified() => break,
                    received = spans.recv_many(&mut batch, room) => if received == 0 { break },
                }
            }
        } else {
            while batch.len() < limits.max_batch {
                match spans.try_recv() {
                    Ok(span) => batch.push(span),
                    Err(_) => break,
                }
            }
        }
        if !batch.is_empty() {
            export(&exporter, &mut batch, limits, &metrics, &mut failing).await;
        }
        if stopping && spans.is_empty() {
            return;
        }
    }
}

async fn export<E: SpanExporter>(
    exporter: &E,
    batch: &mut Vec<SpanData>,
    limits: ExportLimits,
    metrics: &Metrics,
    failing: &mut bool,
) {
    let count = batch.len() as u64;
    let spans = std::mem::replace(batch, Vec::with_capacity(limits.max_batch));
    let outcome = tokio::time::timeout(limits.export_timeout, exporter.export(spans)).await;
    let error = match outcome {
        Ok(Ok(())) => {
            metrics.trace_spans_exported(count);
            if std::mem::take(failing) {
                tracing::info!("trace export works again");
            }
            return;
        }
        Ok(Err(error)) => error.to_string(),
        Err(_) => format!("no answer within {:?}", limits.export_timeout),
    };
    metrics.trace_spans_dropped("export_failed", count);
    // Once per outage, not once per batch.
    if !std::mem::replace(failing, true) {
        tracing::warn!(%error, spans = count, "trace export failed; spans are dropped until it works again");
    }
}

fn propagator() -> &'static TextMapCompositePropagator {
    static PROPAGATOR: OnceLock<TextMapCompositePropagator> = OnceLock::new();
    PROPAGATOR.get_or_init(|| {
        TextMapCompositePropagator::new(vec![
            Box::new(TraceContextPropagator::new()),
            Box::new(BaggagePropagator::new()),
        ])
    })
}

/// The caller's context from W3C `traceparent`, `tracestate` and `baggage`
/// (gRPC metadata are HTTP/2 headers). Invalid or missing: no parent.
pub fn parent_from(headers: &http::HeaderMap) -> Context {
    propagator().extract(&HeaderExtractor(headers))
}

/// Writes `span` as the parent into `headers` (`traceparent`,
/// `tracestate`), replacing the caller's, so the upstream's spans hang
/// under the proxy's. Without export (`span` not recorded) the headers stay
/// as the caller sent them. `baggage` passes through unchanged.
pub fn inject_into(span: &tracing::Span, headers: &mut http::HeaderMap) {
    if span.is_disabled() {
        return;
    }
    let context = span.context();
    if !context.span().span_context().is_valid() {
        return;
    }
    static TRACE_CONTEXT: OnceLock<TraceContextPropagator> = OnceLock::new();
    TRACE_CONTEXT
        .get_or_init(TraceContextPropagator::new)
        .inject_context(&context, &mut HeaderInjector(headers));
}

/// The span of one gRPC call, named `package.Service/Method`, its parent
/// the caller's context.
pub fn grpc_call_span(request: &http::Request<()>) -> tracing::Span {
    let path = request.uri().path();
    let name = path.strip_prefix('/').unwrap_or(path);
    let (service, method) = name.split_once('/').unwrap_or((name, ""));
    let span = tracing::debug_span!(
        target: TARGET,
        "grpc call",
        otel.name = name,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.service = service,
        rpc.method = method,
    );
    if !span.is_disabled() {
        let _ = span.set_parent(parent_from(request.headers()));
    }
    span
}

/// The span of one request to the HTTP proxy, its parent the caller's
/// context.
pub fn proxy_span(request: &http::Request<impl Sized>) -> tracing::Span {
    let span = tracing::debug_span!(
        target: TARGET,
        "proxy request",
        otel.name = request.method().as_str(),
        otel.kind = "server",
        http.request.method = request.method().as_str(),
        url.path = request.uri().path(),
    );
    if !span.is_disabled() {
        let _ = span.set_parent(parent_from(request.headers()));
    }
    span
}

/// The proxy's call to the upstream service (a client span under
/// [`proxy_span`]).
fn upstream_span(method: &http::Method) -> tracing::Span {
    tracing::debug_span!(
        target: TARGET,
        "upstream call",
        otel.name = method.as_str(),
        otel.kind = "client",
        http.request.method = method.as_str(),
    )
}

/// One step the proxy takes on the record after its claim (`dedup
/// commit`, `dedup release`, `dedup renew`): a child span, so each step's
/// attributes are its own and the request's span holds each key once.
pub fn step_span(name: &'static str) -> tracing::Span {
    tracing::debug_span!(target: TARGET, "proxy step", otel.name = name)
}

/// The proxy's call to the upstream: its span, marked as an error if the
/// call is dropped unanswered (the upstream timeout cancelled it).
#[derive(Debug)]
pub struct UpstreamCall {
    span: tracing::Span,
    settled: bool,
}

impl UpstreamCall {
    /// A client span under the current one.
    pub fn start(method: &http::Method) -> UpstreamCall {
        UpstreamCall {
            span: upstream_span(method),
            settled: false,
        }
    }

    /// The call's span.
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// The upstream answered with `status`, or failed (`None`).
    pub fn answered(mut self, status: Option<http::StatusCode>) {
        record_upstream_status(&self.span, status);
        self.settled = true;
    }
}

impl Drop for UpstreamCall {
    fn drop(&mut self) {
        if !self.settled && !self.span.is_disabled() {
            self.span
                .set_status(SpanStatus::error("no answer within the upstream timeout"));
        }
    }
}

/// One read-modify-write (or read) of the store.
pub fn store_span(store: &'static str) -> tracing::Span {
    tracing::debug_span!(
        target: TARGET,
        "store round trip",
        otel.kind = "client",
        db.system.name = store,
    )
}

/// The wait until a decision is durable (the group commit's disk sync, or
/// the shared store's replicas).
pub fn durability_span() -> tracing::Span {
    tracing::debug_span!(target: TARGET, "durability wait")
}

/// Whether the current span is exported: attributes are only worth
/// computing then.
fn recording() -> Option<tracing::Span> {
    let span = tracing::Span::current();
    (!span.is_disabled()).then_some(span)
}

/// A call's store and namespace.
pub fn record_call(key: &Key, store: &'static str) {
    if let Some(span) = recording() {
        span.set_attribute("dedup.namespace", key.namespace().to_owned());
        span.set_attribute("dedup.store", store);
    }
}

/// A claim's decision: outcome, attempt, fencing token, recovered.
pub fn record_claim(outcome: &ClaimOutcome) {
    let Some(span) = recording() else { return };
    span.set_attribute("dedup.outcome", outcome.kind().as_str());
    let record = match outcome {
        ClaimOutcome::Claimed { record, recovered } => {
            span.set_attribute("dedup.recovered", *recovered);
            Some(record)
        }
        ClaimOutcome::Duplicate { record }
        | ClaimOutcome::InProgress { record, .. }
        | ClaimOutcome::FingerprintMismatch { record } => Some(record),
        ClaimOutcome::Stale { .. } => None,
    };
    if let Some(record) = record {
        span.set_attribute("dedup.attempt", i64::from(record.attempt));
        span.set_attribute(
            "dedup.fencing_token",
            i64::try_from(record.fencing_token.0).unwrap_or(i64::MAX),
        );
    }
}

/// A commit's outcome.
pub fn record_commit(outcome: &Result<CommitOutcome, LeaseLost>) {
    let Some(span) = recording() else { return };
    let (name, record) = match outcome {
        Ok(CommitOutcome::Committed(record)) => ("committed", Some(record)),
        Ok(CommitOutcome::AlreadyCommitted(record)) => ("already_committed", Some(record)),
        Err(LeaseLost) => ("lease_lost", None),
    };
    span.set_attribute("dedup.outcome", name);
    if let Some(record) = record {
        span.set_attribute("dedup.attempt", i64::from(record.attempt));
        span.set_attribute(
            "dedup.fencing_token",
            i64::try_from(record.fencing_token.0).unwrap_or(i64::MAX),
        );
    }
}

/// A release's outcome.
pub fn record_release(outcome: &Result<ReleaseOutcome, LeaseLost>) {
    let Some(span) = recording() else { return };
    let name = match outcome {
        Ok(ReleaseOutcome::Released) => "released",
        Ok(ReleaseOutcome::AlreadyReleased) => "already_released",
        Ok(ReleaseOutcome::NotFound) => "not_found",
        Err(LeaseLost) => "lease_lost",
    };
    span.set_attribute("dedup.outcome", name);
}

/// A batch call's size and store.
pub fn record_batch(items: usize, store: &'static str) {
    if let Some(span) = recording() {
        span.set_attribute("dedup.batch.size", i64::try_from(items).unwrap_or(i64::MAX));
        span.set_attribute("dedup.store", store);
    }
}

/// The gRPC status of an answer (from a trailers-only response's headers;
/// absent there means OK in the trailers). Codes that mean the server
/// failed mark the span as an error, as the RPC conventions say.
pub fn record_grpc_status(headers: &http::HeaderMap) {
    let Some(span) = recording() else { return };
    let code = headers
        .get("grpc-status")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<i32>().ok())
        .unwrap_or(0);
    span.set_attribute("rpc.grpc.status_code", i64::from(code));
    let code = tonic::Code::from_i32(code);
    if matches!(
        code,
        tonic::Code::Unknown
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unimplemented
            | tonic::Code::Internal
            | tonic::Code::Unavailable
            | tonic::Code::DataLoss
    ) {
        span.set_status(SpanStatus::error(code.description()));
    }
}

/// The HTTP status the proxy answered and what became of the request.
pub fn record_proxy_answer(status: http::StatusCode, result: &'static str) {
    let Some(span) = recording() else { return };
    span.set_attribute("http.response.status_code", i64::from(status.as_u16()));
    span.set_attribute("dedup.proxy.result", result);
    if status.is_server_error() {
        span.set_status(SpanStatus::error(result));
    }
}

/// The upstream's HTTP status, on the upstream span.
fn record_upstream_status(span: &tracing::Span, status: Option<http::StatusCode>) {
    if span.is_disabled() {
        return;
    }
    match status {
        Some(status) => {
            span.set_attribute("http.response.status_code", i64::from(status.as_u16()));
            if status.is_server_error() {
                span.set_status(SpanStatus::error(status.as_str().to_owned()));
            }
        }
        None => span.set_status(SpanStatus::error("no answer from the upstream")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(
        args: TraceArgs,
        environment: &[(&'static str, &'static str)],
    ) -> Result<Option<TraceSettings>, String> {
        args.validate(&environment.iter().copied().collect::<HashMap<_, _>>())
    }

    fn endpoint(url: &str) -> TraceArgs {
        TraceArgs {
            otlp_endpoint: Some(url.into()),
            otlp_protocol: None,
        }
    }

    #[test]
    fn off_unless_an_endpoint_is_set() {
        assert!(settings(TraceArgs::default(), &[]).unwrap().is_none());
        assert!(
            settings(TraceArgs::default(), &[("OTEL_SERVICE_NAME", "x")])
                .unwrap()
                .is_none()
        );
        let on = settings(
            TraceArgs::default(),
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")],
        )
        .unwrap()
        .unwrap();
        assert_eq!(on.endpoint, "http://c:4318/v1/traces");
        assert_eq!(on.protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(
            on.sampler,
            SamplerChoice::ParentBased(RootSampler::AlwaysOn)
        );
        // The application's settings in a shared environment do not stop a
        // dedupd that does not trace.
        let foreign = [
            ("OTEL_TRACES_EXPORTER", "console"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_SDK_DISABLED", "1"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
        ];
        assert!(settings(TraceArgs::default(), &foreign).unwrap().is_none());
        for off in [
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert!(
                settings(endpoint("http://c:4317"), &[off])
                    .unwrap()
                    .is_none(),
                "{off:?}"
            );
        }
    }

    #[test]
    fn the_flag_wins_and_a_traces_url_is_used_as_it_is() {
        let on = settings(
            endpoint("http://flag:4317"),
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (on.endpoint.as_str(), on.protocol),
            ("http://flag:4317", OtlpProtocol::Grpc)
        );
        let on = settings(
            TraceArgs::default(),
            &[
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://env:4318/custom",
                ),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://other:4318"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!(on.endpoint, "http://env:4318/custom");
        let on = settings(
            TraceArgs {
                otlp_endpoint: Some("http://c:4317".into()),
                otlp_protocol: Some("grpc".into()),
            },
            &[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")],
        )
        .unwrap()
        .unwrap();
        assert_eq!(on.protocol, OtlpProtocol::Grpc);
    }

    #[test]
    fn samplers_and_queue_limits_are_read_and_checked() {
        let on = |environment: &[(&'static str, &'static str)]| {
            settings(endpoint("http://c:4318"), environment)
        };
        assert_eq!(
            on(&[
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25")
            ])
            .unwrap()
            .unwrap()
            .sampler,
            SamplerChoice::ParentBased(RootSampler::Ratio(0.25))
        );
        assert_eq!(
            on(&[("OTEL_TRACES_SAMPLER", "always_off")])
                .unwrap()
                .unwrap()
                .sampler,
            SamplerChoice::AlwaysOff
        );
        let limits = on(&[
            ("OTEL_BSP_MAX_QUEUE_SIZE", "100"),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "10"),
            ("OTEL_BSP_SCHEDULE_DELAY", "250"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2000"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                limits.max_queue,
                limits.max_batch,
                limits.schedule_delay,
                limits.export_timeout
            ),
            (100, 10, Duration::from_millis(250), Duration::from_secs(2))
        );
    }

    #[test]
    fn bad_settings_are_one_clear_line() {
        type Variables = &'static [(&'static str, &'static str)];
        let cases: &[(TraceArgs, Variables, &str)] = &[
            (
                endpoint("collector:4317"),
                &[],
                "not an http:// or https:// URL",
            ),
            (endpoint("ftp://c"), &[], "not an http:// or https:// URL"),
            (endpoint("http://c bad"), &[], "is not a URL"),
            (
                endpoint("https://c:4318"),
                &[],
                "use --otlp-protocol grpc for https",
            ),
            (
                endpoint("http://c"),
                &[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")],
                "grpc or http/protobuf",
            ),
            (
                endpoint("http://c"),
                &[("OTEL_TRACES_SAMPLER", "sometimes")],
                "is not one of always_on",
            ),
            (
                endpoint("http://c"),
                &[
                    ("OTEL_TRACES_SAMPLER", "traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", "2"),
                ],
                "not a ratio from 0 to 1",
            ),
            (
                endpoint("http://c"),
                &[("OTEL_BSP_MAX_QUEUE_SIZE", "0")],
                "not a count",
            ),
            (
                endpoint("http://c"),
                &[
                    ("OTEL_BSP_MAX_QUEUE_SIZE", "10"),
                    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "20"),
                ],
                "larger than OTEL_BSP_MAX_QUEUE_SIZE",
            ),
            (
                endpoint("http://c"),
                &[("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")],
                "not a number of milliseconds",
            ),
            (
                endpoint("http://c"),
                &[("OTEL_TRACES_EXPORTER", "zipkin")],
                "exports with otlp",
            ),
            (
                endpoint("http://c"),
                &[("OTEL_SDK_DISABLED", "maybe")],
                "neither true nor false",
            ),
            (
                endpoint("http://c"),
                &[("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")],
                "uncompressed",
            ),
            (
                endpoint("http://c"),
                &[("OTEL_EXPORTER_OTLP_HEADERS", "api-key")],
                "key=value",
            ),
            (
                endpoint("http://c"),
                &[("OTEL_EXPORTER_OTLP_HEADERS", "a=1,=2")],
                "key=value",
            ),
            (endpoint("http://c:4318/?x=1"), &[], "takes no query"),
            (
                endpoint("http://c"),
                &[("OTEL_BSP_EXPORT_TIMEOUT", "0")],
                "milliseconds",
            ),
        ];
        for (args, environment, expected) in cases {
            let problem = settings(args.clone(), environment).unwrap_err();
            assert!(
                problem.contains(expected),
                "{problem:?} should say {expected:?}"
            );
            assert!(!problem.contains('\n'));
        }
    }
}
