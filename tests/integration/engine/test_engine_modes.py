"""Disaggregated modes in-process: a PREFILL_ONLY engine pins the prompt's KV, a REMOTE_KV
engine receives it by block copy (what the UCX data plane does across processes), and greedy
output equals a normal colocated run."""

from __future__ import annotations

import pytest

from engine.request import RequestMode, RequestStatus, SamplingParams

BS = 8
N = 24


def _drain(engine, rid):
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def _prefill(p_engine, rid, prompt):
    p_engine.add_request(rid, prompt, SamplingParams(max_tokens=N), mode=RequestMode.PREFILL_ONLY)
    outs = _drain(p_engine, rid)
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length"
    assert p_engine.batch_scheduler.requests[rid].status is RequestStatus.PINNED
    assert p_engine.load().num_pinned == 1
    return outs[0].new_token_ids[0]


def _copy_blocks(src, src_ids, dst, dst_ids, first_block):
    for s, d in zip(src_ids[first_block:], dst_ids[first_block:], strict=False):
        dst.kv_cache[d].copy_(src.kv_cache[s])


@pytest.mark.parametrize("warm_prefix", [False, True])
def test_prefill_then_remote_kv_decode_matches_colocated(tiny_model, make_engine, prompts_of, warm_prefix) -> None:
    model = tiny_model("llama_gqa_llama3")
    [prompt] = prompts_of([5 * BS + 3], seed=7)
    expected = model.reference(prompt, N)
    p_eng = make_engine(model.path, block_size=BS)
    d_eng = make_engine(model.path, block_size=BS)
    if warm_prefix:  # the decode engine already holds the first 2 blocks in its prefix cache
        d_eng.generate([prompt[: 2 * BS + 1]], SamplingParams(max_tokens=1))
    first = _prefill(p_eng, "r", prompt)
    assert first == expected[0]
    d_eng.add_request("r", prompt, SamplingParams(max_tokens=N), mode=RequestMode.REMOTE_KV,
                      output_token_ids=[first])
    local = d_eng.num_local_cached_tokens("r")
    assert local == (2 * BS if warm_prefix else 0)
    assert d_eng.batch_scheduler.requests["r"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert d_eng.step() == [] and d_eng.has_unfinished_requests()
    d_ids, p_ids = d_eng.get_block_ids("r"), p_eng.get_block_ids("r")
    assert len(d_ids) == len(p_ids) == -(-len(prompt) // BS)
    _copy_blocks(p_eng, p_ids, d_eng, d_ids, local // BS)
    d_eng.finish_remote_kv("r", ok=True)
    outs = _drain(d_eng, "r")
    assert [t for o in outs for t in o.new_token_ids] == expected[1:]
    assert outs[-1].finish_reason == "length"
    assert p_eng.release("r") is True
    assert p_eng.release("r") is False


@pytest.mark.parametrize("how", ["failed", "invalid_blocks"])
def test_failed_or_partial_transfer_is_recomputed(tiny_model, make_engine, prompts_of, how) -> None:
    model = tiny_model("qwen2_bias")
    [prompt] = prompts_of([4 * BS + 5], seed=8)
    expected = model.reference(prompt, N)
    p_eng = make_engine(model.path, block_size=BS)
    d_eng = make_engine(model.path, block_size=BS)
    first = _prefill(p_eng, "r", prompt)
    d_eng.add_request("r", prompt, SamplingParams(max_tokens=N), mode=RequestMode.REMOTE_KV,
                      output_token_ids=[first])
    d_ids, p_ids = d_eng.get_block_ids("r"), p_eng.get_block_ids("r")
    if how == "failed":
        d_eng.finish_remote_kv("r", ok=False)
    else:
        _copy_blocks(p_eng, p_ids, d_eng, d_ids, 0)
        d_eng.kv_cache[d_ids[2]].fill_(1e3)  # garbage in block 2: reported invalid, must be recomputed
        d_eng.finish_remote_kv("r", ok=True, invalid_block_ids={d_ids[2]})
        assert d_eng.batch_scheduler.requests["r"].num_computed_tokens == 2 * BS
    outs = _drain(d_eng, "r")
    assert [t for o in outs for t in o.new_token_ids] == expected[1:]
    assert p_eng.abort_request("r") is True  # aborting a pinned request releases it
    assert p_eng.release("r") is False


def test_abort_in_every_state_frees_blocks(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    eng = make_engine(model.path, block_size=BS)
    p1, p2, p3 = prompts_of([30, 12, 20], seed=9)
    eng.add_request("running", p1, SamplingParams(max_tokens=50))
    eng.step()
    eng.add_request("waiting", p2, SamplingParams(max_tokens=5))
    eng.add_request("remote", p3, SamplingParams(max_tokens=5), mode=RequestMode.REMOTE_KV, output_token_ids=[3])
    assert eng.load().num_running == 1 and eng.load().num_waiting == 1
    assert all(eng.abort_request(r) for r in ("running", "waiting", "remote"))
    assert eng.abort_request("running") is False
    outs = eng.step()
    assert sorted(o.request_id for o in outs) == ["remote", "running", "waiting"]
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert not eng.has_unfinished_requests()
    assert eng.load().num_free_blocks == eng.kv_cache_spec.num_blocks


@pytest.mark.parametrize("holder_keeps", [4, 2])
def test_peer_fetch_of_a_prefix_then_the_rest_computed_matches_colocated(tiny_model, make_engine, prompts_of,
                                                                         holder_keeps) -> None:
    """A peer fetch (decisions 0043, 0049): the holder pins the prefix blocks it still caches,
    computing nothing (`pin_cached_prefix`), the puller receives only those blocks (REMOTE_KV
    with `remote_kv_tokens`), computes the rest of the prompt and samples the first token
    itself. `holder_keeps` 2 of the 4 blocks asked for (the rest evicted since the decision):
    2 are pinned and pulled, the puller computes more; the output is the same."""
    model = tiny_model("llama_gqa_llama3")
    [prompt] = prompts_of([6 * BS + 5], seed=9)
    expected = model.reference(prompt, N)
    holder = make_engine(model.path, block_size=BS)
    puller = make_engine(model.path, block_size=BS)
    holder.generate([prompt[:holder_keeps * BS + 3]], SamplingParams(max_tokens=2))  # a turn that began with it
    fetched = holder.pin_cached_prefix("r", prompt[:4 * BS])
    assert fetched == holder_keeps * BS
    assert holder.batch_scheduler.requests["r"].status is RequestStatus.PINNED and holder.load().num_pinned == 1
    puller.add_request("r", prompt, SamplingParams(max_tokens=N), mode=RequestMode.REMOTE_KV,
                       remote_kv_tokens=fetched)
    assert puller.batch_scheduler.requests["r"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    h_ids, p_ids = holder.get_block_ids("r"), puller.get_block_ids("r")
    assert len(h_ids) == len(p_ids) == fetched // BS
    _copy_blocks(holder, h_ids, puller, p_ids, 0)
    puller.finish_remote_kv("r", ok=True)
    assert puller.batch_scheduler.requests["r"].num_computed_tokens == fetched
    outs = _drain(puller, "r")
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert holder.release("r") is True
    assert not holder.check_leaks() and not puller.check_leaks()


@pytest.mark.parametrize("evicted", [False, True])
def test_a_prefill_engine_pulls_a_peers_prefix_into_its_cache_then_prefills_the_rest(
        tiny_model, make_engine, prompts_of, evicted) -> None:
    """A fetch into a prefill engine (decision 0046): the holder pins the prefix, the prefill
    engine runs the pull (REMOTE_KV of the prefix and one token, `remote_kv_tokens` the prefix),
    and its prefill of the whole prompt, next, finds the pulled blocks cached and computes only
    the rest. `evicted`: the pulled blocks left its cache before the prefill, which recomputes
    them. Either way the decode engine's output equals the colocated run's."""
    model = tiny_model("llama_gqa_llama3")
    [prompt] = prompts_of([6 * BS + 5], seed=11)
    expected = model.reference(prompt, N)
    holder = make_engine(model.path, block_size=BS)
    p_eng = make_engine(model.path, block_size=BS)
    d_eng = make_engine(model.path, block_size=BS)
    fetched = 4 * BS
    holder.generate([prompt[:fetched + 3]], SamplingParams(max_tokens=2))  # a turn that began with it
    assert holder.pin_cached_prefix("pull", prompt[:fetched]) == fetched
    p_eng.add_request("pull", prompt[:fetched + 1], SamplingParams(max_tokens=1), mode=RequestMode.REMOTE_KV,
                      remote_kv_tokens=fetched)
    _copy_blocks(holder, holder.get_block_ids("pull"), p_eng, p_eng.get_block_ids("pull"), 0)
    p_eng.finish_remote_kv("pull", ok=True)
    assert [o.finish_reason for o in _drain(p_eng, "pull")] == ["length"]
    assert holder.release("pull") is True
    if evicted:
        assert p_eng.reset_prefix_cache()
    first = _prefill(p_eng, "r", prompt)
    assert p_eng.num_local_cached_tokens("r") == (0 if evicted else fetched)
    assert first == expected[0]
    d_eng.add_request("r", prompt, SamplingParams(max_tokens=N), mode=RequestMode.REMOTE_KV, output_token_ids=[first])
    _copy_blocks(p_eng, p_eng.get_block_ids("r"), d_eng, d_eng.get_block_ids("r"), 0)
    d_eng.finish_remote_kv("r", ok=True)
    assert [t for o in _drain(d_eng, "r") for t in o.new_token_ids] == expected[1:]
    assert p_eng.release("r") is True
    assert not holder.check_leaks() and not p_eng.check_leaks() and not d_eng.check_leaks()


def test_remote_kv_tokens_is_refused_outside_a_remote_kv_request(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    [prompt] = prompts_of([3 * BS], seed=10)
    eng = make_engine(model.path, block_size=BS)
    with pytest.raises(ValueError, match="remote_kv_tokens"):
        eng.add_request("a", prompt, SamplingParams(max_tokens=2), remote_kv_tokens=BS)
    with pytest.raises(ValueError, match="remote_kv_tokens"):
        eng.add_request("b", prompt, SamplingParams(max_tokens=2), mode=RequestMode.REMOTE_KV,
                        remote_kv_tokens=len(prompt))
    assert not eng.check_leaks()
