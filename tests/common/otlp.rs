//! An OTLP receiver of the tests' own: the collector's protobuf messages
//! over OTLP/gRPC (the collector's `TraceService`) or OTLP/HTTP
//! (`POST /v1/traces`, protobuf body), keeping every span it is sent.
//! Also a collector that accepts connections and never answers.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, server::conn::http1, service::service_fn, Request, Response};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        trace_service_server::{TraceService, TraceServiceServer},
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    },
    common::v1::{any_value::Value, KeyValue},
    trace::v1::Span,
};
use prost::Message;
use tokio::net::TcpListener;

/// One span as received, with its resource's `service.name`.
#[derive(Debug, Clone)]
pub struct Received {
    pub service_name: String,
    pub span: Span,
}

impl Received {
    /// The value of attribute `key`, if the span has it.
    pub fn attribute(&self, key: &str) -> Option<&Value> {
        attribute(&self.span.attributes, key)
    }

    /// A string attribute.
    pub fn text(&self, key: &str) -> Option<&str> {
        match self.attribute(key)? {
            Value::StringValue(text) => Some(text),
            _ => None,
        }
    }

    /// An integer attribute.
    pub fn int(&self, key: &str) -> Option<i64> {
        match self.attribute(key)? {
            Value::IntValue(value) => Some(*value),
            _ => None,
        }
    }

    /// A boolean attribute.
    pub fn flag(&self, key: &str) -> Option<bool> {
        match self.attribute(key)? {
            Value::BoolValue(value) => Some(*value),
            _ => None,
        }
    }
}

fn attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attributes
        .iter()
        .find(|attribute| attribute.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()
}

/// What a collector was sent.
#[derive(Debug, Clone, Default)]
pub struct Spans(Arc<Mutex<Vec<Received>>>);

impl Spans {
    fn keep(&self, request: ExportTraceServiceRequest) {
        let mut kept = self.0.lock().unwrap();
        for resource_spans in request.resource_spans {
            let service_name = resource_spans
                .resource
                .as_ref()
                .and_then(|resource| attribute(&resource.attributes, "service.name"))
                .and_then(|value| match value {
                    Value::StringValue(name) => Some(name.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for scope_spans in resource_spans.scope_spans {
                kept.extend(scope_spans.spans.into_iter().map(|span| Received {
                    service_name: service_name.clone(),
                    span,
                }));
            }
        }
    }

    /// Every span received so far.
    pub fn all(&self) -> Vec<Received> {
        self.0.lock().unwrap().clone()
    }

    /// [`Spans::until`] the span named `name` in the trace `trace_id`
    /// (hex) arrives.
    pub async fn until_in_trace(&self, name: &str, trace_id: &str) -> Received {
        self.until(&format!("{name} in trace {trace_id}"), |received| {
            received.span.name == name && hex(&received.span.trace_id) == trace_id
        })
        .await
    }

    /// Waits (bounded: 20 s, then panics with what arrived) until a span
    /// matches `wanted`, and returns it.
    pub async fn until(&self, what: &str, wanted: impl Fn(&Received) -> bool) -> Received {
        let started = Instant::now();
        loop {
            if let Some(found) = self.all().into_iter().find(|span| wanted(span)) {
                return found;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "no span {what} arrived within 20 s; received: {:#?}",
                self.all()
                    .iter()
                    .map(|received| &received.span.name)
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[derive(Debug, Clone)]
struct GrpcReceiver(Spans);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.keep(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A collector serving OTLP/gRPC on an ephemeral loopback port.
pub async fn grpc_collector() -> (SocketAddr, Spans) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let spans = Spans::default();
    let service = TraceServiceServer::new(GrpcReceiver(spans.clone()));
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    (address, spans)
}

/// A collector serving OTLP/HTTP with protobuf bodies on `/v1/traces`.
pub async fn http_collector() -> (SocketAddr, Spans) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let spans = Spans::default();
    let kept = spans.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let kept = kept.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let kept = kept.clone();
                    async move {
                        let wrong = request.uri().path() != "/v1/traces"
                            || request
                                .headers()
                                .get("content-type")
                                .is_none_or(|kind| kind != "application/x-protobuf");
                        let body = request.into_body().collect().await?.to_bytes();
                        let status = match ExportTraceServiceRequest::decode(body) {
                            Ok(export) if !wrong => {
                                kept.keep(export);
                                200
                            }
                            _ => 400,
                        };
                        let answer = ExportTraceServiceResponse {
                            partial_success: None,
                        }
                        .encode_to_vec();
                        Ok::<_, hyper::Error>(
                            Response::builder()
                                .status(status)
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(Bytes::from(answer)))
                                .unwrap(),
                        )
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (address, spans)
}

/// A collector that accepts connections and never answers (a stalled
/// network path): each export waits out its timeout.
pub async fn silent_collector() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    address
}

/// The W3C `traceparent` of a sampled remote parent.
pub fn traceparent(trace_id: &str, parent_span_id: &str) -> String {
    format!("00-{trace_id}-{parent_span_id}-01")
}

/// Lowercase hex, as W3C Trace Context writes IDs.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}
