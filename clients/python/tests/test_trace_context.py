"""The application's OpenTelemetry context travels to the sidecar in the
call's metadata (W3C traceparent and baggage), from both clients: seen by a
gRPC server of the test's own that keeps what each call carried."""

from __future__ import annotations

from concurrent import futures
from typing import Any, Dict, Iterator, List, Tuple

import grpc
import pytest
from opentelemetry import baggage, context, trace

import dedupd
import dedupd.aio
from dedupd._proto.dedup.v1 import dedup_pb2 as pb

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture()
def recorder() -> Iterator[Tuple[str, List[Dict[str, str]]]]:
    """A server answering Claim with CLAIMED; yields its address and the
    metadata of every call."""
    seen: List[Dict[str, str]] = []

    def claim(request: pb.ClaimRequest, call: grpc.ServicerContext) -> pb.ClaimResponse:
        seen.append({key: value for key, value in call.invocation_metadata() if isinstance(value, str)})
        return pb.ClaimResponse(
            outcome=pb.CLAIM_OUTCOME_CLAIMED,
            lease_token="token",
            fencing_token=1,
            attempt=1,
            record=pb.Record(namespace="default", correlation_id=request.correlation_id),
        )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler: Any = grpc.unary_unary_rpc_method_handler(
        claim,
        request_deserializer=pb.ClaimRequest.FromString,
        response_serializer=pb.ClaimResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("dedup.v1.ClaimAndCommit", {"Claim": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        server.stop(grace=None)


def in_a_span() -> Any:
    """The context of a sampled span with baggage, as an instrumented
    application has while it handles a message."""
    span = trace.NonRecordingSpan(
        trace.SpanContext(trace_id=TRACE_ID, span_id=SPAN_ID, is_remote=False, trace_flags=trace.TraceFlags(1))
    )
    return baggage.set_baggage("tenant", "acme", trace.set_span_in_context(span))


def test_the_sync_client_sends_the_current_trace_context(recorder: Tuple[str, List[Dict[str, str]]]) -> None:
    address, seen = recorder
    with dedupd.Client(address, token="a-token") as client:
        client.claim_once("untraced")
        attached = context.attach(in_a_span())
        try:
            client.claim_once("traced")
        finally:
            context.detach(attached)
    untraced, traced = seen
    assert "traceparent" not in untraced
    assert traced["traceparent"] == TRACEPARENT
    assert traced["baggage"] == "tenant=acme"
    assert traced["authorization"] == "Bearer a-token", "the token still goes along"


async def test_the_asyncio_client_sends_the_current_trace_context(recorder: Tuple[str, List[Dict[str, str]]]) -> None:
    address, seen = recorder
    async with dedupd.aio.Client(address) as client:
        attached = context.attach(in_a_span())
        try:
            await client.claim_once("traced")
        finally:
            context.detach(attached)
        await client.claim_once("untraced")
    traced, untraced = seen
    assert traced["traceparent"] == TRACEPARENT
    assert "traceparent" not in untraced
