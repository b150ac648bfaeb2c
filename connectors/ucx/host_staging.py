"""`HostStaging`: the explicit host bounce of KV (`--kv-staging host`) through a bounded pool.

When UCX cannot (or is told not to) move the KV tensor's memory itself, the data plane
registers a pool of block-sized slots of host memory instead (pinned where the KV is on a GPU),
sized to what is in flight, not to the cache: `kv_staging_blocks` slots (default
`default_pool_blocks`: the transfer window, capped at the cache). Slots are accounted by
`StagingPool` (one contiguous run per user, so a run of consecutive blocks stays one piece):

- a prefill rank copies a request's blocks into a run when it pins them (`copy_out`) and the
  lease holds the run until it ends; the first reader waits for that copy (the lease's fence).
  A request larger than the pool (or finding it full) is copied per pull instead, into a run
  the pull holds until it ends (`UcxWorkerConnector.source_segments`);
- a decode rank takes a run when a pull is dispatched (queued while none is free: back-pressure),
  the bytes land there, `copy_in` moves them into the KV tensor, and the run returns.

Copies run on one stager thread, off the engine and the UCX progress threads, in chunks of
`CHUNK_BLOCKS` blocks; with CUDA KV on a side CUDA stream of the KV's device (pinned memory,
non-blocking copies, that stream alone synchronized), on the CPU as plain tensor copies.
`take_stats()` drains the bytes and seconds copied, so the bounce shows as its own series
(`host_staging_duration`, `host_staged_bytes`) beside the transfer.

Thread-safety: `copy_out` / `copy_in` may be called from any thread (they queue a job and
return its Future); the pool's accounting is the caller's to serialize (`StagingPool`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from connectors.ucx.staging_pool import SlotRun, StagingPool

CHUNK_BLOCKS = 32
WINDOW_BLOCKS_PER_TRANSFER = 16  # the pool's default share per transfer in flight


def default_pool_blocks(num_cache_blocks: int, max_inflight_transfers: int) -> int:
    """The pool when `kv_staging_blocks` is not set: the transfer window (the pulls a rank runs
    at once, `WINDOW_BLOCKS_PER_TRANSFER` blocks each), never more than the cache."""
    return max(1, min(num_cache_blocks, max_inflight_transfers * WINDOW_BLOCKS_PER_TRANSFER))


class Fence(Protocol):
    def wait(self) -> None: ...


class BlockSource(Protocol):
    """KV blocks the pool copies from and to, each an NHL2BD block `[heads, layers, 2,
    block_size, head_dim]` (`shape[1:]`) however the KV itself lies (vLLM's per-layer tensors:
    `connectors/vllm/staging.py`). `read` / `write` take block ids in order; `heads` limits a
    write to those local heads."""

    @property
    def shape(self) -> tuple[int, ...]: ...  # (num_blocks, *block shape)

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def read(self, block_ids: list[int]) -> torch.Tensor: ...

    def write(self, block_ids: list[int], blocks: torch.Tensor, heads: slice) -> None: ...


class TensorBlocks:
    """A contiguous NHL2BD KV tensor as a `BlockSource` (a run of blocks: one slice copy)."""

    def __init__(self, cache: torch.Tensor) -> None:
        if not cache.is_contiguous() or cache.dim() < 2:
            raise ValueError("the KV cache to stage must be a contiguous [num_blocks, ...] tensor")
        self.cache = cache
        self.shape = tuple(int(d) for d in cache.shape)
        self.dtype = cache.dtype
        self.device = cache.device

    def read(self, block_ids: list[int]) -> torch.Tensor:
        lo = block_ids[0]
        if block_ids == list(range(lo, lo + len(block_ids))):
            return self.cache[lo:lo + len(block_ids)]
        return self.cache.index_select(0, torch.tensor(block_ids, dtype=torch.long, device=self.device))

    def write(self, block_ids: list[int], blocks: torch.Tensor, heads: slice) -> None:
        lo = block_ids[0]
        if block_ids == list(range(lo, lo + len(block_ids))):
            self.cache[lo:lo + len(block_ids), heads].copy_(blocks[:, heads], non_blocking=True)
        else:
            index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            self.cache[index, heads] = blocks[:, heads].to(self.device, non_blocking=True)


@dataclass(slots=True)
class StagingStats:
    num_bytes: int = 0
    seconds: float = 0.0
    num_copies: int = 0


@dataclass(slots=True)
class CopyFence:
    """A staging copy as a fence (`wait()` returns once the bytes are in place; re-raises its error)."""

    future: Future[None]

    def wait(self) -> None:
        self.future.result()


class HostStaging:
    """A pool of `num_slots` block slots for `cache`: a contiguous NHL2BD [num_blocks, ...]
    tensor, or any `BlockSource`."""

    def __init__(self, cache: torch.Tensor | BlockSource, num_slots: int) -> None:
        self.blocks: BlockSource = TensorBlocks(cache) if isinstance(cache, torch.Tensor) else cache
        self.num_blocks = self.blocks.shape[0]
        cuda = self.blocks.device.type == "cuda"
        self.pool = StagingPool(num_slots)
        self.slots = torch.zeros((num_slots, *self.blocks.shape[1:]), dtype=self.blocks.dtype, pin_memory=cuda)
        self.block_nbytes = self.slots[0].numel() * self.slots.element_size()
        self._stream = torch.cuda.Stream(self.blocks.device) if cuda else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-stager")
        self._lock = threading.Lock()
        self._stats = StagingStats()

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size()

    def copy_out(self, block_ids: Sequence[int], run: SlotRun, after: Fence | None = None) -> Future[None]:
        """KV blocks `block_ids` -> slots `run` (in order), once `after` (the compute that wrote
        them) is done."""
        self._check(block_ids, run)
        return self._executor.submit(self._job, list(block_ids), run, True, after, None, None)

    def copy_in(self, run: SlotRun, block_ids: Sequence[int], heads: tuple[int, int] | None = None,
                then: Callable[[BaseException | None], None] | None = None) -> Future[None]:
        """Slots `run` -> KV blocks `block_ids` (in order): whole blocks, or only local heads
        [first, first + count) with `heads` (a pull of a head range: the other heads of those
        blocks come from other ranks). `then(error)` runs on the stager thread once the bytes are
        in place (error None) or the copy failed."""
        self._check(block_ids, run)
        return self._executor.submit(self._job, list(block_ids), run, False, None, heads, then)

    def later(self, fn: Callable[[], None]) -> None:
        """Runs `fn` on the stager thread after every copy queued before it (or at once, on this
        thread, once the stager is shut down)."""
        try:
            self._executor.submit(fn)
        except RuntimeError:  # shut down: no copy is left to wait for
            fn()

    def _job(self, block_ids: list[int], run: SlotRun, out: bool, after: Fence | None,
             heads: tuple[int, int] | None, then: Callable[[BaseException | None], None] | None) -> None:
        try:
            self._copy(block_ids, run, out, after, heads)
        except BaseException as e:
            if then is None:
                raise
            then(e)
            raise
        if then is not None:
            then(None)

    def _check(self, block_ids: Sequence[int], run: SlotRun) -> None:
        if len(block_ids) != run.count or run.start < 0 or run.start + run.count > self.pool.num_slots:
            raise ValueError(f"{len(block_ids)} blocks for slots {run}")
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids must be in [0, {self.num_blocks})")

    def _copy(self, block_ids: list[int], run: SlotRun, out: bool, after: Fence | None,
              heads: tuple[int, int] | None) -> None:
        if after is not None:
            after.wait()
        start = time.perf_counter()
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                self._copy_chunks(block_ids, run, out, heads)
            self._stream.synchronize()
        else:
            self._copy_chunks(block_ids, run, out, heads)
        with self._lock:
            self._stats.seconds += time.perf_counter() - start
            self._stats.num_bytes += len(block_ids) * self.block_nbytes
            self._stats.num_copies += 1

    def _copy_chunks(self, block_ids: list[int], run: SlotRun, out: bool, heads: tuple[int, int] | None) -> None:
        h = slice(heads[0], heads[0] + heads[1]) if heads is not None else slice(None)
        for first in range(0, len(block_ids), CHUNK_BLOCKS):
            ids = block_ids[first:first + CHUNK_BLOCKS]
            slots = self.slots[run.start + first:run.start + first + len(ids)]
            if out:
                slots.copy_(self.blocks.read(ids), non_blocking=True)
            else:
                self.blocks.write(ids, slots, h)

    def take_stats(self) -> StagingStats:
        """What was copied since the last call."""
        with self._lock:
            stats, self._stats = self._stats, StagingStats()
        return stats

    def shutdown(self) -> None:
        """Waits for queued copies, then stops the stager thread. Idempotent."""
        self._executor.shutdown(wait=True)
