"""A step's BlockStored (and BlockRemoved) events in compact form: encoded once by the rank,
handed on as bytes.

The common step (every event a BlockStored of one (medium, group_idx), integer hashes) travels
to the scheduler as `pdserve.v1.CompactEvents`: the events as a serialized EventBatch (what gRPC
subscribers receive), as vLLM's msgpack event list (what ZMQ subscribers receive, inside
`[ts, events, data_parallel_rank]`), and their hashes as one array of unsigned 64-bit ints with
a count per event (what the aggregator and the prefix index need). The scheduler then builds no
object per event: it counts, indexes and republishes from the array and the bytes.

A mixed step (an engine at full cache evicts as it stores: BlockStored and BlockRemoved of one
(medium, group_idx), in any order) takes the same form with one kind byte per event (`kinds`:
KIND_STORED / KIND_REMOVED, event order kept), for a scheduler that says it reads them
(`Welcome.accepts_mixed_compact_events`); `kinds` is empty when every event is a BlockStored
(the form an older scheduler reads). AllBlocksCleared and anything else keep the protobuf path.

Contracts:
- `encode(events, mixed=False)` returns None unless the events qualify (non-empty; each a
  BlockStored with at least one int hash in [0, 2**64) and an int parent or none, or with
  `mixed` also a BlockRemoved with at least one int hash in [0, 2**64); all of the same medium
  and group_idx); else the three forms describe the events as their protobuf form carries them,
  which is what the scheduler publishes for them on the protobuf path: `decode_events` of
  `events_wire` gives `carried(e)` for each, `msgpack_events` equals the events element of
  `connectors.wire.encode_batch` of those. `carried(e)` is `e` itself unless it sets a field the
  protobuf form drops or reshapes (kv_cache_spec_*, locality: dropped, a BlockRemoved's too;
  extra_keys: tuples of its msgpack), as vLLM's GPU block-pool events do (`extra_keys=[None]`,
  `kv_cache_spec_kind="full_attention"`).
- `from_proto(m)` checks the framing (hash array length, counts >= 1 summing to it, the msgpack
  list header holding one element per event, a parseable EventBatch with one event per count,
  `kinds` empty or one known kind byte per event: else KindsError) and raises ValueError
  naming what is wrong; it does not compare the forms event by event (the sender's contract;
  `verify` does, for tests and debugging).
"""

from __future__ import annotations

import re
import struct
import sys
from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import msgpack

from connectors.kv_events import BlockRemoved, BlockStored, KVCacheEvent, event_from_proto, event_to_proto

_U64 = 1 << 64
_BIG_ENDIAN = sys.byteorder == "big"
# Kind bytes of `CompactEvents.kinds` (pdserve.v1.EventType's numbers).
KIND_STORED = 1
KIND_REMOVED = 2
KIND_TYPES: dict[int, type] = {KIND_STORED: BlockStored, KIND_REMOVED: BlockRemoved}
_KIND_OF = {BlockStored: KIND_STORED, BlockRemoved: KIND_REMOVED}
_RUNS = re.compile(b"\x01+|\x02+")
_UNKNOWN_KIND = re.compile(b"[^\x01\x02]")
_STORED_ONLY: frozenset[type] = frozenset({BlockStored})
_REMOVED_ONLY: frozenset[type] = frozenset({BlockRemoved})
_STORED_AND_REMOVED: frozenset[type] = frozenset({BlockStored, BlockRemoved})


@dataclass(frozen=True, slots=True)
class KindRun:
    """Consecutive events of one kind: events [start, stop), hashes [hash_start, hash_stop)."""

    kind: int
    start: int
    stop: int
    hash_start: int
    hash_stop: int


@dataclass(frozen=True, slots=True)
class CompactEvents:
    """See the module docstring. `hashes` is every event's hashes in order; `sizes` how many
    belong to each event; `kinds` one kind byte per event (empty: every event a BlockStored)."""

    events_wire: bytes
    msgpack_events: bytes
    hashes: list[int]
    sizes: list[int]
    medium: str | None
    group_idx: int | None
    kinds: bytes = b""

    @property
    def num_events(self) -> int:
        return len(self.sizes)

    @property
    def num_removed(self) -> int:
        return self.kinds.count(KIND_REMOVED)

    @property
    def num_stored(self) -> int:
        return self.num_events - self.num_removed

    @property
    def mixed(self) -> bool:
        """Whether any event is not a BlockStored."""
        return KIND_REMOVED in self.kinds

    @property
    def event_types(self) -> frozenset[type]:
        """The event types among the events."""
        if not self.mixed:
            return _STORED_ONLY
        return _REMOVED_ONLY if KIND_STORED not in self.kinds else _STORED_AND_REMOVED

    def runs(self) -> list[KindRun]:
        """The events as maximal runs of one kind, in order (`kind_runs`)."""
        return kind_runs(self.sizes, self.kinds)

    @property
    def key(self) -> tuple[str | None, int | None]:
        """(medium, group_idx) as the events carry them (the aggregator's block-state key)."""
        return (self.medium, self.group_idx)

    def events(self) -> list[KVCacheEvent]:
        """The events, decoded from `events_wire` (one object per event: not the hot path)."""
        return decode_events(self.events_wire)


def kind_runs(sizes: list[int], kinds: bytes) -> list[KindRun]:
    """The events given by their hash counts and kind bytes (checked by `check_kinds`; empty:
    all stored) as maximal runs of one kind, in order: one object per run, none per event."""
    if KIND_REMOVED not in kinds:
        return [KindRun(KIND_STORED, 0, len(sizes), 0, sum(sizes))]
    ends = [0, *accumulate(sizes)]
    return [KindRun(kinds[m.start()], m.start(), m.end(), ends[m.start()], ends[m.end()])
            for m in _RUNS.finditer(kinds)]


def qualifies(events: tuple[KVCacheEvent, ...] | list[KVCacheEvent], mixed: bool = False) -> bool:
    """Whether `encode` gives a compact form for `events` (`mixed`: BlockRemoved may be among them)."""
    if not events:
        return False
    kinds = (BlockStored, BlockRemoved) if mixed else (BlockStored,)
    first = events[0]
    if type(first) not in kinds:
        return False
    medium, group = first.medium, first.group_idx  # type: ignore[union-attr]
    for e in events:
        if type(e) not in kinds or e.medium != medium or e.group_idx != group or not e.block_hashes:  # type: ignore[union-attr]
            return False
        parent = e.parent_block_hash if type(e) is BlockStored else None
        if parent is not None and (type(parent) is not int or not 0 <= parent < _U64):
            return False
        for h in e.block_hashes:  # type: ignore[union-attr]
            if type(h) is not int or not 0 <= h < _U64:
                return False
    return True


def carried(e: BlockStored | BlockRemoved) -> BlockStored | BlockRemoved:
    """`e` as its protobuf form carries it (`event_from_proto(event_to_proto(e))`; `e` itself
    when that is the same event, the common case, without the round trip). A BlockRemoved
    with int hashes is carried exactly but for `locality` (dropped)."""
    if type(e) is not BlockStored:
        return e if e.locality is None else BlockRemoved(e.block_hashes, e.medium, e.group_idx)
    if (e.extra_keys is None and e.kv_cache_spec_kind is None and e.kv_cache_spec_sliding_window is None
            and e.locality is None):
        return e
    return event_from_proto(event_to_proto(e))  # type: ignore[return-value]


def encode(events: tuple[KVCacheEvent, ...] | list[KVCacheEvent], mixed: bool = False) -> CompactEvents | None:
    """The compact form of `events`, None when they do not qualify (see `qualifies`); `mixed`
    lets BlockRemoved qualify (for a scheduler that reads `kinds`)."""
    if not qualifies(events, mixed):
        return None
    from connectors.wire.msgpack_codec import _event_out
    from pdserve.v1 import kv_events_pb2 as pb

    out = [carried(e) for e in events]  # type: ignore[arg-type]
    hashes: list[int] = [h for e in out for h in e.block_hashes]  # type: ignore[misc]
    kinds = bytes(_KIND_OF[type(e)] for e in out)
    return CompactEvents(
        events_wire=pb.EventBatch(events=[event_to_proto(e) for e in out]).SerializeToString(),
        msgpack_events=msgpack.packb([_event_out(e, False) for e in out], use_bin_type=True),
        hashes=hashes, sizes=[len(e.block_hashes) for e in out],
        medium=out[0].medium, group_idx=out[0].group_idx,
        kinds=kinds if KIND_REMOVED in kinds else b"")


def pack_hashes(hashes: list[int]) -> bytes:
    """Unsigned 64-bit little-endian."""
    a = array("Q", hashes)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def unpack_hashes(data: bytes) -> list[int]:
    """The ints `pack_hashes` was given (ValueError when the length is not a multiple of 8)."""
    if len(data) % 8:
        raise ValueError(f"compact events: block_hashes holds {len(data)} bytes, not a multiple of 8")
    a = array("Q")
    a.frombytes(data)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tolist()


def to_proto(c: CompactEvents) -> Any:
    """`pdserve.v1.CompactEvents` of `c`."""
    from pdserve.v1 import control_pb2 as cpb

    m = cpb.CompactEvents(events_wire=c.events_wire, msgpack_events=c.msgpack_events,
                          block_hashes=pack_hashes(c.hashes), hashes_per_event=c.sizes)
    if c.medium is not None:
        m.medium = c.medium
    if c.group_idx is not None:
        m.group_idx = c.group_idx
    if c.kinds:
        m.kinds = c.kinds
    return m


def msgpack_list_length(data: bytes) -> int:
    """The element count of the msgpack array `data` starts with (ValueError if none)."""
    if not data:
        raise ValueError("compact events: msgpack_events is empty")
    b = data[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(data) >= 3:
        return int(struct.unpack_from(">H", data, 1)[0])
    if b == 0xDD and len(data) >= 5:
        return int(struct.unpack_from(">I", data, 1)[0])
    raise ValueError(f"compact events: msgpack_events does not start with an array (byte 0x{b:02x})")


def from_proto(m: Any) -> CompactEvents:
    """A received `pdserve.v1.CompactEvents`, its framing checked (ValueError: malformed)."""
    from google.protobuf.message import DecodeError

    from pdserve.v1 import kv_events_pb2 as pb

    sizes = list(m.hashes_per_event)
    if not sizes:
        raise ValueError("compact events: no events (hashes_per_event is empty)")
    if min(sizes) < 1:
        raise ValueError("compact events: an event without block hashes")
    hashes = unpack_hashes(m.block_hashes)
    if sum(sizes) != len(hashes):
        raise ValueError(f"compact events: hashes_per_event sums to {sum(sizes)}, block_hashes holds {len(hashes)}")
    n = msgpack_list_length(m.msgpack_events)
    if n != len(sizes):
        raise ValueError(f"compact events: msgpack_events lists {n} events, hashes_per_event {len(sizes)}")
    try:
        batch = pb.EventBatch.FromString(m.events_wire)
    except DecodeError as e:
        raise ValueError(f"compact events: events_wire is not an EventBatch ({e})") from None
    if len(batch.ListFields()) != 1 or len(batch.events) != len(sizes):
        raise ValueError(f"compact events: events_wire must hold exactly the {len(sizes)} events and nothing else")
    kinds = m.kinds
    check_kinds(kinds, len(sizes))
    return CompactEvents(m.events_wire, m.msgpack_events, hashes, sizes,
                         m.medium if m.HasField("medium") else None,
                         m.group_idx if m.HasField("group_idx") else None,
                         kinds if KIND_REMOVED in kinds else b"")


class KindsError(ValueError):
    """`kinds` is malformed (its own counted reason on the scheduler)."""


def check_kinds(kinds: bytes, num_events: int) -> None:
    """KindsError unless `kinds` is empty or one known kind byte per event."""
    if not kinds:
        return
    if len(kinds) != num_events:
        raise KindsError(f"compact events: kinds holds {len(kinds)} bytes for {num_events} events")
    bad = _UNKNOWN_KIND.search(kinds)
    if bad is not None:
        raise KindsError(f"compact events: unknown kind byte 0x{kinds[bad.start()]:02x} at event {bad.start()}")


def decode_events(events_wire: bytes) -> list[KVCacheEvent]:
    from pdserve.v1 import kv_events_pb2 as pb

    return [event_from_proto(e) for e in pb.EventBatch.FromString(events_wire).events]


def verify(c: CompactEvents) -> None:
    """Checks that the three forms describe the same events (ValueError naming the first
    difference); costs a full decode of each, so it is for tests and debugging."""
    from connectors.wire.msgpack_codec import _event_out

    events = c.events()
    kinds = c.kinds or bytes([KIND_STORED]) * len(events)
    for e, kind in zip(events, kinds, strict=True):
        want = KIND_TYPES[kind]
        if type(e) is not want or (e.medium, e.group_idx) != c.key:  # type: ignore[union-attr]
            raise ValueError(f"compact events: {e!r} is not a {want.__name__} of {c.key}")
    out: list[BlockStored | BlockRemoved] = events  # type: ignore[assignment]
    if [h for e in out for h in e.block_hashes] != c.hashes or [len(e.block_hashes) for e in out] != c.sizes:
        raise ValueError("compact events: block_hashes differ from events_wire")
    if msgpack.packb([_event_out(e, False) for e in out], use_bin_type=True) != c.msgpack_events:
        raise ValueError("compact events: msgpack_events differ from events_wire")


def zmq_payload(msgpack_events: bytes, ts: float, data_parallel_rank: int | None) -> bytes:
    """vLLM's `[ts, events, data_parallel_rank]` msgpack around pre-encoded events: the bytes
    `encode_batch` gives for the same batch."""
    tail = b"\xc0" if data_parallel_rank is None else msgpack.packb(data_parallel_rank)
    return b"\x93\xcb" + struct.pack(">d", float(ts)) + msgpack_events + tail
