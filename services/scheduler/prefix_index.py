"""The scheduler's prefix index: which engine holds which KV block, in which medium.

Built from the republished KV-event stream (the same batches subscribers see). Pure and
synchronous; the republisher serialises calls, so implementations need no locking of their own.

Contract of `PrefixIndex` (every implementation):
- Keys are 64-bit block hashes (`connectors.hashing.to_external`); raw-digest (`bytes`) hashes in
  events are reduced to their low 64 bits, as vLLM does.
- An entry is (block hash, engine id, medium); each engine has one live epoch. Events from a new
  epoch of an engine drop every entry of its old epoch first; events from an epoch that was
  replaced before are ignored (a late report from a dead incarnation never resurrects entries).
- `AllBlocksCleared(medium=None)` drops all of the engine's entries, with a medium only those.
- `match` walks the prompt's hashes from block 0 and, per engine, counts the consecutive blocks
  it holds (in any medium); the first block an engine lacks ends that engine's match.
- Memory is bounded (see `InMemoryPrefixIndex`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from connectors.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
)

DEFAULT_MAX_ENTRIES = 1_000_000
# Events without a medium come from producers older than vLLM's `medium` field: the GPU pool.
DEFAULT_MEDIUM = MEDIUM_GPU


def block_key(block_hash: ExternalBlockHash) -> int:
    """The index key of an event hash: ints as they are, digests by their low 64 bits."""
    return block_hash if isinstance(block_hash, int) else int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class EngineMatch:
    """One engine's longest consecutive prefix match.

    `media[i]` is the set of media holding block i, for i < num_blocks.
    """

    engine_id: str
    epoch: int
    num_blocks: int
    media: tuple[frozenset[str], ...]

    def weighted_blocks(self, weights: Mapping[str, float], unknown_weight: float) -> float:
        """Sum over matched blocks of the best weight among the media holding each block."""
        return sum(max(weights.get(m, unknown_weight) for m in held) for held in self.media)


@dataclass(frozen=True, slots=True)
class IndexSnapshotPart:
    """Every block hash one engine holds in one medium (oldest first)."""

    engine_id: str
    epoch: int
    medium: str
    block_hashes: tuple[int, ...]


@dataclass(slots=True)
class IndexStats:
    num_entries: int = 0
    num_evicted: int = 0
    num_stale_events: int = 0
    num_epoch_changes: int = 0


@runtime_checkable
class PrefixIndex(Protocol):
    """Block hash -> {(engine, epoch, medium)}; see the module docstring for the contract."""

    def apply(self, engine_id: str, epoch: int, events: Sequence[KVCacheEvent]) -> bool:
        """Applies one batch of an engine's events; False when the epoch is dead (ignored)."""
        ...

    def remove_engine(self, engine_id: str) -> None:
        """Drops every entry of the engine (deregistered or declared dead)."""
        ...

    def epoch_of(self, engine_id: str) -> int | None:
        """The live epoch the index holds entries for, None for an unknown engine."""
        ...

    def match(self, block_hashes: Sequence[int]) -> dict[str, EngineMatch]:
        """Per engine with at least one matched block: its longest consecutive match."""
        ...

    def snapshot(self) -> list[IndexSnapshotPart]:
        """The whole index, grouped by (engine, medium)."""
        ...

    def stats(self) -> IndexStats: ...


@dataclass(slots=True)
class _EngineState:
    epoch: int
    dead_epochs: list[int] = field(default_factory=list)  # oldest first


class InMemoryPrefixIndex:
    """A dict-based `PrefixIndex` with a bound on the number of entries.

    Eviction rule: when more than `max_entries` (hash, engine, medium) entries are held, the
    least recently used one goes first, where "used" means stored (again) or counted in a
    `match`. An evicted entry only loses a routing hint (the engine still has the block and
    routing merely under-estimates its prefix); BlockRemoved events keep the index exact while
    it is under the bound. Touching on match keeps the hot shared prefixes (whose block 0 is
    stored only once) from being evicted before their continuations.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, *, max_dead_epochs: int = 8) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._max_entries = max_entries
        self._max_dead_epochs = max_dead_epochs
        # hash -> engine id -> media holding it
        self._blocks: dict[int, dict[str, set[str]]] = {}
        # (hash, engine id, medium) in LRU order, oldest first
        self._lru: OrderedDict[tuple[int, str, str], None] = OrderedDict()
        self._engines: dict[str, _EngineState] = {}
        # engine id -> its (hash, medium) entries, so dropping an engine costs its own size
        self._by_engine: dict[str, set[tuple[int, str]]] = {}
        self._per_medium: dict[str, int] = {}
        self._stats = IndexStats()

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> IndexStats:
        self._stats.num_entries = len(self._lru)
        return IndexStats(len(self._lru), self._stats.num_evicted, self._stats.num_stale_events,
                          self._stats.num_epoch_changes)

    def epoch_of(self, engine_id: str) -> int | None:
        state = self._engines.get(engine_id)
        return state.epoch if state is not None else None

    def blocks_by_medium(self) -> dict[str, int]:
        """Entries per medium (for the index-size metric)."""
        return {m: n for m, n in self._per_medium.items() if n}

    def begin_epoch(self, engine_id: str, epoch: int) -> int | None:
        """Makes `epoch` the engine's live epoch; returns the replaced epoch (its entries are
        dropped) or None when nothing changed or the engine was new. A dead epoch raises."""
        state = self._engines.get(engine_id)
        if state is None:
            self._engines[engine_id] = _EngineState(epoch)
            return None
        if epoch == state.epoch:
            return None
        if epoch in state.dead_epochs:
            raise ValueError(f"engine {engine_id!r}: epoch {epoch} was already replaced")
        old = state.epoch
        self._drop(engine_id, None)
        state.dead_epochs.append(old)
        del state.dead_epochs[:-self._max_dead_epochs]
        state.epoch = epoch
        self._stats.num_epoch_changes += 1
        return old

    def is_dead_epoch(self, engine_id: str, epoch: int) -> bool:
        state = self._engines.get(engine_id)
        return state is not None and epoch in state.dead_epochs

    def apply(self, engine_id: str, epoch: int, events: Sequence[KVCacheEvent]) -> bool:
        if self.is_dead_epoch(engine_id, epoch):
            self._stats.num_stale_events += len(events)
            return False
        self.begin_epoch(engine_id, epoch)
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event.block_hashes, engine_id, event.medium or DEFAULT_MEDIUM)
            elif isinstance(event, BlockRemoved):
                medium = event.medium or DEFAULT_MEDIUM
                for h in event.block_hashes:
                    self._remove(block_key(h), engine_id, medium)
            elif isinstance(event, AllBlocksCleared):
                self._drop(engine_id, event.medium)
        return True

    def remove_engine(self, engine_id: str) -> None:
        self._drop(engine_id, None)
        self._engines.pop(engine_id, None)

    def match(self, block_hashes: Sequence[int]) -> dict[str, EngineMatch]:
        media: dict[str, list[frozenset[str]]] = {}
        active: set[str] | None = None
        for h in block_hashes:
            holders = self._blocks.get(h)
            if not holders:
                break
            still = set(holders) if active is None else active & holders.keys()
            if not still:
                break
            for engine_id in still:
                held = holders[engine_id]
                media.setdefault(engine_id, []).append(frozenset(held))
                for m in held:
                    self._lru.move_to_end((h, engine_id, m))
            active = still
        return {e: EngineMatch(e, self._engines[e].epoch, len(ms), tuple(ms)) for e, ms in media.items()}

    def snapshot(self) -> list[IndexSnapshotPart]:
        grouped: dict[tuple[str, str], list[int]] = {}
        for h, engine_id, medium in self._lru:
            grouped.setdefault((engine_id, medium), []).append(h)
        return [IndexSnapshotPart(e, self._engines[e].epoch, m, tuple(hs)) for (e, m), hs in grouped.items()]

    def entries(self) -> Iterator[tuple[int, str, str]]:
        """Every (hash, engine id, medium), least recently used first."""
        return iter(list(self._lru))

    def _store(self, hashes: Sequence[ExternalBlockHash], engine_id: str, medium: str) -> None:
        # The hot path of every published batch: locals and no helper calls per hash.
        lru, blocks = self._lru, self._blocks
        owned = self._by_engine.setdefault(engine_id, set())
        added = 0
        for raw in hashes:
            h = raw if type(raw) is int else block_key(raw)
            key = (h, engine_id, medium)
            if key in lru:
                lru.move_to_end(key)
                continue
            holders = blocks.get(h)
            if holders is None:
                blocks[h] = {engine_id: {medium}}
            elif (held := holders.get(engine_id)) is None:
                holders[engine_id] = {medium}
            else:
                held.add(medium)
            owned.add((h, medium))
            lru[key] = None
            added += 1
        self._per_medium[medium] = self._per_medium.get(medium, 0) + added
        while len(lru) > self._max_entries:
            old_key, _ = lru.popitem(last=False)
            self._unlink(*old_key)
            self._stats.num_evicted += 1

    def _remove(self, h: int, engine_id: str, medium: str) -> None:
        key = (h, engine_id, medium)
        if key in self._lru:
            del self._lru[key]
            self._unlink(h, engine_id, medium)

    def _unlink(self, h: int, engine_id: str, medium: str) -> None:
        self._per_medium[medium] -= 1
        owned = self._by_engine[engine_id]
        owned.discard((h, medium))
        if not owned:
            del self._by_engine[engine_id]
        holders = self._blocks[h]
        held = holders[engine_id]
        held.discard(medium)
        if not held:
            del holders[engine_id]
            if not holders:
                del self._blocks[h]

    def _drop(self, engine_id: str, medium: str | None) -> None:
        owned = self._by_engine.get(engine_id, ())
        doomed = [(h, m) for h, m in owned if medium is None or m == medium]
        for h, m in doomed:
            del self._lru[(h, engine_id, m)]
            self._unlink(h, engine_id, m)
