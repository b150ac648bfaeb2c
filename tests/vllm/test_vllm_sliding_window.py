"""A model vLLM gives KV the connector cannot move whole is refused when the engine starts,
end to end through `pdserve prefill --engine vllm`: exit status 2 and the connector's reason on
one line (vLLM itself reports only "Engine core initialization failed" from its engine-core
process; the connector leaves the reason for the engine service, `REFUSAL_FILE_ENV`).

The model: a tiny random Mistral whose every layer is sliding-window (made here with
transformers; tokenizer of the demo model). vLLM keeps such a model one `SlidingWindowSpec`
group, whose blocks behind the window are freed, so a prefill's blocks would not hold its
prompt's KV. (A model mixing sliding and full layers is one full-attention group under the
non-hybrid allocator vLLM uses with this connector — `unify_hybrid_kv_cache_specs` — and is
served.) One vLLM engine start: about 30 s here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.demo_model import demo_model_dir

PDSERVE = Path(sys.executable).parent / "pdserve"


@pytest.fixture(scope="module")
def all_sliding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import json

    import torch
    from transformers import MistralConfig, MistralForCausalLM

    demo = demo_model_dir()
    path = tmp_path_factory.mktemp("mistral-sliding")
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    config = MistralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           sliding_window=32)
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)
    return path


def test_an_all_sliding_window_model_is_refused_at_start_with_the_reason(all_sliding_model: Path) -> None:
    proc = subprocess.run(
        [str(PDSERVE), "prefill", "--engine", "vllm", "--engine-id", "sliding-0", "--scheduler", "127.0.0.1:9",
         "--host", "127.0.0.1", "--port", "0", "--model", str(all_sliding_model), "--block-size", "32",
         "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256", "--torch-threads", "1",
         "--vllm-arg", "enforce_eager=true"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last.startswith("pdserve prefill: vLLM engine sliding-0 refused at start: PdserveConnector moves "
                           "full-attention KV only; this model's cache is SlidingWindowSpec"), last
    assert "Serve it colocated" in last


def test_mixed_sliding_and_full_layers_are_one_full_attention_group_with_this_connector() -> None:
    """Why a Gemma-2/3-like model (sliding and full layers) is served: the connector does not
    declare vLLM's SupportsHMA, so vLLM turns its hybrid allocator off and promotes the sliding
    layers' specs to full attention (one group, every block kept); an all-sliding model stays
    a sliding-window group (the refusal above)."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    config = KVTransferConfig(kv_connector="PdserveConnector", kv_connector_module_path="connectors.vllm.connector",
                              kv_role="kv_both")
    assert not KVConnectorFactory.supports_hma_config(config)
    shape = dict(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32)
    mixed = {"l0": SlidingWindowSpec(**shape, sliding_window=32), "l1": FullAttentionSpec(**shape)}
    unify_hybrid_kv_cache_specs(mixed)
    assert {type(s) for s in mixed.values()} == {FullAttentionSpec}
    sliding = {"l0": SlidingWindowSpec(**shape, sliding_window=32)}
    unify_hybrid_kv_cache_specs(sliding)
    assert {type(s) for s in sliding.values()} == {SlidingWindowSpec}
