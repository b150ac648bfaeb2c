"""Tracing: off by default, on from OTEL_* env, W3C context across a real gRPC hop."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.v1 import engine_pb2, engine_pb2_grpc
from services.common.grpc_server import ServiceServer
from services.common.tracing import (
    COMPONENT_ATTRIBUTE,
    REQUEST_ID_ATTRIBUTE,
    ComponentTracer,
    client_interceptors,
    extract_carrier,
    extract_metadata,
    inject_carrier,
    inject_metadata,
    server_interceptors,
    setup_tracing,
    tracing_enabled,
)


@pytest.fixture
def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


def test_off_by_default_and_on_from_standard_env() -> None:
    assert not tracing_enabled({})
    assert setup_tracing("scheduler", env={}, set_global=False) is None
    assert client_interceptors() == [] and server_interceptors() == []
    assert tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert tracing_enabled({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing_enabled({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert not tracing_enabled({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})

    provider = setup_tracing("prefill", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
                             set_global=False)
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "pdserve-prefill"
    provider.shutdown()
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        setup_tracing("x", env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"},
                      set_global=False)
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        setup_tracing("x", env={"OTEL_TRACES_EXPORTER": "zipkin"}, set_global=False)


def test_spans_without_tracing_are_no_ops() -> None:
    tracer = ComponentTracer("scheduler", trace.NoOpTracerProvider())
    with tracer.span("generate", request_id="r1") as span:
        assert not span.is_recording()
        assert inject_metadata([("x", "1")]) == [("x", "1")]


def test_manual_metadata_and_carrier_propagation(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    scheduler, decode = ComponentTracer("scheduler", provider), ComponentTracer("decode", provider)
    with scheduler.span("generate", request_id="req-7"):
        metadata = inject_metadata([("authorization", "Bearer t")])
    assert any(k == "traceparent" for k, _ in metadata)
    with decode.span("decode", parent=extract_metadata(metadata), request_id="req-7"):
        carrier = inject_carrier()
    with decode.span("kv_transfer", parent=extract_carrier(carrier), attributes={"pdserve.rank": 1}):
        pass
    spans = by_name(exporter.get_finished_spans())
    gen, dec, xfer = spans["generate"], spans["decode"], spans["kv_transfer"]
    assert dec.parent is not None and dec.parent.span_id == gen.context.span_id
    assert xfer.parent is not None and xfer.parent.span_id == dec.context.span_id
    assert {s.context.trace_id for s in spans.values()} == {gen.context.trace_id}
    assert dec.attributes is not None and dec.attributes[COMPONENT_ATTRIBUTE] == "decode"
    assert dec.attributes[REQUEST_ID_ATTRIBUTE] == "req-7"
    assert extract_carrier(None) is not None


class _Prefill(engine_pb2_grpc.EngineServicer):
    def __init__(self, tracer: ComponentTracer) -> None:
        self.tracer = tracer

    async def Prefill(self, request: engine_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> engine_pb2.PrefillResponse:
        with self.tracer.span("prefill", request_id=request.request_id):
            return engine_pb2.PrefillResponse(request_id=request.request_id, first_token_id=1)


async def test_context_crosses_a_real_grpc_call(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    server = ServiceServer(["pdserve.v1.Engine"], interceptors=server_interceptors(provider))
    engine_pb2_grpc.add_EngineServicer_to_server(_Prefill(ComponentTracer("prefill", provider)), server.server)
    port = server.bind("127.0.0.1", 0)
    await server.start()
    await server.set_serving(True)
    scheduler = ComponentTracer("scheduler", provider)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             interceptors=client_interceptors(provider)) as channel:
            with scheduler.span("generate", request_id="req-1"):
                reply = await engine_pb2_grpc.EngineStub(channel).Prefill(
                    engine_pb2.PrefillRequest(request_id="req-1", prompt_token_ids=[1, 2]))
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    finally:
        await server.stop(None)
    assert reply.first_token_id == 1 and health.status == health_pb2.HealthCheckResponse.SERVING

    spans = exporter.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 1, "health checks must not be traced"
    named = by_name(spans)
    rpc_spans = [s for s in spans if s.name == "/pdserve.v1.Engine/Prefill"]
    client = next(s for s in rpc_spans if s.kind is trace.SpanKind.CLIENT)
    server_span = next(s for s in rpc_spans if s.kind is trace.SpanKind.SERVER)
    assert client.parent is not None and client.parent.span_id == named["generate"].context.span_id
    assert server_span.parent is not None and server_span.parent.span_id == client.context.span_id
    prefill = named["prefill"]
    assert prefill.parent is not None and prefill.parent.span_id == server_span.context.span_id
    assert prefill.attributes is not None and prefill.attributes[REQUEST_ID_ATTRIBUTE] == "req-1"
