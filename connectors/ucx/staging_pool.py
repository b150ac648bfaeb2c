"""`StagingPool`: the slot accounting of the `--kv-staging host` pool (pure: no torch, no locks).

The pool is `num_slots` block-sized slots of pinned host memory, the only memory the data plane
registers with UCX when KV is staged. Every user of it takes ONE contiguous run of slots
(`allocate`), so a run of consecutive KV blocks maps to consecutive slots and moves as one
piece, exactly as it would from the KV tensor itself:

- a prefill rank takes a run for a request's blocks (in ascending block order) when it pins
  them for sending, and returns it when the lease ends; a request that does not fit (or finds
  no run free) takes a run per pull of it instead, returned when that pull ends;
- a decode rank takes a run for a pull when the pull is dispatched and returns it once the
  bytes were copied into the KV tensor.

`allocate` returns None when no run of that length is free: back-pressure, the caller waits
(a decode rank keeps the pull queued, a prefill rank the pull it serves) or stages otherwise
(a prefill rank pinning: per pull). A request for more slots than the pool has can never be
met: `fits` says so up front (such pulls are split into chunk pulls by the reader). Runs are first-fit
over the free extents, which are merged when runs return, so a pool that empties is one
extent again.

Contracts: a slot belongs to at most one owner; `free` returns exactly the owner's run;
`num_used + num_free == num_slots` always; `peak_used` is the most slots held at once.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotRun:
    """`count` slots from `start`."""

    start: int
    count: int


class StagingPool:
    """See the module docstring. Not thread-safe: the caller serializes (the connector's lock)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a staging pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[tuple[int, int]] = [(0, num_slots)]  # (start, count), sorted, never adjacent
        self._owners: dict[Hashable, SlotRun] = {}
        self.num_used = 0
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return self.num_slots - self.num_used

    def fits(self, count: int) -> bool:
        """Whether a run of `count` slots can ever be had (the pool is at least that large)."""
        return 1 <= count <= self.num_slots

    def allocate(self, owner: Hashable, count: int) -> SlotRun | None:
        """A run of `count` contiguous slots for `owner`, or None while none is free. Raises
        ValueError for an owner that holds a run already or a count the pool can never meet."""
        if owner in self._owners:
            raise ValueError(f"{owner!r} already holds staging slots")
        if not self.fits(count):
            raise ValueError(f"{count} blocks do not fit a staging pool of {self.num_slots} blocks")
        for i, (start, size) in enumerate(self._free):
            if size >= count:
                if size == count:
                    del self._free[i]
                else:
                    self._free[i] = (start + count, size - count)
                run = self._owners[owner] = SlotRun(start, count)
                self.num_used += count
                self.peak_used = max(self.peak_used, self.num_used)
                return run
        return None

    def holds(self, owner: Hashable) -> SlotRun | None:
        return self._owners.get(owner)

    def free(self, owner: Hashable) -> SlotRun | None:
        """Returns `owner`'s run to the pool (None if it holds none), merging free extents."""
        run = self._owners.pop(owner, None)
        if run is None:
            return None
        self.num_used -= run.count
        i = bisect.bisect_left(self._free, (run.start, 0))
        start, count = run.start, run.count
        if i < len(self._free) and self._free[i][0] == start + count:  # merge with the next extent
            count += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == start:  # ... and the previous one
            prev_start, prev_count = self._free.pop(i - 1)
            start, count, i = prev_start, prev_count + count, i - 1
        self._free.insert(i, (start, count))
        return run

    def free_extents(self) -> list[tuple[int, int]]:
        """(start, count) of the free extents, in slot order (for tests and inspection)."""
        return list(self._free)
