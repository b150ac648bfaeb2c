"""Admission: a bounded number of in-flight requests per engine.

Beyond the bound the scheduler answers RESOURCE_EXHAUSTED instead of queueing without limit.
A slot is taken when a request is routed to an engine and given back exactly once when that
leg ends (the caller pairs `try_acquire` with `release`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping


class Admission:
    """Per-engine in-flight counters with one shared bound (`max_inflight_per_engine`)."""

    def __init__(self, max_inflight_per_engine: int) -> None:
        if max_inflight_per_engine < 1:
            raise ValueError(f"max_inflight_per_engine must be >= 1, got {max_inflight_per_engine}")
        self.max_inflight_per_engine = max_inflight_per_engine
        self._inflight: Counter[str] = Counter()
        self.rejected = 0

    @property
    def inflight_counts(self) -> Mapping[str, int]:
        """Engine id -> its in-flight requests, engines with none absent (live; do not modify)."""
        return self._inflight

    def inflight(self, engine_id: str) -> int:
        return self._inflight.get(engine_id, 0)

    def has_room(self, engine_id: str) -> bool:
        return self._inflight.get(engine_id, 0) < self.max_inflight_per_engine

    def try_acquire(self, engine_id: str) -> bool:
        """Takes a slot on the engine; False (and counted as rejected) when it is full."""
        if not self.has_room(engine_id):
            self.rejected += 1
            return False
        self._inflight[engine_id] += 1
        return True

    def release(self, engine_id: str) -> None:
        """Gives a slot back; raises ValueError when the engine holds none (a double release)."""
        if self._inflight[engine_id] <= 0:
            raise ValueError(f"engine {engine_id!r} has no in-flight slot to release")
        self._inflight[engine_id] -= 1
        if self._inflight[engine_id] == 0:
            del self._inflight[engine_id]

    def total(self) -> int:
        return sum(self._inflight.values())
