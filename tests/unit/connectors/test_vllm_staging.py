"""KVStaging: vLLM's per-layer CPU KV tensors <-> pdserve's block-major NHL2BD region."""

from __future__ import annotations

import pytest
import torch

from connectors.vllm.staging import KVStaging

N, H, B, D, L = 6, 3, 4, 5, 2


def vllm_caches() -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.randn(N, H, B, 2 * D) for i in range(L)}


def test_gather_writes_the_nhl2bd_layout_and_scatter_inverts_it() -> None:
    caches = vllm_caches()
    staging = KVStaging(caches)
    staging.gather([4, 1])
    for layer, t in enumerate(caches.values()):
        for b in (4, 1):
            # vLLM's CPU backend: each head's block is K rows then V rows ([2 * B, D] per head)
            k, v = t[b].view(H, 2 * B, D).chunk(2, dim=1)
            assert torch.equal(staging.region[b, :, layer, 0], k)
            assert torch.equal(staging.region[b, :, layer, 1], v)
    before = {name: t.clone() for name, t in caches.items()}
    for t in caches.values():
        t.zero_()
    staging.scatter([4, 1])
    for name, t in caches.items():
        assert torch.equal(t[[4, 1]], before[name][[4, 1]])
        assert not t[[0, 2, 3, 5]].any()  # other blocks untouched


def test_rejects_tensors_of_another_layout() -> None:
    with pytest.raises(ValueError, match="expected vLLM CPU KV tensors"):
        KVStaging({"a": torch.zeros(2, N, H, B, D)})
    with pytest.raises(ValueError, match="one shape and dtype"):
        KVStaging({"a": torch.zeros(N, H, B, 2 * D), "b": torch.zeros(N, H, B, 2 * D, dtype=torch.float16)})
