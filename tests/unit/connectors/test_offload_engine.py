"""The CPU offload tier inside the real engine (a tiny random Llama saved to disk).

- tp 2: each rank saves its own shard into its own host pool and reports its CPU-medium events;
  through the aggregator, a BlockStored appears only after both ranks stored.
- tp 1 with a small device KV budget: a prompt evicted from the device cache is served from the
  tier on its next request (tier hits, same greedy output).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from pathlib import Path
from typing import Any

import pytest
import torch

from connectors.aggregator import KVOutputAggregator
from connectors.hashing import BlockHasher, to_external
from connectors.kv_events import MEDIUM_CPU_OFFLOAD, BlockStored
from connectors.offload import OffloadRankInit, OffloadScheduler, OffloadWorker
from connectors.outputs import KVConnectorOutput
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams

BS = 8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    path = tmp_path_factory.mktemp("offload") / "tiny-llama"
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _drain(q: Any, count: int | None, timeout: float) -> list[KVConnectorOutput]:
    """`count` outputs (waiting up to `timeout` for each), or all that arrive before a quiet gap."""
    out: list[KVConnectorOutput] = []
    while count is None or len(out) < count:
        try:
            out.append(q.get(timeout=timeout))
        except queue.Empty:
            if count is not None:
                raise AssertionError(f"only {len(out)} of {count} rank outputs arrived") from None
            break
    return out


def test_tp2_cpu_events_only_after_every_rank_stored(tiny_llama: Path) -> None:
    ctx = mp.get_context("spawn")
    q0, q1 = ctx.Queue(), ctx.Queue()
    sched = OffloadScheduler(BS, num_cpu_blocks=16)
    engine = LLMEngine(tiny_llama, tp=2, block_size=BS, num_blocks=16, device="cpu", dtype="float32", torch_threads=1,
                       load_tokenizer=False, scheduler_connector=sched,
                       rank_init=OffloadRankInit(16, MEDIUM_CPU_OFFLOAD, (q0.put, q1.put)))
    try:
        prompt = [(7 * i) % 250 + 1 for i in range(27)]  # 3 full blocks + 3 tokens
        engine.generate([prompt], SamplingParams(max_tokens=6))
        hashes = BlockHasher(BS).hash_blocks(prompt)
        # Rank 0's pool holds exactly its device blocks' KV (the device cache still has them).
        rank0 = engine.workers.rank0.connector
        assert isinstance(rank0, OffloadWorker)
        slots = {h: slot for slot, h in rank0.slot_hashes().items()}
        for block_hash in hashes:
            block = engine.kv.pool.get_cached_block(block_hash)
            assert block is not None
            assert torch.equal(rank0.pool[slots[to_external(block_hash)]], engine.kv_cache[block.block_id])
    finally:
        engine.shutdown()
    outs0 = _drain(q0, None, 2.0)
    outs1 = _drain(q1, len(outs0), 30.0)
    assert outs0 and all(o.kv_cache_events for o in outs0)

    agg = KVOutputAggregator()
    agg.register_engine("e", 1, [0, 1])
    early = [e for o in outs0 for e in agg.add_report("e", 1, 0, o).events]
    assert early == []  # rank 0 alone never completes a block
    late = [e for o in outs1 for e in agg.add_report("e", 1, 1, o).events]
    stored = [h for e in late if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored[:3] == [to_external(h) for h in hashes]
    assert all(e.medium == MEDIUM_CPU_OFFLOAD for e in late)
    assert agg.pending_reports()["e"].total == 0


def test_prompt_evicted_from_device_is_served_from_the_tier(tiny_llama: Path) -> None:
    sched = OffloadScheduler(BS, num_cpu_blocks=32)
    engine = LLMEngine(tiny_llama, tp=1, block_size=BS, num_blocks=8, device="cpu", dtype="float32", torch_threads=1,
                       load_tokenizer=False, scheduler_connector=sched, rank_init=OffloadRankInit(32))
    try:
        params = SamplingParams(max_tokens=4)
        prompt = [(5 * i) % 250 + 1 for i in range(33)]  # 4 full blocks + 1 token
        first = engine.generate([prompt], params)
        for seed in (3, 11):  # push the prompt's blocks out of the 8-block device cache
            engine.generate([[(seed * i) % 250 + 1 for i in range(40)]], params)
        assert engine.kv.get_computed_blocks(_probe(prompt)) == []
        again = engine.generate([prompt], params)
        assert again == first
        assert sched.num_hit_tokens == 32
        assert engine.check_leaks() == []
    finally:
        engine.shutdown()


def _probe(prompt: list[int]) -> Request:
    return Request("probe", list(prompt), SamplingParams(), all_token_ids=list(prompt))
