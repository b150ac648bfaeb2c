"""End-to-end fixtures: real clusters (scheduler, prefill and decode services as processes, UCX
between them) on the demo model, and greedy reference outputs from the in-process engine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_cluster import MAX_TOKENS, PROMPT_TEXTS, start_cluster

from services.local_cluster import LocalCluster


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from engine.demo_model import demo_model_dir

    return demo_model_dir()


@pytest.fixture(scope="session")
def prompts(demo_model: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_model / "tokenizer.json"))
    return [tok.encode(t).ids for t in PROMPT_TEXTS]


@pytest.fixture(scope="session")
def reference(demo_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of the engine in this process (what `pdserve offline` runs)."""
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLMEngine(demo_model, torch_threads=1, dtype="float32") as engine:
        return engine.generate(prompts, params)


@pytest.fixture(scope="session")
def tiny_tp_model(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama (4 heads, 2 KV heads: divisible by tp 2, unlike the demo model's 3)
    with the demo model's tokenizer."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      initializer_range=0.1, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(7)
    path = tmp_path_factory.mktemp("tiny-tp-model")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (demo_model / name).exists():
            shutil.copy(demo_model / name, path / name)
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory, "cluster")
    yield c
    c.stop()
    _dump_logs_on_failure(c)


def _dump_logs_on_failure(cluster: LocalCluster) -> None:
    if os.environ.get("PDSERVE_E2E_LOGS"):
        for comp in cluster.components.values():
            if comp.log_path is not None and comp.log_path.exists():
                print(f"==== {comp.name}\n{comp.log_path.read_text()[-4000:]}")
