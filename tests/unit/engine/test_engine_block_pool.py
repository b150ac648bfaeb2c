"""BlockPool and KVCacheManager: ref counts, LRU eviction, prefix cache, events (torch-free)."""

from __future__ import annotations

import pytest

from connectors.hashing import BlockHasher, hash_block, none_hash, to_external
from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.block_pool import BlockPool, NoFreeBlocksError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(), all_token_ids=list(tokens))


def test_golden_hashes_reach_the_events() -> None:
    # Golden vectors of connectors/hashing.py (seed "0"); never skipped.
    assert none_hash().hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    pool = BlockPool(4, 4, medium="CPU")
    kv = KVCacheManager(pool, BlockHasher(4))
    r = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(r, 9)
    kv.cache_blocks(r, 9)
    [ev] = pool.take_events()
    assert ev == BlockStored(block_hashes=(2164874634404590027, 17270480062156288726), parent_block_hash=None,
                             token_ids=(1, 2, 3, 4, 5, 6, 7, 8), block_size=4, medium="CPU",
                             extra_keys=(None, None), group_idx=0)
    assert to_external(hash_block(None, list(range(16)), None)) == 12687895063098490012
    assert to_external(hash_block(None, [1, 2, 3, 4], ("my-lora",))) == 17638755436353697673
    kv.free("a")
    assert pool.check_leaks() == []


def test_prefix_hit_ref_counts_and_lru_eviction() -> None:
    pool = BlockPool(6, 4)
    kv = KVCacheManager(pool, BlockHasher(4))
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    kv.cache_blocks(a, 12)
    b = _req("b", list(range(8)) + [99, 98, 97])
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == kv.get_block_ids("a")[:2]
    assert kv.allocate_slots(b, 3, hits)
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    kv.free("a")
    kv.free("b")
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3
    pool.take_events()
    # Uncached blocks are handed out first, then cached ones, oldest first; a's tail block (block
    # 2 of a) was freed before its head, so it goes before blocks 0 and 1.
    c = _req("c", [50] * 12)
    assert kv.allocate_slots(c, 12)
    removed = [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)]
    a_hashes = BlockHasher(4).external_hashes(list(range(12)))
    assert removed == [a_hashes[2]]
    assert pool.get_cached_block(BlockHasher(4).hash_blocks(list(range(12)))[0]) is not None
    kv.free("c")


def test_allocation_failure_changes_nothing() -> None:
    pool = BlockPool(2, 4)
    kv = KVCacheManager(pool, BlockHasher(4))
    r = _req("r", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert pool.num_free_blocks == 2 and kv.check_leaks() == []
    with pytest.raises(NoFreeBlocksError, match='need 3 free KV blocks, have 2'):
        pool.get_new_blocks(3)


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(3, 4, medium="GPU")
    kv = KVCacheManager(pool, BlockHasher(4))
    r = _req("r", list(range(8)))
    kv.allocate_slots(r, 8)
    kv.cache_blocks(r, 8)
    assert pool.reset_prefix_cache() is False
    kv.free("r")
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared(medium="GPU")] and pool.num_cached_blocks == 0


def test_duplicate_hash_is_not_cached_twice_and_chain_stays_exact() -> None:
    pool = BlockPool(8, 2)
    kv = KVCacheManager(pool, BlockHasher(2))
    a, b = _req("a", [1, 2, 3, 4]), _req("b", [1, 2, 3, 4, 5, 6])
    kv.allocate_slots(a, 4)
    kv.allocate_slots(b, 6)  # computed without using a's (not yet cached) blocks
    kv.cache_blocks(a, 4)
    kv.cache_blocks(b, 6)
    ev_a, ev_b = pool.take_events()
    assert isinstance(ev_b, BlockStored)
    hashes = BlockHasher(2).external_hashes([1, 2, 3, 4, 5, 6])
    assert ev_b.block_hashes == (hashes[2],) and ev_b.parent_block_hash == hashes[1]
    assert ev_b.token_ids == (5, 6)
    kv.free("a")
    kv.free("b")
    assert kv.check_leaks() == []
