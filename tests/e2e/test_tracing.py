"""OpenTelemetry tracing across processes: a real local cluster exports its spans over OTLP/gRPC
to a trace receiver run by this test, and one Generate request must come back as ONE trace
covering scheduler -> prefill -> decode -> every decode rank's KV transfer, correctly parented.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from e2e_cluster import PROMPT_TEXTS
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from services.client import Client
from services.local_cluster import ClusterSpec, LocalCluster

pytestmark = pytest.mark.timeout(300)

SERVER = trace_pb2.Span.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str
    resource: dict[str, Any]
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    status_code: int


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on 127.0.0.1:<free port> that keeps every span it gets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> TraceReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(None)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    got.append(ReceivedSpan(str(resource.get("service.name", "")), resource, s.name, s.kind,
                                            s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                            _attributes(s.attributes), s.status.code))
        with self._lock:
            self._spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0) -> list[ReceivedSpan]:
        """Polls until `done(spans)`; returns the spans either way (the asserts tell what is missing)."""
        deadline = time.monotonic() + timeout
        while not done(spans := self.spans()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return spans


def _otel_env(receiver: TraceReceiver, schedule_delay_ms: int) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": str(schedule_delay_ms),
            "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}


@pytest.fixture
def receiver() -> Iterator[TraceReceiver]:
    with TraceReceiver() as r:
        yield r


def _one(spans: list[ReceivedSpan], name: str, service: str, kind: int | None = None) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.service == service and (kind is None or s.kind == kind)]
    assert len(found) == 1, f"expected one {name!r} span from {service}, got {len(found)}: {found}"
    return found[0]


def _child_of(child: ReceivedSpan, parent: ReceivedSpan) -> None:
    assert child.trace_id == parent.trace_id, f"{child.name} is in another trace than {parent.name}"
    assert child.parent_span_id == parent.span_id, f"{child.name} ({child.service}) is not a child of " \
                                                   f"{parent.name} ({parent.service})"


def test_one_generate_is_one_trace_across_scheduler_prefill_decode_and_every_rank(
        tmp_path: Path, receiver: TraceReceiver, tiny_tp_model: Path) -> None:
    tp = 2  # the demo model's 3 KV heads do not split over 2 ranks; the tiny model's 2 do
    spec = ClusterSpec(model=str(tiny_tp_model), tp=tp, torch_threads=1, kv_cache_memory="16MiB",
                       log_dir=str(tmp_path), env=_otel_env(receiver, 100),
                       scheduler_args=["--path-policy", "remote"])  # the trace of the remote path
    with LocalCluster(spec) as cluster, Client(cluster.target) as client:
        result = client.generate(PROMPT_TEXTS[4], request_id="traced-1", max_tokens=4, temperature=0.0,
                                 ignore_eos=True, timeout=60)
        assert result.prefill_engine_id == "prefill-0" and result.transferred_tokens > 0

        def complete(spans: list[ReceivedSpan]) -> bool:
            names = [s.name for s in spans]
            return names.count("kv_transfer") >= tp and "generate" in names and "decode" in names
        spans = receiver.wait_for(complete)

    generate = _one(spans, "generate", "pdserve-scheduler")
    request_id = generate.attributes["pdserve.request_id"]
    assert request_id.startswith("traced-1.") and generate.attributes["pdserve.client_request_id"] == "traced-1"
    trace = [s for s in spans if s.trace_id == generate.trace_id]
    elsewhere = [s for s in spans if s.trace_id != generate.trace_id
                 and s.attributes.get("pdserve.request_id") in (request_id, "traced-1")]
    assert not elsewhere, f"spans of the request outside its trace: {elsewhere}"
    assert {s.service for s in trace} == {"pdserve-scheduler", "pdserve-prefill", "pdserve-decode"}

    # scheduler: Generate RPC -> generate -> route, and the engine calls' CLIENT spans
    rpc = _one(trace, "/pdserve.v1.Generation/Generate", "pdserve-scheduler", SERVER)
    assert rpc.parent_span_id == ""  # the test's client sends no trace context
    _child_of(generate, rpc)
    route = _one(trace, "route", "pdserve-scheduler")
    _child_of(route, generate)
    assert route.attributes["pdserve.route.prefill"] == "prefill-0"
    assert route.attributes["pdserve.route.decode"] == "decode-0"

    # prefill engine: CLIENT (scheduler) -> SERVER (prefill process) -> prefill
    prefill_call = _one(trace, "/pdserve.v1.Engine/Prefill", "pdserve-scheduler", CLIENT)
    _child_of(prefill_call, generate)
    prefill_rpc = _one(trace, "/pdserve.v1.Engine/Prefill", "pdserve-prefill", SERVER)
    _child_of(prefill_rpc, prefill_call)
    prefill = _one(trace, "prefill", "pdserve-prefill")
    _child_of(prefill, prefill_rpc)
    assert prefill.resource["pdserve.engine_id"] == "prefill-0"

    # decode engine: CLIENT (scheduler) -> SERVER (decode process) -> decode -> kv_transfer per rank
    decode_call = _one(trace, "/pdserve.v1.Engine/Decode", "pdserve-scheduler", CLIENT)
    _child_of(decode_call, generate)
    decode_rpc = _one(trace, "/pdserve.v1.Engine/Decode", "pdserve-decode", SERVER)
    _child_of(decode_rpc, decode_call)
    decode = _one(trace, "decode", "pdserve-decode")
    _child_of(decode, decode_rpc)
    assert decode.attributes["pdserve.remote_kv"] is True

    transfers = [s for s in trace if s.name == "kv_transfer"]
    assert sorted(s.attributes["pdserve.rank"] for s in transfers) == list(range(tp))
    assert sorted(s.resource["pdserve.rank"] for s in transfers) == list(range(tp)), \
        "each rank's span must come from that rank's own process"
    for xfer in transfers:
        _child_of(xfer, decode)
        assert xfer.service == "pdserve-decode" and xfer.resource["pdserve.engine_id"] == "decode-0"
        assert xfer.attributes["pdserve.peer.engine_id"] == "prefill-0"
        assert xfer.attributes["pdserve.peer.rank"] == xfer.attributes["pdserve.rank"]
        assert xfer.attributes["pdserve.kv.blocks"] >= 1 and xfer.attributes["pdserve.kv.bytes"] > 0
        assert xfer.status_code != trace_pb2.Status.STATUS_CODE_ERROR

    for s in (generate, route, prefill, decode, *transfers):
        assert s.attributes["pdserve.request_id"] == request_id, s.name
    assert {s.name for s in trace if s.attributes.get("pdserve.component")} >= {
        "generate", "route", "prefill", "decode", "kv_transfer"}


def test_a_stopped_process_flushes_its_batched_spans(tmp_path: Path, receiver: TraceReceiver) -> None:
    """Spans still in the batch queue (10 min delay) are exported by the SIGTERM drain's exit."""
    spec = ClusterSpec(num_prefill=0, num_decode=0, torch_threads=1, log_dir=str(tmp_path),
                       env=_otel_env(receiver, 600_000))
    cluster = LocalCluster(spec)
    try:
        cluster.start(timeout=120)
        with Client(cluster.target) as client, pytest.raises(grpc.RpcError, match="UNAVAILABLE") as refused:
            client.generate("no engine is up", request_id="flushed-1", max_tokens=2, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not [s for s in receiver.spans() if s.name == "generate"], "exported before the delay"
    finally:
        cluster.stop()
    assert cluster.components["scheduler"].proc is not None and cluster.components["scheduler"].proc.returncode == 0
    generate = _one(receiver.wait_for(lambda spans: any(s.name == "generate" for s in spans), timeout=5),
                    "generate", "pdserve-scheduler")
    assert generate.attributes["pdserve.request_id"] == "flushed-1"
    assert generate.status_code == trace_pb2.Status.STATUS_CODE_ERROR
