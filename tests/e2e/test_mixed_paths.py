"""The scheduler decides the path per request, end to end (threshold policy): on 2 prefill + 2
decode engines, short chat turns are prefilled on the decode engine and long
shared-prefix prompts remotely; a decode engine holding a long prompt's prefix (its own KV
events) prefills the rest itself, or pulls only the blocks it lacks. Outputs are token-identical
to the in-process engine on either path. Cost: one cluster and 6 long prompts (~450-700
tokens: the threshold policy's split needs only more uncached tokens than its 128), about 35 s
on the shared 2-core machine."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from e2e_cluster import start_cluster, wait_for_block

from connectors.hashing import DEFAULT_HASH_SEED, BlockHasher
from services.client import AsyncClient, GenerationResult

pytestmark = pytest.mark.timeout(900)

BLOCK = 16
MAX_TOKENS = 6
SHARED_LEN = 16 * BLOCK  # the long prompts' shared prefix
LONG_SUFFIX = 200  # the fewest tokens after it (the threshold is 128)


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(19)
    short = [[rng.randrange(100, 49000) for _ in range(rng.randint(6, 24))] for _ in range(6)]
    prefix = [rng.randrange(100, 49000) for _ in range(SHARED_LEN)]
    # 200+ tokens no engine holds: past the threshold (128 uncached tokens) on every decode
    # engine, the holder of the shared prefix included, so each goes remote on any machine.
    long = [prefix + [rng.randrange(100, 49000) for _ in range(rng.randint(LONG_SUFFIX, LONG_SUFFIX + 80))]
            for _ in range(4)]
    return short, long


def _reference(demo_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    with LLMEngine(demo_model, torch_threads=1, dtype="float32") as engine:
        return engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


async def _run(target: str, prompts: list[list[int]], concurrency: int) -> list[GenerationResult]:
    sem = asyncio.Semaphore(concurrency)
    async with AsyncClient(target) as client:
        async def one(p: list[int]) -> GenerationResult:
            async with sem:
                return await client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=300)

        return list(await asyncio.gather(*(one(p) for p in prompts)))


async def _mixed(target: str, short: list[list[int]], long: list[list[int]]) -> list[GenerationResult]:
    """Chat turns one after another (a user waits for each answer) while the long prompts run
    three at a time: short ones then never queue behind each other on a decode engine."""
    shorts, longs = await asyncio.gather(_run(target, short, 1), _run(target, long, 3))
    return [*shorts, *longs]


def test_short_prompts_go_decode_local_long_ones_remote_and_outputs_match(
        tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> None:
    short, long = _prompts()
    full = len(long[0]) // BLOCK * BLOCK
    reuse_local = long[0][:full] + [7, 8, 9, 10, 11, 12, 13, 14]  # the decode engine holds all but 8
    reuse_remote = long[0][:full] + [t + 50 for t in range(LONG_SUFFIX)]  # ... all but 200
    expected = _reference(demo_model, short + long + [reuse_local, reuse_remote])
    # The threshold policy (uncached tokens on the decode engine below 128: decode-local) makes
    # the split exact on any machine; the cost policy's boundary moves with the measured speed
    # of this shared CPU (tens to a thousand tokens), which its unit tests cover instead.
    # 256 MiB of KV per engine (~360 blocks of the demo model): long[0]'s ~30 blocks stay cached
    # on its decode engine while the other long prompts pass (64 MiB could evict them).
    c = start_cluster(tmp_path_factory, "paths", num_prefill=2, num_decode=2,
                      engine_args=["--kv-cache-memory", "256MiB"],
                      scheduler_args=["--path-policy", "threshold", "--path-threshold-tokens", "128",
                                      "--log-level", "DEBUG"])
    try:
        first = asyncio.run(_run(c.target, [long[0]], 1))[0]
        assert first.path_reason.startswith("remote:") and first.transferred_tokens > 0, first
        holder = first.decode_engine_id
        mixed = asyncio.run(_mixed(c.target, short, long[1:]))
        results = [*mixed[:len(short)], first, *mixed[len(short):]]
        for r in results[:len(short)]:
            assert r.path_reason.startswith("decode_local:"), r.path_reason
            assert r.prefill_engine_id == "" and r.transferred_tokens == 0
        for r in results[len(short):]:
            assert r.path_reason.startswith("remote:"), r.path_reason
            assert r.prefill_engine_id in ("prefill-0", "prefill-1")
        hashes = BlockHasher(BLOCK, DEFAULT_HASH_SEED).external_hashes(long[0])
        wait_for_block(c, holder, hashes[full // BLOCK - 1])

        local = asyncio.run(_run(c.target, [reuse_local], 1))[0]
        assert local.path_reason == "decode_local:decode_has_prefix", local
        assert local.decode_engine_id == holder, (local.decode_engine_id, holder)
        # Usage.cached_tokens of a decode-local request: its engine's own prefix-cache hit.
        assert local.cached_tokens >= full - BLOCK and local.transferred_tokens == 0, local
        remote = asyncio.run(_run(c.target, [reuse_remote], 1))[0]
        assert remote.path_reason.startswith("remote:"), remote.path_reason
        assert remote.decode_engine_id == holder, (remote.decode_engine_id, holder)
        # The decode engine pulled only the blocks after its own cached prefix.
        assert remote.cached_tokens >= full - BLOCK, remote.cached_tokens
        assert 0 < remote.transferred_tokens <= remote.prompt_tokens - (full - BLOCK), remote.transferred_tokens

        got = [r.token_ids for r in results + [local, remote]]
        assert got == expected
        assert c.wait_no_leaks() == {}
    finally:
        c.stop()
