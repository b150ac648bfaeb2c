"""`KVStaging`: the `--kv-staging host` fallback — vLLM's per-layer KV tensors as blocks of
pdserve's block-major layout, copied through the data plane's bounded staging pool
(`connectors/ucx/host_staging.py`) instead of being registered (by default vLLM's KV is
registered in place: `kv_region.py`).

vLLM's CPU attention keeps one tensor per layer, `[num_blocks, num_kv_heads, block_size,
2 * head_size]`, where each head's block holds its K rows then its V rows (the backend views it
as `[num_blocks, heads, 2 * block_size, head_size]` and chunks dim 2). A run of blocks is
therefore one contiguous range *per layer* — 30 ranges for the demo model — which is what makes
vLLM's own NIXL path send ~60 descriptors per request. pdserve's data plane moves one run as one
message, so the pool's slots hold blocks in pdserve's layout instead, `[heads, num_layers, 2,
block_size, head_dim]` per block ("NHL2BD", every block's KV for all layers contiguous, heads
outermost inside a block, so a head range of a block is one piece for heterogeneous TP; a
(head, layer) of a block is vLLM's `[2, block_size, head_size]` head block as it is, no
transpose), addressed by vLLM's own block ids:

- prefill: `read(block_ids)` gathers a finished prompt's blocks when they are pinned (into
  the pool, on the stager thread);
- decode: pulls land in the pool; `write(block_ids, ...)` scatters them into vLLM's tensors
  before vLLM is told they arrived.

The price is one copy per block on each side and the pool's memory (reported as
`pdserve_engine_kv_mirror_bytes`); the handshake describes the layout as NHL2BD.
"""

from __future__ import annotations

import torch

from connectors.vllm.kv_region import unique_layer_views

LAYOUT = "NHL2BD"


class KVStaging:
    """vLLM's KV as a `host_staging.BlockSource` (see the module docstring). `read` / `write`
    run on the stager thread, on blocks vLLM does not touch meanwhile (pinned, or not yet
    reported received)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = unique_layer_views(kv_caches)
        if not layers:
            raise ValueError("no KV cache tensors to register")
        first = layers[0]
        if first.dim() != 4 or first.shape[3] % 2:
            raise ValueError(f"expected vLLM CPU KV tensors [blocks, heads, block_size, 2*head_size], got "
                             f"{tuple(first.shape)}")
        for t in layers:
            if t.shape != first.shape or t.dtype != first.dtype or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("every layer's KV tensor must be a contiguous CPU tensor of one shape and dtype")
        num_blocks, heads, block_size, two_d = (int(d) for d in first.shape)
        self.layers = layers
        self.num_blocks, self.num_heads, self.block_size, self.head_dim = num_blocks, heads, block_size, two_d // 2
        self.shape = (num_blocks, heads, len(layers), 2, block_size, self.head_dim)
        self.dtype = first.dtype
        self.device = first.device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def read(self, block_ids: list[int]) -> torch.Tensor:
        """vLLM's blocks `block_ids` as NHL2BD blocks `[n, heads, layers, 2, block_size, head_dim]`."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        n = len(block_ids)
        out = torch.empty((n, *self.shape[1:]), dtype=self.dtype)
        for layer, t in enumerate(self.layers):
            out[:, :, layer] = t.index_select(0, idx).view(n, self.num_heads, 2, self.block_size, self.head_dim)
        return out

    def write(self, block_ids: list[int], blocks: torch.Tensor, heads: slice = slice(None)) -> None:
        """NHL2BD `blocks` -> vLLM's blocks `block_ids` (only local `heads` of them)."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        n = len(block_ids)
        for layer, t in enumerate(self.layers):
            if heads == slice(None):
                t.index_copy_(0, idx, blocks[:, :, layer].reshape(n, self.num_heads, self.block_size,
                                                                   2 * self.head_dim))
            else:
                part = blocks[:, heads, layer]
                t[idx, heads] = part.reshape(n, part.shape[1], self.block_size, 2 * self.head_dim)
