"""KVStaging: vLLM's per-layer CPU KV tensors <-> pdserve's block-major NHL2BD blocks (what the
staging pool's slots hold)."""

from __future__ import annotations

import pytest
import torch

from connectors.ucx.host_staging import HostStaging
from connectors.ucx.staging_pool import SlotRun
from connectors.vllm.staging import KVStaging

N, H, B, D, L = 6, 3, 4, 5, 2


def vllm_caches() -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.randn(N, H, B, 2 * D) for i in range(L)}


def test_read_gives_the_nhl2bd_layout_and_write_inverts_it() -> None:
    caches = vllm_caches()
    staging = KVStaging(caches)
    assert staging.shape == (N, H, L, 2, B, D)
    blocks = staging.read([4, 1])
    for layer, t in enumerate(caches.values()):
        for i, b in enumerate((4, 1)):
            # vLLM's CPU backend: each head's block is K rows then V rows ([2 * B, D] per head)
            k, v = t[b].view(H, 2 * B, D).chunk(2, dim=1)
            assert torch.equal(blocks[i, :, layer, 0], k)
            assert torch.equal(blocks[i, :, layer, 1], v)
    before = {name: t.clone() for name, t in caches.items()}
    for t in caches.values():
        t.zero_()
    staging.write([4, 1], blocks)
    for name, t in caches.items():
        assert torch.equal(t[[4, 1]], before[name][[4, 1]])
        assert not t[[0, 2, 3, 5]].any()  # other blocks untouched
    for t in caches.values():
        t.zero_()
    staging.write([4, 1], blocks, slice(1, 3))  # a head range: heads 1-2 only
    for name, t in caches.items():
        assert torch.equal(t[[4, 1], 1:3], before[name][[4, 1], 1:3]) and not t[:, 0].any()


def test_through_the_pool_the_blocks_arrive_byte_exact() -> None:
    src, dst = vllm_caches(), {name: torch.zeros(N, H, B, 2 * D) for name in vllm_caches()}
    out, into = HostStaging(KVStaging(src), 3), HostStaging(KVStaging(dst), 3)
    assert out.block_nbytes == H * L * 2 * B * D * 4
    out.copy_out([5, 0, 2], SlotRun(0, 3)).result()
    into.slots.copy_(out.slots)
    into.copy_in(SlotRun(0, 3), [5, 0, 2]).result()
    for name in src:
        assert torch.equal(dst[name][[5, 0, 2]], src[name][[5, 0, 2]]) and not dst[name][[1, 3, 4]].any()
    out.shutdown()
    into.shutdown()


def test_rejects_tensors_of_another_layout() -> None:
    with pytest.raises(ValueError, match="expected vLLM CPU KV tensors"):
        KVStaging({"a": torch.zeros(2, N, H, B, D)})
    with pytest.raises(ValueError, match="one shape and dtype"):
        KVStaging({"a": torch.zeros(N, H, B, 2 * D), "b": torch.zeros(N, H, B, 2 * D, dtype=torch.float16)})
