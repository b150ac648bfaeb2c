"""A step's BlockStored events in compact form: encoded once by the rank, handed on as bytes.

The common step (every event a BlockStored of one (medium, group_idx), integer hashes) travels
to the scheduler as `pdserve.v1.CompactEvents`: the events as a serialized EventBatch (what gRPC
subscribers receive), as vLLM's msgpack event list (what ZMQ subscribers receive, inside
`[ts, events, data_parallel_rank]`), and their hashes as one array of unsigned 64-bit ints with
a count per event (what the aggregator and the prefix index need). The scheduler then builds no
object per event: it counts, indexes and republishes from the array and the bytes.

Contracts:
- `encode(events)` returns None unless the events qualify (non-empty; each a BlockStored with
  at least one int hash in [0, 2**64), an int parent or none, the same medium and group_idx);
  else the three forms describe the events as their protobuf form carries them, which is what
  the scheduler publishes for them on the protobuf path: `decode_events` of `events_wire` gives
  `carried(e)` for each, `msgpack_events` equals the events element of
  `connectors.wire.encode_batch` of those. `carried(e)` is `e` itself unless it sets a field the
  protobuf form drops or reshapes (kv_cache_spec_*, locality: dropped; extra_keys: tuples of
  its msgpack), as vLLM's GPU block-pool events do (`extra_keys=[None]`,
  `kv_cache_spec_kind="full_attention"`).
- `from_proto(m)` checks the framing (hash array length, counts >= 1 summing to it, the msgpack
  list header holding one element per event, a parseable EventBatch with one event per count)
  and raises ValueError naming what is wrong; it does not compare the forms event by event
  (the sender's contract; `verify` does, for tests and debugging).
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

import msgpack

from connectors.kv_events import BlockStored, KVCacheEvent, event_from_proto, event_to_proto

_U64 = 1 << 64
_BIG_ENDIAN = sys.byteorder == "big"


@dataclass(frozen=True, slots=True)
class CompactEvents:
    """See the module docstring. `hashes` is every event's hashes in order; `sizes` how many
    belong to each event."""

    events_wire: bytes
    msgpack_events: bytes
    hashes: list[int]
    sizes: list[int]
    medium: str | None
    group_idx: int | None

    @property
    def num_events(self) -> int:
        return len(self.sizes)

    @property
    def key(self) -> tuple[str | None, int | None]:
        """(medium, group_idx) as the events carry them (the aggregator's block-state key)."""
        return (self.medium, self.group_idx)

    def events(self) -> list[KVCacheEvent]:
        """The events, decoded from `events_wire` (one object per event: not the hot path)."""
        return decode_events(self.events_wire)


def qualifies(events: tuple[KVCacheEvent, ...] | list[KVCacheEvent]) -> bool:
    """Whether `encode` gives a compact form for `events`."""
    if not events:
        return False
    first = events[0]
    if type(first) is not BlockStored:
        return False
    medium, group = first.medium, first.group_idx
    for e in events:
        if type(e) is not BlockStored or e.medium != medium or e.group_idx != group or not e.block_hashes:
            return False
        parent = e.parent_block_hash
        if parent is not None and (type(parent) is not int or not 0 <= parent < _U64):
            return False
        for h in e.block_hashes:
            if type(h) is not int or not 0 <= h < _U64:
                return False
    return True


def carried(e: BlockStored) -> BlockStored:
    """`e` as its protobuf form carries it (`event_from_proto(event_to_proto(e))`; `e` itself
    when that is the same event, the common case, without the round trip)."""
    if (e.extra_keys is None and e.kv_cache_spec_kind is None and e.kv_cache_spec_sliding_window is None
            and e.locality is None):
        return e
    return event_from_proto(event_to_proto(e))  # type: ignore[return-value]


def encode(events: tuple[KVCacheEvent, ...] | list[KVCacheEvent]) -> CompactEvents | None:
    """The compact form of `events`, None when they do not qualify (see `qualifies`)."""
    if not qualifies(events):
        return None
    from connectors.wire.msgpack_codec import _event_out
    from pdserve.v1 import kv_events_pb2 as pb

    stored = [carried(e) for e in events]  # type: ignore[arg-type]
    hashes: list[int] = [h for e in stored for h in e.block_hashes]  # type: ignore[misc]
    return CompactEvents(
        events_wire=pb.EventBatch(events=[event_to_proto(e) for e in stored]).SerializeToString(),
        msgpack_events=msgpack.packb([_event_out(e, False) for e in stored], use_bin_type=True),
        hashes=hashes, sizes=[len(e.block_hashes) for e in stored],
        medium=stored[0].medium, group_idx=stored[0].group_idx)


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
    return CompactEvents(m.events_wire, m.msgpack_events, hashes, sizes,
                         m.medium if m.HasField("medium") else None,
                         m.group_idx if m.HasField("group_idx") else None)


def decode_events(events_wire: bytes) -> list[KVCacheEvent]:
    from pdserve.v1 import kv_events_pb2 as pb

    return [event_from_proto(e) for e in pb.EventBatch.FromString(events_wire).events]


def verify(c: CompactEvents) -> None:
    """Checks that the three forms describe the same events (ValueError naming the first
    difference); costs a full decode of each, so it is for tests and debugging."""
    from connectors.wire.msgpack_codec import _event_out

    events = c.events()
    for e in events:
        if type(e) is not BlockStored or (e.medium, e.group_idx) != c.key:
            raise ValueError(f"compact events: {e!r} is not a BlockStored of {c.key}")
    stored: list[BlockStored] = events  # type: ignore[assignment]
    if [h for e in stored for h in e.block_hashes] != c.hashes or [len(e.block_hashes) for e in stored] != c.sizes:
        raise ValueError("compact events: block_hashes differ from events_wire")
    if msgpack.packb([_event_out(e, False) for e in stored], use_bin_type=True) != c.msgpack_events:
        raise ValueError("compact events: msgpack_events differ from events_wire")


def zmq_payload(msgpack_events: bytes, ts: float, data_parallel_rank: int | None) -> bytes:
    """vLLM's `[ts, events, data_parallel_rank]` msgpack around pre-encoded events: the bytes
    `encode_batch` gives for the same batch."""
    tail = b"\xc0" if data_parallel_rank is None else msgpack.packb(data_parallel_rank)
    return b"\x93\xcb" + struct.pack(">d", float(ts)) + msgpack_events + tail
