"""`HostStaging`: the explicit host bounce of GPU KV (`--kv-staging host`), measured.

When UCX cannot move GPU memory between the engines (no CUDA transport, or a deliberate
choice), a rank's UCX region is a pinned host mirror of its KV tensor instead of the tensor:
a prefill rank copies a request's blocks device→host (`stage_out`) before it pins them for
readers, a decode rank copies pulled blocks host→device (`stage_in`) before it reports the
pull finished. Both copies are synchronous (the blocks are complete on return) and timed;
`take_stats()` drains the bytes and seconds spent, so the bounce shows up as its own series
(`host_staging_duration`, `host_staged_bytes`) beside the transfer itself.

Thread-safety: each method may be called from any thread; calls are serialized.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StagingStats:
    num_bytes: int = 0
    seconds: float = 0.0
    num_copies: int = 0


class HostStaging:
    """A host mirror of `cache` (a [num_blocks, ...] tensor, pinned when `cache` is on a GPU)."""

    def __init__(self, cache: torch.Tensor) -> None:
        if not cache.is_contiguous():
            raise ValueError("the KV cache to stage must be contiguous")
        self.cache = cache
        self.mirror = torch.zeros(cache.shape, dtype=cache.dtype, pin_memory=cache.is_cuda)
        self._block_nbytes = cache[0].numel() * cache.element_size()
        self._lock = threading.Lock()
        self._stats = StagingStats()

    def stage_out(self, block_ids: Iterable[int]) -> None:
        """Device -> host mirror for `block_ids` (the prefill side, before readers may pull)."""
        self._copy(block_ids, self.mirror, self.cache)

    def stage_in(self, block_ids: Iterable[int]) -> None:
        """Host mirror -> device for `block_ids` (the decode side, after the bytes landed)."""
        self._copy(block_ids, self.cache, self.mirror)

    def _copy(self, block_ids: Iterable[int], dst: torch.Tensor, src: torch.Tensor) -> None:
        ids = sorted({int(b) for b in block_ids})
        if not ids:
            return
        if ids[0] < 0 or ids[-1] >= self.cache.shape[0]:
            raise ValueError(f"block ids must be in [0, {self.cache.shape[0]})")
        index = torch.tensor(ids, dtype=torch.long)
        with self._lock:
            start = time.perf_counter()
            dst.index_copy_(0, index.to(dst.device), src.index_select(0, index.to(src.device)).to(dst.device))
            if self.cache.is_cuda:
                torch.cuda.synchronize(self.cache.device)
            self._stats.seconds += time.perf_counter() - start
            self._stats.num_bytes += len(ids) * self._block_nbytes
            self._stats.num_copies += 1

    def take_stats(self) -> StagingStats:
        """What was staged since the last call."""
        with self._lock:
            stats, self._stats = self._stats, StagingStats()
        return stats
