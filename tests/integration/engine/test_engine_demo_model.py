"""The converted demo model (GGUF -> Hugging Face directory) generates exactly what transformers
generates when it loads the GGUF itself (greedy, float32). Slow: transformers' GGUF load ~25 s."""

from __future__ import annotations

import json

import pytest
import torch

from engine.demo_model import demo_model_dir, gguf_path
from engine.request import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
           "The quick brown fox"]


def test_converted_demo_model_matches_transformers_gguf(make_engine) -> None:
    from transformers import AutoModelForCausalLM

    path = demo_model_dir()
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["rope_theta"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, 100000.0, True)
    assert "im_start" in json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    engine = make_engine(path, kv_cache_memory="64MiB")
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=20))

    src = gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
        n = len(want)  # transformers stops at EOS like the engine does
        assert got == want[:n]
    assert "Red" in engine.tokenizer.decode(ours[0])

    # Stop strings and incremental text on the real tokenizer.
    engine.add_request("s", prompts[0], SamplingParams(max_tokens=20, stop=["Blue"]))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    text = "".join(o.text_delta for o in outs)
    assert outs[-1].finish_reason == "stop" and "Red" in text and "Blue" not in text
    assert text == engine.tokenizer.decode(ours[0])[: len(text)]
