"""A peer fetch's pin on pdserve's engine is a cache operation, not a forward pass (decision 0049):
on an engine busy with a long prefill the pin answers between two of its steps, from a
command-only plan that carries every rank's send and computes nothing, while the long prefill
still runs; the pinned blocks survive eviction pressure (their KV unchanged) until released,
exactly once, with nothing leaked (the `make_engine` fixture checks every engine). A prefix
partly evicted is pinned as far as it is cached; nothing cached is refused with nothing changed."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from connectors.ucx.scheduler import UcxSchedulerConnector
from engine.request import RequestStatus, SamplingParams
from services.engine.backend import DuplicateRequest
from services.engine.native.loop import EngineLoop
from services.engine.native.peer_pin import pin_for_peer

BS = 8
NUM_BLOCKS = 40
PREFIX_BLOCKS = 5


def _engine(make_engine: Any, model: Any, **kw: Any) -> tuple[Any, UcxSchedulerConnector]:
    connector = UcxSchedulerConnector(BS)
    engine = make_engine(model.path, block_size=BS, num_blocks=NUM_BLOCKS, scheduler_connector=connector, **kw)
    return engine, connector


def _warm(engine: Any, prompt: list[int]) -> list[int]:
    """Computes `prompt` (its full blocks are then cached, free) and returns those blocks' ids."""
    engine.generate([prompt], SamplingParams(max_tokens=1))
    hashes = engine.hasher.hash_blocks(prompt)
    blocks = [engine.kv.pool.get_cached_block(h) for h in hashes]
    assert all(b is not None for b in blocks)
    return [b.block_id for b in blocks]


def _recording(engine: Any) -> list[tuple[list[str], list[Any]]]:
    """Every plan the ranks execute: (the requests it computes, its sends: pins for readers)."""
    plans: list[tuple[list[str], list[Any]]] = []
    execute = engine.workers.execute

    def record(plan: Any) -> Any:
        meta = plan.connector_meta
        plans.append(([c.request_id for c in plan.chunks], list(meta.sends) if meta is not None else []))
        return execute(plan)

    engine.workers.execute = record
    return plans


def test_a_pin_on_a_busy_engine_answers_between_steps_without_computing(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    # 16 tokens a step: the long prompt's prefill takes 15 steps.
    engine, connector = _engine(make_engine, model, max_num_batched_tokens=16)
    prefix, long, tail = prompts_of([PREFIX_BLOCKS * BS, 30 * BS, 3], seed=11)
    prefix_blocks = _warm(engine, prefix + tail)[:PREFIX_BLOCKS]
    plans = _recording(engine)
    running = threading.Event()
    loop = EngineLoop(engine, deliver=lambda _: None, flush_pending=connector.has_pending,
                      after_step=lambda e, *_: running.set() if e.batch_scheduler.running else None,
                      periodic=lambda _: None)
    loop.call(lambda e: e.add_request("long", long, SamplingParams(max_tokens=1)))
    loop.start()
    try:
        assert running.wait(60)
        long_state: dict[str, Any] = {}

        def pin(e: Any) -> tuple[int, list[int]]:
            out = pin_for_peer(e, connector, "pin", prefix + tail, 0)
            request = e.batch_scheduler.requests["long"]
            long_state.update(status=request.status, computed=request.num_computed_tokens)
            return out

        num_tokens, block_ids = loop.call(pin).result(60)
        # The long prefill was still under way when the pin answered.
        assert long_state["status"] is RequestStatus.RUNNING and 0 < long_state["computed"] < len(long), long_state
        assert (num_tokens, block_ids) == (PREFIX_BLOCKS * BS, prefix_blocks)  # the partial tail block is not pinned
        assert engine.batch_scheduler.requests["pin"].status is RequestStatus.PINNED
        # Every rank pinned the blocks for the reader in a plan of its own that computed nothing,
        # and the pin was never scheduled.
        pin_plans = [(chunks, [s.request_id for s in sends]) for chunks, sends in plans
                     if any(s.request_id == "pin" for s in sends)]
        assert pin_plans == [([], ["pin"])], plans
        assert not any("pin" in chunks for chunks, _ in plans)
        loop.call(lambda e: e.abort_request("long")).result(60)
    finally:
        loop.stop()
    assert engine.load().num_pinned == 1 and engine.release("pin") is True


def test_pinned_blocks_survive_eviction_pressure_until_released_once(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    engine, connector = _engine(make_engine, model)
    prefix, tail = prompts_of([PREFIX_BLOCKS * BS, 4], seed=12)
    prefix_blocks = _warm(engine, prefix + tail)[:PREFIX_BLOCKS]
    kv_before = engine.kv_cache[prefix_blocks].clone()
    plans = _recording(engine)
    assert pin_for_peer(engine, connector, "pin", prefix, 2) == (PREFIX_BLOCKS * BS, prefix_blocks)
    # Every rank was told at once, with the reader's TP, and nothing was computed.
    [(chunks, [send])] = plans
    assert chunks == [] and (send.request_id, send.block_ids, send.reader_tp_size) == ("pin", prefix_blocks, 2)
    with pytest.raises(DuplicateRequest, match="already running or pinned"):
        pin_for_peer(engine, connector, "pin", prefix, 0)
    # Unrelated prompts needing every other block of the cache, twice over.
    for seed in (13, 14):
        [other] = prompts_of([(NUM_BLOCKS - PREFIX_BLOCKS - 1) * BS - 1], seed=seed)
        engine.generate([other], SamplingParams(max_tokens=1))
    assert [engine.kv.pool.get_cached_block(h).block_id
            for h in engine.hasher.hash_blocks(prefix)] == prefix_blocks
    assert torch.equal(engine.kv_cache[prefix_blocks], kv_before)
    assert engine.release("pin") is True
    assert engine.release("pin") is False and engine.abort_request("pin") is False
    assert engine.load().num_pinned == 0


def test_a_partly_evicted_prefix_is_pinned_as_far_as_it_is_cached(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    engine, connector = _engine(make_engine, model)
    prefix, tail = prompts_of([PREFIX_BLOCKS * BS, 4], seed=15)
    prefix_blocks = _warm(engine, prefix + tail)[:PREFIX_BLOCKS]
    # Freed tail first, the prefix's last blocks are evicted first: take every never-used block,
    # the warm-up's partial block and 2 of the prefix's.
    num_taken = NUM_BLOCKS - (PREFIX_BLOCKS + 1) + 1 + 2
    [other] = prompts_of([num_taken * BS - 1], seed=16)
    engine.generate([other], SamplingParams(max_tokens=1))
    cached = [engine.kv.pool.get_cached_block(h) for h in engine.hasher.hash_blocks(prefix)]
    assert [b is not None for b in cached] == [True] * 3 + [False] * 2  # the setup did what it meant to
    assert pin_for_peer(engine, connector, "pin", prefix + tail, 0) == (3 * BS, prefix_blocks[:3])
    assert engine.release("pin") is True


def test_nothing_cached_is_refused_with_nothing_changed(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    engine, connector = _engine(make_engine, model)
    prompt, other = prompts_of([PREFIX_BLOCKS * BS, PREFIX_BLOCKS * BS], seed=17)
    _warm(engine, other)
    free = engine.kv.pool.num_free_blocks
    assert pin_for_peer(engine, connector, "pin", prompt, 2) == (0, [])
    assert "pin" not in engine.batch_scheduler.requests and engine.kv.pool.num_free_blocks == free
    assert not connector.has_pending() and "pin" not in connector._reader_tp
    with pytest.raises(ValueError, match="vocabulary"):
        pin_for_peer(engine, connector, "bad", [10**9], 0)
    assert "bad" not in engine.batch_scheduler.requests and "bad" not in connector._reader_tp
