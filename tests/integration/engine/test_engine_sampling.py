"""Sampling through the engine: seeds reproduce regardless of batch, stop ids and lengths."""

from __future__ import annotations

from engine.request import SamplingParams


def test_seeded_sampling_is_independent_of_the_batch(tiny_model, make_engine, prompts_of) -> None:
    engine = make_engine(tiny_model("llama_gqa_llama3").path)
    target, *others = prompts_of([10, 20, 7, 33], seed=41)
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    [alone] = engine.generate([target], params)
    together = engine.generate([target, *others], [params] + [SamplingParams(max_tokens=20, temperature=1.0)] * 3)
    assert together[0] == alone
    [other_seed] = engine.generate([target], SamplingParams(max_tokens=20, temperature=0.9, top_k=50,
                                                           top_p=0.9, seed=99))
    assert other_seed != alone


def test_stop_token_ids_and_max_tokens(tiny_model, make_engine, prompts_of) -> None:
    engine = make_engine(tiny_model("qwen2_bias").path)
    [prompt] = prompts_of([12], seed=42)
    [greedy] = engine.generate([prompt], SamplingParams(max_tokens=16))
    stop_at = greedy[5]
    engine.add_request("s", prompt, SamplingParams(max_tokens=16, stop_token_ids=[stop_at]))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == greedy[: greedy.index(stop_at) + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].finished
    assert all(not o.finished for o in outs[:-1])
    assert outs[-1].num_prompt_tokens == len(prompt)
