"""An engine changes role in place under streaming load (docs/decisions/0044): on 1 prefill + 1
decode engine, `prefill-0` goes prefill -> decode -> mixed -> prefill through the admin
endpoint while requests stream. Every request completes token-identical to the in-process
engine, none migrated or restarted, no block leaks; the engine keeps its incarnation epoch, and
the prefix it cached before the first change still hits its cache after the third. Cost: one
cluster, ~40 short requests, about 60 s on the shared 2-core machine."""

from __future__ import annotations

import asyncio
import random
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e_cluster import start_cluster

from services.client import AsyncClient
from services.local_cluster import LocalCluster
from tests.role_change_load import admin, engine_role, generate, set_role, stream

pytestmark = pytest.mark.timeout(900)

BLOCK = 16
MAX_TOKENS = 6
ENGINE = "prefill-0"


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(38)
    load = [[rng.randrange(100, 49000) for _ in range(rng.randint(40, 90))] for _ in range(8)]
    cached = [rng.randrange(100, 49000) for _ in range(6 * BLOCK + 5)]
    return load, cached


def _reference(demo_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    with LLMEngine(demo_model, torch_threads=1, dtype="float32") as engine:
        return engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


async def _scenario(c: LocalCluster, load: list[list[int]], cached: list[int]) -> dict[str, Any]:
    seen: dict[str, Any] = {"load": []}
    stop = asyncio.Event()
    streaming = asyncio.create_task(stream(c.target, load, MAX_TOKENS, stop, seen["load"]))
    async with AsyncClient(c.target) as client:
        seen["first"] = await generate(client, cached, MAX_TOKENS)  # computed on prefill-0 (remote path)
        for role in ("decode", "mixed"):
            await asyncio.sleep(1.5)
            await set_role(c, ENGINE, role)
            seen[role] = await generate(client, cached + [11, 12, 13], MAX_TOKENS)
        await asyncio.sleep(1.5)
        await set_role(c, ENGINE, "prefill")
        stop.set()
        await streaming
        # Alone on the cluster now: what prefill-0's own prefix cache gives this prompt is the
        # prefix it cached as a prefill engine, three role changes ago.
        before = await asyncio.to_thread(_prefix_hits, c)
        seen["prefill"] = await generate(client, cached + [21, 22], MAX_TOKENS)
        seen["prefill_hit_tokens"] = await asyncio.to_thread(_prefix_hits, c) - before
    return seen


def _prefix_hits(c: LocalCluster) -> float:
    """Prompt tokens prefill-0's prefix cache has served, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    port = c.components[ENGINE].metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "pdserve_engine_prefix_cache_hits_tokens_total")


def test_prefill_decode_mixed_prefill_under_load(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> None:
    load, cached = _prompts()
    probes = [cached, cached + [11, 12, 13], cached + [21, 22]]
    expected = _reference(demo_model, load + probes)
    c = start_cluster(tmp_path_factory, "roles", num_prefill=1, num_decode=1, metrics=True,
                      engine_args=["--kv-cache-memory", "128MiB"])
    try:
        epoch = engine_role(c, ENGINE)["epoch"]
        seen = asyncio.run(_scenario(c, load, cached))
        results = seen["load"]
        assert len(results) >= 2 * len(load), len(results)
        for k, r in results:
            assert r.token_ids == expected[k], (k, r.path_reason)
            assert r.num_migrations == 0 and r.finish_reason == "length", r
        paths = {r.path_reason for _, r in results}
        assert any(p.startswith("remote:") for p in paths), paths  # before and after: disaggregated
        assert any(p.startswith("decode_local:") for p in paths), paths  # meanwhile: no prefill engine
        first = seen["first"]
        assert first.prefill_engine_id == ENGINE and first.token_ids == expected[len(load)]
        for role in ("decode", "mixed"):  # no prefill engine: computed where the prefix is cached
            r = seen[role]
            assert r.token_ids == expected[len(load) + 1], role
            assert r.prefill_engine_id == "" and r.cached_tokens >= 5 * BLOCK, (role, r)
        back = seen["prefill"]
        assert back.prefill_engine_id == ENGINE and back.token_ids == expected[len(load) + 2], back
        assert seen["prefill_hit_tokens"] >= 5 * BLOCK, seen["prefill_hit_tokens"]
        engine = engine_role(c, ENGINE)
        assert engine["epoch"] == epoch and engine["role"] == "prefill" and engine["role_epoch"] == 3
        changes = [(x["old"], x["new"], x["source"]) for x in admin(c)["changes"]]
        assert changes == [("prefill", "decode", "operator"), ("decode", "mixed", "operator"),
                           ("mixed", "prefill", "operator")]
        assert c.wait_no_leaks() == {}
    finally:
        c.stop()
