"""The pdserve metric catalogue: every Prometheus metric, defined once, and small wrappers.

Naming: `pdserve_<component>_<thing>_<unit>` (counters end in `_total`); `pdserve_kv_*` for
KV reuse across engines, which spans scheduler and engines (decision 0043). Labels are
low-cardinality only: engine ids, roles, media, reasons, policies, outcomes and
prefill→decode pairs (`src_engine`, `dst_engine`) — never a request id or prompt text.

Process model (the choice, and why): every process owns its own `CollectorRegistry` and its
own `/metrics` port. A component's rank r serves on `metrics_port + r`
(`metrics_port_for_rank`), so a tp-2 engine pod exposes two ports and the chart's
PodMonitor scrapes each. Prometheus' multiprocess mode was rejected: it must be switched on by
an environment variable before `prometheus_client` is imported, it cannot run scrape-time
collectors (our gauges read live state), and it would make in-process tests that host a
scheduler and several engines share files on disk. Per-process registries also let one test
process host many components without duplicate-registration errors.

Usage: a component builds `registry = CollectorRegistry()`, the metric groups it needs
(`SchedulerMetrics(registry)`, `EngineMetrics(registry, engine_id, role)`,
`TransferMetrics(registry)`, `EventMetrics(registry)`), registers scrape-time readers of its
own state (`track_load`, `track_aggregator`, ...), and calls
`start_metrics_server(port, registry)`. Code under test may pass `CollectorRegistry()` and
read values back with `registry.get_sample_value(...)`.

Scrape-time readers run on the HTTP server's thread: the state they read must be safe to
read from another thread (a snapshot, or plain ints and dicts read under the GIL). A reader
that raises is logged and skipped; it never breaks the scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.bound_ports import PortInUse

logger = logging.getLogger(__name__)

# `_created` series double every counter's series count and no dashboard uses them.
prometheus_client.disable_created_metrics()


class Kind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


# Buckets span a CPU build (a 135M model, seconds per prompt) and a GPU build (milliseconds).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25,
                         0.5, 1.0, 2.5, 5.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0)
ERROR_RATIO_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 10.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0)
STEP_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(15))  # 1 .. 16384 tokens


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One catalogue entry. Counter names include `_total`; `series()` lists exported samples."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def series(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this metric."""
        if self.kind is Kind.HISTOGRAM:
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


_C, _G, _H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM
_ER = ("engine", "role")
_PAIR = ("src_engine", "dst_engine")

_SPECS = (
    # --- scheduler: request path ---
    MetricSpec("pdserve_scheduler_requests_total", _C,
               "Finished client requests by outcome (success, cancelled, deadline, rejected, error)",
               ("outcome",)),
    MetricSpec("pdserve_scheduler_requests_in_flight", _G, "Client requests accepted and not finished"),
    MetricSpec("pdserve_scheduler_time_to_first_token_seconds", _H,
               "Time from Generate arrival to the first token sent; path is disaggregated or decode_only",
               ("path",), LATENCY_BUCKETS),
    MetricSpec("pdserve_scheduler_inter_token_latency_seconds", _H,
               "Time between consecutive tokens streamed to a client", (), TOKEN_LATENCY_BUCKETS),
    MetricSpec("pdserve_scheduler_e2e_request_latency_seconds", _H,
               "Time from Generate arrival to the final message, by path", ("path",), LATENCY_BUCKETS),
    MetricSpec("pdserve_scheduler_queue_time_seconds", _H,
               "Time from Generate arrival until the request is dispatched to an engine", (), QUEUE_BUCKETS),
    MetricSpec("pdserve_scheduler_prompt_tokens_total", _C, "Prompt tokens of accepted requests"),
    MetricSpec("pdserve_scheduler_generation_tokens_total", _C, "Tokens streamed to clients"),
    MetricSpec("pdserve_scheduler_prefix_hit_tokens_total", _C,
               "Prompt tokens found cached at routing time, by medium of the chosen engine's hit",
               ("medium",)),
    MetricSpec("pdserve_scheduler_routing_decisions_total", _C,
               "Engine choices by role, engine, policy and reason", ("role", "engine", "policy", "reason")),
    MetricSpec("pdserve_scheduler_path_decisions_total", _C,
               "Path decisions: remote (prefill engine + KV transfer) or decode_local (prefill on the decode "
               "engine), by path and reason (e.g. decode_local:short_prompt, remote:long_prompt)", ("path", "reason")),
    MetricSpec("pdserve_scheduler_path_ttft_prediction_error_ratio", _H,
               "Path decisions' relative TTFT prediction error, |predicted - actual| / actual, by the path taken "
               "(remote or decode_local)", ("path",), ERROR_RATIO_BUCKETS),
    MetricSpec("pdserve_scheduler_transferred_tokens_total", _C,
               "Prompt tokens decode engines pulled from prefill engines (only the blocks they lacked)"),
    MetricSpec("pdserve_kv_peer_fetch_blocks_total", _C,
               "KV blocks engines pulled from a peer's cache instead of recomputing (decision 0043), by holder "
               "(source), puller (target) and transport", ("source", "target", "transport")),
    MetricSpec("pdserve_kv_peer_fetch_bytes_total", _C,
               "Bytes of the KV blocks pulled from a peer's cache (blocks x the KV bytes of a block)",
               ("source", "target", "transport")),
    MetricSpec("pdserve_kv_peer_fetch_failures_total", _C,
               "Peer fetches that failed and were recomputed, by holder, puller, transport and reason "
               "(pin_failed: the holder did not pin; transfer_failed: the pull failed; pull_failed: a prefill "
               "engine's pull did not complete; evicted: the pulled blocks left the prefill engine's cache before "
               "its prefill)",
               ("source", "target", "transport", "reason")),
    MetricSpec("pdserve_kv_peer_fetch_duration_seconds", _H,
               "Peer fetches from dispatch to the blocks' arrival (the holder's pin and the pull)",
               ("source", "target", "transport"), LATENCY_BUCKETS),
    MetricSpec("pdserve_kv_prompt_tokens_by_tier_total", _C,
               "Prompt tokens by where their KV came from: own (the computing engine's prefix cache), peer "
               "(pulled from another engine's cache), recomputed", ("tier",)),
    MetricSpec("pdserve_scheduler_decode_only_total", _C,
               "Requests served without a prefill engine, by reason "
               "(short_prompt, no_prefill_engine, prefill_failed)", ("reason",)),
    MetricSpec("pdserve_scheduler_migrations_total", _C,
               "Requests moved to another decode engine mid-stream, by reason", ("reason",)),
    MetricSpec("pdserve_scheduler_retries_total", _C, "Engine calls retried, by role and reason",
               ("role", "reason")),
    MetricSpec("pdserve_scheduler_lease_outcomes_total", _C,
               "How prefill KV holds ended: released, aborted or expired (later ones are no-ops: duplicate)",
               ("outcome",)),
    # --- scheduler: aggregation and registry (read at scrape time) ---
    MetricSpec("pdserve_scheduler_aggregator_pending_reports", _G,
               "Per-rank reports waiting for the rest of their engine's ranks", ("engine",)),
    MetricSpec("pdserve_scheduler_aggregator_oldest_pending_age_seconds", _G,
               "Age of the oldest incomplete per-rank report (0 when none is pending)", ("engine",)),
    MetricSpec("pdserve_scheduler_rank_reports_total", _C,
               "StepReports applied, by kind: rank (one rank's own events) or merged (carrying other ranks' "
               "events too, StepReport.merged_event_ranks): which reporting protocol the engines speak",
               ("kind",)),
    MetricSpec("pdserve_scheduler_registered_engines", _G, "Engines known to the scheduler, by role and state",
               ("role", "state")),
    MetricSpec("pdserve_scheduler_registered_ranks", _G, "Ranks known to the scheduler, by role and state",
               ("role", "state")),
    # --- engine roles and the role planner (scheduler; docs/decisions/0044) ---
    MetricSpec("pdserve_engine_role", _G, "1 for the role each engine serves now, 0 for the others",
               ("engine_id", "role")),
    MetricSpec("pdserve_planner_desired_engines", _G,
               "Engines per role the role planner predicts best (HPA/KEDA scale on it)", ("role",)),
    MetricSpec("pdserve_planner_predicted_goodput_rps", _G,
               "Predicted goodput (requests/s at 90 % SLO attainment) of the current and desired split",
               ("split",)),
    MetricSpec("pdserve_planner_observed_goodput_rps", _G,
               "Requests/s that met both SLOs over the planner's window", ()),
    MetricSpec("pdserve_scheduler_index_converged", _G,
               "1 once this replica's prefix index holds every engine's blocks (a replica that (re)started "
               "while engines ran: after a peer's snapshot; see scheduler replicas), 0 while converging"),
    MetricSpec("pdserve_scheduler_control_reconnects_total", _C,
               "Control streams re-opened by a rank of an already registered engine", ("engine",)),
    MetricSpec("pdserve_scheduler_registrations_refused_total", _C,
               "Hello messages refused, by reason (compat_hash, stale_epoch, malformed, ...)", ("reason",)),
    MetricSpec("pdserve_scheduler_client_refused_total", _C,
               "Client API / KV-event calls refused by auth or limits, by reason (missing_token, bad_token, "
               "scope, rate, streams)", ("reason",)),
    MetricSpec("pdserve_scheduler_client_streams", _G, "Open Generate and Subscribe streams counted by the limits"),
    MetricSpec("pdserve_scheduler_http_requests_total", _C,
               "OpenAI-compatible HTTP API requests answered, by endpoint and HTTP status code",
               ("endpoint", "code")),
    # --- scheduler: KV event plane ---
    MetricSpec("pdserve_events_received_total", _C, "KV events received from engines, by type and medium",
               ("engine", "type", "medium")),
    MetricSpec("pdserve_events_published_total", _C, "KV events republished to subscribers, by type and medium",
               ("type", "medium")),
    MetricSpec("pdserve_events_rejected_total", _C,
               "KV events dropped (stale_epoch, unknown_engine, duplicate)", ("reason",)),
    MetricSpec("pdserve_events_subscribers", _G, "Connected event subscribers, by transport (grpc, zmq)",
               ("transport",)),
    MetricSpec("pdserve_events_subscriber_lag_batches", _G,
               "Largest number of batches a subscriber is behind, by transport", ("transport",)),
    MetricSpec("pdserve_events_subscriber_resyncs_total", _C,
               "Subscribers that fell out of the replay ring and got a snapshot", ("transport",)),
    MetricSpec("pdserve_events_index_blocks", _G, "Blocks in the scheduler's prefix index, by medium",
               ("medium",)),
    # --- engines (labels engine, role) ---
    MetricSpec("pdserve_engine_info", _G, "Always 1; labels carry the engine's static facts",
               ("engine", "role", "tp_size", "version")),
    MetricSpec("pdserve_engine_running_requests", _G, "Requests in the running batch", _ER),
    MetricSpec("pdserve_engine_waiting_requests", _G, "Requests waiting (incl. waiting for remote KV)", _ER),
    MetricSpec("pdserve_engine_pinned_requests", _G, "Finished prefills holding KV until pulled", _ER),
    MetricSpec("pdserve_engine_kv_cache_usage_ratio", _G, "Fraction of KV blocks in use (0..1)", _ER),
    MetricSpec("pdserve_engine_kv_cache_free_blocks", _G, "KV blocks free or evictable", _ER),
    MetricSpec("pdserve_engine_prefix_cache_queries_tokens_total", _C,
               "Prompt tokens looked up in the local prefix cache", _ER),
    MetricSpec("pdserve_engine_prefix_cache_hits_tokens_total", _C,
               "Prompt tokens found in the local prefix cache", _ER),
    MetricSpec("pdserve_engine_preemptions_total", _C, "Requests preempted (recompute) for lack of blocks", _ER),
    MetricSpec("pdserve_engine_step_duration_seconds", _H, "Wall time of one engine step", _ER, STEP_BUCKETS),
    MetricSpec("pdserve_engine_step_tokens", _H, "Tokens computed in one engine step", _ER, STEP_TOKEN_BUCKETS),
    MetricSpec("pdserve_engine_prompt_tokens_total", _C, "Prompt tokens computed (cache hits excluded)", _ER),
    MetricSpec("pdserve_engine_generation_tokens_total", _C, "Tokens sampled", _ER),
    MetricSpec("pdserve_engine_finished_requests_total", _C, "Requests finished, by finish reason",
               (*_ER, "finish_reason")),
    MetricSpec("pdserve_engine_kv_events_total", _C, "KV events emitted by this engine, by type and medium",
               (*_ER, "type", "medium")),
    MetricSpec("pdserve_engine_control_reconnects_total", _C,
               "Control streams this engine's ranks re-opened to the scheduler", _ER),
    MetricSpec("pdserve_engine_kv_bytes_registered", _G,
               "KV bytes this rank registered with the data plane (vLLM engines: vLLM's own KV, in place)",
               (*_ER, "rank")),
    MetricSpec("pdserve_engine_kv_mirror_bytes", _G,
               "Bytes of the host staging pool the data plane moves KV through instead (--kv-staging host, "
               "--kv-staging-blocks; 0 in place)",
               (*_ER, "rank")),
    # --- KV transfer, per prefill→decode pair ---
    MetricSpec("pdserve_transfer_operations_total", _C,
               "KV pulls started by a decode rank (one per rank per request)", _PAIR),
    MetricSpec("pdserve_transfer_bytes_total", _C, "KV bytes received by decode ranks, by the UCX transport "
               "that carried them (sysv, cma, tcp, rc_mlx5, cuda_ipc...; unknown where UCX could not say)",
               (*_PAIR, "transport")),
    MetricSpec("pdserve_transfer_transport_fallbacks_total", _C, "KV pulls over a slower UCX transport than "
               "--expected-transports allows, by expected and actual transport", (*_PAIR, "expected", "actual")),
    MetricSpec("pdserve_transfer_blocks_total", _C, "KV blocks received by decode ranks", _PAIR),
    MetricSpec("pdserve_transfer_duration_seconds", _H, "Duration of one successful rank's KV pull",
               _PAIR, TRANSFER_BUCKETS),
    MetricSpec("pdserve_transfer_failures_total", _C, "Failed KV pulls, by reason (timeout, peer_gone, "
               "stale_epoch, ucx_error, invalid_blocks, cancelled)", (*_PAIR, "reason")),
    MetricSpec("pdserve_transfer_inflight_operations", _G, "KV pulls in progress on this decode engine",
               ("engine",)),
    MetricSpec("pdserve_transfer_lease_expiries_total", _C,
               "Prefill KV holds freed because no reader finished within the lease", ("engine",)),
)

CATALOGUE: dict[str, MetricSpec] = {s.name: s for s in _SPECS}


def exported_series() -> frozenset[str]:
    """Every sample name the catalogue can export (dashboards and alerts may use only these)."""
    return frozenset(name for spec in _SPECS for name in spec.series())


def metrics_port_for_rank(base_port: int, rank: int) -> int | None:
    """The /metrics port of rank `rank` (base + rank); None when metrics are off (base 0)."""
    if base_port == 0:
        return None
    if not 0 < base_port + rank < 65536 or rank < 0:
        raise ValueError(f"metrics port {base_port} + rank {rank} is not a TCP port")
    return base_port + rank


def _build(spec: MetricSpec, registry: CollectorRegistry) -> Any:
    if spec.kind is Kind.COUNTER:
        return Counter(spec.name, spec.help, spec.labels, registry=registry)
    if spec.kind is Kind.GAUGE:
        return Gauge(spec.name, spec.help, spec.labels, registry=registry)
    return Histogram(spec.name, spec.help, spec.labels, registry=registry, buckets=spec.buckets or ())


class _Group:
    """Builds this group's push-style metrics (those not read by a collector) in `registry`."""

    _names: tuple[str, ...] = ()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._m = {name: _build(CATALOGUE[name], registry) for name in self._names}

    def _track(self, collector: Collector) -> None:
        self.registry.register(collector)


# ---------------------------------------------------------------- scrape-time collectors


class _CallbackCollector(Collector):
    """Emits gauge families computed by `read()` at scrape time; a failing read emits nothing."""

    def __init__(self, what: str, read: Callable[[], Iterable[GaugeMetricFamily]], names: Iterable[str]) -> None:
        self._what = what
        self._read = read
        self._names = tuple(names)

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(n, CATALOGUE[n].help, labels=CATALOGUE[n].labels) for n in self._names]

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(self._read())
        except Exception:  # a scrape must never fail because one reader did
            logger.warning("metrics: reading %s failed; skipped this scrape", self._what, exc_info=True)
            return
        yield from families


def _family(name: str) -> GaugeMetricFamily:
    spec = CATALOGUE[name]
    return GaugeMetricFamily(name, spec.help, labels=spec.labels)


class PendingReportsSource(Protocol):
    """What the scheduler's aggregator offers to metrics: per-engine counts and ages.

    Either a plain number (reported with engine="all") or a mapping engine id -> value.
    `oldest_pending_age()` is in seconds; None or an empty mapping means nothing is pending.
    """

    def pending_reports(self) -> int | Mapping[str, int]: ...

    def oldest_pending_age(self) -> float | None | Mapping[str, float]: ...


def _per_engine(value: float | None | Mapping[str, float]) -> Mapping[str, float]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return value
    return {"all": float(value)}


@dataclass(frozen=True, slots=True)
class RegisteredCount:
    """Engines and ranks in one (role, state) of the scheduler's registry."""

    role: str
    state: str
    num_engines: int
    num_ranks: int


@dataclass(frozen=True, slots=True)
class SubscriberLag:
    """One connected event subscriber: its transport (grpc or zmq) and batches behind."""

    transport: str
    lag_batches: int


class EngineLoadLike(Protocol):
    """The fields of `LLMEngine.load()` that metrics read."""

    num_running: int
    num_waiting: int
    num_pinned: int
    kv_usage: float
    num_free_blocks: int


# ---------------------------------------------------------------- metric groups


class SchedulerMetrics(_Group):
    """The scheduler's request path, routing, aggregation and registry metrics."""

    _names = ("pdserve_scheduler_requests_total", "pdserve_scheduler_requests_in_flight",
              "pdserve_scheduler_time_to_first_token_seconds", "pdserve_scheduler_inter_token_latency_seconds",
              "pdserve_scheduler_e2e_request_latency_seconds", "pdserve_scheduler_queue_time_seconds",
              "pdserve_scheduler_prompt_tokens_total", "pdserve_scheduler_generation_tokens_total",
              "pdserve_scheduler_prefix_hit_tokens_total", "pdserve_scheduler_routing_decisions_total",
              "pdserve_scheduler_decode_only_total", "pdserve_scheduler_migrations_total",
              "pdserve_scheduler_path_decisions_total", "pdserve_scheduler_transferred_tokens_total",
              "pdserve_scheduler_path_ttft_prediction_error_ratio",
              "pdserve_kv_peer_fetch_blocks_total", "pdserve_kv_peer_fetch_bytes_total",
              "pdserve_kv_peer_fetch_failures_total", "pdserve_kv_peer_fetch_duration_seconds",
              "pdserve_kv_prompt_tokens_by_tier_total",
              "pdserve_scheduler_retries_total", "pdserve_scheduler_lease_outcomes_total",
              "pdserve_scheduler_control_reconnects_total", "pdserve_scheduler_registrations_refused_total",
              "pdserve_scheduler_client_refused_total", "pdserve_scheduler_client_streams",
              "pdserve_scheduler_http_requests_total", "pdserve_scheduler_rank_reports_total")

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self._children: dict[tuple[str, ...], Any] = {}

    def _labelled(self, name: str, *values: str) -> Any:
        """The child of labelled metric `name` for `values` (in the order of its labels), kept:
        `labels()` checks and stringifies its arguments and takes a lock on every call, and
        the request path counts several labelled metrics per request. Children are never
        removed from these metrics, so a kept one is the one `labels()` would return."""
        key = (name, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._m[name].labels(*values)
        return child

    def request_started(self, num_prompt_tokens: int) -> None:
        """A Generate call was accepted (validated and tokenized)."""
        self._m["pdserve_scheduler_requests_in_flight"].inc()
        self._m["pdserve_scheduler_prompt_tokens_total"].inc(num_prompt_tokens)

    def request_finished(self, outcome: str, e2e_seconds: float, path: str = "disaggregated") -> None:
        """A started request ended: outcome success|cancelled|deadline|error; path as in observe_ttft."""
        self._m["pdserve_scheduler_requests_in_flight"].dec()
        self._labelled("pdserve_scheduler_requests_total", outcome).inc()
        self._labelled("pdserve_scheduler_e2e_request_latency_seconds", path).observe(e2e_seconds)

    def request_rejected(self) -> None:
        """A Generate call was refused before it started (bad input, overload, auth)."""
        self._m["pdserve_scheduler_requests_total"].labels(outcome="rejected").inc()

    def observe_queue_time(self, seconds: float) -> None:
        self._m["pdserve_scheduler_queue_time_seconds"].observe(seconds)

    def observe_ttft(self, seconds: float, path: str = "disaggregated") -> None:
        """First token sent; path is `disaggregated` or `decode_only`."""
        self._labelled("pdserve_scheduler_time_to_first_token_seconds", path).observe(seconds)

    def observe_inter_token_latency(self, seconds: float, num_tokens: int = 1) -> None:
        """A message with `num_tokens` tokens went out `seconds` after the previous one."""
        self._m["pdserve_scheduler_inter_token_latency_seconds"].observe(seconds / max(num_tokens, 1))
        self._m["pdserve_scheduler_generation_tokens_total"].inc(num_tokens)

    def count_first_tokens(self, num_tokens: int) -> None:
        """Tokens sent in the first message (not an inter-token interval)."""
        self._m["pdserve_scheduler_generation_tokens_total"].inc(num_tokens)

    def count_prefix_hit(self, medium: str, num_tokens: int) -> None:
        self._m["pdserve_scheduler_prefix_hit_tokens_total"].labels(medium=medium).inc(num_tokens)

    def count_routing_decision(self, role: str, engine: str, policy: str, reason: str) -> None:
        """e.g. ("prefill", "prefill-0", "prefix", "longest_prefix") or ("decode", "decode-1", "load", "least_kv")."""
        self._labelled("pdserve_scheduler_routing_decisions_total", role, engine, policy, reason).inc()

    def count_path_decision(self, path: str, reason: str) -> None:
        """path decode_local | remote; reason the path policy's, e.g. "decode_local:short_prompt"."""
        self._labelled("pdserve_scheduler_path_decisions_total", path, reason).inc()

    def observe_path_ttft_error(self, path: str, ratio: float) -> None:
        """A path decision's |predicted - actual| / actual TTFT; path remote | decode_local."""
        self._labelled("pdserve_scheduler_path_ttft_prediction_error_ratio", path).observe(ratio)

    def count_transferred_tokens(self, num_tokens: int) -> None:
        self._m["pdserve_scheduler_transferred_tokens_total"].inc(num_tokens)

    def peer_fetched(self, source: str, target: str, transport: str, num_blocks: int, num_bytes: int,
                     seconds: float | None) -> None:
        """A peer fetch whose blocks arrived."""
        self._labelled("pdserve_kv_peer_fetch_blocks_total", source, target, transport).inc(num_blocks)
        self._labelled("pdserve_kv_peer_fetch_bytes_total", source, target, transport).inc(num_bytes)
        if seconds is not None:
            self._labelled("pdserve_kv_peer_fetch_duration_seconds", source, target, transport).observe(seconds)

    def peer_fetch_failed(self, source: str, target: str, transport: str, reason: str) -> None:
        self._labelled("pdserve_kv_peer_fetch_failures_total", source, target, transport, reason).inc()

    def count_prompt_tiers(self, own: int, peer: int, recomputed: int) -> None:
        """One request's prompt tokens by where their KV came from."""
        for tier, n in (("own", own), ("peer", peer), ("recomputed", recomputed)):
            if n > 0:
                self._labelled("pdserve_kv_prompt_tokens_by_tier_total", tier).inc(n)

    def count_decode_only(self, reason: str) -> None:
        self._labelled("pdserve_scheduler_decode_only_total", reason).inc()

    def count_migration(self, reason: str) -> None:
        self._m["pdserve_scheduler_migrations_total"].labels(reason=reason).inc()

    def count_retry(self, role: str, reason: str) -> None:
        self._m["pdserve_scheduler_retries_total"].labels(role=role, reason=reason).inc()

    def count_lease_outcome(self, outcome: str) -> None:
        """released | aborted | expired | duplicate (a later, no-op release)."""
        self._labelled("pdserve_scheduler_lease_outcomes_total", outcome).inc()

    def count_rank_reports(self, rank: int, merged: int) -> None:
        """StepReports applied (one message's): kind "merged" for the `merged` that carry other
        ranks' events, "rank" for the other `rank`. One update per kind and message."""
        if rank:
            self._labelled("pdserve_scheduler_rank_reports_total", "rank").inc(rank)
        if merged:
            self._labelled("pdserve_scheduler_rank_reports_total", "merged").inc(merged)

    def count_control_reconnect(self, engine: str) -> None:
        self._m["pdserve_scheduler_control_reconnects_total"].labels(engine=engine).inc()

    def count_registration_refused(self, reason: str) -> None:
        self._m["pdserve_scheduler_registrations_refused_total"].labels(reason=reason).inc()

    def count_client_refused(self, reason: str) -> None:
        """A client call refused by services.common.security.ServerGuard (auth or a limit)."""
        self._m["pdserve_scheduler_client_refused_total"].labels(reason=reason).inc()

    def count_http_request(self, endpoint: str, code: int) -> None:
        """An HTTP API request was answered; `endpoint` is a route path (a fixed set) or `other`."""
        self._m["pdserve_scheduler_http_requests_total"].labels(endpoint=endpoint, code=str(code)).inc()

    def set_client_streams(self, num_streams: int) -> None:
        self._m["pdserve_scheduler_client_streams"].set(num_streams)

    def track_aggregator(self, source: PendingReportsSource) -> None:
        """Reads `source.pending_reports()` / `oldest_pending_age()` at every scrape."""
        pending_name = "pdserve_scheduler_aggregator_pending_reports"
        age_name = "pdserve_scheduler_aggregator_oldest_pending_age_seconds"

        def read() -> Iterable[GaugeMetricFamily]:
            pending, age = _family(pending_name), _family(age_name)
            counts = _per_engine(source.pending_reports())
            ages = _per_engine(source.oldest_pending_age())
            for engine in sorted(set(counts) | set(ages)):
                pending.add_metric([engine], float(counts.get(engine, 0)))
                age.add_metric([engine], float(ages.get(engine, 0.0)))
            return (pending, age)

        self._track(_CallbackCollector("aggregator", read, (pending_name, age_name)))

    def track_registry(self, read_counts: Callable[[], Iterable[RegisteredCount]]) -> None:
        """Reads the engine registry's per (role, state) counts at every scrape."""
        engines_name, ranks_name = "pdserve_scheduler_registered_engines", "pdserve_scheduler_registered_ranks"

        def read() -> Iterable[GaugeMetricFamily]:
            engines, ranks = _family(engines_name), _family(ranks_name)
            for c in read_counts():
                engines.add_metric([c.role, c.state], float(c.num_engines))
                ranks.add_metric([c.role, c.state], float(c.num_ranks))
            return (engines, ranks)

        self._track(_CallbackCollector("registry", read, (engines_name, ranks_name)))

    def track_convergence(self, converged: Callable[[], bool]) -> None:
        """Reads whether the replica's prefix index has converged at every scrape."""
        name = "pdserve_scheduler_index_converged"

        def read() -> Iterable[GaugeMetricFamily]:
            family = _family(name)
            family.add_metric([], 1.0 if converged() else 0.0)
            return (family,)

        self._track(_CallbackCollector("convergence", read, (name,)))


@dataclass(frozen=True, slots=True)
class PlannerReading:
    """The role planner's last decision as metrics see it."""

    desired: Mapping[str, int]
    predicted_current_rps: float
    predicted_desired_rps: float
    observed_rps: float


class RoleMetrics(_Group):
    """Engine roles and the role planner's advice, read at scrape time."""

    def track(self, read_roles: Callable[[], Iterable[tuple[str, str]]],
              read_plan: Callable[[], PlannerReading | None], roles: Iterable[str]) -> None:
        """`read_roles`: (engine id, role) of every engine; `read_plan`: the planner's last
        decision (None: no planner, or none yet: its families are exported without samples);
        `roles`: every role an engine may serve."""
        names = ("pdserve_engine_role", "pdserve_planner_desired_engines", "pdserve_planner_predicted_goodput_rps",
                 "pdserve_planner_observed_goodput_rps")
        all_roles = tuple(roles)

        def read() -> Iterable[GaugeMetricFamily]:
            served, desired, predicted, observed = (_family(n) for n in names)
            for engine_id, role in read_roles():
                for r in all_roles:
                    served.add_metric([engine_id, r], 1.0 if r == role else 0.0)
            plan = read_plan()
            if plan is None:  # no planner (or no decision yet): its families, empty
                return (served, desired, predicted, observed)
            for r in all_roles:
                desired.add_metric([r], float(plan.desired.get(r, 0)))
            predicted.add_metric(["current"], plan.predicted_current_rps)
            predicted.add_metric(["desired"], plan.predicted_desired_rps)
            observed.add_metric([], plan.observed_rps)
            return (served, desired, predicted, observed)

        self._track(_CallbackCollector("roles", read, names))


class EventMetrics(_Group):
    """The scheduler's KV event plane: intake, republishing, subscribers and the prefix index."""

    _names = ("pdserve_events_received_total", "pdserve_events_published_total",
              "pdserve_events_rejected_total", "pdserve_events_subscriber_resyncs_total")

    def count_received(self, engine: str, event_type: str, medium: str, n: int = 1) -> None:
        """event_type: BlockStored | BlockRemoved | AllBlocksCleared (vLLM's names)."""
        self._m["pdserve_events_received_total"].labels(engine=engine, type=event_type, medium=medium).inc(n)

    def count_published(self, event_type: str, medium: str, n: int = 1) -> None:
        self._m["pdserve_events_published_total"].labels(type=event_type, medium=medium).inc(n)

    def count_rejected(self, reason: str, n: int = 1) -> None:
        self._m["pdserve_events_rejected_total"].labels(reason=reason).inc(n)

    def count_resync(self, transport: str) -> None:
        self._m["pdserve_events_subscriber_resyncs_total"].labels(transport=transport).inc()

    def track_subscribers(self, read_lags: Callable[[], Iterable[SubscriberLag]]) -> None:
        """Reads every subscriber's lag at scrape time; exports the count and the max per transport."""
        count_name, lag_name = "pdserve_events_subscribers", "pdserve_events_subscriber_lag_batches"

        def read() -> Iterable[GaugeMetricFamily]:
            counts: dict[str, int] = {}
            worst: dict[str, int] = {}
            for s in read_lags():
                counts[s.transport] = counts.get(s.transport, 0) + 1
                worst[s.transport] = max(worst.get(s.transport, 0), s.lag_batches)
            subscribers, lag = _family(count_name), _family(lag_name)
            for transport in ("grpc", "zmq", *sorted(set(counts) - {"grpc", "zmq"})):
                subscribers.add_metric([transport], float(counts.get(transport, 0)))
                lag.add_metric([transport], float(worst.get(transport, 0)))
            return (subscribers, lag)

        self._track(_CallbackCollector("subscribers", read, (count_name, lag_name)))

    def track_index(self, read_blocks: Callable[[], Mapping[str, int]]) -> None:
        """Reads the prefix index's block count per medium at scrape time."""
        name = "pdserve_events_index_blocks"

        def read() -> Iterable[GaugeMetricFamily]:
            family = _family(name)
            for medium, n in sorted(read_blocks().items()):
                family.add_metric([medium], float(n))
            return (family,)

        self._track(_CallbackCollector("prefix index", read, (name,)))


class EngineMetrics(_Group):
    """One engine's metrics (rank 0's process), every series labelled engine and role."""

    _names = ("pdserve_engine_info", "pdserve_engine_prefix_cache_queries_tokens_total",
              "pdserve_engine_prefix_cache_hits_tokens_total", "pdserve_engine_preemptions_total",
              "pdserve_engine_step_duration_seconds", "pdserve_engine_step_tokens",
              "pdserve_engine_prompt_tokens_total", "pdserve_engine_generation_tokens_total",
              "pdserve_engine_finished_requests_total", "pdserve_engine_kv_events_total",
              "pdserve_engine_control_reconnects_total")

    def __init__(self, registry: CollectorRegistry, engine_id: str, role: str, *, tp_size: int = 1) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        if not engine_id:
            raise ValueError("engine_id must not be empty")
        super().__init__(registry)
        self.engine_id, self.role = engine_id, role
        from services.common.version import __version__

        self._m["pdserve_engine_info"].labels(engine=engine_id, role=role, tp_size=str(tp_size),
                                              version=__version__).set(1)

    def _child(self, name: str) -> Any:
        return self._m[name].labels(engine=self.engine_id, role=self.role)

    def observe_step(self, seconds: float, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """One engine step computed this many prompt tokens and sampled this many tokens."""
        self._child("pdserve_engine_step_duration_seconds").observe(seconds)
        self._child("pdserve_engine_step_tokens").observe(num_prompt_tokens + num_generation_tokens)
        self._child("pdserve_engine_prompt_tokens_total").inc(num_prompt_tokens)
        self._child("pdserve_engine_generation_tokens_total").inc(num_generation_tokens)

    def count_prefix_cache(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """A prompt of `num_queried_tokens` found `num_hit_tokens` in the local prefix cache."""
        self._child("pdserve_engine_prefix_cache_queries_tokens_total").inc(num_queried_tokens)
        self._child("pdserve_engine_prefix_cache_hits_tokens_total").inc(num_hit_tokens)

    def count_preemptions(self, n: int = 1) -> None:
        self._child("pdserve_engine_preemptions_total").inc(n)

    def count_finished(self, finish_reason: str) -> None:
        """finish_reason: stop | length | abort (RequestOutput.finish_reason)."""
        self._m["pdserve_engine_finished_requests_total"].labels(
            engine=self.engine_id, role=self.role, finish_reason=finish_reason).inc()

    def count_kv_events(self, event_type: str, medium: str, n: int = 1) -> None:
        self._m["pdserve_engine_kv_events_total"].labels(
            engine=self.engine_id, role=self.role, type=event_type, medium=medium).inc(n)

    def count_control_reconnect(self) -> None:
        self._child("pdserve_engine_control_reconnects_total").inc()

    def track_load(self, read_load: Callable[[], EngineLoadLike]) -> None:
        """Reads `engine.load()` (num_running, num_waiting, num_pinned, kv_usage, num_free_blocks)
        at every scrape."""
        fields = {"pdserve_engine_running_requests": "num_running",
                  "pdserve_engine_waiting_requests": "num_waiting",
                  "pdserve_engine_pinned_requests": "num_pinned",
                  "pdserve_engine_kv_cache_usage_ratio": "kv_usage",
                  "pdserve_engine_kv_cache_free_blocks": "num_free_blocks"}
        labels = [self.engine_id, self.role]

        def read() -> Iterable[GaugeMetricFamily]:
            load = read_load()
            families = []
            for name, attr in fields.items():
                family = _family(name)
                family.add_metric(labels, float(getattr(load, attr)))
                families.append(family)
            return families

        self._track(_CallbackCollector("engine load", read, fields))


class KVMemoryMetrics(_Group):
    """What one rank registered with the data plane (each rank process its own)."""

    _names = ("pdserve_engine_kv_bytes_registered", "pdserve_engine_kv_mirror_bytes")

    def set(self, engine: str, role: str, rank: int, num_bytes_registered: int, num_mirror_bytes: int) -> None:
        labels = {"engine": engine, "role": role, "rank": str(rank)}
        self._m["pdserve_engine_kv_bytes_registered"].labels(**labels).set(num_bytes_registered)
        self._m["pdserve_engine_kv_mirror_bytes"].labels(**labels).set(num_mirror_bytes)


class TransferMetrics(_Group):
    """KV transfer per prefill→decode pair (decode ranks) and lease expiries (prefill ranks).

    Each rank process records its own pulls; Prometheus sums ranks by (src_engine, dst_engine).
    """

    _names = ("pdserve_transfer_operations_total", "pdserve_transfer_bytes_total",
              "pdserve_transfer_blocks_total", "pdserve_transfer_duration_seconds",
              "pdserve_transfer_failures_total", "pdserve_transfer_inflight_operations",
              "pdserve_transfer_lease_expiries_total", "pdserve_transfer_transport_fallbacks_total")

    def transfer_started(self, src_engine: str, dst_engine: str) -> None:
        """A decode rank of `dst_engine` began pulling from `src_engine`."""
        self._m["pdserve_transfer_operations_total"].labels(src_engine=src_engine, dst_engine=dst_engine).inc()
        self._m["pdserve_transfer_inflight_operations"].labels(engine=dst_engine).inc()

    def transfer_succeeded(self, src_engine: str, dst_engine: str, num_bytes: int, num_blocks: int,
                           seconds: float, transport: str = "unknown") -> None:
        """The pull started by `transfer_started` finished with every block received."""
        pair = {"src_engine": src_engine, "dst_engine": dst_engine}
        self._m["pdserve_transfer_bytes_total"].labels(**pair, transport=transport).inc(num_bytes)
        self._m["pdserve_transfer_blocks_total"].labels(**pair).inc(num_blocks)
        self._m["pdserve_transfer_duration_seconds"].labels(**pair).observe(seconds)
        self._m["pdserve_transfer_inflight_operations"].labels(engine=dst_engine).dec()

    def transfer_failed(self, src_engine: str, dst_engine: str, reason: str) -> None:
        """The pull started by `transfer_started` failed (reason: timeout, peer_gone, ...)."""
        self._m["pdserve_transfer_failures_total"].labels(
            src_engine=src_engine, dst_engine=dst_engine, reason=reason).inc()
        self._m["pdserve_transfer_inflight_operations"].labels(engine=dst_engine).dec()

    def record_interval(self, src_engine: str, dst_engine: str, *, num_bytes: int, num_blocks: int,
                        durations: Iterable[float], failures_by_reason: Mapping[str, int],
                        bytes_by_transport: Mapping[str, int] | None = None,
                        fallbacks: Mapping[tuple[str, str], int] | None = None) -> None:
        """What one rank's pulls from `src_engine` did since its last drain: every finished
        pull's duration, the bytes and blocks they moved (split by UCX transport when
        `bytes_by_transport` is given, else "unknown"), failures by reason, and pulls that fell
        back below the expected transport by (expected, actual)."""
        pair = {"src_engine": src_engine, "dst_engine": dst_engine}
        durations = list(durations)
        num_ops = len(durations) + sum(failures_by_reason.values())
        if num_ops:
            self._m["pdserve_transfer_operations_total"].labels(**pair).inc(num_ops)
        by_transport = dict(bytes_by_transport) if bytes_by_transport else {}
        rest = num_bytes - sum(by_transport.values())
        if rest > 0 or not by_transport:
            by_transport["unknown"] = by_transport.get("unknown", 0) + max(rest, 0)
        for transport, n in by_transport.items():
            self._m["pdserve_transfer_bytes_total"].labels(**pair, transport=transport).inc(n)
        for (expected, actual), n in (fallbacks or {}).items():
            self._m["pdserve_transfer_transport_fallbacks_total"].labels(**pair, expected=expected,
                                                                          actual=actual).inc(n)
        self._m["pdserve_transfer_blocks_total"].labels(**pair).inc(num_blocks)
        for seconds in durations:
            self._m["pdserve_transfer_duration_seconds"].labels(**pair).observe(seconds)
        for reason, n in failures_by_reason.items():
            self._m["pdserve_transfer_failures_total"].labels(**pair, reason=reason).inc(n)

    def set_inflight(self, engine: str, num_operations: int) -> None:
        """Pulls of `engine` (this rank) queued or in flight right now."""
        self._m["pdserve_transfer_inflight_operations"].labels(engine=engine).set(num_operations)

    def count_lease_expiry(self, engine: str, n: int = 1) -> None:
        """Prefill side: `n` KV holds of `engine` were freed by lease expiry."""
        self._m["pdserve_transfer_lease_expiries_total"].labels(engine=engine).inc(n)


class MetricsServer:
    """A running /metrics HTTP endpoint; `port` is the bound port."""

    def __init__(self, server: Any, thread: Any) -> None:
        self._server, self._thread = server, thread
        self.port: int = server.server_port

    def close(self) -> None:
        """Stops serving and joins the thread (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None


def start_metrics_server(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> MetricsServer:
    """Serves `registry` at http://host:port/metrics on a daemon thread (port 0 picks one)."""
    if not 0 <= port < 65536:
        raise ValueError(f"metrics port must be 0..65535, got {port}")
    try:
        server, thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise PortInUse("metrics_port", host, port, e.strerror or str(e)) from e
    logger.info("metrics: serving /metrics on %s:%d", host, server.server_port)
    return MetricsServer(server, thread)
