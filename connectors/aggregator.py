"""Per-rank output aggregation for the central scheduler (ARCHITECTURE §3).

Every rank of every engine reports one `KVConnectorOutput` per step (`add_report`). The
aggregator turns these into engine-level facts:

- Finished transfers. An engine's expected rank set is fixed at registration. A request id is
  finished when `needed` distinct expected ranks reported it, where `needed` is the engine's
  finished count when the id was first seen (all ranks unless changed with
  `expected_finished_count`). A rank counts at most once per id; reports persist across steps;
  an id is released exactly once, then remembered (bounded) so late or repeated reports of it
  are absorbed. Ids in `failed_recving` count as received on that rank; the released id is
  failed when any rank reported it failed. Invalid block ids are the union over ranks: a
  report's invalid ids attach to the receiving ids of the same report (or, when it has none,
  to that rank's next report that has some), and are released with the id.
- Worker-side KV events (each rank holds one shard of a block). The aggregator tracks, per
  (medium, group_idx, hash), which ranks hold the block. A `BlockStored` is published when
  every expected rank holds every one of its hashes and at least one of them was not yet
  published; repeats are absorbed. A `BlockRemoved` is published at the first report that
  removes a published hash (the block is no longer whole in that medium); later removals
  of the same hash by other ranks are absorbed. `AllBlocksCleared(medium)` drops the rank
  from every block of that medium (every medium when None); it is published when it
  removes a published block or when no other rank's clear is outstanding, so a clear
  reported by every rank is published once. `BlockStored` events without hashes carry
  nothing to index and are dropped.
- Everything of an engine is cleared on `drop_engine` or when it registers a new epoch;
  `abort` drops one request id. Reports from another epoch raise `StaleEpochError`.

Plain data in and out; no protobuf, no asyncio, no locks (one caller thread). The clock is
injectable for the pending-age metric.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, islice, repeat
from operator import attrgetter, or_
from typing import TypeVar

from connectors.compact_events import KIND_REMOVED, KIND_STORED, KindRun, check_kinds, kind_runs
from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from connectors.outputs import KVConnectorOutput, KVConnectorStats, KVConnectorWorkerMetadata

DEFAULT_MAX_DONE_IDS = 65536


class UnknownEngineError(ValueError):
    """A report or query named an engine that is not registered."""


class StaleEpochError(ValueError):
    """A report carried an epoch other than the engine's registered one."""


@dataclass(slots=True)
class AggregatedResult:
    """What one `add_report` (or `add_reports`) released.

    `finished_recving` includes the failed ids; `failed_recving` is the failed subset.
    `invalid_block_ids` maps a released receiving id to the union of invalid block ids the
    ranks attached to it (absent when none). `events` are ready to publish, in order.
    Stats and worker metadata are those of the report(s), folded with `aggregate`.
    """

    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: dict[str, frozenset[int]] = field(default_factory=dict)
    events: list[KVCacheEvent] = field(default_factory=list)
    kv_connector_stats: KVConnectorStats | None = None
    kv_connector_worker_meta: KVConnectorWorkerMetadata | None = None

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.events
                    or self.kv_connector_stats is not None or self.kv_connector_worker_meta is not None)

    def merge(self, other: AggregatedResult) -> None:
        """Appends `other` (a later result of the same engine) to self."""
        self.finished_sending.extend(other.finished_sending)
        self.finished_recving.extend(other.finished_recving)
        self.failed_recving |= other.failed_recving
        self.invalid_block_ids.update(other.invalid_block_ids)
        self.events.extend(other.events)
        self.kv_connector_stats = _fold(self.kv_connector_stats, other.kv_connector_stats)
        self.kv_connector_worker_meta = _fold(self.kv_connector_worker_meta, other.kv_connector_worker_meta)

    def to_output(self) -> KVConnectorOutput:
        """The engine-level output for a scheduler-side connector's `update_connector_output`."""
        invalid: set[int] = set()
        for ids in self.invalid_block_ids.values():
            invalid |= ids
        return KVConnectorOutput(
            finished_sending=frozenset(self.finished_sending),
            finished_recving=frozenset(self.finished_recving),
            failed_recving=frozenset(self.failed_recving),
            invalid_block_ids=frozenset(invalid),
            kv_connector_stats=self.kv_connector_stats,
            kv_cache_events=tuple(self.events),
            kv_connector_worker_meta=self.kv_connector_worker_meta,
        )


_Foldable = TypeVar("_Foldable", KVConnectorStats, KVConnectorWorkerMetadata)


def _fold(acc: _Foldable | None, other: _Foldable | None) -> _Foldable | None:
    if acc is None:
        return other
    if other is None:
        return acc
    return acc.aggregate(other)


@dataclass(frozen=True, slots=True)
class PendingCounts:
    """Partial states of one engine: ids some but not enough ranks reported, blocks some but
    not all ranks hold, and clears not yet reported by every rank."""

    sending: int
    recving: int
    blocks: int
    clears: int

    @property
    def total(self) -> int:
        return self.sending + self.recving + self.blocks + self.clears


class _IdCounters:
    """Distinct-rank counters of request ids for one direction (sending or receiving).

    Bulk dict operations (`map`, `update`) keep the per-id work in C; Python loops run only
    for ids seen for the first time, ids released, and failure bookkeeping.
    """

    __slots__ = ("done", "failed", "invalid", "masks", "max_done", "needed", "since")

    def __init__(self, max_done: int) -> None:
        self.masks: dict[str, int] = {}       # id -> mask of ranks that reported it
        self.since: dict[str, float] = {}     # id -> first report (insertion ordered)
        self.needed: dict[str, int] = {}      # id -> ranks needed, when not every rank
        self.failed: set[str] = set()
        self.invalid: dict[str, set[int]] = {}
        self.done: dict[str, None] = {}       # released or aborted ids (bounded, oldest first)
        self.max_done = max_done

    def count(self, ids: frozenset[str], bit: int, full: int, needed: int, now: float) -> list[str]:
        """Counts `ids` for the rank `bit`; returns the ids this released."""
        masks = self.masks
        todo = list(ids)
        olds = list(map(masks.get, todo, repeat(0)))
        if 0 in olds and self.done:
            # Only an id without counters can be a released or aborted one (pending and done
            # are disjoint); drop those before counting.
            done = self.done
            if any(i in done for i, old in zip(todo, olds, strict=True) if not old):
                todo = [i for i in todo if i not in done]
                olds = list(map(masks.get, todo, repeat(0)))
        news = list(map(or_, olds, repeat(bit)))
        masks.update(zip(todo, news, strict=True))
        if 0 in olds:
            fresh = [i for i, old in zip(todo, olds, strict=True) if not old]
            self.since.update(zip(fresh, repeat(now)))
            if needed != full.bit_count():
                self.needed.update(zip(fresh, repeat(needed)))
        if self.needed:
            need = self.needed
            released = [i for i, new in zip(todo, news, strict=True)
                        if new == full or (i in need and new.bit_count() >= need[i])]
        elif full in news:
            released = [i for i, new in zip(todo, news, strict=True) if new == full]
        else:
            return []
        if released:
            self._release(released)
        return released

    def _release(self, released: list[str]) -> None:
        for mapping in (self.masks, self.since):
            deque(map(mapping.pop, released), maxlen=0)
        if self.needed:
            deque(map(self.needed.pop, released, repeat(None)), maxlen=0)
        self._remember(released)

    def _remember(self, request_ids: list[str]) -> None:
        done = self.done
        done.update(zip(request_ids, repeat(None)))
        excess = len(done) - self.max_done
        if excess > 0:
            deque(map(done.pop, list(islice(done, excess))), maxlen=0)

    def forget(self, request_id: str) -> bool:
        """Drops the id's counters and remembers it as done. True when it was pending."""
        pending = self.masks.pop(request_id, None) is not None
        if pending:
            del self.since[request_id]
            self.needed.pop(request_id, None)
        self._remember([request_id])
        return pending

    def oldest(self) -> float | None:
        return next(iter(self.since.values())) if self.since else None


_MediumKey = tuple[str | None, int | None]
_HASHES = attrgetter("block_hashes")
_KIND_BYTES = {BlockStored: KIND_STORED, BlockRemoved: KIND_REMOVED}
_EVENT_TYPES = frozenset({BlockStored, BlockRemoved, AllBlocksCleared})
_ONLY_STORED = frozenset({BlockStored})
_MEDIUM_KEY_OF = attrgetter("medium", "group_idx")


class _EngineState:
    __slots__ = ("blocks", "clears", "epoch", "finished_count", "full_mask", "live",
                 "pending_blocks", "rank_bits", "ranks", "recving", "sending", "unattributed_invalid")

    def __init__(self, epoch: int, ranks: tuple[int, ...], finished_count: int, max_done: int) -> None:
        self.epoch = epoch
        self.ranks = ranks
        self.rank_bits = {r: 1 << i for i, r in enumerate(ranks)}
        self.full_mask = (1 << len(ranks)) - 1
        self.finished_count = finished_count
        self.sending = _IdCounters(max_done)
        self.recving = _IdCounters(max_done)
        self.unattributed_invalid: dict[int, set[int]] = {}
        # (medium, group_idx) -> hash -> mask of ranks holding the block
        self.blocks: dict[_MediumKey, dict[object, int]] = {}
        # (medium, group_idx) -> published hashes (a dict, not a set: a dict of ints or bytes is
        # not tracked by the garbage collector, a set always is and every full collection
        # would walk each of its entries)
        self.live: dict[_MediumKey, dict[object, None]] = {}
        # (medium, group_idx) -> hash -> time it became partial (some, not all ranks)
        self.pending_blocks: dict[_MediumKey, dict[object, float]] = {}
        # medium -> mask of ranks whose clear is outstanding
        self.clears: dict[str | None, int] = {}


class KVOutputAggregator:
    """Aggregates per-rank connector reports of many engines (see the module docstring).

    Errors raise ValueError subclasses and change no state.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 max_done_ids: int = DEFAULT_MAX_DONE_IDS) -> None:
        if max_done_ids < 1:
            raise ValueError(f"max_done_ids must be >= 1, got {max_done_ids}")
        self._clock = clock
        self._max_done_ids = max_done_ids
        self._engines: dict[str, _EngineState] = {}
        # The last events tuple that passed validation, and the run plan of the last one
        # applied: every TP rank of a step usually hands over the same tuple object (the
        # Control servicer decodes one copy per step), so its per-event scans run once, not once
        # per rank. Tuples and events are immutable; holding the reference keeps its id unique.
        self._valid_events: tuple[KVCacheEvent, ...] = ()
        self._plan_events: tuple[KVCacheEvent, ...] = ()
        self._plan: tuple[_MediumKey, list[object]] | None = None

    # -- registration -------------------------------------------------------------------

    def register_engine(self, engine_id: str, epoch: int, ranks: Collection[int],
                        finished_count: int | None = None) -> bool:
        """Registers (engine_id, epoch) with its fixed expected rank set.

        Repeating the current registration is a no-op (returns False). A different epoch is a
        new incarnation: every pending state of the old one is dropped (returns True). The same
        epoch with another rank set raises ValueError. `finished_count` (default: all ranks)
        is how many distinct ranks must report an id.
        """
        rank_tuple = tuple(sorted(set(ranks)))
        if not engine_id:
            raise ValueError("engine_id must be non-empty")
        if not rank_tuple or len(rank_tuple) != len(ranks) or rank_tuple[0] < 0:
            raise ValueError(f"ranks must be distinct non-negative ints, got {sorted(ranks)}")
        count = len(rank_tuple) if finished_count is None else finished_count
        self._check_count(count, len(rank_tuple))
        current = self._engines.get(engine_id)
        if current is not None and current.epoch == epoch:
            if current.ranks != rank_tuple:
                raise ValueError(f"engine {engine_id!r} epoch {epoch} is registered with ranks "
                                 f"{list(current.ranks)}, not {list(rank_tuple)}")
            return False
        self._engines[engine_id] = _EngineState(epoch, rank_tuple, count, self._max_done_ids)
        return True

    def drop_engine(self, engine_id: str) -> bool:
        """Forgets an engine and everything pending for it. False when it was unknown."""
        return self._engines.pop(engine_id, None) is not None

    def engine_epoch(self, engine_id: str) -> int | None:
        state = self._engines.get(engine_id)
        return None if state is None else state.epoch

    def abort(self, request_id: str, engine_id: str | None = None) -> bool:
        """Drops the pending counters of `request_id` (on one engine, or every engine); later
        reports of it are absorbed, also when no rank reported it yet. True when something
        pending was dropped."""
        states = self._engines.values() if engine_id is None else [self._state(engine_id)]
        dropped = False
        for state in states:
            for counters in (state.sending, state.recving):
                dropped |= counters.forget(request_id)
            state.recving.failed.discard(request_id)
            state.recving.invalid.pop(request_id, None)
        return dropped

    # -- reports ------------------------------------------------------------------------

    def add_report(self, engine_id: str, epoch: int, rank: int, output: KVConnectorOutput) -> AggregatedResult:
        """Applies one rank's report and returns what it released."""
        state = self._checked(engine_id, epoch, rank, output)
        result = AggregatedResult(kv_connector_stats=output.kv_connector_stats,
                                  kv_connector_worker_meta=output.kv_connector_worker_meta)
        self._apply(state, rank, output, result, self._clock())
        return result

    def add_reports(self, engine_id: str, epoch: int,
                    outputs: Mapping[int, KVConnectorOutput]) -> AggregatedResult:
        """Applies one step's reports of several ranks (in rank order) and returns the union of
        what they released, stats and worker metadata folded (the first object is updated in
        place). Every report is validated before any is applied."""
        for rank, output in outputs.items():
            state = self._checked(engine_id, epoch, rank, output)
        result = AggregatedResult()
        now = self._clock()
        for rank in sorted(outputs):
            output = outputs[rank]
            self._apply(state, rank, output, result, now)
            result.kv_connector_stats = _fold(result.kv_connector_stats, output.kv_connector_stats)
            result.kv_connector_worker_meta = _fold(result.kv_connector_worker_meta,
                                                    output.kv_connector_worker_meta)
        return result

    def add_shared_events(self, engine_id: str, epoch: int, ranks: Collection[int],
                          events: tuple[KVCacheEvent, ...]) -> AggregatedResult:
        """Applies the same worker events as reported by each of `ranks` in one step (an engine
        whose ranks agree, e.g. gathered by its rank 0) and returns what they released.

        The state afterwards equals `add_report` of each rank with only these events, in rank
        order, and so do the published events as a multiset. A run of BlockStored of one
        (medium, group) (the common case) is applied once with the ranks' joint mask, so the
        events it completes come out in event order (one by one, an event completed by an
        earlier rank of the group would come out first); BlockStored mixed with BlockRemoved of
        one (medium, group) take `add_shared_hashes`' route for kinds (the same events in the
        same order as a compact report of them). Every rank is validated before anything is
        applied (ValueError: unknown or repeated rank, stale epoch, not an event).
        """
        order = sorted(set(ranks))
        if len(order) != len(ranks):
            raise ValueError(f"engine {engine_id!r}: ranks repeat in {sorted(ranks)}")
        output = KVConnectorOutput(kv_cache_events=events)
        state = self._state(engine_id)
        for rank in order:
            state = self._checked(engine_id, epoch, rank, output)
        result = AggregatedResult()
        if not order or not events:
            return result
        now = self._clock()
        plan = self._stored_plan(events)
        if plan is None:
            arrays = _mixed_arrays(events)
            if arrays is not None:  # BlockStored and BlockRemoved of one (medium, group)
                key, hashes, sizes, kinds = arrays
                bits = [state.rank_bits[rank] for rank in order]
                published = self._mixed_hashes(state, bits, key, hashes, sizes, kinds, now)
                result.events.extend(events if published is None else map(events.__getitem__, published))
                return result
            for rank in order:
                self._apply(state, rank, output, result, now)
            return result
        key, hashes = plan
        if len(order) > 1 and _repeats(hashes):
            for rank in order:  # `_repeats`: the joint mask would publish fewer events
                self._apply(state, rank, output, result, now)
            return result
        mask = 0
        for rank in order:
            mask |= state.rank_bits[rank]
        self._stored_run(state, mask, key, events, result, now, hashes)  # type: ignore[arg-type]
        return result

    def add_shared_hashes(self, engine_id: str, epoch: int, ranks: Collection[int], key: _MediumKey,
                          hashes: list[int], sizes: list[int], kinds: bytes = b"") -> list[int] | None:
        """`add_shared_events` for a run of BlockStored events of one (medium, group_idx) `key`
        given by their hashes (in order) and the number of hashes of each (>= 1): the same
        state afterwards, and the same published events, returned as their indices (None: all,
        in order; [] none). With `kinds` (one byte per event, `compact_events.KIND_STORED` or
        `KIND_REMOVED`; empty: every event stored) the run mixes BlockStored and BlockRemoved,
        applied in event order with §3's semantics, and the indices are those
        `add_shared_events` publishes, in its order (an index may repeat: a block removed by one
        rank and stored again in the same step). No object per event is built. Validated
        before anything applies (ValueError: unknown or repeated rank, stale epoch, a size < 1,
        a count mismatch, a malformed `kinds`)."""
        order = sorted(set(ranks))
        if len(order) != len(ranks):
            raise ValueError(f"engine {engine_id!r}: ranks repeat in {sorted(ranks)}")
        if sum(sizes) != len(hashes) or (sizes and min(sizes) < 1):
            raise ValueError(f"engine {engine_id!r}: {len(hashes)} hashes do not split into events of sizes {sizes}")
        check_kinds(kinds, len(sizes))
        state = self._state(engine_id)
        if order and epoch != state.epoch:
            raise StaleEpochError(f"engine {engine_id!r}: report for epoch {epoch}, current epoch is {state.epoch}")
        rank_bits = state.rank_bits
        for rank in order:
            if rank not in rank_bits:
                raise ValueError(f"engine {engine_id!r}: rank {rank} is not one of the expected ranks {list(state.ranks)}")
        if not order or not sizes:
            return []
        if KIND_REMOVED in kinds or (len(order) > 1 and _repeats(hashes)):
            return self._mixed_hashes(state, [rank_bits[r] for r in order], key, hashes, sizes, kinds, self._clock())
        mask = 0
        for rank in order:
            mask |= rank_bits[rank]
        return self._stored_hashes(state, mask, key, hashes, sizes, self._clock())  # type: ignore[arg-type]

    # -- metrics ------------------------------------------------------------------------

    def pending_reports(self) -> dict[str, PendingCounts]:
        """Per engine id: the partial states waiting for more rank reports."""
        return {engine_id: PendingCounts(
            sending=len(s.sending.masks), recving=len(s.recving.masks),
            blocks=sum(len(p) for p in s.pending_blocks.values()),
            clears=len(s.clears)) for engine_id, s in self._engines.items()}

    def oldest_pending_age(self, engine_id: str | None = None) -> float | None:
        """Seconds since the oldest partial state (of one engine or all) began; None if none."""
        states = self._engines.values() if engine_id is None else [self._state(engine_id)]
        oldest: float | None = None
        for state in states:
            for since in self._oldest_in(state):
                oldest = since if oldest is None else min(oldest, since)
        return None if oldest is None else max(0.0, self._clock() - oldest)

    # -- internals ----------------------------------------------------------------------

    @staticmethod
    def _check_count(count: int, num_ranks: int) -> None:
        if not 1 <= count <= num_ranks:
            raise ValueError(f"finished count must be in [1, {num_ranks}] (the expected ranks), got {count}")

    def _state(self, engine_id: str) -> _EngineState:
        state = self._engines.get(engine_id)
        if state is None:
            raise UnknownEngineError(f"engine {engine_id!r} is not registered")
        return state

    def _checked(self, engine_id: str, epoch: int, rank: int, output: KVConnectorOutput) -> _EngineState:
        state = self._state(engine_id)
        if epoch != state.epoch:
            raise StaleEpochError(f"engine {engine_id!r}: report for epoch {epoch}, current epoch is {state.epoch}")
        if rank not in state.rank_bits:
            raise ValueError(f"engine {engine_id!r}: rank {rank} is not one of the expected ranks {list(state.ranks)}")
        if output.expected_finished_count:
            self._check_count(output.expected_finished_count, len(state.ranks))
        events = output.kv_cache_events
        if events and events is not self._valid_events:
            if not _EVENT_TYPES.issuperset(map(type, events)):
                bad = next(e for e in events if type(e) not in _EVENT_TYPES)
                raise ValueError(f"not a KV cache event: {type(bad).__name__}")
            if type(events) is tuple:
                self._valid_events = events
        return state

    @staticmethod
    def _oldest_in(state: _EngineState) -> Iterable[float]:
        for counters in (state.sending, state.recving):
            oldest = counters.oldest()
            if oldest is not None:
                yield oldest
        for blocks in state.pending_blocks.values():
            if blocks:
                yield next(iter(blocks.values()))

    def _apply(self, state: _EngineState, rank: int, output: KVConnectorOutput,
               result: AggregatedResult, now: float) -> None:
        bit = state.rank_bits[rank]
        if output.expected_finished_count:
            state.finished_count = output.expected_finished_count
        if output.finished_sending:
            result.finished_sending += state.sending.count(
                output.finished_sending, bit, state.full_mask, state.finished_count, now)
        if output.finished_recving or output.failed_recving:
            self._count_recving(state, rank, bit, output, result, now)
        elif output.invalid_block_ids:
            state.unattributed_invalid.setdefault(rank, set()).update(output.invalid_block_ids)
        events = output.kv_cache_events
        if not events:
            return
        plan = self._stored_plan(events)
        if plan is not None:
            key, hashes = plan
            self._stored_run(state, bit, key, events, result, now, hashes)  # type: ignore[arg-type]
            return
        i, n = 0, len(events)
        while i < n:
            event = events[i]
            if type(event) is BlockStored:
                # A run of BlockStored of one (medium, group) is applied in bulk; the result
                # equals applying them one by one (they only add this rank's bit).
                key = (event.medium, event.group_idx)
                j = i + 1
                while j < n and type(e := events[j]) is BlockStored and (e.medium, e.group_idx) == key:
                    j += 1
                self._stored_run(state, bit, key, events[i:j], result, now)  # type: ignore[arg-type]
                i = j
                continue
            if type(event) is BlockRemoved:
                self._removed(state, bit, event, result, now)
            else:
                self._cleared(state, bit, event, result, now)  # type: ignore[arg-type]
            i += 1

    def _stored_plan(self, events: Collection[KVCacheEvent]) -> tuple[_MediumKey, list[object]] | None:
        """(key, hashes) when `events` are BlockStored of one (medium, group), else None;
        memoized for the last tuple (every rank of a step usually hands over the same one)."""
        if events is not self._plan_events:
            self._plan = None
            if _ONLY_STORED == set(map(type, events)):
                keys = set(map(_MEDIUM_KEY_OF, events))
                if len(keys) == 1:
                    self._plan = (keys.pop(), list(chain.from_iterable(map(_HASHES, events))))
            # only an immutable tuple may be remembered by identity
            self._plan_events = events if type(events) is tuple else ()  # type: ignore[assignment]
        return self._plan

    def _count_recving(self, state: _EngineState, rank: int, bit: int, output: KVConnectorOutput,
                       result: AggregatedResult, now: float) -> None:
        counters = state.recving
        failed = output.failed_recving
        ids = output.finished_recving | failed if failed else output.finished_recving
        invalid = set(output.invalid_block_ids)
        held = state.unattributed_invalid.pop(rank, None)
        if held:
            invalid |= held
        if failed or invalid:
            live_ids = ids.difference(counters.done) if counters.done else ids
            counters.failed.update(failed.intersection(live_ids))
            if invalid:
                for request_id in live_ids:
                    counters.invalid.setdefault(request_id, set()).update(invalid)
        released = counters.count(ids, bit, state.full_mask, state.finished_count, now)
        result.finished_recving += released
        if counters.failed or counters.invalid:
            for request_id in released:
                if request_id in counters.failed:
                    counters.failed.discard(request_id)
                    result.failed_recving.add(request_id)
                bad = counters.invalid.pop(request_id, None)
                if bad:
                    result.invalid_block_ids[request_id] = frozenset(bad)

    def _stored_run(self, state: _EngineState, bit: int, key: _MediumKey,
                    events: tuple[BlockStored, ...], result: AggregatedResult, now: float,
                    hashes: list[object] | None = None) -> None:
        """`hashes`, when given, are the events' hashes in order (read only)."""
        if hashes is None:
            hashes = list(chain.from_iterable(map(_HASHES, events)))
        published = self._stored_hashes(state, bit, key, hashes, map(len, map(_HASHES, events)), now)
        if published is None:
            result.events.extend(events)
        else:
            result.events.extend(map(events.__getitem__, published))

    def _stored_hashes(self, state: _EngineState, bit: int, key: _MediumKey, hashes: list[object],
                       sizes: Iterable[int], now: float) -> list[int] | None:
        """Adds `bit` to every block of a BlockStored run given by its hashes (in order) and
        `sizes` (how many of them each event has); returns the indices of the events this
        completes and publishes, None for all of them."""
        blocks = state.blocks.get(key)
        if blocks is None:
            blocks = state.blocks[key] = {}
            state.live[key] = {}
            state.pending_blocks[key] = {}
        partial = state.pending_blocks[key]
        full = state.full_mask
        news = list(map(or_, map(blocks.get, hashes, repeat(0)), repeat(bit)))
        blocks.update(zip(hashes, news, strict=True))
        if bit != full and bit in news:
            # Only this rank holds these: new partial blocks (a repeat keeps its first time).
            partial.update((h, now) for h, new in zip(hashes, news, strict=True) if new == bit and h not in partial)
        if full not in news:
            return []
        whole = news.count(full) == len(news)
        if partial:
            deque(map(partial.pop, compress(hashes, map(full.__eq__, news)) if not whole else hashes,
                      repeat(None)), maxlen=0)
        live = state.live[key]
        if whole:
            distinct = dict.fromkeys(hashes)
            if len(distinct) == len(hashes) and live.keys().isdisjoint(distinct):
                # Every event is whole, none was published and none repeats: publish them all.
                live.update(distinct)
                return None
        published: list[int] = []
        offset = 0
        for i, size in enumerate(sizes):
            own = hashes[offset:offset + size]
            if size and news[offset:offset + size].count(full) == size and not all(map(live.__contains__, own)):
                live.update(dict.fromkeys(own))
                published.append(i)
            offset += size
        return published

    def _mixed_hashes(self, state: _EngineState, bits: list[int], key: _MediumKey, hashes: Sequence[object],
                      sizes: list[int], kinds: bytes, now: float) -> list[int] | None:
        """BlockStored and BlockRemoved events of `key` (by hashes, sizes and kind bytes) as
        reported by each rank of `bits` (in order); returns the indices of the events published,
        in publication order (None: each once, in event order). Rank by rank unless the stored
        hashes are distinct and none of them is removed in the step: then every hash's
        operations commute with every other hash's and each stored event's fate depends on its
        own blocks only, so the ranks' joint mask gives the same state and the same events (a
        stored event is published once all its blocks are whole, by whichever rank; a removed
        one at the first rank that drops a published hash, which the joint drop does once).
        (A stored hash repeated across events of the step could be published by an earlier
        event at one rank and a later one at another: rank by rank keeps §3's count exact.)"""
        runs = kind_runs(sizes, kinds)
        stored = [h for r in runs if r.kind == KIND_STORED for h in hashes[r.hash_start:r.hash_stop]]
        removed = [h for r in runs if r.kind != KIND_STORED for h in hashes[r.hash_start:r.hash_stop]]
        distinct = set(stored)
        if len(bits) > 1 and len(distinct) == len(stored) and distinct.isdisjoint(removed):
            joint = 0
            for bit in bits:
                joint |= bit
            bits = [joint]
        published: list[int] = []
        for bit in bits:
            for run in runs:
                self._apply_run(state, bit, key, hashes, sizes, run, published, now)
        return None if published == list(range(len(sizes))) else published

    def _apply_run(self, state: _EngineState, bit: int, key: _MediumKey, hashes: Sequence[object],
                   sizes: list[int], run: KindRun, published: list[int], now: float) -> None:
        """One rank's (or joint mask's) events of `run`; appends the indices it publishes."""
        start, stop = run.start, run.stop
        if run.kind == KIND_STORED:
            got = self._stored_hashes(state, bit, key, list(hashes[run.hash_start:run.hash_stop]),
                                      sizes[start:stop], now)
            published.extend(range(start, stop) if got is None else [start + i for i in got])
            return
        offset = run.hash_start
        for i in range(start, stop):
            size = sizes[i]
            if self._drop_rank(state, key, bit, hashes[offset:offset + size], now):
                published.append(i)
            offset += size

    def _drop_rank(self, state: _EngineState, key: _MediumKey, bit: int, hashes: Iterable[object],
                   now: float) -> bool:
        """Removes the rank from the given blocks; True when a published block lost its whole."""
        blocks = state.blocks.get(key)
        if not blocks:
            return False
        live, partial = state.live[key], state.pending_blocks[key]
        full = state.full_mask
        unpublished = False
        for h in hashes:
            old = blocks.get(h, 0)
            if not old & bit:
                continue
            new = old & ~bit
            if new:
                blocks[h] = new
                if old == full:
                    partial[h] = now
            else:
                del blocks[h]
                partial.pop(h, None)
            if h in live:
                del live[h]
                unpublished = True
        return unpublished

    def _removed(self, state: _EngineState, bit: int, event: BlockRemoved,
                 result: AggregatedResult, now: float) -> None:
        if self._drop_rank(state, (event.medium, event.group_idx), bit, event.block_hashes, now):
            result.events.append(event)

    def _cleared(self, state: _EngineState, bit: int, event: AllBlocksCleared,
                 result: AggregatedResult, now: float) -> None:
        unpublished = False
        for key in list(state.blocks):
            if event.medium is None or key[0] == event.medium:
                unpublished |= self._drop_rank(state, key, bit, list(state.blocks[key]), now)
        outstanding = state.clears.get(event.medium, 0)
        if unpublished or not outstanding:
            result.events.append(event)
        outstanding |= bit
        if outstanding == state.full_mask:
            state.clears.pop(event.medium, None)
        else:
            state.clears[event.medium] = outstanding


def _repeats(hashes: Sequence[object]) -> bool:
    """Whether a hash occurs twice in one step's stored run. Then the ranks' joint mask is not
    the same as rank by rank: a block one rank completes with an early event and another with a
    later one publishes both events one rank at a time (§3 counts per rank) but only the first
    jointly. Such steps go rank by rank."""
    return len(set(hashes)) != len(hashes)


def _mixed_arrays(events: Collection[KVCacheEvent]) -> tuple[_MediumKey, list[object], list[int], bytes] | None:
    """(key, hashes, sizes, kinds) of BlockStored and BlockRemoved events of one (medium,
    group_idx), each with a hash; None for any other mix (AllBlocksCleared, several keys)."""
    if not {BlockStored, BlockRemoved}.issuperset(map(type, events)):
        return None
    keys = set(map(_MEDIUM_KEY_OF, events))
    sizes = list(map(len, map(_HASHES, events)))
    if len(keys) != 1 or not sizes or min(sizes) < 1:
        return None
    kinds = bytes(_KIND_BYTES[type(e)] for e in events)
    return keys.pop(), list(chain.from_iterable(map(_HASHES, events))), sizes, kinds
