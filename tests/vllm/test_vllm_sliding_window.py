"""Sliding-window models with vLLM engines, end to end.

Refused: a tiny random Mistral whose every layer is sliding-window, through `pdserve prefill
--engine vllm`: exit status 2 and the connector's reason on one line (vLLM itself reports only
"Engine core initialization failed" from its engine-core process; the connector leaves the
reason for the engine service, `REFUSAL_FILE_ENV`). vLLM keeps such a model one
`SlidingWindowSpec` group, whose blocks behind the window are freed, so a prefill's blocks
would not hold its prompt's KV.

Served: a tiny random Gemma-2 (a sliding-window layer, window 48, then a full-attention layer;
logit softcapping, which vLLM's CPU attention implements). The connector does not declare
vLLM's `SupportsHMA`, so vLLM turns its hybrid allocator off and keeps every layer's KV as one
full-attention group (`unify_hybrid_kv_cache_specs`); the sliding layers still attend within
their window. One prefill and one decode engine: prompts longer than the window, disaggregated
(KV over UCX), token-identical to vLLM colocated greedy in fp32 (which is itself token-identical
to transformers' greedy: vLLM applies the window), `transferred_tokens` exact with and without a
local prefix hit on the decode engine.

On the shared 2-core host: the refusal 23 s; the Gemma-2 cluster starts in 23-35 s, its test 1-7 s."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_cluster import BLOCK, colocated, generate_greedy, vllm_cluster

from engine.demo_model import demo_model_dir
from services.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(1200)  # the cluster starts slowly when the shared host is loaded

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
    _copy_tokenizer(demo, path)
    return path


def _copy_tokenizer(demo: Path, path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)


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
    assert "behind the 32-token window" in last, last
    assert "--vllm-arg disable_sliding_window=true and --max-model-len 32 or less" in last, last


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



def test_a_local_attention_group_is_refused_with_what_would_serve_it() -> None:
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from connectors.vllm.connector import _check_kv_cache_groups

    chunked = ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32,
                                        attention_chunk_size=64)
    with pytest.raises(ValueError, match=r"cache is ChunkedLocalAttentionSpec \(not every prompt token's KV is kept "
                                         r"in its blocks\). Serve it colocated$"):
        _check_kv_cache_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(["l0"], chunked)]))

WINDOW = 48  # not a multiple of BLOCK: the window's edge falls inside a block
MAX_TOKENS = 16
MAX_LEN = 256


@pytest.fixture(scope="module")
def mixed_sliding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Gemma-2, sliding layer then full layer, its queries and keys scaled up: at
    transformers' default init attention is nearly uniform (an average of V that no block order
    changes) and greedy repeats one token. Sharpened, 16 tokens are 16 different ones, and each
    prompt's tokens change when the window is removed or the first block masked out (checked with
    transformers), or when a decode engine's first two pulled blocks trade places (checked by
    breaking the connector's pull)."""
    import json

    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    demo = demo_model_dir()
    path = tmp_path_factory.mktemp("gemma2-mixed")
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    config = Gemma2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                          sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                          query_pre_attn_scalar=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():  # sharp attention: which positions a layer sees (window, block order) shows in the tokens
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    model.save_pretrained(path)
    _copy_tokenizer(demo, path)
    return path


@pytest.fixture(scope="module")
def mixed_cluster(tmp_path_factory: pytest.TempPathFactory, mixed_sliding_model: Path) -> Iterator[LocalCluster]:
    # 2 MiB: 64 blocks of 2 layers x 2 KV heads x 32 tokens x K,V x 32 x fp32, few enough to evict
    with vllm_cluster(tmp_path_factory, "vllm-gemma2", model=str(mixed_sliding_model), num_prefill=1, num_decode=1,
                      kv_cache_memory="2MiB", scheduler_args=["--path-policy", "remote"], max_model_len=MAX_LEN,
                      max_num_seqs=4) as c:
        yield c


def _prompt(length: int, seed: int) -> list[int]:
    return [1000 + (i * 37 + seed) % 3000 for i in range(length)]


def _evict_prefix_cache(cluster: LocalCluster, name: str) -> None:
    """Cycles every block of `name`'s pool through other prompts, so the prompts computed there
    before are no longer cached (vLLM evicts least recently freed first)."""
    num_blocks = cluster.inspect(name).num_blocks
    per_prompt = MAX_LEN // BLOCK - 1
    for seed in range(num_blocks // per_prompt + 2):
        colocated(cluster, _prompt(per_prompt * BLOCK, 100 + seed), 1, name=name)


def _transformers_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def test_a_mixed_sliding_and_full_model_is_served_token_identical(mixed_cluster: LocalCluster,
                                                                  mixed_sliding_model: Path) -> None:
    """Cold prompts (70, 120, 161 tokens: the window's edge in the first, middle and last
    block) transfer their whole prompt; a prompt whose first 2 blocks (64 tokens, more than
    the window) the decode engine already holds transfers only the rest. The reference is
    vLLM colocated on the decode engine, whose prefix cache is then cycled out."""
    cold = [_prompt(70, 1), _prompt(120, 2), _prompt(161, 3)]
    warm = _prompt(150, 4)
    changed_start = _prompt(2 * BLOCK, 50) + cold[1][2 * BLOCK:]  # cold[1] with its first 2 blocks replaced
    reference = [colocated(mixed_cluster, p, MAX_TOKENS) for p in (*cold, warm, changed_start)]
    assert reference[4] != reference[1], "the tokens do not depend on the first blocks: the test could not fail"
    assert reference == _transformers_greedy(mixed_sliding_model, [*cold, warm, changed_start])
    _evict_prefix_cache(mixed_cluster, "decode-0")
    colocated(mixed_cluster, warm[:2 * BLOCK + 3], 1)
    results = generate_greedy(mixed_cluster.target, [*cold, warm], MAX_TOKENS, concurrency=4)
    for i, (result, expected) in enumerate(zip(results, reference, strict=False)):
        assert result.token_ids == expected, f"prompt {i}: {result.token_ids} != {expected}"
    for prompt, result in zip(cold, results, strict=False):
        assert (result.cached_tokens, result.transferred_tokens) == (0, len(prompt)), result
    assert (results[3].cached_tokens, results[3].transferred_tokens) == (2 * BLOCK, len(warm) - 2 * BLOCK), results[3]
    assert mixed_cluster.wait_no_leaks(timeout=60) == {}
