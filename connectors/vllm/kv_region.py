"""vLLM's KV tensors as a `KVRegion` registered in place, and the fence that orders transfers
after vLLM's compute.

vLLM 0.32 (`vllm/v1/worker/utils.py` `allocate_kv_cache`) allocates one int8 buffer for every
attention layer and hands the connector one `[B, H, N, C]` view per layer (`C`: one token's K
and V of one head), each at `offset + l * layer_stride` with the strides of the resolved
`KVCacheLayout`. `describe_kv_caches` reads everything from the tensors themselves — the
shared storage, the layer stride from the views' addresses, the byte strides, the device —
names the layout from the strides (checked against the one vLLM says it resolved), and returns
the whole allocation as the region: registered bytes are vLLM's KV bytes, nothing is mirrored.

What it refuses, with the reason: views on different allocations or at irregular layer
offsets, content that is not K and V of `head_dim` each (MLA, quantized scales), views whose
dtype or shape differ (more than one KV cache group). Layers sharing one view (vLLM's
cross-layer KV sharing) are registered once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from connectors.kv_layout import (
    BLOCK_OUTERMOST,
    VLLM_LAYOUTS,
    KVRegion,
    StridedKVLayout,
    layout_from_strides,
    vllm_layout_strides,
)


def describe_kv_caches(kv_caches: dict[str, torch.Tensor], *, num_blocks: int, block_size: int, head_dim: int,
                       layout_name: str | None = None) -> KVRegion:
    """`kv_caches` (vLLM's `register_kv_caches` argument, layers in model order) as one
    `KVRegion`; `num_blocks` is vLLM's block-manager count (the views may hold kernel blocks,
    several per manager block). Raises ValueError naming what does not fit."""
    layers = unique_layer_views(kv_caches)
    if not layers:
        raise ValueError("vLLM registered no KV cache tensors")
    first = layers[0]
    for t in layers:
        if t.dim() != 4 or t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise ValueError("every layer's KV view must be 4-D [blocks, heads, slots, content] of one shape, stride "
                             f"and dtype (one KV cache group); got {tuple(t.shape)}/{t.stride()}/{t.dtype} beside "
                             f"{tuple(first.shape)}/{first.stride()}/{first.dtype}")
    storage = first.untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in layers):
        raise ValueError("vLLM's KV views lie in more than one allocation; pdserve registers one per rank")
    elem = first.element_size()
    if first.stride(3) != 1 or first.shape[3] * elem != 2 * head_dim * elem:
        raise ValueError(f"vLLM's KV content is {first.shape[3]} elements a slot, not K and V of head_dim {head_dim} "
                         "(MLA or quantized KV is not supported)")
    base = storage.data_ptr()
    offsets = [t.data_ptr() - base for t in layers]
    layer_stride = offsets[1] - offsets[0] if len(offsets) > 1 else first.shape[0] * first.stride(0) * elem
    if any(b - a != layer_stride for a, b in zip(offsets, offsets[1:], strict=False)) or layer_stride <= 0:
        raise ValueError(f"vLLM's KV views are not evenly spaced layers (byte offsets {offsets[:4]}...)")
    kernel_blocks = int(first.shape[0])
    if kernel_blocks % num_blocks:
        raise ValueError(f"{kernel_blocks} kernel blocks are not whole pages of {num_blocks} blocks")
    shape = (len(layers), kernel_blocks, int(first.shape[1]), int(first.shape[2]))
    strides = (layer_stride, *(int(first.stride(d)) * elem for d in range(3)))
    name = _layout_name(shape, strides, layout_name)  # type: ignore[arg-type]
    if int(first.shape[2]) * (kernel_blocks // num_blocks) != block_size:
        raise ValueError(f"vLLM's KV views hold {first.shape[2]}-slot kernel blocks, {kernel_blocks // num_blocks} "
                         f"a page, for {block_size}-token blocks")
    layout = StridedKVLayout(name, shape, strides, int(first.shape[3]) * elem, offsets[0],  # type: ignore[arg-type]
                             kernel_blocks // num_blocks)
    memory = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, 0, (storage.nbytes(),), (1,))
    layout.validate(int(memory.numel()))
    return KVRegion(memory, layout, block_size, head_dim, str(first.dtype).removeprefix("torch."))


def allocate_like_vllm(layout_name: str, *, num_layers: int, num_blocks: int, num_heads: int, block_size: int,
                       head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """KV tensors as vLLM 0.32 allocates them for one full-attention group of unpadded pages
    (`vllm/v1/worker/utils.py` `allocate_kv_cache` over `get_kv_cache_config_from_groups`):
    one zeroed int8 buffer; per layer a `[B, H, N, 2 * head_dim]` view of `dtype` at the
    layout's strides — block-outermost layouts interleave the layers' pages inside each block
    (block stride = every layer's page), the others give each layer its own region. For tests
    and the GPU check, where vLLM is not installed; `tests/vllm/test_vllm_kv_region.py` checks
    it against vLLM's own allocator."""
    elem = torch.empty(0, dtype=dtype).element_size()
    content = 2 * head_dim * elem
    shape = (num_layers, num_blocks, num_heads, block_size)
    page = num_heads * block_size * content
    strides = vllm_layout_strides(layout_name, shape, content,
                                  num_layers * page if layout_name in BLOCK_OUTERMOST else None)
    buf = torch.zeros(num_layers * num_blocks * page, dtype=torch.int8, device=device)
    view = torch.as_strided(buf, (*shape, content), (*strides, 1))
    return {f"model.layers.{i}.self_attn.attn": view[i].view(dtype) for i in range(num_layers)}


def logical_view(region: KVRegion) -> torch.Tensor:
    """The region as its logical `[L, B, H, N, C]` tensor of bytes (a strided view, no copy)."""
    layout = region.layout
    return torch.as_strided(region.memory, (*layout.shape, layout.content_nbytes), (*layout.strides, 1),
                            layout.offset)


def _layout_name(shape: tuple[int, int, int, int], strides: tuple[int, int, int, int], stated: str | None) -> str:
    """The layout the strides show; `stated` (vLLM's resolved name) must agree with them."""
    found = layout_from_strides(shape, strides)
    if found is None:
        raise ValueError(f"vLLM's KV strides {strides} (L, B, H, N bytes) match no KVCacheLayout")
    if stated is None or stated == found:
        return found
    if stated not in VLLM_LAYOUTS:
        raise ValueError(f"vLLM resolved KV layout {stated!r}, which pdserve does not know ({', '.join(VLLM_LAYOUTS)})")
    order = VLLM_LAYOUTS[stated]
    sized = [strides[d] for d in order if shape[d] > 1]
    if any(a <= b for a, b in zip(sized, sized[1:], strict=False)):
        raise ValueError(f"vLLM says its KV layout is {stated}, the strides {strides} say {found}")
    return stated


def unique_layer_views(kv_caches: dict[str, Any]) -> list[torch.Tensor]:
    """Layer views in vLLM's order, each once (shared layers alias one view)."""
    seen: set[int] = set()
    layers = []
    for t in kv_caches.values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            layers.append(t)
    return layers


@dataclass(slots=True)
class ComputeFence:
    """vLLM's compute queued so far on a CUDA stream, as an event: `wait()` blocks until it ran
    (that event only — no device-wide synchronize). `record()` returns None on the CPU, where
    vLLM's forward has finished when the connector hook runs."""

    event: Any

    @classmethod
    def record(cls, device: torch.device, cuda: Any = None) -> ComputeFence | None:
        """An event recorded on `device`'s current stream (vLLM's); `cuda` stands in for
        `torch.cuda` in tests."""
        if device.type != "cuda":
            return None
        cuda = cuda or torch.cuda
        event = cuda.Event()
        event.record(cuda.current_stream(device))
        return cls(event)

    def wait(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return bool(self.event.query())


FenceFactory = Callable[[torch.device], ComputeFence | None]
