"""The default (cost) path policy end to end on 1 prefill + 1 decode engine, with a workload
whose right answer is clear both ways on any machine: a few-token chat turn on an idle cluster
is prefilled where it decodes (no transfer hop to pay), a 1,200-token prompt remotely (its
prefill would stall the decode engine far past the stall budget). The first two chat turns
and one long prompt are the cost model's to learn from (the per-token cost needs two prompt
sizes; a path not measured yet may be tried once); every later decision must be right. Every answer carries the policy's predicted TTFT on both paths and the
measured one; outputs match the in-process engine. Cost: one cluster and 8 requests (~40 s on
the shared 2-core machine)."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import pytest
from e2e_cluster import start_cluster

from services.client import AsyncClient, GenerationResult

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 4
WARM = 2  # chat turns the cost model learns from (with one long prompt) before its decisions are checked


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(30)
    short = [[rng.randrange(100, 49000) for _ in range(rng.randint(6, 12))] for _ in range(WARM + 4)]
    long = [[rng.randrange(100, 49000) for _ in range(1200)] for _ in range(2)]
    return short, long


def _warm_first(short: list[list[int]], long: list[list[int]]) -> list[list[int]]:
    """The cost model's lessons first: WARM chat turns and one long prompt (any path), then the
    checked ones: 4 chat turns and one long prompt."""
    return short[:WARM] + long[:1] + short[WARM:] + long[1:]


async def _one_by_one(target: str, prompts: list[list[int]]) -> list[GenerationResult]:
    async with AsyncClient(target) as client:
        return [await client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=120)
                for p in prompts]


def test_default_policy_keeps_chat_turns_local_and_sends_long_prompts_remote(
        tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> None:
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    short, long = _prompts()
    with LLMEngine(demo_model, torch_threads=1, dtype="float32") as engine:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        expected = engine.generate(_warm_first(short, long), params)
    c = start_cluster(tmp_path_factory, "cost-paths", scheduler_args=["--path-policy", "cost"])
    try:
        results = asyncio.run(_one_by_one(c.target, _warm_first(short, long)))
        decisions = "; ".join(f"{r.path_reason} {r.prompt_tokens} tokens: predicted {r.predicted_ttft_ms:.0f} ms, "
                              f"other path {r.alternative_ttft_ms or 0:.0f} ms, actual {r.scheduler_ttft_ms:.0f} ms"
                              for r in results)
        checked_short, checked_long = results[WARM + 1:-1], results[-1:]
        for r in checked_short:
            assert r.path_reason == "decode_local:short_prompt", decisions
            assert r.prefill_engine_id == "" and r.transferred_tokens == 0
        for r in checked_long:
            assert r.path_reason == "remote:long_prompt", decisions
            assert r.prefill_engine_id == "prefill-0" and r.transferred_tokens > 0
        for r in results:  # the prediction on both paths beside the measured TTFT
            assert r.predicted_ttft_ms > 0 and r.alternative_ttft_ms is not None and r.alternative_ttft_ms > 0
            assert 0 < r.scheduler_ttft_ms < math.inf and r.ttft_s is not None
        # The remote prefill of 1,200 tokens is predicted slower than a chat turn's local one.
        assert results[-1].predicted_ttft_ms > results[-2].predicted_ttft_ms, decisions
        assert [r.token_ids for r in results] == expected
        assert c.wait_no_leaks() == {}
    finally:
        c.stop()
