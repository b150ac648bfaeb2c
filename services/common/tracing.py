"""OpenTelemetry tracing: off by default, switched on by the standard `OTEL_*` variables.

Tracing is enabled in a process when `setup_tracing(component)` finds, in the environment,
`OTEL_TRACES_EXPORTER` set to `otlp` or `console`, or an OTLP endpoint
(`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), and
`OTEL_SDK_DISABLED` is not true. The OTLP protocol follows `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`
/ `OTEL_EXPORTER_OTLP_PROTOCOL` (`grpc`, the default, or `http/protobuf`); sampler, resource
attributes and service name (`OTEL_TRACES_SAMPLER`, `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_SERVICE_NAME`, default `pdserve-<component>`) are read by the SDK. These are the only
environment variables this module reads. When tracing is off every helper is a cheap no-op.

Spans (names are the contract the dashboards and the trace test rely on): `generate` and
`route` on the scheduler, `prefill` on the prefill engine, `kv_transfer` on each decode rank,
`decode` on the decode engine. Every span carries `pdserve.component` and, when given,
`pdserve.request_id` (an attribute, never a metric label).

Context crosses processes as W3C trace context: in gRPC metadata through
`client_interceptors()` / `server_interceptors()` (the opentelemetry grpc instrumentation,
limited to the Generation and Engine services so health checks and the long-lived control and
event streams make no spans), or by hand with `inject_metadata` / `extract_metadata`; to a
rank process inside step metadata with `inject_carrier` / `extract_carrier`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

logger = logging.getLogger(__name__)

COMPONENT_ATTRIBUTE = "pdserve.component"
REQUEST_ID_ATTRIBUTE = "pdserve.request_id"
TRACED_SERVICES = ("pdserve.v1.Generation", "pdserve.v1.Engine")
_TRUE = ("1", "true", "yes", "on")

_provider: TracerProvider | None = None


def tracing_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the OTEL_* environment asks for traces (see the module docstring)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").lower() in _TRUE:
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _exporter_from_env(env: Mapping[str, str]) -> SpanExporter:
    kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind == "console":
        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER: pdserve supports otlp, console or none, got {kind!r}")
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: expected grpc or http/protobuf, got {protocol!r}")
    return OTLPSpanExporter()


def setup_tracing(component: str, *, exporter: SpanExporter | None = None,
                  env: Mapping[str, str] | None = None, set_global: bool = True) -> TracerProvider | None:
    """Creates this process's tracer provider, or returns None when tracing is off.

    `exporter` (tests: the SDK's InMemorySpanExporter) forces tracing on and is wired with a
    synchronous processor; otherwise the exporter comes from the environment behind a batch
    processor. With `set_global` the provider becomes OpenTelemetry's global one (once per
    process) and the default of every helper here.
    """
    global _provider
    env = os.environ if env is None else env
    if exporter is None and not tracing_enabled(env):
        return None
    from services.common.version import __version__

    attributes: dict[str, Any] = {"service.version": __version__, COMPONENT_ATTRIBUTE: component}
    if not env.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = f"pdserve-{component}"
    provider = TracerProvider(resource=Resource.create(attributes))
    if exporter is not None:
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(_exporter_from_env(env)))
    if set_global:
        trace.set_tracer_provider(provider)
        _provider = provider
    logger.info("tracing: on for %s", component)
    return provider


class ComponentTracer:
    """Starts spans of one component, tagged with `pdserve.component` and the request id."""

    def __init__(self, component: str, provider: trace.TracerProvider | None = None) -> None:
        self.component = component
        self._tracer = (provider or _provider or trace.get_tracer_provider()).get_tracer("pdserve")

    @contextmanager
    def span(self, name: str, *, request_id: str | None = None, parent: Context | None = None,
             kind: trace.SpanKind = trace.SpanKind.INTERNAL,
             attributes: Mapping[str, str | int | float | bool] | None = None) -> Iterator[trace.Span]:
        """A span around the `with` body, current inside it; child of `parent` or of the current span.

        An exception leaving the body is recorded on the span and re-raised.
        """
        attrs: dict[str, str | int | float | bool] = {COMPONENT_ATTRIBUTE: self.component, **(attributes or {})}
        if request_id is not None:
            attrs[REQUEST_ID_ATTRIBUTE] = request_id
        with self._tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attrs) as span:
            yield span


def inject_metadata(metadata: Iterable[tuple[str, str]] = (), context: Context | None = None
                    ) -> list[tuple[str, str]]:
    """`metadata` plus the W3C trace context (`traceparent`, ...) of `context` or the current one."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return [*metadata, *carrier.items()]


def extract_metadata(metadata: Iterable[Any] | None) -> Context:
    """The trace context carried in gRPC metadata (e.g. `context.invocation_metadata()`)."""
    carrier: dict[str, str] = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        if isinstance(value, str):
            carrier[key.lower()] = value
    return propagate.extract(carrier)


def inject_carrier(context: Context | None = None) -> dict[str, str]:
    """The current (or given) trace context as a plain dict, to ship to a rank process."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def extract_carrier(carrier: Mapping[str, str] | None) -> Context:
    """The trace context from `inject_carrier`'s dict (an empty context when None)."""
    return propagate.extract(dict(carrier or {}))


def current_context() -> Context:
    return otel_context.get_current()


def _traced(details: Any) -> bool:
    method = getattr(details, "method", "")
    if isinstance(method, bytes):
        method = method.decode()
    service = method.lstrip("/").split("/", 1)[0]
    return service in TRACED_SERVICES


def server_interceptors(provider: trace.TracerProvider | None = None) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for `ServiceServer(interceptors=...)`; empty when tracing is off.

    A traced RPC gets a SERVER span, child of the caller's context from the metadata, current
    while the handler runs (so `ComponentTracer.span` nests under it).
    """
    provider = provider or _provider
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=provider, filter_=_traced)]


def client_interceptors(provider: trace.TracerProvider | None = None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for `grpc.aio.*_channel(..., interceptors=...)`; empty when tracing is off.

    A traced call gets a CLIENT span and carries its W3C context in the metadata.
    """
    provider = provider or _provider
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(tracer_provider=provider, filter_=_traced))
