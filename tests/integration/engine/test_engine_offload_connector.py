"""The batch scheduler drives a real scheduler-side connector: the CPU offload tier saves
blocks after compute and loads them back on a tier hit (synchronous external tokens), and the
greedy output is unchanged."""

from __future__ import annotations

from connectors.kv_events import BlockStored
from connectors.offload import build_offload
from engine.request import SamplingParams

BS = 8


def test_offload_tier_hit_skips_recompute_and_keeps_output(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    [prompt] = prompts_of([5 * BS + 3], seed=51)
    # Probe engine for the block size in bytes, then an engine with the tier.
    probe = make_engine(model.path, block_size=BS, num_blocks=4)
    scheduler_side, rank_init = build_offload(memory_bytes=64 * probe.kv_cache_spec.block_nbytes, block_size=BS,
                                              block_nbytes=probe.kv_cache_spec.block_nbytes, working_medium="CPU")
    engine = make_engine(model.path, block_size=BS, rank_init=rank_init, scheduler_connector=scheduler_side)
    expected = model.reference(prompt, 16)
    assert engine.generate([prompt], SamplingParams(max_tokens=16)) == [expected]
    assert engine.reset_prefix_cache()  # the device cache forgets; the tier keeps its copies
    engine.kv_cache.zero_()  # and stale device blocks cannot help: the KV must come from the tier
    engine.take_events()

    engine.add_request("again", prompt, SamplingParams(max_tokens=16))
    tokens, cached = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    assert tokens == expected
    assert cached == 0  # nothing came from the device prefix cache ...
    assert scheduler_side.num_hit_tokens == 5 * BS  # ... everything full came from the tier
    stored = [e for e in engine.take_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in stored) >= 5  # loaded blocks are device-cached again
    engine.take_connector_outputs()
