"""Prefill and decode engines of different TP sizes, both directions, real processes and UCX.

Each case starts a cluster (scheduler, one prefill and one decode engine: 3 rank processes) on
a tiny random Llama with 2 KV heads or an MQA variant (1 KV head, replicated over TP ranks),
runs 16 prompts 4 at a time and compares every token with the in-process engine. About 20-40 s
per case on the 2-core reference machine; the rank-kill case about 40 s. The 2-head cases run on
both KV transports (ucx-tag, and nixl: one NIXL READ per pull).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from e2e_cluster import start_cluster

from bench.chaos import ChaosConfig, run_chaos
from connectors.ucx.nixl_transport import nixl_importable
from services.client import AsyncClient, GenerationResult

MAX_TOKENS = 8
NUM_PROMPTS = 16
CONCURRENCY = 4


@pytest.fixture(scope="session")
def tiny_mqa_model(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/e2e/conftest.py's tiny Llama with one KV head (multi-query attention)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=2048,
                      initializer_range=0.1, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(11)
    path = tmp_path_factory.mktemp("tiny-mqa-model")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (demo_model / name).exists():
            shutil.copy(demo_model / name, path / name)
    return path


def _reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLMEngine(model, torch_threads=1, dtype="float32") as engine:
        return engine.generate(prompts, params)


async def _run(target: str, prompts: list[list[int]]) -> list[GenerationResult]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(client: AsyncClient, prompt: list[int]) -> GenerationResult:
        async with gate:
            return await client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async with AsyncClient(target) as client:
        return list(await asyncio.gather(*(one(client, p) for p in prompts)))


NEEDS_NIXL = pytest.mark.skipif(not nixl_importable(), reason="nixl-cu12 not installed")


@pytest.mark.parametrize(("model_name", "prefill_tp", "decode_tp", "transport"), [
    *((m, p, d, "ucx-tag") for m in ("tiny_tp_model", "tiny_mqa_model") for p, d in ((2, 1), (1, 2))),
    # The RMA transport (one NIXL READ per pull): both directions, the 2-head model.
    pytest.param("tiny_tp_model", 2, 1, "nixl", marks=NEEDS_NIXL),
    pytest.param("tiny_tp_model", 1, 2, "nixl", marks=NEEDS_NIXL),
])
def test_tokens_match_the_in_process_engine_across_tp_sizes(
        request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, prompts: list[list[int]],
        model_name: str, prefill_tp: int, decode_tp: int, transport: str) -> None:
    model: Path = request.getfixturevalue(model_name)
    batch = [prompts[i % len(prompts)] + [100 + i] for i in range(NUM_PROMPTS)]  # 16 distinct prompts
    want = _reference(model, batch)
    cluster = start_cluster(tmp_path_factory, f"hetero-{model_name}-{prefill_tp}{decode_tp}-{transport}",
                            model=str(model), prefill_tp=prefill_tp, decode_tp=decode_tp,
                            engine_args=["--kv-transport", transport] if transport != "ucx-tag" else [])
    try:
        results = asyncio.run(_run(cluster.target, batch))
        assert [r.token_ids for r in results] == want
        assert all(r.prefill_engine_id == "prefill-0" for r in results)
        # No silent recompute: every prompt's KV came over UCX from the other TP size.
        assert all(r.transferred_tokens + r.cached_tokens >= r.prompt_tokens - 1 for r in results), \
            [(r.prompt_tokens, r.transferred_tokens, r.cached_tokens) for r in results]
        assert sum(r.transferred_tokens for r in results) > 0
        assert cluster.wait_no_leaks() == {}
    finally:
        cluster.stop()


def test_prefill_rank_killed_mid_transfer_loses_and_repeats_no_token(tmp_path: Path, tiny_tp_model: Path) -> None:
    """SIGKILL rank 1 of a tp-2 prefill engine feeding a tp-1 decode engine while requests
    stream: pulls from it fail (the decode rank names the blocks that missed its heads), those
    requests recompute, the engine restarts, and every token matches the reference."""
    cfg = ChaosConfig(duration_s=10.0, num_prefill=1, num_decode=1, tp=1, prefill_tp=2, decode_tp=1,
                      concurrency=4, num_prompts=8, prompt_len=(48, 96), max_tokens=24, deadline_s=60.0,
                      lease_s=5.0, include_scheduler=False, schedule=[(3.0, "prefill-0/1")],
                      model=str(tiny_tp_model), log_dir=str(tmp_path / "logs"))
    report = run_chaos(cfg)
    summary = report.to_json()
    assert [k.victim for k in report.kills] == ["prefill-0/1"], summary
    assert report.lost == 0 and report.token_errors == 0, summary
    assert set(report.failed) <= {"DEADLINE_EXCEEDED"}, summary
    assert report.completed > 0 and report.leaks == {}, summary
