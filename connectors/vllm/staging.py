"""`KVStaging`: the `--kv-staging host` fallback — a block-major mirror of vLLM's per-layer KV
tensors registered instead of them (by default vLLM's KV is registered in place: `kv_region.py`).

vLLM's CPU attention keeps one tensor per layer, `[num_blocks, num_kv_heads, block_size,
2 * head_size]`, where each head's block holds its K rows then its V rows (the backend views it
as `[num_blocks, heads, 2 * block_size, head_size]` and chunks dim 2). A run of blocks is
therefore one contiguous range *per layer* — 30 ranges for the demo model — which is what makes
vLLM's own NIXL path send ~60 descriptors per request. pdserve's data plane moves one run as one
message, so each rank registers a region in pdserve's layout instead, `[num_blocks, heads,
num_layers, 2, block_size, head_dim]` ("NHL2BD", every block's KV for all layers contiguous,
heads outermost inside a block, so a head range of a block is one piece for heterogeneous TP;
a (head, layer) of a block is vLLM's `[2, block_size, head_size]` head block as it is, no
transpose), indexed by vLLM's own block ids:

- prefill: `gather(block_ids)` copies a finished prompt's blocks in, before they are pinned;
- decode: pulls land in the region; `scatter(block_ids)` copies them out into vLLM's tensors
  before vLLM is told they arrived.

The price is one memcpy per block on each side and a second copy of the KV memory (reported as
`pdserve_engine_kv_mirror_bytes`); the region is the layout the handshake describes
(`NHL2BD/vllm-staging`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from connectors.vllm.kv_region import unique_layer_views

LAYOUT = "NHL2BD"


class KVStaging:
    """See the module docstring. Not thread-safe: call it from the worker's step thread."""

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
        self.region = torch.empty((num_blocks, heads, len(layers), 2, block_size, self.head_dim), dtype=first.dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def gather(self, block_ids: Sequence[int]) -> None:
        """vLLM's tensors -> the region, for `block_ids`."""
        if not block_ids:
            return
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        n = len(block_ids)
        for layer, t in enumerate(self.layers):
            blocks = t.index_select(0, idx).view(n, self.num_heads, 2, self.block_size, self.head_dim)
            self.region[idx, :, layer] = blocks

    def scatter(self, block_ids: Sequence[int]) -> None:
        """The region -> vLLM's tensors, for `block_ids`."""
        if not block_ids:
            return
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        n = len(block_ids)
        for layer, t in enumerate(self.layers):
            blocks = self.region[idx, :, layer].reshape(n, self.num_heads, self.block_size, 2 * self.head_dim)
            t.index_copy_(0, idx, blocks)
