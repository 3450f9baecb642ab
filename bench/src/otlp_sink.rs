//! An OTLP/gRPC collector that accepts every span and keeps only a count
//! (`dedupd-bench otlp-sink`): the collector that is up, in the trace
//! export benchmark (benches/traces.sh).

use std::{
    future::Future,
    sync::atomic::{AtomicU64, Ordering},
    sync::Arc,
};

use opentelemetry_proto::tonic::collector::trace::v1::{
    trace_service_server::{TraceService, TraceServiceServer},
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use tokio::net::TcpListener;
use tonic::transport::{server::TcpIncoming, Server};

/// Counts the spans it is sent.
#[derive(Debug, Default, Clone)]
pub struct Sink {
    spans: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|resource| &resource.scope_spans)
            .map(|scope| scope.spans.len())
            .sum();
        self.spans.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Serves the sink on `listener` until `shutdown` resolves, then logs how
/// many spans arrived.
pub async fn serve(
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let sink = Sink::default();
    let spans = Arc::clone(&sink.spans);
    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, "OTLP sink serving");
    }
    Server::builder()
        .add_service(TraceServiceServer::new(sink))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown)
        .await?;
    tracing::info!(spans = spans.load(Ordering::Relaxed), "OTLP sink received");
    Ok(())
}
