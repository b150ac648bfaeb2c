"""Fixtures for engine integration tests: tiny random Hugging Face models saved to disk, engines
with a leak check after every test, and transformers' greedy generate as the reference."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

torch.set_num_threads(2)

TINY_VOCAB = 512


def _build(kind: str) -> tuple[Any, Any]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common: dict[str, Any] = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  max_position_embeddings=512, initializer_range=0.1, eos_token_id=None,
                                  bos_token_id=None, pad_token_id=0)
    if kind == "llama_gqa_llama3":
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope, **common)
        return cfg, LlamaForCausalLM
    if kind == "qwen2_bias":
        return Qwen2Config(num_attention_heads=4, num_key_value_heads=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common), Qwen2ForCausalLM
    if kind == "llama_tied_mqa_headdim":
        cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True,
                          **common)
        return cfg, LlamaForCausalLM
    if kind == "mistral":
        return MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None, **common), \
            MistralForCausalLM
    raise KeyError(kind)


class TinyModel:
    def __init__(self, kind: str, root: Path) -> None:
        cfg, cls = _build(kind)
        torch.manual_seed(1234)
        self.hf = cls(cfg).eval()
        self.path = root / kind
        self.hf.save_pretrained(self.path)
        self.kind = kind

    def reference(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = self.hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(prompt):].tolist()


_CACHE: dict[str, TinyModel] = {}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    root = tmp_path_factory.mktemp("tiny-models")

    def get(kind: str) -> TinyModel:
        if kind not in _CACHE:
            _CACHE[kind] = TinyModel(kind, root)
        return _CACHE[kind]

    return get


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Any]]:
    """Builds engines; after the test every engine must have no leaked block or request."""
    from engine.llm_engine import LLMEngine

    engines: list[LLMEngine] = []

    def make(model: str | Path, **kw: Any) -> LLMEngine:
        kw.setdefault("kv_cache_memory", "8MiB")
        kw.setdefault("torch_threads", 2)
        kw.setdefault("dtype", "float32")  # parity with transformers' float32 reference
        engine = LLMEngine(model, **kw)
        engines.append(engine)
        return engine

    yield make
    problems = []
    for engine in engines:
        problems += engine.check_leaks()
        engine.shutdown()
    assert not problems, problems


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, TINY_VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def prompts_of() -> Callable[..., list[list[int]]]:
    return random_prompts
