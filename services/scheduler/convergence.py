"""`IndexConvergence`: a (re)started scheduler replica's prefix index catches up with its peers.

A replica that starts while engines already run hears each engine only from the report its
stream starts at (`Hello.first_position`); vLLM engines cannot resend their block pool, so the
blocks stored before that point must come from a peer replica's snapshot. The snapshot names,
per engine, the rank-0 report position it holds everything up to (`EngineSnapshot.position`);
this replica installs it and then its own batches after that position, so the index ends as if
it had heard every report: no gap, no duplicate.

`IndexConvergence` is the Control servicer's event sink until then (pure, loop-thread only):
- `publish` passes a batch straight on for an engine epoch that is complete (heard from its
  first report, or installed from a snapshot); any other batch is held with the position of
  the rank-0 report being applied (`EnginePositions.last`). A full `AllBlocksCleared` (the epoch
  ends) drops what is held for that epoch and passes on.
- `install(snapshot)` (None: no peer offered one) completes every engine it can: one heard from
  its start (held batches published), or one whose snapshot position reaches back to where this
  replica's hearing starts (`position >= first - 1`: the snapshot's blocks, then the held
  batches after `position`). It returns the engines still missing, those of the snapshot not
  connected here yet among them. With none missing the replica has converged: what is held is
  published in order and every later batch passes straight on.
- `finish(reason)` converges at once (the caller's timeout; too much held): held batches are
  published as they are (the index under-reports what it never heard; never wrong).
Worker-side events of an engine with several ranks are positioned by rank 0's report: those
whose ranks straddle the snapshot point may be missing until stored again (under-reported).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from connectors.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from services.scheduler.engine_positions import EnginePositions
from services.scheduler.event_sink import CompactBatch, EventSink

logger = logging.getLogger(__name__)

DEFAULT_MAX_HELD_BATCHES = 200_000


@dataclass(slots=True)
class EngineSnapshot:
    """One engine in a peer's snapshot: its blocks per medium, up to rank 0's `position`."""

    engine_id: str
    epoch: int
    position: int
    blocks: dict[str | None, list[int | bytes]] = field(default_factory=dict)


@dataclass(slots=True)
class PeerSnapshot:
    scheduler_id: str
    engines: dict[str, EngineSnapshot] = field(default_factory=dict)


@dataclass(slots=True)
class _Held:
    engine_id: str
    epoch: int
    position: int
    batch: KVEventBatch


def _clears_all(batch: KVEventBatch) -> bool:
    if type(batch) is CompactBatch or not batch.events:
        return False
    last = batch.events[-1]
    return isinstance(last, AllBlocksCleared) and last.medium is None


class IndexConvergence:
    """See the module docstring. `on_converged` hooks run once, when the replica converges."""

    def __init__(self, target: EventSink, positions: EnginePositions, *,
                 max_held_batches: int = DEFAULT_MAX_HELD_BATCHES, clock: Callable[[], float] = time.time,
                 live: Callable[[str, int], bool] = lambda engine_id, epoch: True) -> None:
        self.target = target
        self.positions = positions
        self.live = live  # whether (engine, epoch) is still registered and up: a dead one is not waited for
        self.max_held_batches = max_held_batches
        self._clock = clock
        self.converged = False
        self.forced_reason = ""
        self.num_installed_engines = 0
        self.num_installed_blocks = 0
        self.on_converged: list[Callable[[], None]] = []
        self._complete: set[tuple[str, int]] = set()
        self._held: list[_Held] = []

    @property
    def num_held(self) -> int:
        return len(self._held)

    def publish(self, engine_id: str, epoch: int, batch: KVEventBatch) -> None:
        if self.converged or (engine_id, epoch) in self._complete:
            self.target.publish(engine_id, epoch, batch)
            return
        if self.positions.complete_from_start(engine_id, epoch):
            self._complete_engine(engine_id, epoch, None)
            self.target.publish(engine_id, epoch, batch)
            return
        if _clears_all(batch):
            self._held = [h for h in self._held if (h.engine_id, h.epoch) != (engine_id, epoch)]
            self._complete.add((engine_id, epoch))
            self.target.publish(engine_id, epoch, batch)
            return
        self._held.append(_Held(engine_id, epoch, self.positions.last(engine_id, epoch), batch))
        if len(self._held) > self.max_held_batches:
            self.finish(f"more than {self.max_held_batches} batches held")

    def install(self, snapshot: PeerSnapshot | None) -> list[str]:
        """Completes what it can (see the module docstring); returns the engines still missing."""
        if self.converged:
            return []
        missing: list[str] = []
        for engine_id, pos in self.positions.items():
            if (engine_id, pos.epoch) in self._complete or not self.live(engine_id, pos.epoch):
                continue
            if pos.first <= 1:
                self._complete_engine(engine_id, pos.epoch, None)
                continue
            snap = snapshot.engines.get(engine_id) if snapshot is not None else None
            if snap is None or snap.epoch != pos.epoch or snap.position < pos.first - 1:
                missing.append(engine_id)
                continue
            self._complete_engine(engine_id, pos.epoch, snap)
        if snapshot is not None:
            missing += [e for e in snapshot.engines if self.positions.get(e) is None]
        if not missing:
            self._converge()
        return missing

    def finish(self, reason: str) -> None:
        """Converges now, publishing every held batch as it is."""
        if self.converged:
            return
        self.forced_reason = reason
        logger.warning("prefix index converged without a complete snapshot (%s): it under-reports "
                       "blocks stored before this replica started until they are stored again", reason)
        self._converge()

    def _complete_engine(self, engine_id: str, epoch: int, snap: EngineSnapshot | None) -> None:
        after = snap.position if snap is not None else -1
        if snap is not None:
            ts = self._clock()
            for medium, hashes in snap.blocks.items():
                if hashes:
                    self.target.publish(engine_id, epoch,
                                        KVEventBatch(ts, [BlockStored(tuple(hashes), None, (), 0, medium=medium)]))
                    self.num_installed_blocks += len(hashes)
            self.num_installed_engines += 1
            logger.info("engine %s: installed a peer's snapshot up to report %d (%d blocks)", engine_id,
                        snap.position, sum(len(h) for h in snap.blocks.values()))
        keep: list[_Held] = []
        for h in self._held:
            if (h.engine_id, h.epoch) != (engine_id, epoch):
                keep.append(h)
            elif h.position > after:
                self.target.publish(h.engine_id, h.epoch, h.batch)
        self._held = keep
        self._complete.add((engine_id, epoch))

    def _converge(self) -> None:
        held, self._held = self._held, []
        self.converged = True
        for h in held:
            self.target.publish(h.engine_id, h.epoch, h.batch)
        self._complete.clear()
        logger.info("prefix index converged (%d engines from a peer's snapshot, %d blocks)",
                    self.num_installed_engines, self.num_installed_blocks)
        for hook in self.on_converged:
            hook()
