"""The scheduler loop's own stalls, so that liveness is judged on time the loop could listen.

A rank's message proves it alive only once the scheduler's event loop reads it. While the loop is
stalled (a long callback, a full garbage collection, a starved process) messages wait unread in
the sockets, and a rank that beat on time looks silent. `LoopStalls` records those intervals; the
heartbeat sweep subtracts them from a rank's silence (`EngineRegistry.expire(stalled_since=...)`).

Pure and synchronous: the caller measures (`observe(expected, actual)` from a periodic task that
knows when it should have woken) and asks (`stalled_since(t)`).

Contracts:
- `observe(expected, actual)`: a tick that should have run at `expected` ran at `actual`; when it
  was late by more than `tolerance_s` the whole interval (expected, actual] counts as stalled.
- `stalled_since(t)`: the stalled seconds after `t` (overlaps clipped at `t`), over the stalls
  recorded within the last `horizon_s` (older ones are forgotten; a rank silent that long is
  judged on wall time alone beyond the horizon). At most `max_entries` stalls are kept (the
  oldest go first), so a loop that is late on every tick costs bounded memory and time.
"""

from __future__ import annotations

from collections import deque


class LoopStalls:
    """Recorded loop stalls (see the module docstring)."""

    __slots__ = ("_stalls", "horizon_s", "max_lag_s", "tolerance_s", "total_s")

    def __init__(self, *, horizon_s: float, tolerance_s: float = 0.02, max_entries: int = 256) -> None:
        if horizon_s <= 0 or tolerance_s < 0 or max_entries < 1:
            raise ValueError(f"horizon_s must be > 0, tolerance_s >= 0 and max_entries >= 1, got "
                             f"{horizon_s}, {tolerance_s}, {max_entries}")
        self.horizon_s = horizon_s
        self.tolerance_s = tolerance_s
        self._stalls: deque[tuple[float, float]] = deque(maxlen=max_entries)
        self.total_s = 0.0  # every stall ever recorded, for metrics
        self.max_lag_s = 0.0

    def observe(self, expected: float, actual: float) -> float:
        """Records a tick due at `expected` that ran at `actual`; returns its lag (>= 0)."""
        lag = max(0.0, actual - expected)
        self.max_lag_s = max(self.max_lag_s, lag)
        if lag > self.tolerance_s:
            self._stalls.append((expected, actual))
            self.total_s += lag
        while self._stalls and self._stalls[0][1] < actual - self.horizon_s:
            self._stalls.popleft()
        return lag

    def stalled_since(self, t: float) -> float:
        """Stalled seconds after `t` among the remembered stalls."""
        total = 0.0
        for start, end in reversed(self._stalls):
            if end <= t:
                break  # stalls are recorded in time order: the older ones end earlier still
            total += end - max(start, t)
        return total

    def __len__(self) -> int:
        return len(self._stalls)
