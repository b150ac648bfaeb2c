"""Prefix-cache reuse, the KV events that describe it, eviction and preemption by recompute."""

from __future__ import annotations

from connectors.hashing import BlockHasher
from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.request import SamplingParams

BS = 16


def _run(engine, rid, prompt, max_tokens=8):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens, cached = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
    return tokens, cached


def test_shared_prefix_computes_only_the_suffix(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    engine = make_engine(model.path, block_size=BS)
    prefix, tail_a, tail_b = prompts_of([3 * BS, 5, 9], seed=3)
    a, b = prefix + tail_a, prefix + tail_b
    hasher = BlockHasher(BS)

    out_a, cached_a = _run(engine, "a", a)
    events_a = engine.take_events()
    assert cached_a == 0
    stored = [e for e in events_a if isinstance(e, BlockStored)]
    # Prompt a (53 tokens) + 7 computed outputs = 60 computed tokens: 3 full blocks stored.
    all_hashes = [h for e in stored for h in e.block_hashes]
    assert all_hashes == hasher.external_hashes((a + out_a)[: 3 * BS])
    assert stored[0].parent_block_hash is None
    for prev, ev in zip(stored, stored[1:], strict=False):
        assert ev.parent_block_hash == prev.block_hashes[-1]
    assert [t for e in stored for t in e.token_ids] == a[: 3 * BS]
    assert all(e.block_size == BS and e.medium == "CPU" for e in stored)

    out_b, cached_b = _run(engine, "b", b, max_tokens=30)
    assert cached_b == 3 * BS
    assert out_b == model.reference(b, 30)
    stored_b = [e for e in engine.take_events() if isinstance(e, BlockStored)]
    # b's new full blocks chain onto the shared prefix's last block.
    assert stored_b[0].parent_block_hash == hasher.external_hashes(prefix)[-1]
    assert [h for e in stored_b for h in e.block_hashes] == hasher.external_hashes(b + out_b[:-1])[3:]


def test_eviction_emits_block_removed_for_exactly_the_evicted_blocks(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    engine = make_engine(model.path, block_size=BS, num_blocks=8)
    pool = engine.kv.pool
    live: set[int | bytes] = set()
    removed_total: list[int | bytes] = []
    for i, prompt in enumerate(prompts_of([3 * BS + 2, 2 * BS + 5, 4 * BS + 1, 3 * BS], seed=4)):
        _run(engine, f"r{i}", prompt, max_tokens=4)
        for ev in engine.take_events():
            if isinstance(ev, BlockStored):
                assert not live & set(ev.block_hashes)
                live |= set(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert len(ev.block_hashes) == 1 and ev.block_hashes[0] in live
                live -= set(ev.block_hashes)
                removed_total += ev.block_hashes
    from connectors.hashing import to_external

    assert removed_total, "the workload must evict"
    assert live == {to_external(h) for h in pool._cached}
    assert engine.reset_prefix_cache()
    assert engine.take_events() == [AllBlocksCleared(medium="CPU")]


def test_preemption_by_recompute_keeps_greedy_output(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("qwen2_bias")
    prompts = prompts_of([20, 30, 12, 25], seed=5)
    engine = make_engine(model.path, block_size=8, num_blocks=14)
    ours = engine.generate(prompts, SamplingParams(max_tokens=40))
    assert engine.batch_scheduler.num_preemptions > 0
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == model.reference(prompt, 40)


def test_request_outgrowing_the_whole_cache_ends_with_length(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    engine = make_engine(model.path, block_size=8, num_blocks=2)
    [prompt] = prompts_of([10], seed=6)
    engine.add_request("big", prompt, SamplingParams(max_tokens=30))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == model.reference(prompt, 30)[: 16 - len(prompt) + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
