"""The KV-event republisher: one sequence over every engine's batches, a replay ring, and
bounded per-subscriber buffers.

Pure and synchronous (no asyncio, no gRPC, no ZMQ); thread-safe: `publish` may be called from
any thread, state changes happen under one lock, and subscribers are woken through a callback
they supply. The gRPC servicer and the ZMQ publisher sit on top.

Contract:
- `publish(engine_id, epoch, batch)` (the scheduler's `EventSink`; `publish_seq` also returns
  the seq) gives a non-empty batch the next sequence number (0, 1, 2, ... per scheduler
  process, shared by gRPC and ZMQ), applies it to the prefix index, appends it to the ring (the
  last `ring_size` batches) and offers it to every subscriber and listener, in sequence order.
  It never blocks on a consumer. An empty batch publishes nothing.
- An engine's new epoch (seen in `register_epoch` or `publish`) first publishes an
  `AllBlocksCleared` batch stamped with the old epoch (unless that epoch's last batch already
  was one, e.g. from the Control servicer's fencing), then marks the old epoch dead; batches
  from a dead epoch are refused (None, counted). `remove_engine` does the same for an engine
  that left.
- The ring holds the batches themselves, or with a `ring_codec` their packed bytes (unpacked
  for a replay; the batches replayed are equal to those published, and keep their cached wire
  encodings).
- A subscription starting at `from_seq`: inside the ring (oldest <= from_seq <= next) gets
  exactly the batches from_seq, from_seq+1, ...; older than the ring, or ahead of the publisher
  (the scheduler restarted and seqs began again at 0), gets SNAPSHOT_BEGIN, the index as
  BlockStored batches, SNAPSHOT_END(next_seq), then live batches from next_seq. None means live
  only.
- `subscribe(None, snapshot=True)` starts with a snapshot, then live: how a subscriber resumes at
  another replica (each replica's seqs are its own). A snapshot's SNAPSHOT_BEGIN names each
  engine's position (`position_of`, the scheduler's rank-0 report positions) and the replica's
  `scheduler_id`, so a restarted replica can install it (services/scheduler/convergence.py).
- A subscriber whose unread live batches exceed `subscriber_buffer` is cut off at once (its
  buffer freed) and, on its next `take`, receives RESYNC followed by a snapshot; never a silent
  gap and never a stalled publisher.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch
from services.scheduler.event_sink import CompactBatch
from services.scheduler.prefix_index import DEFAULT_MEDIUM, PrefixIndex

logger = logging.getLogger(__name__)

SNAPSHOT_BLOCKS_PER_BATCH = 1024
MAX_DEAD_EPOCHS = 8


@dataclass(slots=True, eq=False)
class SequencedBatch:
    """A republished batch. `wire` caches encodings per format (filled lazily by consumers)."""

    seq: int
    engine_id: str
    epoch: int
    batch: KVEventBatch
    wire: dict[str, bytes] = field(default_factory=dict, repr=False)


class RingCodec(Protocol):
    """Packs a republished batch into bytes for the replay ring and back (see EventRepublisher)."""

    def pack(self, sb: SequencedBatch) -> bytes:
        """The batch as bytes; may also fill `sb.wire` (the bytes are then shared)."""
        ...

    def unpack(self, data: bytes) -> KVEventBatch:
        """The batch `pack` was given, up to equality of its events."""
        ...


@dataclass(slots=True, eq=False)
class _Packed:
    """A ring entry held as bytes: one small object instead of one per event."""

    seq: int
    engine_id: str
    epoch: int
    data: bytes
    wire: dict[str, bytes]


@dataclass(frozen=True, slots=True)
class SnapshotBatch:
    """Part of a snapshot: BlockStored events describing the index, without a sequence number
    (snapshot entries carry no parent chain or tokens: parent None, token_ids empty)."""

    engine_id: str
    epoch: int
    batch: KVEventBatch


class NoticeKind(enum.Enum):
    SNAPSHOT_BEGIN = 1
    SNAPSHOT_END = 2
    RESYNC = 3


@dataclass(frozen=True, slots=True)
class StreamNotice:
    """SNAPSHOT_BEGIN names every engine the snapshot describes with its position (engine_id,
    epoch, rank 0's last report position: see `EventRepublisher.position_of`) and the replica
    that took it."""

    kind: NoticeKind
    next_seq: int
    reason: str = ""
    positions: tuple[tuple[str, int, int], ...] = ()
    scheduler_id: str = ""


StreamItem = SequencedBatch | SnapshotBatch | StreamNotice


@dataclass(frozen=True, slots=True)
class EventFilter:
    """Selects batches by engine and events by medium and type; empty sets select everything.

    An event without a medium counts as the default medium (GPU); an AllBlocksCleared without a
    medium clears every medium and so matches any medium filter.
    """

    engine_ids: frozenset[str] = frozenset()
    media: frozenset[str] = frozenset()
    types: frozenset[type] = frozenset()

    @property
    def selects_all(self) -> bool:
        return not (self.engine_ids or self.media or self.types)

    def wants_engine(self, engine_id: str) -> bool:
        return not self.engine_ids or engine_id in self.engine_ids

    def wants_event(self, event: KVCacheEvent) -> bool:
        if self.types and type(event) not in self.types:
            return False
        if not self.media:
            return True
        if isinstance(event, AllBlocksCleared) and event.medium is None:
            return True
        return (event.medium or DEFAULT_MEDIUM) in self.media

    def apply(self, sb: SequencedBatch) -> SequencedBatch | None:
        """The batch as this filter sees it, None when nothing of it is selected."""
        if self.selects_all:
            return sb
        if not self.wants_engine(sb.engine_id):
            return None
        if not (self.media or self.types):
            return sb
        if type(sb.batch) is CompactBatch:  # BlockStored (and BlockRemoved) of one medium
            c = sb.batch.compact
            if self.media and (c.medium or DEFAULT_MEDIUM) not in self.media:
                return None
            present = c.event_types
            if not self.types or self.types.issuperset(present):
                return sb
            if self.types.isdisjoint(present):
                return None
            # a mixed batch of which one kind is selected: the per-event path below
        events = [e for e in sb.batch.events if self.wants_event(e)]
        if not events:
            return None
        if len(events) == len(sb.batch.events):
            return sb
        b = sb.batch
        return SequencedBatch(sb.seq, sb.engine_id, sb.epoch, KVEventBatch(b.ts, events, b.data_parallel_rank))


@dataclass(slots=True)
class RepublisherStats:
    num_batches: int = 0
    num_events: int = 0
    num_stale_batches: int = 0
    num_resyncs: int = 0
    num_snapshots: int = 0
    num_subscribers: int = 0
    events_by_type: dict[str, int] = field(default_factory=dict)


class Subscription:
    """One subscriber's view of the stream. Call `take` after each wake-up; `close` when done.

    `wake` is called (from whichever thread published) when items become available after the
    subscriber drained everything; it must be cheap and thread-safe.
    """

    def __init__(self, owner: EventRepublisher, event_filter: EventFilter, buffer: int,
                 wake: Callable[[], None]) -> None:
        self._owner = owner
        self.filter = event_filter
        self._buffer = buffer
        self._wake = wake
        self._ready: deque[StreamItem] = deque()
        self._live: deque[SequencedBatch] = deque()
        self._overflowed = False
        self.closed = False
        self.num_resyncs = 0

    @property
    def lag(self) -> int:
        """Unread live batches (the buffer this subscriber occupies)."""
        return len(self._live)

    def take(self, max_items: int = 256) -> list[StreamItem]:
        """The next items in stream order (empty when nothing is pending)."""
        with self._owner._lock:
            if self._overflowed:
                self._overflowed = False
                nxt = self._owner._next_seq
                self._ready.append(StreamNotice(NoticeKind.RESYNC, nxt,
                                                f"subscriber fell more than {self._buffer} batches behind"))
                self._ready.extend(self._owner._snapshot_items(self.filter, "resync"))
            out: list[StreamItem] = []
            while self._ready and len(out) < max_items:
                out.append(self._ready.popleft())
            while self._live and len(out) < max_items:
                out.append(self._live.popleft())
            return out

    def close(self) -> None:
        self._owner._unsubscribe(self)

    def _offer(self, sb: SequencedBatch) -> None:
        if self._overflowed:
            return
        selected = self.filter.apply(sb)
        if selected is None:
            return
        if len(self._live) >= self._buffer:
            self._overflowed = True
            self._live.clear()
            self._ready.clear()
            self.num_resyncs += 1
            self._owner._stats.num_resyncs += 1
            for observer in self._owner.on_resync:
                observer(self)
            logger.warning("KV-event subscriber fell %d batches behind at seq %d: resyncing",
                           self._buffer, sb.seq)
            self._wake()
            return
        self._live.append(selected)
        if len(self._live) == 1 and not self._ready:
            self._wake()


class EventRepublisher:
    """See the module docstring. `index` is fed every published batch and is the snapshot source."""

    def __init__(self, index: PrefixIndex, *, ring_size: int = 4096, subscriber_buffer: int = 1024,
                 snapshot_blocks_per_batch: int = SNAPSHOT_BLOCKS_PER_BATCH,
                 clock: Callable[[], float] = time.time, ring_codec: RingCodec | None = None) -> None:
        if ring_size < 1:
            raise ValueError(f"ring_size must be >= 1, got {ring_size}")
        if subscriber_buffer < 1:
            raise ValueError(f"subscriber_buffer must be >= 1, got {subscriber_buffer}")
        self.index = index
        # The index's array path for compact batches (`InMemoryPrefixIndex.apply_compact`), if any.
        self._apply_compact: Callable[[str, int, str | None, list[int], list[int], bytes], bool] | None = \
            getattr(index, "apply_compact", None)
        self.ring_size = ring_size
        self.subscriber_buffer = subscriber_buffer
        self._snapshot_blocks = snapshot_blocks_per_batch
        self._clock = clock
        self._lock = threading.RLock()
        # With a codec the ring holds packed bytes (unpacked again only for a replay), so the
        # garbage collector does not walk every event of the last `ring_size` batches.
        self._codec = ring_codec
        self._ring: deque[SequencedBatch | _Packed] = deque(maxlen=ring_size)
        self._next_seq = 0
        self._epochs: dict[str, int] = {}
        # engine -> epoch whose last published batch ended in a full AllBlocksCleared
        self._cleared: dict[str, int] = {}
        self._dead_epochs: dict[str, deque[int]] = {}
        self._subscribers: list[Subscription] = []
        self._listeners: list[Callable[[SequencedBatch], None]] = []
        self._stats = RepublisherStats()
        # Observers (metrics): called under the lock, must not block.
        self.on_received: list[Callable[[str, KVEventBatch], None]] = []
        self.on_rejected: list[Callable[[str, int], None]] = []
        self.on_resync: list[Callable[[Subscription], None]] = []
        # Named in a snapshot's SNAPSHOT_BEGIN (set by the scheduler service): rank 0's last
        # applied report position of (engine, epoch), and this replica's id.
        self.position_of: Callable[[str, int], int] = lambda engine_id, epoch: 0
        self.scheduler_id = ""

    # -- producers -------------------------------------------------------------------------

    def publish(self, engine_id: str, epoch: int, batch: KVEventBatch) -> None:
        """`EventSink.publish`: see `publish_seq`."""
        self.publish_seq(engine_id, epoch, batch)

    def publish_seq(self, engine_id: str, epoch: int, batch: KVEventBatch) -> int | None:
        """Republishes one engine batch; returns its seq, None when empty or from a dead epoch.

        Raises ValueError (changing nothing) for an empty engine id, a negative epoch or an
        event that is not a KV event.
        """
        _check_batch(engine_id, epoch, batch)
        with self._lock:
            for observer in self.on_received:
                observer(engine_id, batch)
            if epoch in self._dead_epochs.get(engine_id, ()):
                self._stats.num_stale_batches += 1
                for rejected in self.on_rejected:
                    rejected("stale_epoch", num_events(batch))
                logger.debug("dropping KV events of %s from dead epoch %d", engine_id, epoch)
                return None
            self._adopt_epoch(engine_id, epoch)
            if not num_events(batch):
                return None
            return self._append(engine_id, epoch, batch)

    def register_epoch(self, engine_id: str, epoch: int) -> None:
        """An engine (re)registered with `epoch`: a new epoch clears the old one at once."""
        _check_batch(engine_id, epoch, KVEventBatch(0.0))
        with self._lock:
            if epoch in self._dead_epochs.get(engine_id, ()):
                raise ValueError(f"engine {engine_id!r}: epoch {epoch} was already replaced")
            self._adopt_epoch(engine_id, epoch)

    def remove_engine(self, engine_id: str) -> None:
        """The engine left (or was declared dead): publish its AllBlocksCleared and forget it."""
        with self._lock:
            epoch = self._epochs.pop(engine_id, None)
            if epoch is None:
                return
            self._retire(engine_id, epoch)
            self.index.remove_engine(engine_id)

    def add_listener(self, listener: Callable[[SequencedBatch], None]) -> None:
        """Calls `listener(batch)` for every published batch, in order, under the publish lock
        (it must not block; the ZMQ publisher is one)."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[SequencedBatch], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    # -- consumers -------------------------------------------------------------------------

    def epoch_of(self, engine_id: str) -> int | None:
        """The engine's live epoch as the republisher knows it (None: unknown or removed)."""
        with self._lock:
            return self._epochs.get(engine_id)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def oldest_seq(self) -> int:
        """The oldest seq still in the ring (next_seq when nothing was published yet)."""
        with self._lock:
            return self._ring[0].seq if self._ring else self._next_seq

    def replay(self, start_seq: int) -> list[SequencedBatch]:
        """The buffered batches with seq >= start_seq, oldest first (vLLM's replay semantics:
        a start older than the ring starts at the oldest buffered batch)."""
        with self._lock:
            if not self._ring or start_seq >= self._next_seq:
                return []
            skip = max(0, start_seq - self._ring[0].seq)
            return [self._ring_batch(i) for i in range(skip, len(self._ring))]

    def snapshot(self, event_filter: EventFilter | None = None) -> list[StreamItem]:
        """SNAPSHOT_BEGIN, the index as BlockStored batches, SNAPSHOT_END(next_seq), taken under
        the publish lock: exactly the state after batch next_seq - 1 (the ZMQ replay socket's
        snapshot request; a subscription starts with the same)."""
        with self._lock:
            return self._snapshot_items(event_filter or EventFilter(), "snapshot requested")

    def subscribe(self, from_seq: int | None, event_filter: EventFilter | None = None, *,
                  wake: Callable[[], None] = lambda: None, snapshot: bool = False) -> Subscription:
        """A new subscription; see the module docstring for what it receives first."""
        if from_seq is not None and from_seq < 0:
            raise ValueError(f"from_seq must be >= 0, got {from_seq}")
        if snapshot and from_seq is not None:
            raise ValueError("snapshot: only without from_seq (a from_seq resumes this replica's sequence)")
        f = event_filter or EventFilter()
        with self._lock:
            sub = Subscription(self, f, self.subscriber_buffer, wake)
            nxt = self._next_seq
            oldest = self._ring[0].seq if self._ring else nxt
            if from_seq is None:
                if snapshot:
                    sub._ready.extend(self._snapshot_items(f, "snapshot requested"))
            elif oldest <= from_seq <= nxt:
                skip = from_seq - oldest
                for i in range(skip, len(self._ring)):
                    selected = f.apply(self._ring_batch(i))
                    if selected is not None:
                        sub._ready.append(selected)
            else:
                reason = (f"from_seq {from_seq} is older than the replay ring (oldest {oldest})"
                          if from_seq < oldest else
                          f"from_seq {from_seq} is ahead of the publisher (next {nxt}): the scheduler restarted")
                sub._ready.extend(self._snapshot_items(f, reason))
            self._subscribers.append(sub)
            self._stats.num_subscribers = len(self._subscribers)
            return sub

    def stats(self) -> RepublisherStats:
        with self._lock:
            s = self._stats
            return RepublisherStats(s.num_batches, s.num_events, s.num_stale_batches, s.num_resyncs,
                                    s.num_snapshots, len(self._subscribers), dict(s.events_by_type))

    def subscriber_lags(self) -> list[int]:
        with self._lock:
            return [s.lag for s in self._subscribers]

    # -- internals (callers hold the lock) -------------------------------------------------

    def _append(self, engine_id: str, epoch: int, batch: KVEventBatch) -> int:
        seq = self._next_seq
        self._next_seq += 1
        sb = SequencedBatch(seq, engine_id, epoch, batch)
        s = self._stats
        s.num_batches += 1
        by_type = s.events_by_type
        if type(batch) is CompactBatch:
            # BlockStored (and BlockRemoved) of one medium, as hashes: indexed and counted
            # without an event object.
            c = batch.compact
            if self._apply_compact is not None:
                self._apply_compact(engine_id, epoch, c.medium, c.hashes, c.sizes, c.kinds)
            else:
                self.index.apply(engine_id, epoch, batch.events)
            self._cleared.pop(engine_id, None)
            s.num_events += c.num_events
            for name, count in (("BlockStored", c.num_stored), ("BlockRemoved", c.num_removed)):
                if count:
                    by_type[name] = by_type.get(name, 0) + count
        else:
            self.index.apply(engine_id, epoch, batch.events)
            last = batch.events[-1]
            if isinstance(last, AllBlocksCleared) and last.medium is None:
                self._cleared[engine_id] = epoch
            else:
                self._cleared.pop(engine_id, None)
            s.num_events += len(batch.events)
            for kind, count in Counter(map(type, batch.events)).items():
                by_type[kind.__name__] = by_type.get(kind.__name__, 0) + count
        for sub in self._subscribers:
            sub._offer(sb)
        for listener in self._listeners:
            try:
                listener(sb)
            except Exception:
                logger.exception("KV-event listener failed on seq %d", seq)
        if self._codec is None:
            self._ring.append(sb)
        else:
            self._ring.append(_Packed(seq, engine_id, epoch, self._codec.pack(sb), sb.wire))
        return seq

    def _ring_batch(self, i: int) -> SequencedBatch:
        entry = self._ring[i]
        if isinstance(entry, SequencedBatch):
            return entry
        assert self._codec is not None
        return SequencedBatch(entry.seq, entry.engine_id, entry.epoch, self._codec.unpack(entry.data), entry.wire)

    def _adopt_epoch(self, engine_id: str, epoch: int) -> None:
        current = self._epochs.get(engine_id)
        if current == epoch:
            return
        if current is not None:
            logger.info("engine %s: epoch %d replaces %d; clearing its KV-event entries", engine_id, epoch, current)
            self._retire(engine_id, current)
        self._epochs[engine_id] = epoch

    def _retire(self, engine_id: str, epoch: int) -> None:
        if self._cleared.get(engine_id) != epoch:  # not already cleared by its producer
            self._append(engine_id, epoch, KVEventBatch(self._clock(), [AllBlocksCleared()]))
        self._cleared.pop(engine_id, None)
        dead = self._dead_epochs.setdefault(engine_id, deque(maxlen=MAX_DEAD_EPOCHS))
        dead.append(epoch)

    def _snapshot_items(self, f: EventFilter, reason: str) -> list[StreamItem]:
        self._stats.num_snapshots += 1
        nxt = self._next_seq
        positions = tuple((e, epoch, self.position_of(e, epoch)) for e, epoch in self._epochs.items()
                          if f.wants_engine(e))
        items: list[StreamItem] = [StreamNotice(NoticeKind.SNAPSHOT_BEGIN, nxt, reason, positions, self.scheduler_id)]
        if not f.types or BlockStored in f.types:
            ts = self._clock()
            n = self._snapshot_blocks
            for part in self.index.snapshot():
                if not f.wants_engine(part.engine_id) or (f.media and part.medium not in f.media):
                    continue
                for i in range(0, len(part.block_hashes), n):
                    stored = BlockStored(part.block_hashes[i:i + n], None, (), 0, medium=part.medium)
                    items.append(SnapshotBatch(part.engine_id, part.epoch, KVEventBatch(ts, [stored])))
        items.append(StreamNotice(NoticeKind.SNAPSHOT_END, nxt))
        return items

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            sub.closed = True
            sub._live.clear()
            sub._ready.clear()
            if sub in self._subscribers:
                self._subscribers.remove(sub)
            self._stats.num_subscribers = len(self._subscribers)


def num_events(batch: KVEventBatch) -> int:
    """The batch's event count (a CompactBatch's without decoding it)."""
    return batch.num_events if type(batch) is CompactBatch else len(batch.events)


def _check_batch(engine_id: str, epoch: int, batch: KVEventBatch) -> None:
    if not engine_id:
        raise ValueError("KV events need an engine id")
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if type(batch) is CompactBatch:
        return  # BlockStored and BlockRemoved only, by construction
    for e in batch.events:
        if not isinstance(e, BlockStored | BlockRemoved | AllBlocksCleared):
            raise ValueError(f"not a KV event: {type(e).__name__}")

