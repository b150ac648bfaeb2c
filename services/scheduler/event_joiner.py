"""`EventJoiner`: an engine's ranks' identical compact worker events, decoded and applied once.

In the per-rank protocol every TP rank reports the same worker events of a step in its own
report. The first copy is decoded and applied to the aggregator at once; a later copy with the
same bytes (the caller's `content` key) from a rank not yet counted is only noted here: no
decode, no aggregator call. The noted copies are applied together, with the ranks' joint mask
(`KVOutputAggregator.add_shared_hashes`, whose state and published events equal applying them
rank by rank), when the last rank's copy arrives.

Contracts:
- Per engine and rank, copies reach the aggregator in arrival order: a report of the engine
  that joins no open step, or that the caller applies by another route (`flush` first),
  applies the noted copies of its ranks (all of them, see below) before itself.
- The state afterwards and the published events are those of rank-by-rank application, each
  block's events in the same order. An event comes out at the report that completes it or
  later: the noted copies apply when the step's last copy arrives, so events of different
  blocks that ranks complete one by one come out together, in event order; and where noted
  copies would complete a block before every rank reported (the missing ranks held it
  already), at the next `flush` (the engine's next report of other events, or `flush_all`,
  which the Control servicer's heartbeat sweep calls).
- Up to MAX_OPEN_PER_ENGINE steps stay open per engine, so the copies of one step still meet
  when each rank's ReportBatch of several steps is read in turn (a scheduler behind, whose
  ranks coalesce their reports): a copy joins the newest open step of its content unless one
  of its ranks was counted there or in a later step (a rank's copies apply in its order);
  completing a step applies the older steps' noted copies first. Several steps are open only
  while every one is BlockStored alone (stores commute across ranks: the same state and each
  block's events); a copy with BlockRemoved, or of another epoch, applies every noted copy
  first. A copy that joins no open step is applied on its own, as rank by rank, but decoded
  once per engine and content while recent (up to MAX_DECODED_PER_ENGINE contents, forgotten
  at every `flush_all`).
- A copy the aggregator refuses (ValueError: stale epoch, unknown rank) changes nothing here;
  noted copies of an epoch the aggregator no longer holds are dropped, not applied.

Plain data in and out; no protobuf, no asyncio (one caller thread).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from connectors.aggregator import KVOutputAggregator
from connectors.compact_events import CompactEvents

# publish(engine_id, epoch, compact, published): `published` are the indices of the events the
# aggregator released (None: all of them, in order); never called with none.
# Decoded copies kept per engine for copies that arrive apart from their step's others.
MAX_DECODED_PER_ENGINE = 16
# Steps per engine whose copies may still join (a rank's ReportBatch of several steps read
# before the next rank's: each step's copies still meet).
MAX_OPEN_PER_ENGINE = 16
PublishCompact = Callable[[str, int, CompactEvents, "list[int] | None"], None]


@dataclass(slots=True)
class _Noted:
    """The engine's last decoded copy: its content, the ranks counted, those noted but not applied."""

    epoch: int
    content: Hashable
    compact: CompactEvents
    counted: set[int]
    waiting: list[int] = field(default_factory=list)
    swept: bool = False  # a flush_all passed since a rank's copy last joined


class EventJoiner:
    """See the module docstring. `publish` receives what the aggregator releases."""

    def __init__(self, aggregator: KVOutputAggregator, publish: PublishCompact) -> None:
        self.aggregator = aggregator
        self.publish = publish
        # Per engine, its open steps in arrival order: the last MAX_OPEN_PER_ENGINE decoded
        # copies, each with the ranks counted and those noted but not applied. Several are open
        # only while every one is BlockStored alone (see `_joinable`).
        self._noted: dict[str, list[_Noted]] = {}
        # Per engine, the copies decoded lately (content -> events), for copies that arrive
        # apart from their step's others: decoded once all the same. Bounded per engine,
        # oldest dropped.
        self._decoded: dict[str, dict[Hashable, CompactEvents]] = {}
        self._decoded_epoch: dict[str, int] = {}
        self.num_joined = 0   # copies applied with another rank's (no decode, no own call)
        self.num_decoded = 0  # copies decoded and applied on arrival

    def __len__(self) -> int:
        """Engines with a copy noted (applied or waiting)."""
        return len(self._noted)

    def add(self, engine_id: str, epoch: int, ranks: tuple[int, ...], num_ranks: int, content: Hashable,
            decode: Callable[[], CompactEvents]) -> tuple[CompactEvents, list[int] | None]:
        """One report's copy of compact worker events, counted for `ranks` (the sender, and the
        ranks it merges) of an engine of `num_ranks` ranks; `decode` gives its events (called
        only when no open step has the same `content`; its ValueError propagates, nothing
        applied). Returns the copy's events and the indices of those this report releases (None:
        all, in order; [] none) for the caller to publish; earlier reports' events that a flush
        releases go to `publish` first."""
        opened = self._noted.get(engine_id)
        if opened:
            i = _joinable(opened, epoch, content, ranks)
            if i is not None:
                return self._join(engine_id, opened, i, ranks, num_ranks)
        # A copy counted for every rank (merged) comes once: nothing to keep for later copies.
        compact = decode() if len(ranks) >= num_ranks else self._decode(engine_id, epoch, content, decode)
        if opened:
            self._flush_before(engine_id, opened, epoch, ranks, compact)
        published = self.aggregator.add_shared_hashes(engine_id, epoch, ranks, compact.key, compact.hashes,
                                                      compact.sizes, compact.kinds)
        self.num_decoded += 1
        if len(ranks) < num_ranks:
            opened = self._noted.setdefault(engine_id, [])
            opened.append(_Noted(epoch, content, compact, set(ranks)))
            if len(opened) > MAX_OPEN_PER_ENGINE:
                self._flush_noted(engine_id, opened.pop(0))
        return compact, published

    def _join(self, engine_id: str, opened: list[_Noted], i: int, ranks: tuple[int, ...],
              num_ranks: int) -> tuple[CompactEvents, list[int] | None]:
        noted = opened[i]
        noted.counted.update(ranks)
        noted.waiting.extend(ranks)
        noted.swept = False
        self.num_joined += 1
        if len(noted.counted) < num_ranks:
            return noted.compact, []
        for older in opened[:i]:  # their ranks' earlier copies apply first
            if older.waiting:
                self._flush_noted(engine_id, older)
        del opened[i]
        if not opened:
            del self._noted[engine_id]
        self._decoded.get(engine_id, {}).pop(noted.content, None)  # every rank counted it
        return noted.compact, self._apply_waiting(engine_id, noted)

    def _flush_before(self, engine_id: str, opened: list[_Noted], epoch: int, ranks: tuple[int, ...],
                      compact: CompactEvents) -> None:
        """Before a new copy applies: the noted copies of `ranks` (and every older one) apply
        first, and every one when the new copy or an open step is not BlockStored alone or is
        of another epoch (then only the new copy stays open)."""
        if compact.kinds or any(n.compact.kinds or n.epoch != epoch for n in opened):
            for noted in opened:
                if noted.waiting:
                    self._flush_noted(engine_id, noted)
            del self._noted[engine_id]
            return
        last = max((j for j, n in enumerate(opened) if not n.counted.isdisjoint(ranks)), default=-1)
        for noted in opened[:last + 1]:
            if noted.waiting:
                self._flush_noted(engine_id, noted)

    def _decode(self, engine_id: str, epoch: int, content: Hashable,
                decode: Callable[[], CompactEvents]) -> CompactEvents:
        if self._decoded_epoch.get(engine_id) != epoch:
            self._decoded[engine_id], self._decoded_epoch[engine_id] = {}, epoch
        cache = self._decoded[engine_id]
        compact = cache.get(content)
        if compact is None:
            compact = decode()
            cache[content] = compact
            if len(cache) > MAX_DECODED_PER_ENGINE:
                del cache[next(iter(cache))]
        return compact

    def flush(self, engine_id: str) -> None:
        """Applies the engine's noted copies now, in arrival order (what they release goes to
        `publish`): call before applying the engine's worker events by another route. The open
        steps stay known, so their copies still to come join them."""
        for noted in self._noted.get(engine_id, ()):
            if noted.waiting:
                self._flush_noted(engine_id, noted)

    def flush_all(self) -> None:
        """`flush` of every engine; forgets an open step no rank sent a copy of since the
        previous `flush_all`, and the decoded copies (they serve a burst only)."""
        for engine_id, opened in list(self._noted.items()):
            for noted in opened:
                if noted.waiting:
                    self._flush_noted(engine_id, noted)
            kept = [n for n in opened if not n.swept]
            for noted in kept:
                noted.swept = True
            if kept:
                self._noted[engine_id] = kept
            else:
                del self._noted[engine_id]
        self._decoded.clear()
        self._decoded_epoch.clear()

    def _flush_noted(self, engine_id: str, noted: _Noted) -> None:
        published = self._apply_waiting(engine_id, noted)
        noted.waiting = []
        if published is None or published:
            self.publish(engine_id, noted.epoch, noted.compact, published)

    def _apply_waiting(self, engine_id: str, noted: _Noted) -> list[int] | None:
        if not noted.waiting or self.aggregator.engine_epoch(engine_id) != noted.epoch:
            return []  # nothing waits, or the epoch's state is gone
        c = noted.compact
        return self.aggregator.add_shared_hashes(engine_id, noted.epoch, noted.waiting, c.key, c.hashes,
                                                 c.sizes, c.kinds)


def _joinable(opened: list[_Noted], epoch: int, content: Hashable, ranks: tuple[int, ...]) -> int | None:
    """The open step this copy joins: same epoch and content, none of `ranks` counted there or
    in a later step (a rank's copies apply in its order); None: it opens a step of its own."""
    for i in range(len(opened) - 1, -1, -1):
        noted = opened[i]
        if not noted.counted.isdisjoint(ranks):
            return None
        if noted.epoch == epoch and noted.content == content:
            return i
    return None
