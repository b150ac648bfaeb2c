"""pdserve_scheduler_prefix_hit_tokens_total: the prompt tokens cached on the engine that computes
the prompt, per medium, counted once per routed request (the kv-events dashboard's hit-rate panel
reads it; it was declared and never incremented)."""

from __future__ import annotations

from services.scheduler.prefix_index import EngineMatch
from services.scheduler.routing import MEDIUM_ORDER, Route, RoutingDecision, _blocks_by_medium
from services.scheduler.telemetry import SchedulerTelemetry


def test_each_block_counts_once_under_its_fastest_medium() -> None:
    match = EngineMatch("p0", 1, 4, (frozenset({"GPU", "CPU_OFFLOAD"}), frozenset({"CPU_OFFLOAD"}),
                                     frozenset({"CPU_OFFLOAD", "STORAGE"}), frozenset({"STORAGE"})))
    assert _blocks_by_medium(match, MEDIUM_ORDER) == (("CPU_OFFLOAD", 2), ("GPU", 1), ("STORAGE", 1))
    assert _blocks_by_medium(None, MEDIUM_ORDER) == ()


def test_routed_counts_the_hit_tokens_by_medium() -> None:
    telemetry = SchedulerTelemetry()
    route = Route(RoutingDecision("p0", "longest_prefix", 3), RoutingDecision("d0", "load"),
                  prefix_hit_blocks=(("GPU", 3), ("CPU_OFFLOAD", 1)))
    telemetry.routed(route, "prefix", 16)
    telemetry.routed(Route(RoutingDecision("p0", "load"), RoutingDecision("d0", "load")), "prefix", 16)
    value = telemetry.prometheus.get_sample_value
    assert value("pdserve_scheduler_prefix_hit_tokens_total", {"medium": "GPU"}) == 48
    assert value("pdserve_scheduler_prefix_hit_tokens_total", {"medium": "CPU_OFFLOAD"}) == 16
