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
rank process inside step metadata with `inject_carrier` / `extract_carrier` (or `trace_carrier`,
None when there is nothing to carry).

Processes: the scheduler and each engine's rank 0 call `setup_tracing` at start; batched spans
are flushed at exit, after the SIGTERM drain (`shutdown_tracing` in the engines, the SDK's exit
hook in the scheduler). A spawned rank process (tp > 1) sets itself up from the inherited
environment with `process_tracer` and flushes when its RankAgent shuts down.
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
                  env: Mapping[str, str] | None = None, set_global: bool = True,
                  attributes: Mapping[str, str | int] | None = None) -> TracerProvider | None:
    """Creates this process's tracer provider, or returns None when tracing is off.

    `exporter` (tests: the SDK's InMemorySpanExporter) forces tracing on and is wired with a
    synchronous processor; otherwise the exporter comes from the environment behind a batch
    processor (`OTEL_BSP_*` tune it). `attributes` are added to the resource (e.g.
    `pdserve.engine_id`, `pdserve.rank`). With `set_global` the provider becomes OpenTelemetry's
    global one and the default of every helper here; a second global call in the same process
    returns the first provider unchanged.
    """
    global _provider
    if set_global and _provider is not None:
        return _provider
    env = os.environ if env is None else env
    if exporter is None and not tracing_enabled(env):
        return None
    from services.common.version import __version__

    resource: dict[str, Any] = {"service.version": __version__, COMPONENT_ATTRIBUTE: component,
                                **(attributes or {})}
    if not env.get("OTEL_SERVICE_NAME"):
        resource["service.name"] = f"pdserve-{component}"
    provider = TracerProvider(resource=Resource.create(resource))
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


def tracing_active() -> bool:
    """Whether `setup_tracing` installed a provider in this process."""
    return _provider is not None


def flush_tracing(timeout_s: float = 5.0) -> bool:
    """Exports the spans this process has batched so far (True when done in time, or off)."""
    return _provider.force_flush(int(timeout_s * 1000)) if _provider is not None else True


def shutdown_tracing() -> None:
    """Flushes and closes this process's provider (idempotent; a no-op when tracing is off).

    Call it when a process ends (the services do, after their SIGTERM drain); the SDK's own exit
    hook is a second line of defence.
    """
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown()


def process_tracer(component: str, attributes: Mapping[str, str | int] | None = None) -> ComponentTracer | None:
    """This process's tracer for `component`, or None when tracing is off.

    Sets tracing up from the environment when no provider exists yet: a spawned rank process
    inherits its engine's `OTEL_*` variables. Rank 0 shares the engine process's provider.
    """
    if _provider is None and setup_tracing(component, attributes=attributes) is None:
        return None
    return ComponentTracer(component)


Attributes = Mapping[str, str | int | float | bool]


class ComponentTracer:
    """Starts spans of one component, tagged with `pdserve.component` and the request id.

    Without a provider (tracing off: no `provider` given, no `setup_tracing`, no global SDK
    provider) a span costs one check and yields the invalid span; nothing is attached.
    """

    def __init__(self, component: str, provider: trace.TracerProvider | None = None) -> None:
        self.component = component
        self._explicit = provider
        self._tracer: trace.Tracer | None = None

    def tracer(self) -> trace.Tracer | None:
        """The underlying tracer, or None while tracing is off in this process."""
        if self._tracer is None:
            provider = self._explicit or _provider
            if provider is None:
                provider = trace.get_tracer_provider()
                if isinstance(provider, trace.ProxyTracerProvider):
                    return None
            self._tracer = provider.get_tracer("pdserve")
        return self._tracer

    def _attributes(self, request_id: str | None, attributes: Attributes | None) -> dict[str, str | int | float | bool]:
        attrs: dict[str, str | int | float | bool] = {COMPONENT_ATTRIBUTE: self.component, **(attributes or {})}
        if request_id is not None:
            attrs[REQUEST_ID_ATTRIBUTE] = request_id
        return attrs

    @contextmanager
    def span(self, name: str, *, request_id: str | None = None, parent: Context | None = None,
             kind: trace.SpanKind = trace.SpanKind.INTERNAL,
             attributes: Attributes | None = None) -> Iterator[trace.Span]:
        """A span around the `with` body, current inside it; child of `parent` or of the current span.

        An exception leaving the body is recorded on the span and re-raised.
        """
        tracer = self.tracer()
        if tracer is None:
            yield trace.INVALID_SPAN
            return
        with tracer.start_as_current_span(name, context=parent, kind=kind,
                                          attributes=self._attributes(request_id, attributes)) as span:
            yield span

    def start(self, name: str, *, request_id: str | None = None, parent: Context | None = None,
              attributes: Attributes | None = None) -> trace.Span | None:
        """A span that outlives a `with` block (e.g. begun in one thread, ended in another);
        the caller ends it with `span.end()`. Not made current. None when tracing is off."""
        tracer = self.tracer()
        if tracer is None:
            return None
        return tracer.start_span(name, context=parent, attributes=self._attributes(request_id, attributes))


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


def trace_carrier() -> dict[str, str] | None:
    """The current span's context as an `inject_carrier` dict, or None when no span is being
    recorded here (tracing off, or not sampled): the cheap way to fill an optional carrier."""
    if not trace.get_current_span().is_recording():
        return None
    return inject_carrier()


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
