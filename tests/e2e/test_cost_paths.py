"""The default (cost) path policy end to end on 1 prefill + 1 decode engine, with a workload
whose right answer is clear both ways on any machine: a few-token chat turn on an idle cluster
is prefilled where it decodes (no transfer hop to pay), a 1,200-token prompt remotely (its
prefill would stall the decode engine far past the stall budget). The first two chat turns
are the cost model's to learn from (a path not measured yet is tried once); every later
decision must be right. Every answer carries the policy's predicted TTFT on both paths and the
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
WARM = 2  # chat turns the cost model learns from before its decisions are checked


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(30)
    short = [[rng.randrange(100, 49000) for _ in range(rng.randint(6, 12))] for _ in range(WARM + 4)]
    long = [[rng.randrange(100, 49000) for _ in range(1200)] for _ in range(2)]
    return short, long


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
        expected = engine.generate(short + long, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                ignore_eos=True))
    c = start_cluster(tmp_path_factory, "cost-paths", scheduler_args=["--path-policy", "cost"])
    try:
        results = asyncio.run(_one_by_one(c.target, short + long))
        decisions = [(r.path_reason, r.predicted_ttft_ms, r.alternative_ttft_ms, r.scheduler_ttft_ms)
                     for r in results]
        for r in results[WARM:len(short)]:
            assert r.path_reason == "decode_local:short_prompt", decisions
            assert r.prefill_engine_id == "" and r.transferred_tokens == 0
        for r in results[len(short):]:
            assert r.path_reason == "remote:long_prompt", decisions
            assert r.prefill_engine_id == "prefill-0" and r.transferred_tokens > 0
        for r in results:  # the prediction on both paths beside the measured TTFT
            assert r.predicted_ttft_ms > 0 and r.alternative_ttft_ms is not None and r.alternative_ttft_ms > 0
            assert 0 < r.scheduler_ttft_ms < math.inf and r.ttft_s is not None
        # The remote prefill of 1,200 tokens is predicted slower than a chat turn's local one.
        assert results[-1].predicted_ttft_ms > results[WARM].predicted_ttft_ms, decisions
        assert [r.token_ids for r in results] == expected
        assert c.wait_no_leaks() == {}
    finally:
        c.stop()
