"""KVCacheManager: which blocks each request holds, prefix-cache lookups, block hashing.

Torch-free. A request's blocks cover tokens [0, len(blocks) * block_size); the prefix cache is
keyed by the chained block hash of `connectors/hashing.py`.
"""

from __future__ import annotations

from connectors.hashing import BlockHasher
from engine.block_pool import BlockPool, KVCacheBlock
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, hasher: BlockHasher) -> None:
        if hasher.block_size != pool.block_size:
            raise ValueError("hasher and pool disagree on block_size")
        self.pool = pool
        self.hasher = hasher
        self.block_size = pool.block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    def update_block_hashes(self, request: Request) -> None:
        """Extends request.block_hashes to every full block of its tokens."""
        have = len(request.block_hashes)
        if request.num_tokens // self.block_size > have:
            parent = request.block_hashes[-1] if have else None
            request.block_hashes.extend(self.hasher.hash_blocks(request.all_token_ids, parent=parent,
                                                                start_block=have))

    def get_computed_blocks(self, request: Request, max_tokens: int | None = None) -> list[KVCacheBlock]:
        """Longest cached prefix of the request, leaving at least one token to compute (the model
        needs one to produce logits) and at most max_tokens tokens. No side effects."""
        limit = request.num_tokens - 1 if max_tokens is None else min(max_tokens, request.num_tokens - 1)
        return self._cached_prefix(request, limit // self.block_size)

    def get_cached_full_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Longest cached prefix of the request's full blocks, all of them (nothing is computed
        after it: a peer-fetch pin). No side effects."""
        return self._cached_prefix(request, request.num_tokens // self.block_size)

    def _cached_prefix(self, request: Request, max_blocks: int) -> list[KVCacheBlock]:
        self.update_block_hashes(request)
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed: list[KVCacheBlock] | None = None) -> bool:
        return self._num_needed(request, num_new_tokens, computed or []) <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: list[KVCacheBlock] | None = None) -> bool:
        """Makes room for num_new_tokens beyond request.num_computed_tokens (plus the computed
        prefix blocks, when given). Returns False, changing nothing, when blocks run out."""
        computed = computed or []
        if self._num_needed(request, num_new_tokens, computed) > self.pool.num_free_blocks:
            return False
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self.num_cached_blocks.setdefault(request.request_id, len(computed))
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's full, computed blocks in the prefix cache (BlockStored)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        done = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        self.update_block_hashes(request)
        self.pool.cache_full_blocks(blocks, request.block_hashes, done, num_full, request.all_token_ids)
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        """Returns the request's blocks to the pool, tail first (its last blocks evict first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def check_leaks(self) -> list[str]:
        problems = self.pool.check_leaks()
        if self.req_to_blocks:
            problems.append(f"requests still holding blocks: {sorted(self.req_to_blocks)[:10]}")
        if self.num_cached_blocks:
            problems.append(f"num_cached_blocks not empty: {sorted(self.num_cached_blocks)[:10]}")
        return problems

    def _num_needed(self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock]) -> int:
        have = len(self.req_to_blocks.get(request.request_id, ()))
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        new = max(0, cdiv(total, self.block_size) - have - len(computed))
        # Touching a free cached block takes it out of the free queue.
        return new + sum(1 for b in computed if b.ref_cnt == 0)
