"""Handshake metadata of one rank's KV data plane, and the transfer descriptor it is read with.

Every rank publishes a `UcxHandshakeMetadata` (in its control-stream Hello); the scheduler hands
the prefill ranks' metadata to every decode rank, which creates UCX endpoints from the worker
addresses ahead of the first request. The wire form is a msgpack map wrapped in a versioned
envelope `{"v": HANDSHAKE_VERSION, "hash": compatibility_hash, "meta": <msgpack bytes>}`; as in
vLLM's NIXL payload the receiver checks the version and the compatibility hash *before* it
decodes the rest, so an incompatible peer is refused with a clear reason.

Layout contract (cross-area): the KV tensor of a rank has shape
`[num_blocks, num_kv_heads_local, num_layers, 2, block_size, head_dim]` ("NHL2BD"); block `b`
is the contiguous byte range `[b * block_nbytes, (b + 1) * block_nbytes)` of the region, local
head `h` of it the contiguous range `[b * block_nbytes + h * head_block_nbytes, ...)` (heads
outermost, so any head range of a block is one piece), and rank
`r` of a `tp_size` engine holds KV heads `[head_start, head_end)` = `connectors.head_map.rank_heads`
(`[r*H/T, (r+1)*H/T)`, or one replicated head when H < T). Every rank's metadata carries its
head range, so a reader of another TP size addresses exactly the heads it needs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

from connectors.head_map import partition_problem, rank_heads
from connectors.kv_layout import LAYOUT_PREFIX, VLLM_LAYOUTS

HANDSHAKE_VERSION = 1
KV_LAYOUT = "NHL2BD"
# Layouts a region may have: pdserve's own, or vLLM's KV registered in place ("vllm:LBHNC"...,
# `connectors/kv_layout.py`); a region in a vLLM layout is addressed by its owner only, so a
# reader needs just the name (both ends must have the same, which the compatibility hash checks).
KV_LAYOUTS = (KV_LAYOUT, *(LAYOUT_PREFIX + name for name in VLLM_LAYOUTS))
MEMORY_TYPES = ("cpu", "cuda")
KV_TRANSPORTS = ("ucx-tag", "nixl")
DEFAULT_KV_TRANSPORT = "ucx-tag"
# The largest metadata blob accepted from a peer (a worker address is a few hundred bytes).
MAX_METADATA_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class PeerKey:
    """One rank of one engine incarnation."""

    engine_id: str
    epoch: int
    tp_rank: int


@dataclass(frozen=True, slots=True)
class KVRegionLayout:
    """Shape of one rank's KV region, as a reader needs it to address blocks and heads."""

    num_blocks: int
    block_nbytes: int
    num_layers: int
    block_size: int
    head_dim: int
    num_kv_heads: int  # of the whole model
    head_start: int  # first KV head this rank holds
    head_end: int  # one past the last
    dtype: str
    layout: str = KV_LAYOUT
    memory_type: str = "cpu"  # where the region lives: cpu or cuda (a peer without it is cpu)

    @property
    def native(self) -> bool:
        """The region is pdserve's own engine's (its layout), not a vLLM engine's KV in place."""
        return self.layout == KV_LAYOUT

    @property
    def num_local_heads(self) -> int:
        return self.head_end - self.head_start

    @property
    def head_nbytes(self) -> int:
        """Bytes of one head's K (or V) for one layer and one block."""
        return self.block_nbytes // (self.num_layers * 2 * self.num_local_heads)

    @property
    def head_block_nbytes(self) -> int:
        """Bytes of one head's K and V for every layer of one block: one contiguous piece."""
        return self.block_nbytes // self.num_local_heads

    def validate(self) -> None:
        """Raises ValueError naming the first inconsistent field."""
        for name in ("num_blocks", "block_nbytes", "num_layers", "block_size", "head_dim", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"handshake: {name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.head_start < self.head_end <= self.num_kv_heads:
            raise ValueError(f"handshake: heads [{self.head_start}, {self.head_end}) not within "
                             f"[0, {self.num_kv_heads})")
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"handshake: unsupported KV layout {self.layout!r} (expected one of {KV_LAYOUTS})")
        if self.memory_type not in MEMORY_TYPES:
            raise ValueError(f"handshake: unknown KV memory type {self.memory_type!r} (expected one of {MEMORY_TYPES})")
        per_elem, rem = divmod(self.block_nbytes, self.num_layers * 2 * self.num_local_heads
                               * self.block_size * self.head_dim)
        if rem or per_elem not in (1, 2, 4, 8):
            raise ValueError(f"handshake: block_nbytes {self.block_nbytes} does not match the layout "
                             f"{self.num_local_heads}x{self.num_layers}x2x{self.block_size}x{self.head_dim}")


@dataclass(frozen=True, slots=True)
class UcxHandshakeMetadata:
    """What a peer needs to read this rank's KV: identity, worker address, region layout."""

    engine_id: str
    epoch: int
    tp_rank: int
    tp_size: int
    compatibility_hash: str
    worker_address: bytes
    region: KVRegionLayout
    protocol_version: int = HANDSHAKE_VERSION
    # How peers move this rank's blocks (`UcxConnectorConfig.kv_transport`); the worker address
    # is that transport's (an absent field reads as the tag transport of older builds).
    kv_transport: str = DEFAULT_KV_TRANSPORT
    # Whether this rank serves a request's blocks to one reader in several pulls (`chunk` pulls
    # and `release`, connectors/ucx/tag_transport.py); older builds read as False.
    chunked_pulls: bool = False
    # The most blocks one pull of this rank may read (its host staging pool); 0: no limit.
    max_pull_blocks: int = 0

    @property
    def key(self) -> PeerKey:
        return PeerKey(self.engine_id, self.epoch, self.tp_rank)

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        if not self.engine_id:
            raise ValueError("handshake: engine_id is empty")
        if not 0 <= self.epoch < 1 << 64:
            raise ValueError(f"handshake: epoch {self.epoch} is not a 64-bit unsigned id")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"handshake: tp_rank {self.tp_rank} not in [0, tp_size={self.tp_size})")
        if not self.worker_address:
            raise ValueError("handshake: worker_address is empty")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"handshake: unknown KV transport {self.kv_transport!r} (this build knows "
                             f"{', '.join(KV_TRANSPORTS)})")
        if self.max_pull_blocks < 0:
            raise ValueError(f"handshake: max_pull_blocks must be >= 0, got {self.max_pull_blocks}")
        self.region.validate()
        problem = partition_problem(self.region.num_kv_heads, self.tp_size)
        if problem is not None:
            raise ValueError(f"handshake: {problem}")
        start, end = rank_heads(self.tp_rank, self.tp_size, self.region.num_kv_heads)
        if (self.region.head_start, self.region.head_end) != (start, end):
            raise ValueError(f"handshake: rank {self.tp_rank}/{self.tp_size} must hold heads [{start}, {end})")

    def encode(self) -> bytes:
        """The versioned wire form (see the module docstring)."""
        body = asdict(self)
        inner = msgpack.packb(body, use_bin_type=True)
        return bytes(msgpack.packb({"v": HANDSHAKE_VERSION, "hash": self.compatibility_hash,
                                    "transport": self.kv_transport, "meta": inner}, use_bin_type=True))

    @classmethod
    def decode(cls, data: bytes, *, expected_hash: str | None = None,
               expected_transport: str | None = None) -> UcxHandshakeMetadata:
        """Parses and validates a peer's metadata.

        Raises ValueError (never another exception) on a wrong version, a KV transport other
        than `expected_transport` (checked before the hash, which covers it too, so the reason
        names it), a compatibility hash different from `expected_hash`, a malformed or
        oversized blob, or inconsistent fields.
        """
        if len(data) > MAX_METADATA_BYTES:
            raise ValueError(f"handshake: metadata of {len(data)} bytes exceeds {MAX_METADATA_BYTES}")
        try:
            outer = msgpack.unpackb(data, raw=False)
        except Exception as e:  # msgpack raises several unrelated types
            raise ValueError(f"handshake: metadata is not msgpack: {e}") from None
        if not isinstance(outer, dict) or outer.get("v") != HANDSHAKE_VERSION:
            version = outer.get("v") if isinstance(outer, dict) else None
            raise ValueError(f"handshake: unsupported metadata version {version!r} "
                             f"(this build speaks {HANDSHAKE_VERSION})")
        transport = outer.get("transport", DEFAULT_KV_TRANSPORT)
        if expected_transport is not None and transport != expected_transport:
            raise ValueError(f"handshake: peer moves KV with --kv-transport {transport}, this engine with "
                             f"{expected_transport}: both engines of a pair must use the same KV transport")
        if expected_hash is not None and outer.get("hash") != expected_hash:
            raise ValueError(f"handshake: compatibility hash {outer.get('hash')!r} differs from ours "
                             f"{expected_hash!r} (model, dtype, layers, heads, block size or layout differ)")
        try:
            body = msgpack.unpackb(outer["meta"], raw=False)
            meta = _from_dict(body)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"handshake: malformed metadata: {e}") from None
        if meta.compatibility_hash != outer.get("hash"):
            raise ValueError("handshake: envelope and body compatibility hashes differ")
        if meta.kv_transport != transport:
            raise ValueError("handshake: envelope and body KV transports differ")
        meta.validate()
        return meta


def _from_dict(body: Any) -> UcxHandshakeMetadata:
    if not isinstance(body, dict):
        raise TypeError("metadata body is not a map")
    region_fields = {f.name for f in fields(KVRegionLayout)}
    region_raw = body["region"]
    if not isinstance(region_raw, dict):
        raise TypeError("region is not a map")
    region = KVRegionLayout(**{k: v for k, v in region_raw.items() if k in region_fields})
    top = {f.name for f in fields(UcxHandshakeMetadata)} - {"region"}
    meta = UcxHandshakeMetadata(region=region, **{k: v for k, v in body.items() if k in top})
    _check_types(meta)
    return meta


def _check_types(meta: UcxHandshakeMetadata) -> None:
    expect: dict[str, type] = {"engine_id": str, "epoch": int, "tp_rank": int, "tp_size": int,
                               "compatibility_hash": str, "worker_address": bytes, "protocol_version": int,
                               "kv_transport": str, "chunked_pulls": bool, "max_pull_blocks": int}
    for name, typ in expect.items():
        if not isinstance(getattr(meta, name), typ):
            raise TypeError(f"{name} must be {typ.__name__}")
    for f in fields(KVRegionLayout):
        value = getattr(meta.region, f.name)
        if not isinstance(value, str if f.name in ("dtype", "layout", "memory_type") else int):
            raise TypeError(f"region.{f.name} has the wrong type")


@dataclass(frozen=True, slots=True)
class KVTransferDescriptor:
    """Where a request's prompt KV lives on the prefill engine (mirrors engine.proto's).

    `block_ids` are the prefill engine's block ids in prompt order; every rank of the prefill
    engine uses the same ids in its own region (heads differ per rank).
    """

    engine_id: str
    epoch: int
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    tp_size: int
    block_size: int
    num_kv_heads: int
    lease_expires_unix_ms: int = 0
