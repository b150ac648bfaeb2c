"""vLLM's KV-event wire format (msgpack), byte for byte (reference spec §1.3).

Encoding (what `msgspec.msgpack.Encoder()` writes for vLLM's structs):

- The batch is the array `[ts, events, data_parallel_rank]`; `ts` is always float64, the rank
  nil when None.
- Map mode (vLLM since the switch away from `array_like` events, the default here): each event
  is a map whose first key is `"type"` (the class name), then its fields in declaration order;
  required fields are always present, nil included (`parent_block_hash`, `lora_id`, `medium`,
  `lora_name`; `medium` of `BlockRemoved`); fields that default to None are omitted when None.
- Legacy array mode (`legacy=True`, vLLM up to about v0.25): each event is
  `[ClassName, every field ...]` with trailing nils: 12 elements for `BlockStored`, 4 for
  `BlockRemoved`, 1 for `AllBlocksCleared`. `locality` is not sent (it postdates array mode).
- Integer hashes are sent as msgpack unsigned ints (`0xcf` from 2**63), byte hashes as `bin`.
- pdserve's `AllBlocksCleared.medium` goes out as a `"medium"` key in map mode only when set
  (vLLM decoders ignore unknown keys); legacy mode cannot carry it.

Decoding is tolerant: an outer array of length 2 or more (extra elements ignored) or an outer
map; per event an array (legacy, any length: missing trailing fields are None) or a map (unknown
keys ignored, missing optional keys None); unknown tags are skipped; hashes as uint64 or bin.
Malformed input raises `WireFormatError` (a ValueError).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgpack

from connectors.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    KVEventBatch,
)

logger = logging.getLogger(__name__)

_U64 = 1 << 64

# Declaration (= wire) order. `required` fields are sent even when None in map mode.
_STORED_REQUIRED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name")
_STORED_OPTIONAL = ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                    "locality")
_STORED_LEGACY = _STORED_REQUIRED + _STORED_OPTIONAL[:4]
_REMOVED_REQUIRED = ("block_hashes", "medium")
_REMOVED_OPTIONAL = ("group_idx", "locality")
_REMOVED_LEGACY = _REMOVED_REQUIRED + _REMOVED_OPTIONAL[:1]


class WireFormatError(ValueError):
    """The bytes are not a KV-event batch in vLLM's wire format."""


# -- encoding ---------------------------------------------------------------------------------

def _hash_out(h: ExternalBlockHash) -> ExternalBlockHash:
    if isinstance(h, bytes):
        return h
    if isinstance(h, int) and not isinstance(h, bool) and 0 <= h < _U64:
        return h
    raise ValueError(f"block hash must be an int in [0, 2**64) or bytes, got {h!r}")


def _hashes_out(hashes: tuple[ExternalBlockHash, ...]) -> list[ExternalBlockHash]:
    return [_hash_out(h) for h in hashes]


def _stored_values(e: BlockStored) -> dict[str, Any]:
    return {
        "block_hashes": _hashes_out(e.block_hashes),
        "parent_block_hash": None if e.parent_block_hash is None else _hash_out(e.parent_block_hash),
        "token_ids": list(e.token_ids),
        "block_size": e.block_size,
        "lora_id": e.lora_id,
        "medium": e.medium,
        "lora_name": e.lora_name,
        "extra_keys": None if e.extra_keys is None else list(e.extra_keys),
        "group_idx": e.group_idx,
        "kv_cache_spec_kind": e.kv_cache_spec_kind,
        "kv_cache_spec_sliding_window": e.kv_cache_spec_sliding_window,
        "locality": e.locality,
    }


def _removed_values(e: BlockRemoved) -> dict[str, Any]:
    return {"block_hashes": _hashes_out(e.block_hashes), "medium": e.medium,
            "group_idx": e.group_idx, "locality": e.locality}


def _as_map(tag: str, values: dict[str, Any], required: tuple[str, ...],
            optional: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": tag}
    for name in required:
        out[name] = values[name]
    for name in optional:
        if values[name] is not None:
            out[name] = values[name]
    return out


def _int_hashes(hashes: tuple[ExternalBlockHash, ...]) -> bool:
    """Whether every hash is a plain int in [0, 2**64) (the common case, checked in bulk)."""
    if len(hashes) == 1:
        h = hashes[0]
        return type(h) is int and 0 <= h < _U64
    return all(type(h) is int and 0 <= h < _U64 for h in hashes)


# Map-mode BlockStored whose optional fields are all None: a copy of a template per
# (block_size, lora_id, medium, lora_name) with the per-event values put in (a dict copy keeps
# the key order), cheaper than building the map key by key; bounded (cleared when full).
_STORED_TEMPLATES: dict[tuple[Any, ...], dict[str, Any]] = {}
_MAX_TEMPLATES = 256


def _stored_map_fast(e: BlockStored) -> dict[str, Any]:
    """`_as_map` of a BlockStored without the intermediate dicts: same keys, same order."""
    if (e.extra_keys is None and e.group_idx is None and e.kv_cache_spec_kind is None
            and e.kv_cache_spec_sliding_window is None and e.locality is None):
        shape = (e.block_size, e.lora_id, e.medium, e.lora_name)
        template = _STORED_TEMPLATES.get(shape)
        if template is None:
            if len(_STORED_TEMPLATES) >= _MAX_TEMPLATES:
                _STORED_TEMPLATES.clear()
            template = _STORED_TEMPLATES[shape] = {
                "type": "BlockStored", "block_hashes": None, "parent_block_hash": None, "token_ids": None,
                "block_size": e.block_size, "lora_id": e.lora_id, "medium": e.medium, "lora_name": e.lora_name}
        hashes = e.block_hashes
        copied = template.copy()
        copied["block_hashes"] = list(hashes) if _int_hashes(hashes) else _hashes_out(hashes)
        if e.parent_block_hash is not None:
            copied["parent_block_hash"] = _hash_out(e.parent_block_hash)
        copied["token_ids"] = list(e.token_ids)
        return copied
    parent = e.parent_block_hash
    out: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(e.block_hashes) if _int_hashes(e.block_hashes) else _hashes_out(e.block_hashes),
        "parent_block_hash": None if parent is None else _hash_out(parent),
        "token_ids": list(e.token_ids),
        "block_size": e.block_size,
        "lora_id": e.lora_id,
        "medium": e.medium,
        "lora_name": e.lora_name,
    }
    if e.extra_keys is not None:
        out["extra_keys"] = list(e.extra_keys)
    if e.group_idx is not None:
        out["group_idx"] = e.group_idx
    if e.kv_cache_spec_kind is not None:
        out["kv_cache_spec_kind"] = e.kv_cache_spec_kind
    if e.kv_cache_spec_sliding_window is not None:
        out["kv_cache_spec_sliding_window"] = e.kv_cache_spec_sliding_window
    if e.locality is not None:
        out["locality"] = e.locality
    return out


def _event_out(event: KVCacheEvent, legacy: bool) -> Any:
    if type(event) is BlockStored and not legacy:
        return _stored_map_fast(event)
    if isinstance(event, BlockStored):
        values = _stored_values(event)
        if legacy:
            return ["BlockStored", *(values[n] for n in _STORED_LEGACY)]
        return _as_map("BlockStored", values, _STORED_REQUIRED, _STORED_OPTIONAL)
    if isinstance(event, BlockRemoved):
        values = _removed_values(event)
        if legacy:
            return ["BlockRemoved", *(values[n] for n in _REMOVED_LEGACY)]
        return _as_map("BlockRemoved", values, _REMOVED_REQUIRED, _REMOVED_OPTIONAL)
    if isinstance(event, AllBlocksCleared):
        if legacy:
            return ["AllBlocksCleared"]
        return _as_map("AllBlocksCleared", {"medium": event.medium}, (), ("medium",))
    raise ValueError(f"not a KV cache event: {type(event).__name__}")


def encode_batch(batch: KVEventBatch, *, legacy: bool = False) -> bytes:
    """vLLM's msgpack bytes for `batch`: events as maps, or as arrays when `legacy`.

    Raises ValueError for a hash outside [0, 2**64) or a non-event, before writing anything.
    """
    events = [_event_out(e, legacy) for e in batch.events]
    return msgpack.packb([float(batch.ts), events, batch.data_parallel_rank], use_bin_type=True)


# -- decoding ---------------------------------------------------------------------------------

def _hash_in(value: Any) -> ExternalBlockHash:
    if isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _U64):
        return value
    raise WireFormatError(f"block hash must be uint64 or bin, got {type(value).__name__}")


def _hashes_in(value: Any) -> tuple[ExternalBlockHash, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise WireFormatError(f"block_hashes must be an array, got {type(value).__name__}")
    return tuple(_hash_in(v) for v in value)


def _frozen(value: Any) -> Any:
    """msgpack arrays inside extra keys become tuples (events are hashable values)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _opt_int(value: Any, name: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise WireFormatError(f"{name} must be an int or nil, got {type(value).__name__}")


def _opt_str(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise WireFormatError(f"{name} must be a str or nil, got {type(value).__name__}")


def _stored_in(f: dict[str, Any]) -> BlockStored:
    token_ids = f.get("token_ids") or []
    if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
        raise WireFormatError("token_ids must be an array of ints")
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise WireFormatError("extra_keys must be an array or nil")
    parent = f.get("parent_block_hash")
    return BlockStored(
        block_hashes=_hashes_in(f.get("block_hashes")),
        parent_block_hash=None if parent is None else _hash_in(parent),
        token_ids=tuple(token_ids),
        block_size=_opt_int(f.get("block_size"), "block_size") or 0,
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=None if extra is None else tuple(_frozen(k) for k in extra),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(f.get("kv_cache_spec_sliding_window"),
                                              "kv_cache_spec_sliding_window"),
        locality=_opt_str(f.get("locality"), "locality"),
    )


def _removed_in(f: dict[str, Any]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes_in(f.get("block_hashes")),
        medium=_opt_str(f.get("medium"), "medium"),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        locality=_opt_str(f.get("locality"), "locality"),
    )


def _cleared_in(f: dict[str, Any]) -> AllBlocksCleared:
    return AllBlocksCleared(medium=_opt_str(f.get("medium"), "medium"))


_DECODERS: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], KVCacheEvent]]] = {
    "BlockStored": (_STORED_LEGACY, _stored_in),
    "BlockRemoved": (_REMOVED_LEGACY, _removed_in),
    "AllBlocksCleared": ((), _cleared_in),
}


def _event_in(raw: Any) -> KVCacheEvent | None:
    if isinstance(raw, list):
        if not raw:
            raise WireFormatError("empty event array")
        tag, fields = raw[0], None
        decoder = _DECODERS.get(tag) if isinstance(tag, str) else None
        if decoder is not None:
            fields = dict(zip(decoder[0], raw[1:], strict=False))
    elif isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
        decoder = _DECODERS.get(tag) if isinstance(tag, str) else None
    else:
        raise WireFormatError(f"event must be an array or a map, got {type(raw).__name__}")
    if decoder is None or fields is None:
        logger.debug("skipping KV event with unknown tag %r", tag)
        return None
    return decoder[1](fields)


def decode_batch(data: bytes) -> KVEventBatch:
    """Parses one vLLM KV-event batch (any version, see the module docstring)."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for bad bytes
        raise WireFormatError(f"not a msgpack document: {e}") from e
    if isinstance(raw, list):
        if len(raw) < 2:
            raise WireFormatError(f"batch array needs at least [ts, events], got {len(raw)} elements")
        ts, events, dp_rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, dp_rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise WireFormatError(f"batch must be an array or a map, got {type(raw).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise WireFormatError(f"ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise WireFormatError(f"events must be an array, got {type(events).__name__}")
    decoded = [e for e in (_event_in(r) for r in events) if e is not None]
    return KVEventBatch(ts=float(ts), events=decoded,
                        data_parallel_rank=_opt_int(dp_rank, "data_parallel_rank"))
