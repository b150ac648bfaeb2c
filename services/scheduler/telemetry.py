"""`SchedulerTelemetry`: the scheduler's metrics in the scheduler's own vocabulary, wrapping
`services.common.metrics.SchedulerMetrics` (names and labels are defined there), plus the
scrape-time readers of the registry and the aggregator.

Without a registry it records into a private one, so callers never branch on "metrics on?".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry

from connectors.aggregator import KVOutputAggregator
from services.common.metrics import RegisteredCount, SchedulerMetrics
from services.scheduler.lifecycle import ReleaseCause
from services.scheduler.registry import EngineRegistry
from services.scheduler.routing import Route

_LEASE_OUTCOME = {
    ReleaseCause.TRANSFERRED: "released", ReleaseCause.TRANSFER_FAILED: "released",
    ReleaseCause.FINISHED: "released", ReleaseCause.ENGINE_GONE: "released",
    ReleaseCause.ABORT: "aborted", ReleaseCause.LEASE_EXPIRED: "expired",
}


class _AggregatorSource:
    def __init__(self, aggregator: KVOutputAggregator) -> None:
        self.aggregator = aggregator

    def pending_reports(self) -> Mapping[str, int]:
        return {engine: counts.total for engine, counts in self.aggregator.pending_reports().items()}

    def oldest_pending_age(self) -> float | None:
        return self.aggregator.oldest_pending_age()


class SchedulerTelemetry:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.prometheus = registry or CollectorRegistry()
        self.metrics = SchedulerMetrics(self.prometheus)

    def track(self, engines: EngineRegistry, aggregator: KVOutputAggregator) -> None:
        self.metrics.track_aggregator(_AggregatorSource(aggregator))
        self.metrics.track_registry(lambda: registered_counts(engines))

    def routed(self, route: Route, policy: str, block_size: int) -> None:
        m = self.metrics
        for medium, num_blocks in route.prefix_hit_blocks:
            m.count_prefix_hit(medium, num_blocks * block_size)
        if route.prefill.engine_id is not None:
            m.count_routing_decision("prefill", route.prefill.engine_id, policy, route.prefill.reason)
        if route.path is not None:
            m.count_path_decision(route.path.path, route.path.reason)
            if route.path.local:  # decode_only_total keeps its short labels: short_prompt, no_prefill_engine, ...
                m.count_decode_only(route.path.reason.partition(":")[2])
        if route.decode.engine_id is not None:
            m.count_routing_decision("decode", route.decode.engine_id, "load", route.decode.reason)

    def prefill_failed(self, retried: bool) -> None:
        if retried:
            self.metrics.count_retry("prefill", "prefill_failed")
        else:
            self.metrics.count_decode_only("prefill_failed")

    def release(self, cause: ReleaseCause, first: bool) -> None:
        self.metrics.count_lease_outcome(_LEASE_OUTCOME[cause] if first else "duplicate")


def registered_counts(engines: EngineRegistry) -> Iterable[RegisteredCount]:
    """Engines and ranks by (role, state): state routable, draining or unhealthy."""
    counts: dict[tuple[str, str], list[int]] = {}
    for engine in list(engines.engines.values()):
        state = "routable" if engine.routable else "draining" if engine.healthy else "unhealthy"
        entry = counts.setdefault((str(engine.role), state), [0, 0])
        entry[0] += 1
        entry[1] += len(engine.ranks)
    return [RegisteredCount(role, state, n, r) for (role, state), (n, r) in sorted(counts.items())]
