"""StagingPool: slot accounting and back-pressure of the bounded `--kv-staging host` pool (pure)."""

from __future__ import annotations

import random

import pytest

from connectors.ucx.staging_pool import SlotRun, StagingPool


def test_runs_are_contiguous_disjoint_and_accounted() -> None:
    pool = StagingPool(10)
    a, b = pool.allocate("a", 4), pool.allocate("b", 3)
    assert (a, b) == (SlotRun(0, 4), SlotRun(4, 3))
    assert (pool.num_used, pool.num_free, pool.peak_used) == (7, 3, 7)
    assert pool.free("a") == a and pool.free("a") is None  # exactly once
    assert (pool.num_used, pool.num_free, pool.peak_used) == (3, 7, 7)
    assert pool.free_extents() == [(0, 4), (7, 3)]
    assert pool.free("b") == b and pool.free_extents() == [(0, 10)]  # merged back into one extent


def test_a_full_pool_pushes_back_until_a_run_returns() -> None:
    pool = StagingPool(8)
    pool.allocate("a", 5)
    assert pool.allocate("b", 4) is None  # back-pressure: wait, nothing changed
    assert pool.num_used == 5 and pool.holds("b") is None
    pool.free("a")
    assert pool.allocate("b", 4) == SlotRun(0, 4)


def test_fragmented_free_slots_are_not_one_run() -> None:
    pool = StagingPool(6)
    for owner in "abc":
        pool.allocate(owner, 2)
    pool.free("a")
    pool.free("c")
    assert pool.num_free == 4 and pool.allocate("d", 3) is None  # 2 + 2 free, no run of 3
    assert pool.allocate("d", 2) == SlotRun(0, 2)  # first fit


def test_what_can_never_fit_and_double_owners_are_refused() -> None:
    pool = StagingPool(4)
    assert not pool.fits(5) and not pool.fits(0) and pool.fits(4)
    with pytest.raises(ValueError, match="do not fit a staging pool of 4"):
        pool.allocate("big", 5)
    pool.allocate("a", 1)
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate("a", 1)
    with pytest.raises(ValueError, match="at least one slot"):
        StagingPool(0)


def test_random_churn_keeps_every_slot_owned_once_and_the_totals_exact() -> None:
    rng = random.Random(7)
    pool = StagingPool(64)
    held: dict[int, SlotRun] = {}
    for step in range(2000):
        if held and rng.random() < 0.5:
            owner = rng.choice(list(held))
            assert pool.free(owner) == held.pop(owner)
        else:
            run = pool.allocate(step, rng.randint(1, 12))
            if run is not None:
                held[step] = run
        slots = [s for r in held.values() for s in range(r.start, r.start + r.count)]
        assert len(slots) == len(set(slots)) and all(0 <= s < 64 for s in slots)
        assert pool.num_used == len(slots) and pool.num_used + pool.num_free == 64
        free = [s for start, n in pool.free_extents() for s in range(start, start + n)]
        assert sorted(free + slots) == list(range(64))
    for owner in list(held):
        pool.free(owner)
    assert pool.free_extents() == [(0, 64)]
