"""Tracing helpers: the no-op path when off, the step-plan carrier, and a process's own provider
(set up from OTEL_* once, flushed by shutdown_tracing) checked in a fresh interpreter."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from connectors.ucx.handshake import KVTransferDescriptor
from connectors.ucx.scheduler import UcxSchedulerConnector
from services.common.tracing import (
    REQUEST_ID_ATTRIBUTE,
    ComponentTracer,
    extract_carrier,
    trace_carrier,
    tracing_active,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_without_a_provider_spans_cost_nothing_and_carry_nothing() -> None:
    assert not tracing_active()
    tracer = ComponentTracer("decode")
    before = trace.get_current_span()
    with tracer.span("decode", request_id="r") as span:
        assert span is trace.INVALID_SPAN
        assert trace.get_current_span() is before  # nothing attached
        assert trace_carrier() is None
    assert tracer.start("kv_transfer", request_id="r") is None
    assert tracer.tracer() is None


def test_the_pull_command_carries_the_decode_span_to_a_rank() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    decode, rank = ComponentTracer("decode", provider), ComponentTracer("decode", provider)
    connector = UcxSchedulerConnector(block_size=16)
    descriptor = KVTransferDescriptor("prefill-0", 7, "r1", (3, 4), 20, 1, 16, 3, 0)
    with decode.span("decode", request_id="r1"):
        carrier = trace_carrier()
        assert carrier is not None and "traceparent" in carrier
        connector.queue_pull("r1", descriptor, [5, 6], carrier)
    connector.queue_pull("r2", descriptor, [7])  # untraced: no carrier
    meta = pickle.loads(pickle.dumps(connector.build_connector_meta(None)))  # as ranks 1.. receive it
    traced, untraced = meta.pulls
    assert untraced.trace_carrier is None
    span = rank.start("kv_transfer", request_id="r1", parent=extract_carrier(traced.trace_carrier),
                      attributes={"pdserve.rank": 1})
    assert span is not None
    span.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["kv_transfer"].parent is not None
    assert spans["kv_transfer"].parent.span_id == spans["decode"].context.span_id
    assert spans["kv_transfer"].context.trace_id == spans["decode"].context.trace_id
    assert spans["kv_transfer"].attributes is not None
    assert spans["kv_transfer"].attributes[REQUEST_ID_ATTRIBUTE] == "r1"


_RANK_PROCESS = textwrap.dedent("""
    import json
    from services.common import tracing

    first = tracing.process_tracer("decode", {"pdserve.engine_id": "decode-0", "pdserve.rank": 1})
    again = tracing.setup_tracing("scheduler")   # second global set-up: the first provider stays
    assert first is not None and tracing.tracing_active()
    span = first.start("kv_transfer", request_id="r9", attributes={"pdserve.kv.bytes": 4096})
    span.end()
    print("SHUTDOWN", flush=True)
    tracing.shutdown_tracing()                  # flushes the batch (its delay is 10 min)
    tracing.shutdown_tracing()                  # idempotent
    print(json.dumps({"active": tracing.tracing_active(),
                      "service": again.resource.attributes["service.name"]}), flush=True)
""")


def test_a_process_sets_itself_up_once_from_the_environment_and_flushes_on_shutdown() -> None:
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "600000",
           "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", _RANK_PROCESS], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    before, _, after = proc.stdout.partition("SHUTDOWN\n")
    assert "kv_transfer" not in before, "the span was exported before shutdown: batching is not in use"
    exported_text, _, summary_line = after.strip().rpartition("\n")
    exported = json.loads(exported_text)
    assert exported["name"] == "kv_transfer"
    assert exported["attributes"] == {"pdserve.component": "decode", "pdserve.request_id": "r9",
                                      "pdserve.kv.bytes": 4096}
    resource = exported["resource"]["attributes"]
    assert resource["service.name"] == "pdserve-decode" and resource["pdserve.rank"] == 1
    assert json.loads(summary_line) == {"active": False, "service": "pdserve-decode"}


def test_tracing_off_in_a_process_without_otel_variables() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = ("from services.common import tracing\n"
            "assert tracing.process_tracer('decode') is None and not tracing.tracing_active()\n"
            "assert tracing.server_interceptors() == [] and tracing.client_interceptors() == []\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
