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

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import or_
from typing import Protocol, runtime_checkable

from connectors.compact_events import KIND_REMOVED, kind_runs
from connectors.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
)

DEFAULT_MAX_ENTRIES = 1_000_000
_MASK64 = (1 << 64) - 1
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


class IntLru:
    """Exact least-recently-used order over int keys, built from ints only.

    `stamp` maps each key to the tick of its last use; two parallel deques list (key, tick) in
    use order, with stale pairs (a key used again or removed since) skipped lazily and
    compacted away once they outnumber the live keys. An OrderedDict would do the same, but
    the garbage collector walks its million entries on every full collection (about 25 times
    the cost of a dict of ints, measured); dicts and deques of ints cost it next to nothing.
    """

    __slots__ = ("_keys", "_slack", "_stamp", "_tick", "_ticks")

    def __init__(self, slack: int = 1024) -> None:
        self._slack = slack
        self._stamp: dict[int, int] = {}
        self._keys: deque[int] = deque()
        self._ticks: deque[int] = deque()
        self._tick = 0

    def __len__(self) -> int:
        return len(self._stamp)

    def __contains__(self, key: int) -> bool:
        return key in self._stamp

    def touch(self, key: int) -> None:
        """Marks `key` used now (adding it when absent)."""
        self._tick += 1
        self._stamp[key] = self._tick
        self._keys.append(key)
        self._ticks.append(self._tick)
        if len(self._keys) > 2 * len(self._stamp) + self._slack:
            self._compact()

    def touch_many(self, keys: Sequence[int]) -> None:
        """`touch(key)` for each key, in order."""
        start = self._tick + 1
        self._tick += len(keys)
        ticks = range(start, self._tick + 1)
        self._stamp.update(zip(keys, ticks, strict=True))
        self._keys.extend(keys)
        self._ticks.extend(ticks)
        if len(self._keys) > 2 * len(self._stamp) + self._slack:
            self._compact()

    def holds_any(self, keys: Sequence[int]) -> bool:
        return not self._stamp.keys().isdisjoint(keys)

    def discard(self, key: int) -> None:
        self._stamp.pop(key, None)

    def pop_oldest(self) -> int:
        """Removes and returns the least recently used key (KeyError when empty)."""
        stamp, keys, ticks = self._stamp, self._keys, self._ticks
        while keys:
            key, tick = keys.popleft(), ticks.popleft()
            if stamp.get(key) == tick:
                del stamp[key]
                return key
        raise KeyError("pop_oldest from an empty IntLru")

    def pop_oldest_many(self, n: int) -> list[int]:
        """`pop_oldest()` n times, in one call (KeyError, after popping all, when fewer held)."""
        stamp, keys, ticks = self._stamp, self._keys, self._ticks
        out: list[int] = []
        while len(out) < n and keys:
            key, tick = keys.popleft(), ticks.popleft()
            if stamp.get(key) == tick:
                del stamp[key]
                out.append(key)
        if len(out) < n:
            raise KeyError(f"pop_oldest_many({n}) from an IntLru holding {len(out)}")
        return out

    def __iter__(self) -> Iterator[int]:
        """Keys, least recently used first."""
        stamp = self._stamp
        return iter([k for k, t in zip(self._keys, self._ticks, strict=True) if stamp.get(k) == t])

    def _compact(self) -> None:
        live = [(k, t) for k, t in zip(self._keys, self._ticks, strict=True) if self._stamp.get(k) == t]
        self._keys = deque(k for k, _ in live)
        self._ticks = deque(t for _, t in live)


@dataclass(slots=True)
class _EngineState:
    epoch: int
    dead_epochs: list[int] = field(default_factory=list)  # oldest first


class InMemoryPrefixIndex:
    """A compact dict-based `PrefixIndex` with a bound on the number of entries.

    Eviction rule: when more than `max_entries` (hash, engine, medium) entries are held, the
    least recently used one goes first, where "used" means stored (again) or counted in a
    `match`. An evicted entry only loses a routing hint (the engine still has the block and
    routing merely under-estimates its prefix); BlockRemoved events keep the index exact while
    it is under the bound. Touching on match keeps the hot shared prefixes (whose block 0 is
    stored only once) from being evicted before their continuations.

    Layout: each (engine, medium) pair gets a small slot number; a block is one int -> int
    entry (hash -> bitmask of the slots holding it) and an LRU entry is one int
    (`slot << 64 | hash`). Only ints are stored per block, which the garbage collector never
    tracks, so a full collection does not walk a million small containers.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, *, max_dead_epochs: int = 8) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._max_entries = max_entries
        self._max_dead_epochs = max_dead_epochs
        # hash -> bitmask of the slots holding it
        self._blocks: dict[int, int] = {}
        # slot << 64 | hash, in LRU order, oldest first
        self._lru = IntLru()
        self._engines: dict[str, _EngineState] = {}
        # (engine id, medium) <-> slot; slot -> the hashes it holds
        self._slots: dict[tuple[str, str], int] = {}
        self._slot_keys: dict[int, tuple[str, str]] = {}
        self._slot_hashes: dict[int, set[int]] = {}
        self._free_slots: list[int] = []
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
        out: dict[str, int] = {}
        for slot, hashes in self._slot_hashes.items():
            if hashes:
                medium = self._slot_keys[slot][1]
                out[medium] = out.get(medium, 0) + len(hashes)
        return out

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
        i, n = 0, len(events)
        while i < n:
            event = events[i]
            if type(event) is BlockStored:
                # A run of BlockStored of one medium whose blocks are all new to the index is
                # stored at once (the same result as one by one, see `_store_new`).
                medium = event.medium or DEFAULT_MEDIUM
                j = i + 1
                while j < n and type(e := events[j]) is BlockStored and (e.medium or DEFAULT_MEDIUM) == medium:
                    j += 1
                run: Sequence[BlockStored] = events[i:j]  # type: ignore[assignment]
                if j - i == 1 or not self._store_new([h for e in run for h in e.block_hashes], engine_id, medium):
                    for e in run:
                        self._store(e.block_hashes, engine_id, medium)
                i = j
                continue
            i += 1
            if isinstance(event, BlockStored):
                self._store(event.block_hashes, engine_id, event.medium or DEFAULT_MEDIUM)
            elif isinstance(event, BlockRemoved):
                slot = self._slots.get((engine_id, event.medium or DEFAULT_MEDIUM))
                if slot is not None:
                    for h in event.block_hashes:
                        self._remove(block_key(h), slot)
            elif isinstance(event, AllBlocksCleared):
                self._drop(engine_id, event.medium)
        return True

    def apply_stored(self, engine_id: str, epoch: int, medium: str | None, hashes: list[int],
                     sizes: list[int]) -> bool:
        """`apply` of BlockStored events of one medium given by their int hashes (in order) and
        the number of hashes of each: the same state afterwards, no object per event."""
        if self.is_dead_epoch(engine_id, epoch):
            self._stats.num_stale_events += len(sizes)
            return False
        self.begin_epoch(engine_id, epoch)
        medium = medium or DEFAULT_MEDIUM
        if len(sizes) == 1 or not self._store_new(hashes, engine_id, medium):
            offset = 0
            for size in sizes:
                self._store(hashes[offset:offset + size], engine_id, medium)
                offset += size
        return True

    def apply_compact(self, engine_id: str, epoch: int, medium: str | None, hashes: list[int],
                      sizes: list[int], kinds: bytes = b"") -> bool:
        """`apply` of BlockStored and BlockRemoved events of one medium given by their int hashes
        (in order), the number of hashes of each and their kind bytes (`compact_events.kinds`,
        checked by the caller; empty: all stored): the same state afterwards, applied in event
        order, no object per event."""
        if KIND_REMOVED not in kinds:
            return self.apply_stored(engine_id, epoch, medium, hashes, sizes)
        if self.is_dead_epoch(engine_id, epoch):
            self._stats.num_stale_events += len(sizes)
            return False
        self.begin_epoch(engine_id, epoch)
        medium = medium or DEFAULT_MEDIUM
        for run in kind_runs(sizes, kinds):
            own = hashes[run.hash_start:run.hash_stop]
            if run.kind == KIND_REMOVED:
                self._remove_many(own, engine_id, medium)
            elif run.stop - run.start == 1 or not self._store_new(own, engine_id, medium):
                offset = run.hash_start
                for size in sizes[run.start:run.stop]:
                    self._store(hashes[offset:offset + size], engine_id, medium)
                    offset += size
        return True

    def remove_engine(self, engine_id: str) -> None:
        self._drop(engine_id, None)
        for key in [k for k in self._slots if k[0] == engine_id]:
            slot = self._slots.pop(key)
            del self._slot_keys[slot]
            self._slot_hashes.pop(slot, None)
            self._free_slots.append(slot)
        self._engines.pop(engine_id, None)

    def match(self, block_hashes: Sequence[int]) -> dict[str, EngineMatch]:
        media: dict[str, list[frozenset[str]]] = {}
        active: set[str] | None = None
        blocks, lru, slot_keys = self._blocks, self._lru, self._slot_keys
        for h in block_hashes:
            mask = blocks.get(h)
            if not mask:
                break
            holders: dict[str, set[str]] = {}
            slot = 0
            while mask:
                if mask & 1:
                    engine_id, medium = slot_keys[slot]
                    if active is None or engine_id in active:
                        holders.setdefault(engine_id, set()).add(medium)
                        lru.touch(slot << 64 | h)
                mask >>= 1
                slot += 1
            if not holders:
                break
            for engine_id, held in holders.items():
                media.setdefault(engine_id, []).append(frozenset(held))
            active = set(holders)
        return {e: EngineMatch(e, self._engines[e].epoch, len(ms), tuple(ms)) for e, ms in media.items()}

    def snapshot(self) -> list[IndexSnapshotPart]:
        grouped: dict[int, list[int]] = {}
        for key in self._lru:
            grouped.setdefault(key >> 64, []).append(key & _MASK64)
        parts = []
        for slot, hs in grouped.items():
            engine_id, medium = self._slot_keys[slot]
            parts.append(IndexSnapshotPart(engine_id, self._engines[engine_id].epoch, medium, tuple(hs)))
        return parts

    def entries(self) -> Iterator[tuple[int, str, str]]:
        """Every (hash, engine id, medium), least recently used first."""
        keys = self._slot_keys
        return iter([(key & _MASK64, *keys[key >> 64]) for key in self._lru])

    def _slot(self, engine_id: str, medium: str) -> int:
        slot = self._slots.get((engine_id, medium))
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[(engine_id, medium)] = slot
            self._slot_keys[slot] = (engine_id, medium)
        return slot

    def _store(self, hashes: Sequence[ExternalBlockHash], engine_id: str, medium: str) -> None:
        # The hot path of every published batch: locals and no helper calls per hash.
        slot = self._slot(engine_id, medium)
        bit, high = 1 << slot, slot << 64
        lru, blocks = self._lru, self._blocks
        owned = self._slot_hashes.get(slot)
        if owned is None:
            owned = self._slot_hashes[slot] = set()
        for raw in hashes:
            h = raw if type(raw) is int else block_key(raw)
            key = high | h
            if key not in lru:
                blocks[h] = blocks.get(h, 0) | bit
                owned.add(h)
            lru.touch(key)
        if len(lru) > self._max_entries:
            self._evict(len(lru) - self._max_entries)

    def _store_new(self, hashes: Sequence[ExternalBlockHash], engine_id: str, medium: str) -> bool:
        """Stores `hashes` in bulk when none is held by (engine, medium) yet and they fit the
        bound (False, nothing changed, otherwise). Then storing them one by one, evicting after
        each, would only ever evict entries older than all of them, the same ones evicted here
        at the end (a block stored again, by contrast, may be evicted and re-added in between)."""
        hs = [raw if type(raw) is int else block_key(raw) for raw in hashes]
        slot = self._slot(engine_id, medium)
        high, lru, blocks = slot << 64, self._lru, self._blocks
        keys = [high | h for h in hs]
        if len(keys) > self._max_entries or lru.holds_any(keys):
            return False
        bit = 1 << slot
        blocks.update(zip(hs, map(or_, map(blocks.get, hs, repeat(0)), repeat(bit)), strict=True))
        owned = self._slot_hashes.get(slot)
        if owned is None:
            owned = self._slot_hashes[slot] = set()
        owned.update(hs)
        lru.touch_many(keys)
        if len(lru) > self._max_entries:
            self._evict(len(lru) - self._max_entries)
        return True

    def _evict(self, n: int) -> None:
        """Drops the `n` least recently used entries (as `_unlink` of each, in one loop)."""
        blocks, slot_hashes = self._blocks, self._slot_hashes
        for key in self._lru.pop_oldest_many(n):
            h, slot = key & _MASK64, key >> 64
            slot_hashes[slot].discard(h)
            mask = blocks[h] & ~(1 << slot)
            if mask:
                blocks[h] = mask
            else:
                del blocks[h]
        self._stats.num_evicted += n

    def _remove_many(self, hashes: Sequence[int], engine_id: str, medium: str) -> None:
        """`_remove` of each int hash, in one loop (BlockRemoved of an unknown slot: nothing)."""
        slot = self._slots.get((engine_id, medium))
        if slot is None:
            return
        high, lru = slot << 64, self._lru
        for h in hashes:
            key = high | h
            if key in lru:
                lru.discard(key)
                self._unlink(h, slot)

    def _remove(self, h: int, slot: int) -> None:
        key = slot << 64 | h
        if key in self._lru:
            self._lru.discard(key)
            self._unlink(h, slot)

    def _unlink(self, h: int, slot: int) -> None:
        self._slot_hashes[slot].discard(h)
        mask = self._blocks[h] & ~(1 << slot)
        if mask:
            self._blocks[h] = mask
        else:
            del self._blocks[h]

    def _drop(self, engine_id: str, medium: str | None) -> None:
        for (e, m), slot in list(self._slots.items()):
            if e != engine_id or (medium is not None and m != medium):
                continue
            hashes = self._slot_hashes.get(slot)
            if not hashes:
                continue
            high, lru = slot << 64, self._lru
            for h in list(hashes):
                lru.discard(high | h)
                self._unlink(h, slot)
