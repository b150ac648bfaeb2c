"""HostStaging: KV blocks <-> the bounded pool's slots on the stager thread, byte-exact (CPU
tensors; the CUDA branch adds only the side stream and pinned slots, tested on a GPU)."""

from __future__ import annotations

import threading

import pytest
import torch

from connectors.ucx.host_staging import CHUNK_BLOCKS, HostStaging, default_pool_blocks
from connectors.ucx.staging_pool import SlotRun


def _cache(num_blocks: int = 100, seed: int = 3) -> torch.Tensor:
    # [blocks, heads, layers, 2, block_size, head_dim] (NHL2BD)
    return torch.rand(num_blocks, 4, 2, 2, 4, 8, generator=torch.Generator().manual_seed(seed))


def test_blocks_go_out_to_slots_and_back_in_byte_exact_in_chunks() -> None:
    src, dst = _cache(seed=1), torch.zeros(100, 4, 2, 2, 4, 8)
    staging_out, staging_in = HostStaging(src, 80), HostStaging(dst, 80)
    ids = [*range(10, 10 + CHUNK_BLOCKS + 5), 3, 97, 50]  # a run longer than a chunk, then scattered blocks
    run = SlotRun(7, len(ids))
    staging_out.copy_out(ids, run).result()
    assert torch.equal(staging_out.slots[7:7 + len(ids)], src[ids])
    staging_in.slots.copy_(staging_out.slots)  # what the transfer does between the two pools
    done = threading.Event()
    staging_in.copy_in(run, ids, then=lambda error: done.set() if error is None else None).result()
    assert done.is_set() and torch.equal(dst[ids], src[ids])
    assert torch.count_nonzero(dst[[b for b in range(100) if b not in ids]]) == 0  # nothing else written
    stats = staging_in.take_stats()
    assert stats.num_bytes == len(ids) * staging_in.block_nbytes and stats.num_copies == 1
    assert staging_in.take_stats().num_copies == 0
    staging_out.shutdown()
    staging_in.shutdown()


def test_a_head_range_pull_copies_only_its_heads_into_the_blocks() -> None:
    src, dst = _cache(seed=2), torch.full((100, 4, 2, 2, 4, 8), 7.0)
    staging = HostStaging(dst, 8)
    staging.slots[0:3] = src[[5, 6, 40]]
    staging.copy_in(SlotRun(0, 3), [5, 6, 40], heads=(2, 2)).result()
    assert torch.equal(dst[[5, 6, 40], 2:4], src[[5, 6, 40], 2:4])
    assert bool((dst[[5, 6, 40], 0:2] == 7.0).all())  # the other ranks' heads untouched
    staging.shutdown()


def test_a_copy_out_waits_for_the_compute_fence_and_errors_reach_the_callback() -> None:
    staging = HostStaging(_cache(), 4)
    gate = threading.Event()

    class Fence:
        def wait(self) -> None:
            assert gate.wait(5)

    future = staging.copy_out([1, 2], SlotRun(0, 2), after=Fence())
    assert not future.done()
    gate.set()
    future.result(timeout=5)
    errors: list[BaseException | None] = []
    with pytest.raises(ValueError, match="2 blocks for slots"):
        staging.copy_in(SlotRun(0, 3), [1, 2], then=errors.append)
    assert errors == []  # refused before queueing: nothing ran
    staging.shutdown()


def test_the_default_pool_is_the_transfer_window_capped_at_the_cache() -> None:
    assert default_pool_blocks(num_cache_blocks=10_000, max_inflight_transfers=64) == 1024
    assert default_pool_blocks(num_cache_blocks=300, max_inflight_transfers=64) == 300
    assert default_pool_blocks(num_cache_blocks=300, max_inflight_transfers=1) == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the side stream and pinned slots "
                                                           "run where a GPU is visible (make gpu-check)")
def test_gpu_blocks_are_staged_on_a_side_stream_through_pinned_slots() -> None:
    src = _cache(seed=4).cuda()
    staging = HostStaging(src, 16)
    assert staging.slots.is_pinned() and staging._stream is not None
    staging.copy_out([3, 9, 4], SlotRun(2, 3)).result()
    assert torch.equal(staging.slots[2:5], src[[3, 9, 4]].cpu())
    staging.shutdown()
