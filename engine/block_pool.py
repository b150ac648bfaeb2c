"""BlockPool: the engine's KV blocks, their reference counts, the prefix cache and its events.

Torch-free. A block is *free* when its ref count is 0; free blocks sit in an LRU queue (head =
evicted first). A free block may still be *cached* (it holds a hash and can be reused by a
later request with the same prefix) until it is handed out again: then its hash is dropped and
a BlockRemoved event is queued. Caching full blocks queues a BlockStored event. Producers append
to the event queue; the engine drains it with `take_events()` once per step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from connectors.hashing import BlockHash, to_external
from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are requested than the pool has free."""


class BlockPool:
    """Owns `num_blocks` blocks; every block id in [0, num_blocks) is usable."""

    def __init__(self, num_blocks: int, block_size: int, *, medium: str | None = None,
                 enable_events: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.medium = medium
        self.enable_events = enable_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVCacheEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Takes n blocks from the head of the free queue (ref count 1), evicting cached ones."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} free KV blocks, have {len(self._free)}")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on blocks found in the prefix cache (removing free ones from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference per block; blocks reaching 0 join the queue tail in the given order
        (so callers pass a request's blocks tail first: its last blocks are evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt < 1:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int, token_ids: Sequence[int]) -> None:
        """Registers blocks[num_cached_blocks:num_full_blocks] (holding token_ids' full blocks)
        under their hashes and queues one BlockStored per contiguous run of newly cached blocks.

        A block whose hash another block already holds stays uncached (it is freed as a plain
        block later); the run is split there so every event's parent chain stays exact.
        """
        run: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
                if run and run[-1] != i - 1:
                    self._emit_stored(run, block_hashes, token_ids)
                    run = []
                run.append(i)
        if run:
            self._emit_stored(run, block_hashes, token_ids)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared(medium=self.medium))
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def check_leaks(self) -> list[str]:
        problems = []
        if len(self._free) != self.num_blocks:
            used = [b.block_id for b in self.blocks if b.ref_cnt]
            problems.append(f"{self.num_blocks - len(self._free)} blocks not free: {used[:10]}")
        return problems

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self.enable_events:
                self._events.append(BlockRemoved(block_hashes=(to_external(block.block_hash),),
                                                 medium=self.medium, group_idx=0))
        block.block_hash = None

    def _emit_stored(self, run: list[int], block_hashes: Sequence[BlockHash], token_ids: Sequence[int]) -> None:
        if not self.enable_events:
            return
        first, last = run[0], run[-1]
        bs = self.block_size
        self._events.append(BlockStored(
            block_hashes=tuple(to_external(block_hashes[i]) for i in run),
            parent_block_hash=to_external(block_hashes[first - 1]) if first > 0 else None,
            token_ids=tuple(token_ids[first * bs:(last + 1) * bs]),
            block_size=bs,
            lora_id=None,
            medium=self.medium,
            lora_name=None,
            extra_keys=tuple(None for _ in run),
            group_idx=0,
        ))
