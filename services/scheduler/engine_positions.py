"""`EnginePositions`: how far this scheduler replica has heard each engine's rank 0.

Every rank numbers its reports (`StepReport.position`: 1, 2, 3 ... per epoch, the same at every
replica; `services.engine.control_fanout`). Rank 0's position names a point in the engine's
event history that every replica agrees on, so a replica that restarted can take a peer's
snapshot "up to position P" and apply its own reports after P: no gap, no duplicate.

Contract (pure, loop-thread only, like the registry):
- `hello(engine, epoch, first_position)` on each accepted Hello of rank 0: the first one of an
  epoch records where this replica's knowledge of it starts (`Hello.first_position`); later
  Hellos of the same epoch change nothing (the stream resends what was not acknowledged). A new
  epoch replaces the old one.
- `advance(engine, epoch, position)` when a numbered report of rank 0 is applied (before its
  events are published, so `last` is the position of the events being published).
- `complete_from_start(engine, epoch)`: this replica heard every report of the epoch (first
  position 1), or the reports are not numbered (position 0: an older engine; nothing better is
  known).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EnginePosition:
    epoch: int
    first: int  # the first position this replica heard of the epoch (0: not numbered)
    last: int  # the last applied position (first - 1 before any report)


class EnginePositions:
    """See the module docstring."""

    def __init__(self) -> None:
        self._engines: dict[str, EnginePosition] = {}

    def hello(self, engine_id: str, epoch: int, first_position: int) -> None:
        current = self._engines.get(engine_id)
        if current is not None and current.epoch == epoch:
            return
        self._engines[engine_id] = EnginePosition(epoch, first_position, max(0, first_position - 1))

    def advance(self, engine_id: str, epoch: int, position: int) -> None:
        current = self._engines.get(engine_id)
        if current is None or current.epoch != epoch:
            self._engines[engine_id] = current = EnginePosition(epoch, position, position)
        current.last = max(current.last, position)

    def get(self, engine_id: str) -> EnginePosition | None:
        return self._engines.get(engine_id)

    def last(self, engine_id: str, epoch: int) -> int:
        """The last applied position of (engine, epoch); 0 when unknown."""
        p = self._engines.get(engine_id)
        return p.last if p is not None and p.epoch == epoch else 0

    def complete_from_start(self, engine_id: str, epoch: int) -> bool:
        p = self._engines.get(engine_id)
        return p is not None and p.epoch == epoch and p.first <= 1

    def remove(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)

    def items(self) -> list[tuple[str, EnginePosition]]:
        return list(self._engines.items())
