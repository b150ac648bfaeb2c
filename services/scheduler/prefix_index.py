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

from collections import Counter, deque
from collections.abc import Iterable, Iterator, KeysView, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, repeat, takewhile, zip_longest
from operator import eq, not_, or_, rshift
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
# How many block hashes `InMemoryPrefixIndex.match` remembers the holders of (few, so that
# testing each stored run against them stays in the CPU's cache)
_MAX_FIRST_HOLDERS = 4096
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

    `stamp` maps each key to the tick of its last use; two parallel lists give (key, tick) in
    use order from `head` on, with stale pairs (a key used again or removed since) skipped
    lazily and compacted away once they outnumber the live keys. An OrderedDict would do the
    same, but the garbage collector walks its million entries on every full collection (about
    25 times the cost of a dict of ints, measured); dicts and lists of ints cost it next to
    nothing. Lists rather than deques so that the bulk operations (`touch_many`,
    `pop_oldest_many`, `discard_many`) work on slices with C-level `map`s, no Python loop per
    key; the consumed front is cut off once it is half of the lists (amortised O(1) per key).
    """

    __slots__ = ("_head", "_keys", "_slack", "_stamp", "_tick", "_ticks")

    def __init__(self, slack: int = 1024) -> None:
        self._slack = slack
        self._stamp: dict[int, int] = {}
        self._keys: list[int] = []
        self._ticks: list[int] = []
        self._head = 0
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
        if len(self._keys) - self._head > 2 * len(self._stamp) + self._slack:
            self._compact()

    def touch_many(self, keys: Sequence[int]) -> None:
        """`touch(key)` for each key, in order."""
        start = self._tick + 1
        self._tick += len(keys)
        ticks = range(start, self._tick + 1)
        self._stamp.update(zip(keys, ticks, strict=True))
        self._keys.extend(keys)
        self._ticks.extend(ticks)
        if len(self._keys) - self._head > 2 * len(self._stamp) + self._slack:
            self._compact()

    def holds_any(self, keys: Sequence[int]) -> bool:
        return not self._stamp.keys().isdisjoint(keys)

    def keys(self) -> KeysView[int]:
        """The keys held, in no particular order (a live view: copy it before changing this)."""
        return self._stamp.keys()

    def discard(self, key: int) -> None:
        self._stamp.pop(key, None)

    def discard_many(self, keys: Iterable[int]) -> list[int]:
        """`discard(key)` for each key; returns the keys that were held, each once."""
        stamp = self._stamp
        unique = list(dict.fromkeys(keys))
        held = list(compress(unique, map(stamp.__contains__, unique)))
        _consume(map(stamp.__delitem__, held))
        return held

    def pop_oldest(self) -> int:
        """Removes and returns the least recently used key (KeyError when empty)."""
        stamp, keys, ticks = self._stamp, self._keys, self._ticks
        i, n = self._head, len(keys)
        while i < n:
            key, tick = keys[i], ticks[i]
            i += 1
            if stamp.get(key) == tick:
                del stamp[key]
                self._advance(i)
                return key
        self._advance(i)
        raise KeyError("pop_oldest from an empty IntLru")

    def pop_oldest_many(self, n: int) -> list[int]:
        """`pop_oldest()` n times, in one call (KeyError, after popping all, when fewer held).

        Each round takes the next `still needed` pairs as slices and keeps the live ones (at
        most that many, oldest first), so no pair is looked at twice."""
        stamp, keys, ticks = self._stamp, self._keys, self._ticks
        out: list[int] = []
        head, end = self._head, len(keys)
        while len(out) < n and head < end:
            stop = min(head + n - len(out), end)
            chunk = keys[head:stop]
            live = list(compress(chunk, map(eq, map(stamp.get, chunk), ticks[head:stop])))
            _consume(map(stamp.__delitem__, live))
            out += live
            head = stop
        self._advance(head)
        if len(out) < n:
            raise KeyError(f"pop_oldest_many({n}) from an IntLru holding {len(out)}")
        return out

    def __iter__(self) -> Iterator[int]:
        """Keys, least recently used first."""
        return iter(self._live()[0])

    def _live(self) -> tuple[list[int], list[int]]:
        keys, ticks = self._keys[self._head:], self._ticks[self._head:]
        flags = list(map(eq, map(self._stamp.get, keys), ticks))
        return list(compress(keys, flags)), list(compress(ticks, flags))

    def _advance(self, head: int) -> None:
        if head > len(self._keys) // 2:
            del self._keys[:head], self._ticks[:head]
            head = 0
        self._head = head

    def _compact(self) -> None:
        self._keys, self._ticks = self._live()
        self._head = 0


def _consume(it: Iterable[object]) -> None:
    """Runs an iterator (of C-level calls) to its end without a Python loop."""
    deque(it, maxlen=0)


def _block_major(columns: list[tuple[int, list[int | None]]]) -> list[int]:
    """The keys of (slot, key per block) columns block by block, lowest slot first within a
    block: the order `match` touches them in, as if each block were matched in turn."""
    columns = sorted(columns, key=lambda column: column[0])
    return [key for key in chain.from_iterable(zip_longest(*(keys for _, keys in columns))) if key is not None]


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

    Layout: each (engine, medium) pair gets a small slot number and an entry is one int,
    `slot << 64 | hash`, held in the LRU (`IntLru`: one dict entry and two list items) and
    nowhere else: storing, evicting and removing an entry is one insertion or deletion in one
    large dict, done for a whole run with C-level maps. `match` asks the LRU for block 0's key
    under every live slot, or, for a block 0 asked about before, only under the slots that
    held it then (`_first_holders`: a store of the hash forgets it, so a slot holding it that
    is not named there cannot exist), then walks each engine holding it on its own slots
    only: one `takewhile` over the prompt's keys for an engine with one medium (no Python step
    per block), a loop over its media otherwise; the matched entries are touched in one
    `touch_many`, block by block and in slot order within a block (`_block_major`). Only
    ints are stored per entry, which the garbage collector never tracks, so a full collection
    does not walk a million small containers.

    Dropping an engine's or a medium's entries retires their slots (`_drop`): the entries are
    gone from every answer at once, and leave the LRU as eviction reaches them or in one pass
    once they are half of it, so the LRU holds at most twice `max_entries` keys.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, *, max_dead_epochs: int = 8) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._max_entries = max_entries
        self._max_dead_epochs = max_dead_epochs
        # slot << 64 | hash, in LRU order, oldest first
        self._lru = IntLru()
        self._engines: dict[str, _EngineState] = {}
        # (engine id, medium) <-> slot
        self._slots: dict[tuple[str, str], int] = {}
        self._slot_keys: dict[int, tuple[str, str]] = {}
        # `match`'s candidates: every live slot's keys' high part, each engine's slots, lowest
        # first (None after a slot is added or freed)
        self._match_slots: tuple[list[int], dict[str, list[int]]] | None = None
        # Block hashes `match` was asked about -> the slots that held them then, lowest first,
        # and no other slot since (a store of a hash forgets it): `match` probes only those.
        # Oldest asked first; at most _MAX_FIRST_HOLDERS. `_asked`: its keys, as a set (the
        # store paths test every stored hash against it: a set's test is ~30 % cheaper).
        self._first_holders: dict[int, list[int]] = {}
        self._asked: set[int] = set()
        # slot -> how many entries it holds (the index-size metric; what a dropped slot
        # leaves in the LRU)
        self._slot_sizes: dict[int, int] = {}
        # Dropped slots whose entries are still in the LRU -> how many (see `_drop`); a slot
        # number is reused only once none is left.
        self._retired: dict[int, int] = {}
        self._num_retired = 0
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._stats = IndexStats()

    def __len__(self) -> int:
        return len(self._lru) - self._num_retired

    def stats(self) -> IndexStats:
        self._stats.num_entries = len(self)
        return IndexStats(len(self), self._stats.num_evicted, self._stats.num_stale_events,
                          self._stats.num_epoch_changes)

    def epoch_of(self, engine_id: str) -> int | None:
        state = self._engines.get(engine_id)
        return state.epoch if state is not None else None

    def blocks_by_medium(self) -> dict[str, int]:
        """Entries per medium (for the index-size metric)."""
        out: dict[str, int] = {}
        for slot, size in self._slot_sizes.items():
            if size:
                medium = self._slot_keys[slot][1]
                out[medium] = out.get(medium, 0) + size
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
        if len(sizes) == 1 or not self._store_new(hashes, engine_id, medium, ints=True):
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
            elif run.stop - run.start == 1 or not self._store_new(own, engine_id, medium, ints=True):
                offset = run.hash_start
                for size in sizes[run.start:run.stop]:
                    self._store(hashes[offset:offset + size], engine_id, medium)
                    offset += size
        return True

    def remove_engine(self, engine_id: str) -> None:
        self._drop(engine_id, None)
        self._engines.pop(engine_id, None)

    def match(self, block_hashes: Sequence[int]) -> dict[str, EngineMatch]:
        if not block_hashes:
            return {}
        engine_ids = self._engines_holding(block_hashes[0])
        if not engine_ids:
            return {}
        lru, slot_keys, slots_of = self._lru, self._slot_keys, self._candidates()[1]
        held_by = lru.keys().__contains__
        columns: list[tuple[int, list[int | None]]] = []  # (slot, its key per matched block)
        out: dict[str, EngineMatch] = {}
        for engine_id in engine_ids:
            slots = slots_of[engine_id]
            if len(slots) == 1:  # one medium: its run of consecutive blocks, C-level
                keys: list[int | None] = list(takewhile(held_by, map(or_, repeat(slots[0] << 64), block_hashes)))
                media: Sequence[frozenset[str]] = (frozenset((slot_keys[slots[0]][1],)),) * len(keys)
                columns.append((slots[0], keys))
            else:
                engine_columns, media = self._match_media(block_hashes, slots)
                columns += zip(slots, engine_columns, strict=True)
            out[engine_id] = EngineMatch(engine_id, self._engines[engine_id].epoch, len(media), tuple(media))
        lru.touch_many(columns[0][1] if len(columns) == 1 else _block_major(columns))  # type: ignore[arg-type]
        return out

    def _engines_holding(self, h: int) -> list[str]:
        """The engines holding `h` in some medium, by their lowest slot holding it. Probes the
        slots `_first_holders` names for `h` (dropping those that hold it no more), or, for an
        `h` it does not know, every live slot (and remembers those that hold it)."""
        lru, slot_keys, first = self._lru, self._slot_keys, self._first_holders
        known = first.get(h)
        if known is None:
            highs = self._candidates()[0]  # one C-level intersection: no Python step per slot
            holders = sorted(map(rshift, lru.keys() & map(or_, highs, repeat(h)), repeat(64)))
            if len(first) >= _MAX_FIRST_HOLDERS:
                self._asked.remove(oldest := next(iter(first)))
                del first[oldest]
            self._asked.add(h)
        else:
            holders = [slot for slot in known if slot in slot_keys and slot << 64 | h in lru]
        first[h] = holders
        return list(dict.fromkeys(slot_keys[slot][0] for slot in holders))

    def _candidates(self) -> tuple[list[int], dict[str, list[int]]]:
        """Every live slot's keys' high part; each engine's slots, lowest first."""
        if self._match_slots is None:
            slots = sorted(self._slot_keys)
            slots_of: dict[str, list[int]] = {}
            for slot in slots:
                slots_of.setdefault(self._slot_keys[slot][0], []).append(slot)
            self._match_slots = ([slot << 64 for slot in slots], slots_of)
        return self._match_slots

    def _match_media(self, block_hashes: Sequence[int], slots: list[int]
                     ) -> tuple[list[list[int | None]], list[frozenset[str]]]:
        """One engine's match over its several slots (media): per slot the key of each matched
        block (None where that medium lacks it), and the media holding each matched block."""
        held_by = self._lru.keys().__contains__
        names = [self._slot_keys[slot][1] for slot in slots]
        highs = [slot << 64 for slot in slots]
        columns: list[list[int | None]] = [[] for _ in slots]
        media: list[frozenset[str]] = []
        for h in block_hashes:
            keys = list(map(or_, highs, repeat(h)))
            flags = list(map(held_by, keys))
            if True not in flags:
                break
            for column, key, flag in zip(columns, keys, flags, strict=True):
                column.append(key if flag else None)
            media.append(frozenset(compress(names, flags)))
        return columns, media

    def snapshot(self) -> list[IndexSnapshotPart]:
        grouped: dict[int, list[int]] = {}
        retired = self._retired
        for key in self._lru:
            if key >> 64 not in retired:
                grouped.setdefault(key >> 64, []).append(key & _MASK64)
        parts = []
        for slot, hs in grouped.items():
            engine_id, medium = self._slot_keys[slot]
            parts.append(IndexSnapshotPart(engine_id, self._engines[engine_id].epoch, medium, tuple(hs)))
        return parts

    def entries(self) -> Iterator[tuple[int, str, str]]:
        """Every (hash, engine id, medium), least recently used first."""
        keys, retired = self._slot_keys, self._retired
        return iter([(key & _MASK64, *keys[key >> 64]) for key in self._lru if key >> 64 not in retired])

    def _slot(self, engine_id: str, medium: str) -> int:
        slot = self._slots.get((engine_id, medium))
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:  # not len(self._slots): retired slots are numbered but not in it
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            self._slots[(engine_id, medium)] = slot
            self._slot_keys[slot] = (engine_id, medium)
            self._match_slots = None
        return slot

    def _store(self, hashes: Sequence[ExternalBlockHash], engine_id: str, medium: str) -> None:
        # The path of a block stored again (or a run of one event): locals, no helper calls
        # per hash.
        slot = self._slot(engine_id, medium)
        high, lru, asked = slot << 64, self._lru, self._asked
        held = len(lru)
        for raw in hashes:
            h = raw if type(raw) is int else block_key(raw)
            lru.touch(high | h)
            if h in asked:
                self._forget([h])
        self._slot_sizes[slot] = self._slot_sizes.get(slot, 0) + len(lru) - held
        if len(lru) - self._num_retired > self._max_entries:
            self._evict(len(lru) - self._num_retired - self._max_entries)

    def _store_new(self, hashes: Sequence[ExternalBlockHash], engine_id: str, medium: str, *,
                   ints: bool = False) -> bool:
        """Stores `hashes` in bulk when none is held by (engine, medium) yet and they fit the
        bound (False, nothing changed, otherwise). Then storing them one by one, evicting after
        each, would only ever evict entries older than all of them, the same ones evicted here
        at the end (a block stored again, by contrast, may be evicted and re-added in between).
        `ints`: the hashes are ints already (the compact paths), no per-hash conversion."""
        hs = hashes if ints else [raw if type(raw) is int else block_key(raw) for raw in hashes]
        slot = self._slot(engine_id, medium)
        lru = self._lru
        keys = list(map(or_, repeat(slot << 64), hs))  # type: ignore[arg-type]
        if len(keys) > self._max_entries or lru.holds_any(keys):
            return False
        held = len(lru)
        lru.touch_many(keys)
        if self._asked and not self._asked.isdisjoint(hs):
            self._forget(hs)  # type: ignore[arg-type]
        self._slot_sizes[slot] = self._slot_sizes.get(slot, 0) + len(lru) - held
        if len(lru) - self._num_retired > self._max_entries:
            self._evict(len(lru) - self._num_retired - self._max_entries)
        return True

    def _forget(self, hashes: Sequence[int]) -> None:
        """Forgets the holders of `hashes` (just stored: a new holder), so that `match` asks
        every slot about them again."""
        _consume(map(self._first_holders.pop, hashes, repeat(None)))
        self._asked.difference_update(hashes)

    def _evict(self, n: int) -> None:
        """Drops the `n` least recently used entries (one alone without the bulk path's
        fixed cost: a block stored again evicts one at a time)."""
        lru = self._lru
        self._stats.num_evicted += n
        if n == 1 and not self._retired:  # a block stored again: one at a time, no list
            self._slot_sizes[lru.pop_oldest() >> 64] -= 1
            return
        while n:
            keys = [lru.pop_oldest()] if n == 1 else lru.pop_oldest_many(n)
            if self._retired:  # a dropped slot's entries leave as they come to the front
                keys = self._skip_retired(keys)
            self._count_out(keys)
            n -= len(keys)

    def _remove_many(self, hashes: Sequence[int], engine_id: str, medium: str) -> None:
        """`_remove` of each int hash, in bulk (BlockRemoved of an unknown slot: nothing)."""
        slot = self._slots.get((engine_id, medium))
        if slot is not None:
            self._slot_sizes[slot] -= len(self._lru.discard_many(map(or_, repeat(slot << 64), hashes)))

    def _remove(self, h: int, slot: int) -> None:
        key = slot << 64 | h
        if key in self._lru:
            self._lru.discard(key)
            self._slot_sizes[slot] -= 1

    def _count_out(self, keys: list[int]) -> None:
        """Takes keys just dropped from the LRU off their slots' sizes."""
        sizes = self._slot_sizes
        slots = list(map(rshift, keys, repeat(64)))
        if slots and slots.count(slots[0]) == len(slots):  # the common case: one engine's old run
            sizes[slots[0]] -= len(slots)
            return
        for slot, n in Counter(slots).items():
            sizes[slot] -= n

    def _drop(self, engine_id: str, medium: str | None) -> None:
        """Drops every entry of the engine (of one medium when given) by retiring its slots:
        their entries leave the index at once (`match`, `entries`, the bound count only live
        slots) and the LRU lazily, when eviction reaches them or, once they are half of it, in
        one C-level pass. So a drop costs nothing per entry, and no set of hashes per slot
        has to be kept up to date on every store and eviction."""
        for key in [k for k in self._slots if k[0] == engine_id and (medium is None or k[1] == medium)]:
            slot = self._slots.pop(key)
            del self._slot_keys[slot]
            self._match_slots = None
            size = self._slot_sizes.pop(slot, 0)
            if size:
                self._retired[slot] = size
                self._num_retired += size
            else:
                self._free_slots.append(slot)
        if self._num_retired * 2 > len(self._lru):
            self._purge_retired()

    def _purge_retired(self) -> None:
        retired, lru = self._retired, self._lru
        lru.discard_many(list(compress(lru.keys(), map(retired.__contains__, map(rshift, lru.keys(), repeat(64))))))
        self._free_slots += retired
        retired.clear()
        self._num_retired = 0

    def _skip_retired(self, keys: list[int]) -> list[int]:
        """`keys` (just out of the LRU) less those of retired slots, which are counted out."""
        retired = self._retired
        slots = list(map(rshift, keys, repeat(64)))
        flags = list(map(retired.__contains__, slots))
        if True not in flags:
            return keys
        for slot in compress(slots, flags):
            retired[slot] -= 1
            if not retired[slot]:
                del retired[slot]
                self._free_slots.append(slot)
        self._num_retired -= flags.count(True)
        return list(compress(keys, map(not_, flags)))
