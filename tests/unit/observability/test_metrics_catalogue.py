"""The metric catalogue: naming rules, every entry exported by some group, values move."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import (
    CATALOGUE,
    EngineMetrics,
    EventMetrics,
    Kind,
    KVMemoryMetrics,
    PlannerReading,
    RegisteredCount,
    RoleMetrics,
    SchedulerMetrics,
    SubscriberLag,
    TransferMetrics,
    exported_series,
    metrics_port_for_rank,
    start_metrics_server,
)
from services.common.version import __version__

FORBIDDEN_LABELS = {"request_id", "request", "prompt", "trace_id", "block_hash"}


@dataclass
class Load:
    num_running: int = 2
    num_waiting: int = 1
    num_pinned: int = 3
    kv_usage: float = 0.25
    num_free_blocks: int = 96


class Aggregator:
    def __init__(self) -> None:
        self.pending = {"prefill-0": 2}
        self.ages = {"prefill-0": 4.5}

    def pending_reports(self) -> dict[str, int]:
        return self.pending

    def oldest_pending_age(self) -> dict[str, float]:
        return self.ages


def full_registry() -> tuple[CollectorRegistry, SchedulerMetrics, EngineMetrics, TransferMetrics, EventMetrics]:
    registry = CollectorRegistry()
    sched, engine = SchedulerMetrics(registry), EngineMetrics(registry, "decode-0", "decode", tp_size=2)
    transfer, events = TransferMetrics(registry), EventMetrics(registry)
    sched.track_aggregator(Aggregator())
    sched.track_registry(lambda: [RegisteredCount("prefill", "ready", 1, 2)])
    sched.track_convergence(lambda: True)
    engine.track_load(Load)
    events.track_subscribers(lambda: [SubscriberLag("grpc", 4), SubscriberLag("grpc", 9)])
    events.track_index(lambda: {"GPU": 10, "CPU_OFFLOAD": 3})
    KVMemoryMetrics(registry).set("decode-0", "decode", 0, 1 << 20, 0)
    RoleMetrics(registry).track(lambda: [("prefill-0", "mixed")],
                                lambda: PlannerReading({"prefill": 1, "decode": 1}, 1.5, 2.5, 1.2),
                                ("prefill", "decode", "mixed"))
    return registry, sched, engine, transfer, events


def scrape(registry: CollectorRegistry) -> dict[str, list]:
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_names_follow_the_convention() -> None:
    for name, spec in CATALOGUE.items():
        assert re.fullmatch(r"pdserve_(scheduler|engine|transfer|events|kv|planner)_[a-z0-9_]+", name), name
        assert (spec.kind is Kind.COUNTER) == name.endswith("_total"), name
        if spec.kind is Kind.HISTOGRAM:
            assert spec.buckets and list(spec.buckets) == sorted(spec.buckets), name
            assert name.rsplit("_", 1)[1] in ("seconds", "tokens", "ratio"), name
        assert not FORBIDDEN_LABELS & set(spec.labels), name
        assert spec.help, name


def test_every_catalogue_entry_is_exported_by_exactly_one_owner() -> None:
    registry, *_ = full_registry()  # a duplicate registration would raise here
    families = scrape(registry)
    # the text parser strips `_total` from counter family names
    expected = {n.removesuffix("_total") if CATALOGUE[n].kind is Kind.COUNTER else n for n in CATALOGUE}
    assert set(families) == expected


def test_histogram_buckets_cover_cpu_and_gpu_speeds() -> None:
    ttft = CATALOGUE["pdserve_scheduler_time_to_first_token_seconds"].buckets or ()
    assert ttft[0] <= 0.01 and ttft[-1] >= 60  # a GPU's 10 ms and a CPU's long prompt
    transfer = CATALOGUE["pdserve_transfer_duration_seconds"].buckets or ()
    assert transfer[0] <= 0.001 and transfer[-1] >= 5


def test_recording_methods_move_the_right_series() -> None:
    registry, sched, engine, transfer, events = full_registry()
    sched.request_started(num_prompt_tokens=12)
    assert registry.get_sample_value("pdserve_scheduler_requests_in_flight") == 1
    sched.observe_ttft(0.2, path="decode_only")
    sched.observe_inter_token_latency(0.06, num_tokens=3)
    sched.request_finished("success", 1.0, path="decode_only")
    sched.count_routing_decision("prefill", "prefill-0", "prefix", "longest_prefix")
    engine.observe_step(0.01, num_prompt_tokens=30, num_generation_tokens=2)
    transfer.transfer_started("prefill-0", "decode-0")
    transfer.transfer_succeeded("prefill-0", "decode-0", num_bytes=4096, num_blocks=2, seconds=0.003)
    transfer.transfer_started("prefill-0", "decode-0")
    transfer.transfer_failed("prefill-0", "decode-0", "timeout")
    events.count_published("BlockStored", "GPU", 5)

    v = registry.get_sample_value
    assert v("pdserve_scheduler_requests_in_flight") == 0
    assert v("pdserve_scheduler_requests_total", {"outcome": "success"}) == 1
    assert v("pdserve_scheduler_prompt_tokens_total") == 12
    assert v("pdserve_scheduler_generation_tokens_total") == 3
    assert v("pdserve_scheduler_inter_token_latency_seconds_sum") == pytest.approx(0.02)
    assert v("pdserve_scheduler_time_to_first_token_seconds_count", {"path": "decode_only"}) == 1
    assert v("pdserve_engine_step_tokens_sum", {"engine": "decode-0", "role": "decode"}) == 32
    pair = {"src_engine": "prefill-0", "dst_engine": "decode-0"}
    assert v("pdserve_transfer_operations_total", pair) == 2
    assert v("pdserve_transfer_bytes_total", {**pair, "transport": "unknown"}) == 4096
    assert v("pdserve_transfer_duration_seconds_count", pair) == 1
    assert v("pdserve_transfer_failures_total", {**pair, "reason": "timeout"}) == 1
    assert v("pdserve_transfer_inflight_operations", {"engine": "decode-0"}) == 0
    assert v("pdserve_events_published_total", {"type": "BlockStored", "medium": "GPU"}) == 5
    assert v("pdserve_engine_info", {"engine": "decode-0", "role": "decode", "tp_size": "2",
                                     "version": __version__}) == 1


def test_collectors_read_live_state_at_scrape_time() -> None:
    registry = CollectorRegistry()
    agg = Aggregator()
    SchedulerMetrics(registry).track_aggregator(agg)
    assert registry.get_sample_value("pdserve_scheduler_aggregator_pending_reports", {"engine": "prefill-0"}) == 2
    agg.pending, agg.ages = {}, {}
    assert registry.get_sample_value("pdserve_scheduler_aggregator_pending_reports", {"engine": "prefill-0"}) is None

    registry, *_ = full_registry()
    v = registry.get_sample_value
    assert v("pdserve_engine_kv_cache_usage_ratio", {"engine": "decode-0", "role": "decode"}) == 0.25
    assert v("pdserve_engine_pinned_requests", {"engine": "decode-0", "role": "decode"}) == 3
    assert v("pdserve_events_subscribers", {"transport": "grpc"}) == 2
    assert v("pdserve_events_subscriber_lag_batches", {"transport": "grpc"}) == 9
    assert v("pdserve_events_subscribers", {"transport": "zmq"}) == 0
    assert v("pdserve_scheduler_registered_ranks", {"role": "prefill", "state": "ready"}) == 2
    assert v("pdserve_events_index_blocks", {"medium": "CPU_OFFLOAD"}) == 3


def test_scalar_aggregator_is_reported_as_engine_all() -> None:
    class Scalar:
        def pending_reports(self) -> int:
            return 5

        def oldest_pending_age(self) -> float | None:
            return None

    registry = CollectorRegistry()
    SchedulerMetrics(registry).track_aggregator(Scalar())
    assert registry.get_sample_value("pdserve_scheduler_aggregator_pending_reports", {"engine": "all"}) == 5
    assert registry.get_sample_value(
        "pdserve_scheduler_aggregator_oldest_pending_age_seconds", {"engine": "all"}) == 0


def test_a_failing_reader_does_not_break_the_scrape() -> None:
    registry = CollectorRegistry()
    sched = SchedulerMetrics(registry)

    def broken() -> list[RegisteredCount]:
        raise RuntimeError("registry is gone")

    sched.track_registry(broken)
    sched.request_rejected()
    families = scrape(registry)
    assert "pdserve_scheduler_registered_engines" not in families
    assert families["pdserve_scheduler_requests"][0].value == 1


def test_bad_engine_identity_is_refused() -> None:
    with pytest.raises(ValueError, match="role"):
        EngineMetrics(CollectorRegistry(), "e0", "router")
    with pytest.raises(ValueError, match="engine_id"):
        EngineMetrics(CollectorRegistry(), "", "decode")


def test_rank_ports() -> None:
    assert metrics_port_for_rank(0, 3) is None
    assert metrics_port_for_rank(9400, 0) == 9400
    assert metrics_port_for_rank(9400, 3) == 9403
    with pytest.raises(ValueError, match=r'metrics port 65535 \+ rank 1 is not a TCP port'):
        metrics_port_for_rank(65535, 1)


def test_metrics_server_serves_the_registry_over_http() -> None:
    registry, sched, *_ = full_registry()
    sched.request_rejected()
    server = start_metrics_server(0, registry, host="127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
    finally:
        server.close()
        server.close()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "pdserve_scheduler_requests_total" in names
    assert names <= exported_series()
    with pytest.raises(ValueError, match='metrics port must be 0..65535, got 70000'):
        start_metrics_server(70000, registry)


def test_transfer_bytes_carry_the_ucx_transport_and_fallbacks_are_counted() -> None:
    registry, _, _, transfer, _ = full_registry()
    transfer.record_interval("prefill-0", "decode-0", num_bytes=5000, num_blocks=3, durations=[0.01, 0.02],
                             failures_by_reason={}, bytes_by_transport={"tcp": 4000, "sysv": 600},
                             fallbacks={("rdma", "tcp"): 2})
    v = registry.get_sample_value
    pair = {"src_engine": "prefill-0", "dst_engine": "decode-0"}
    assert v("pdserve_transfer_bytes_total", {**pair, "transport": "tcp"}) == 4000
    assert v("pdserve_transfer_bytes_total", {**pair, "transport": "sysv"}) == 600
    assert v("pdserve_transfer_bytes_total", {**pair, "transport": "unknown"}) == 400  # not attributed
    assert v("pdserve_transfer_transport_fallbacks_total", {**pair, "expected": "rdma", "actual": "tcp"}) == 2
