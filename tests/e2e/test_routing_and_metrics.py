"""Prefix-aware routing over real KV events, and the metrics every process exports, end to end."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from e2e_cluster import start_cluster
from prometheus_client.parser import text_string_to_metric_families

from services.client import AsyncClient, GenerationResult

pytestmark = pytest.mark.timeout(600)

BLOCK = 16


def _generate(target: str, prompt: list[int], max_tokens: int = 4) -> GenerationResult:
    async def go() -> GenerationResult:
        async with AsyncClient(target) as client:
            return await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=120)

    return asyncio.run(go())


def test_requests_follow_the_prefill_engine_that_holds_their_prefix(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    c = start_cluster(tmp_path_factory, "routing", num_prefill=2, metrics=True,
                      scheduler_args=["--routing-policy", "prefix"])
    try:
        scheduler_port = c.components["scheduler"].metrics_port or 0
        prefix_a = [1000 + i for i in range(6 * BLOCK)]
        prefix_b = [5000 + i for i in range(6 * BLOCK)]
        first_a = _generate(c.target, prefix_a + [7, 8, 9])
        first_b = _generate(c.target, prefix_b + [7, 8, 9])
        holders = {"a": first_a.prefill_engine_id, "b": first_b.prefill_engine_id}
        assert holders["a"] and holders["b"]
        # Cold prompts: nobody holds block 0, so both went by load.
        assert _prefill_reasons(scheduler_port) == {"load": 2}
        for i in range(4):
            for name, prefix in (("a", prefix_a), ("b", prefix_b)):
                result = _generate(c.target, prefix + [11 + i, 12 + i, 13 + i])
                assert result.prefill_engine_id == holders[name], f"prefix {name} left its engine"
                assert result.cached_tokens >= 6 * BLOCK - BLOCK, result
        # Every warm prompt was routed because of its prefix, not by load or in turn.
        assert _prefill_reasons(scheduler_port) == {"load": 2, "prefix": 8}
        # A new epoch of the engine holding prefix a: its index entries vanish at once, so the
        # next prefix-a request is routed by load (no live engine holds its block 0).
        c.restart(holders["a"])
        c.wait_ready(2, 1, timeout=120)
        _wait_for_epoch_change(c, holders["a"])
        again = _generate(c.target, prefix_a + [99, 98])
        assert again.prefill_engine_id in ("prefill-0", "prefill-1")
        assert _prefill_reasons(scheduler_port) == {"load": 3, "prefix": 8}
        assert c.wait_no_leaks() == {}
    finally:
        c.stop()


def _prefill_reasons(port: int) -> dict[str, int]:
    """The scheduler's prefill routing decisions so far, by reason (zero counts left out)."""
    counts: dict[str, int] = {}
    for name, labels, value in _scrape(port).get("pdserve_scheduler_routing_decisions", []):
        if name == "pdserve_scheduler_routing_decisions_total" and labels["role"] == "prefill" and value:
            counts[labels["reason"]] = counts.get(labels["reason"], 0) + int(value)
    return counts


def _wait_for_epoch_change(c, name: str) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            c.inspect(name)
            return
        except Exception:
            time.sleep(0.3)
    raise TimeoutError(f"{name} did not come back")


def _scrape(port: int) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = [(s.name, s.labels, s.value) for s in family.samples]
    return families


def _total(families: dict[str, list[tuple[str, dict[str, str], float]]], sample_name: str) -> float:
    return sum(v for fam in families.values() for name, _, v in fam if name == sample_name)


def test_every_process_exports_the_metrics_the_dashboards_use(tmp_path_factory: pytest.TempPathFactory) -> None:
    c = start_cluster(tmp_path_factory, "metrics", metrics=True)
    try:
        prompts = [[2000 + i for i in range(40 + 7 * k)] for k in range(6)]
        for p in prompts:
            _generate(c.target, p, max_tokens=6)
        scheduler = _scrape(c.components["scheduler"].metrics_port or 0)
        prefill = _scrape(c.components["prefill-0"].metrics_port or 0)
        decode = _scrape(c.components["decode-0"].metrics_port or 0)
    finally:
        c.stop()
    # Scheduler: traffic, latency histograms observed, routing decisions, aggregator, registry, events.
    assert _total(scheduler, "pdserve_scheduler_requests_total") >= len(prompts)
    assert _total(scheduler, "pdserve_scheduler_time_to_first_token_seconds_count") >= len(prompts)
    assert _total(scheduler, "pdserve_scheduler_inter_token_latency_seconds_count") > 0
    assert _total(scheduler, "pdserve_scheduler_e2e_request_latency_seconds_count") >= len(prompts)
    assert _total(scheduler, "pdserve_scheduler_routing_decisions_total") >= len(prompts)
    assert "pdserve_scheduler_aggregator_pending_reports" in scheduler
    assert _total(scheduler, "pdserve_scheduler_registered_engines") >= 2
    assert _total(scheduler, "pdserve_events_published_total") > 0
    # The native engine (tp 1 here) reports rank by rank: no report carries other ranks' events.
    kinds = {labels["kind"]: v for name, labels, v in scheduler.get("pdserve_scheduler_rank_reports", [])
             if name == "pdserve_scheduler_rank_reports_total"}
    assert kinds.get("rank", 0) > 0 and kinds.get("merged", 0) == 0, kinds
    # Engines: load gauges, steps, finished requests, KV events.
    for fams in (prefill, decode):
        assert "pdserve_engine_kv_cache_usage_ratio" in fams
        assert _total(fams, "pdserve_engine_step_duration_seconds_count") > 0
        assert _total(fams, "pdserve_engine_finished_requests_total") >= len(prompts)
    assert _total(prefill, "pdserve_engine_kv_events_total") > 0
    # The KV transfer per prefill->decode pair, recorded by the decode rank.
    pair = [labels for name, labels, v in decode.get("pdserve_transfer_bytes", [])
            if name == "pdserve_transfer_bytes_total" and v > 0]
    assert pair and pair[0]["src_engine"] == "prefill-0" and pair[0]["dst_engine"] == "decode-0"
    assert _total(decode, "pdserve_transfer_duration_seconds_count") >= len(prompts)
    # Every metric a dashboard or alert queries is a family some process exports.
    from services.common.metrics import CATALOGUE

    exported = set(scheduler) | set(prefill) | set(decode)
    chart = Path(__file__).resolve().parents[2] / "helm" / "pdserve"
    text = " ".join(p.read_text() for p in [*chart.glob("dashboards/*.json"), *chart.glob("files/*.yaml")])
    used = {name for name in CATALOGUE if name in text}
    assert used, "no catalogue metric found in the dashboards"
    missing = sorted(n for n in used if n not in exported and n.removesuffix("_total") not in exported)
    assert not missing, f"dashboards query metrics no process exports: {missing}"
