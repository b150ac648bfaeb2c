"""KV-cache event types, as in vLLM's `vllm/distributed/kv_events.py`, plus protobuf conversion.

Field order is vLLM's declaration (and wire) order. Hashes are 64-bit ints (the external form
from `connectors.hashing.to_external`); the wire codec also accepts vLLM's raw-bytes form.
`kv_cache_spec_kind`, `kv_cache_spec_sliding_window` and `locality` exist so that events decoded
from a vLLM stream survive a wire round trip; pdserve's producers leave them None and the
protobuf form does not carry them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_CPU_OFFLOAD = "CPU_OFFLOAD"
MEDIUM_DISK = "STORAGE"

ExternalBlockHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[ExternalBlockHash, ...]
    parent_block_hash: ExternalBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


# BlockStored's slot setters in field order: `_new_stored` fills an instance through them,
# which equals calling the class (same fields, equality and hash) at a third of the cost of
# the frozen dataclass's `__init__` (one `object.__setattr__` lookup per field); decoding
# builds one per event, on the scheduler's hot path.
_STORED_SETTERS = tuple(BlockStored.__dict__[name].__set__ for name in BlockStored.__dataclass_fields__)


def _new_stored(*values: Any) -> BlockStored:
    """`BlockStored(*values)`, every field given positionally."""
    event = object.__new__(BlockStored)
    for setter, value in zip(_STORED_SETTERS, values, strict=True):
        setter(event, value)
    return event


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[ExternalBlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """vLLM's AllBlocksCleared has no fields; `medium` is a pdserve addition (None = every
    medium), sent on the wire only in map mode, as a key that vLLM decoders ignore."""

    medium: str | None = None


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def _hash_int(h: ExternalBlockHash) -> int:
    return h if isinstance(h, int) else int.from_bytes(h[-8:], "big")


def event_to_proto(event: KVCacheEvent) -> Any:
    """Converts one event into a `pdserve.v1.KVEvent` message."""
    from pdserve.v1 import kv_events_pb2 as pb

    if isinstance(event, BlockStored):
        msg = pb.BlockStored(
            block_hashes=[_hash_int(h) for h in event.block_hashes],
            token_ids=list(event.token_ids),
            block_size=event.block_size,
        )
        if event.parent_block_hash is not None:
            msg.parent_block_hash = _hash_int(event.parent_block_hash)
        if event.lora_id is not None:
            msg.lora_id = event.lora_id
        if event.medium is not None:
            msg.medium = event.medium
        if event.lora_name is not None:
            msg.lora_name = event.lora_name
        if event.extra_keys is not None:
            msg.extra_keys = msgpack.packb([list(k) if k is not None else None for k in event.extra_keys])
        if event.group_idx is not None:
            msg.group_idx = event.group_idx
        return pb.KVEvent(block_stored=msg)
    if isinstance(event, BlockRemoved):
        removed = pb.BlockRemoved(block_hashes=[_hash_int(h) for h in event.block_hashes])
        if event.medium is not None:
            removed.medium = event.medium
        if event.group_idx is not None:
            removed.group_idx = event.group_idx
        return pb.KVEvent(block_removed=removed)
    cleared = pb.AllBlocksCleared()
    if event.medium is not None:
        cleared.medium = event.medium
    return pb.KVEvent(all_blocks_cleared=cleared)


def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def event_from_proto(msg: Any) -> KVCacheEvent:
    """Converts a `pdserve.v1.KVEvent` message back; raises ValueError when it is empty."""
    kind = msg.WhichOneof("event")
    if kind == "block_stored":
        s = msg.block_stored
        extra = None
        if s.HasField("extra_keys"):
            extra = tuple(tuple(k) if k is not None else None for k in msgpack.unpackb(s.extra_keys))
        has = s.HasField
        return _new_stored(
            tuple(s.block_hashes),
            s.parent_block_hash if has("parent_block_hash") else None,
            tuple(s.token_ids),
            s.block_size,
            s.lora_id if has("lora_id") else None,
            s.medium if has("medium") else None,
            s.lora_name if has("lora_name") else None,
            extra,
            s.group_idx if has("group_idx") else None,
            None, None, None)  # kv_cache_spec_kind, kv_cache_spec_sliding_window, locality
    if kind == "block_removed":
        r = msg.block_removed
        return BlockRemoved(tuple(r.block_hashes), _opt(r, "medium"), _opt(r, "group_idx"))
    if kind == "all_blocks_cleared":
        return AllBlocksCleared(_opt(msg.all_blocks_cleared, "medium"))
    raise ValueError("KVEvent has no event set")
