"""Greedy output must equal transformers' generate token for token (same dtype)."""

from __future__ import annotations

import pytest

from engine.request import SamplingParams

KINDS = ["llama_gqa_llama3", "qwen2_bias", "llama_tied_mqa_headdim", "mistral"]
NEW_TOKENS = 36


@pytest.mark.parametrize("kind", KINDS)
def test_batch1_matches_transformers(kind, tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model(kind)
    engine = make_engine(model.path)
    for prompt in prompts_of([7, 40], seed=1):
        [ours] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS))
        assert ours == model.reference(prompt, NEW_TOKENS)


@pytest.mark.parametrize("kind", KINDS[:3])
def test_eight_concurrent_requests_match_transformers(kind, tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model(kind)
    # A small token budget forces chunked prefill and prefill chunks mixed with decodes.
    engine = make_engine(model.path, max_num_batched_tokens=40, block_size=8)
    lengths = [3, 70, 17, 33, 1, 52, 9, 25]
    prompts = prompts_of(lengths, seed=2)
    ours = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == model.reference(prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


def test_transformers4_config_dialect_gives_the_same_output(tiny_model, make_engine, prompts_of, tmp_path) -> None:
    """The same checkpoint with rope_theta / rope_scaling at the top level (transformers 4)."""
    import json
    import shutil

    model = tiny_model("llama_gqa_llama3")
    legacy = tmp_path / "legacy"
    shutil.copytree(model.path, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    assert rope["rope_type"] == "llama3"
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (legacy / "config.json").write_text(json.dumps(cfg))
    [prompt] = prompts_of([90], seed=11)  # positions past original_max_position_embeddings
    [ours] = make_engine(legacy).generate([prompt], SamplingParams(max_tokens=NEW_TOKENS))
    assert ours == model.reference(prompt, NEW_TOKENS)
