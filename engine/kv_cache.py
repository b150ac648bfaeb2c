"""Allocation of one rank's KV cache tensor (layout NHL2BD, see docs/architecture.md)."""

from __future__ import annotations

import logging

import torch

from connectors.head_map import num_local_heads, rank_heads
from engine.config import KVCacheSpec, ModelConfig

logger = logging.getLogger(__name__)


def make_kv_cache_spec(config: ModelConfig, *, block_size: int, memory_bytes: int, tp_size: int = 1,
                       num_blocks: int | None = None, element_size: int = 4,
                       device_kind: str = "cpu") -> KVCacheSpec:
    """num_blocks = memory_bytes // block_nbytes (or the explicit num_blocks). Raises ValueError
    when the budget does not hold one full-length sequence's worth of a single block."""
    config.check_tp(tp_size)
    heads = num_local_heads(tp_size, config.num_kv_heads)
    probe = KVCacheSpec(1, block_size, config.num_layers, heads, config.head_dim, config.dtype, element_size, tp_size)
    n = num_blocks if num_blocks is not None else memory_bytes // probe.block_nbytes
    if n < 1:
        raise ValueError(f"KV cache budget {memory_bytes} bytes holds no block of {probe.block_nbytes} bytes")
    ranges = tuple(rank_heads(r, tp_size, config.num_kv_heads) for r in range(tp_size))
    return KVCacheSpec(n, block_size, config.num_layers, heads, config.head_dim, config.dtype, element_size,
                       tp_size, kv_head_ranges=ranges, device_kind=device_kind)


def allocate_kv_cache(spec: KVCacheSpec, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A zeroed contiguous tensor of spec.shape; block b's KV for all layers is kv_cache[b]."""
    cache = torch.zeros(spec.shape, dtype=dtype, device=device)
    logger.info("KV cache: %d blocks of %d tokens (%d bytes each, %.1f MiB, %d KV heads/rank)",
                spec.num_blocks, spec.block_size, spec.block_nbytes,
                spec.num_blocks * spec.block_nbytes / 2**20, spec.num_kv_heads_local)
    return cache
