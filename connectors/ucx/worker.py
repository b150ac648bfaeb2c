"""`UcxWorkerConnector`: the worker side of the `ucx` KV connector (one per rank process).

Decode ranks pull a request's prompt KV from the prefill ranks holding their KV heads (the
same rank under equal TP; under different TP sizes one or several ranks, each read for a head
range straight into the decode rank's blocks, see `connectors.head_map`); prefill ranks serve
pulls of the blocks they pinned for it. The service drives it explicitly:

- every rank: construct with its identity and `kv_cache` tensor, publish
  `get_handshake_metadata()` in Hello, drain `get_transfer_results()` regularly (it also renews
  leases and expires stale ones), `shutdown()` at exit;
- decode rank: `add_peer(metadata)` / `remove_peer(engine_id, epoch)` from Welcome and
  PeerUpdate (endpoints exist before the first request), `start_pull(request_id, descriptor,
  local_block_ids)`, `cancel(request_id)`;
- prefill rank: `expect_send(request_id, block_ids)` BEFORE the descriptor leaves the engine,
  `cancel(request_id)` on abort.

Contracts:
- Every pull ends exactly once: in `finished_recving`, or in `failed_recving` with the local
  block ids that did not receive all their bytes (from every prefill rank read) in
  `get_block_ids_with_load_errors()`, within
  `transfer_timeout_s` of its dispatch (plus one drain; time the transport's progress thread
  could not run is not counted: `UcxTagTransport._credit_stall`); never a hang. A stale epoch, an
  unknown peer or blocks out of the peer's range fail at once without a byte moved.
- A prefill rank reports `finished_sending` once every expected reader said it is done (success
  or failure) and every send of the request completed, or when the lease ran out with no send
  in flight. A reader's read is one pull, or with host staging a chunked read: several pulls
  of at most half the smaller pool (ours or the writer's `max_pull_blocks`), ended by a
  `release` (connectors/ucx/tag_transport.py), so a pull larger than either pool is moved
  through it in rounds. Pulls of blocks not pinned for the request, of a dead epoch, or after the lease
  are refused without touching memory.
- Thread-safe: every public method may be called from any thread; UCX runs on the transport's
  own progress thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from connectors.base import KVConnectorMetadata, WorkerConnector
from connectors.head_map import HeadRead, mapping_problem, rank_heads, read_plan
from connectors.kv_events import KVCacheEvent
from connectors.kv_layout import LAYOUT_PREFIX, KVRegion
from connectors.outputs import KVConnectorStats, TransferResults
from connectors.ucx.ep_info import UNKNOWN, TransportExpectation
from connectors.ucx.handshake import (
    DEFAULT_KV_TRANSPORT,
    KV_LAYOUT,
    KV_TRANSPORTS,
    KVRegionLayout,
    KVTransferDescriptor,
    PeerKey,
    UcxHandshakeMetadata,
)
from connectors.ucx.transport import (
    BlockAddressing,
    HeadGeometry,
    KVTransport,
    PullOp,
    PullRequest,
    PullResult,
    Segment,
    coalesce,
    split_segments,
)

logger = logging.getLogger(__name__)


# CMA rendezvous makes the reader process_vm_readv() the writer's memory, and with endpoint
# error handling off (needed for shared memory at all) UCX aborts the reading process when the
# writer dies mid-read. Copy-in/copy-out through SysV shared memory is as fast on one host (two
# cores pipeline the copies) and a dead peer only stalls it, which our timeouts handle.
DEFAULT_UCX_TLS = "^cma"
_EXPECT_PULL_S = 0.02


@dataclass(slots=True)
class UcxConnectorConfig:
    """Data-plane settings (EngineConfig carries the same names).

    `ucx_tls` empty means UCX_TLS from the environment if set, else `DEFAULT_UCX_TLS`.
    `kv_staging` "host" moves KV through a bounded pool of host block slots (pinned for GPU KV,
    connectors/ucx/host_staging.py) instead of the KV tensor itself; "none" registers the
    tensor itself. `kv_staging_blocks`: the pool's slots (0: the transfer window,
    `max_inflight_transfers` x 16 blocks, at most the cache).
    `kv_transport` "ucx-tag" (`UcxTagTransport`: the writer sends tagged messages) or "nixl"
    (`NixlTransport`: the reader posts one NIXL READ per pull; needs nixl-cu12).
    `expected_transports` (e.g. "rdma"): a pull over a slower UCX transport is a fallback,
    counted and logged once per peer pair (connectors/ucx/ep_info.py); empty expects nothing.
    """

    transfer_timeout_s: float = 5.0
    lease_s: float = 30.0
    max_inflight_transfers: int = 64
    ucx_tls: str = ""
    ucx_net_devices: str = ""
    kv_staging: str = "none"
    kv_staging_blocks: int = 0
    kv_transport: str = DEFAULT_KV_TRANSPORT
    expected_transports: str = ""

    def validate(self) -> None:
        if self.transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s: must be > 0")
        if self.lease_s <= 0:
            raise ValueError("lease_s: must be > 0")
        if self.max_inflight_transfers < 1:
            raise ValueError("max_inflight_transfers: must be >= 1")
        if self.kv_staging not in ("none", "host"):
            raise ValueError(f"kv_staging: must be none or host, got {self.kv_staging!r}")
        if self.kv_staging_blocks < 0:
            raise ValueError(f"kv_staging_blocks: must be >= 0 (0: the transfer window), got {self.kv_staging_blocks}")
        if self.kv_staging == "host" and self.kv_transport == "nixl":
            raise ValueError("kv_staging host moves KV through a pool the writer fills per request, which a NIXL "
                             "READ (addressed by the writer's KV blocks) cannot see: use --kv-transport ucx-tag")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport: must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}")
        TransportExpectation.parse(self.expected_transports)

    def ucx_options(self) -> dict[str, str]:
        """UCX context options (UCX_ names without the prefix)."""
        options = {}
        if self.ucx_tls:
            options["TLS"] = self.ucx_tls
        elif "UCX_TLS" not in os.environ:
            options["TLS"] = DEFAULT_UCX_TLS
        if self.ucx_net_devices:
            options["NET_DEVICES"] = self.ucx_net_devices
        return options


@dataclass(slots=True)
class _Results:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass(slots=True)
class PairTransferStats:
    """Pulls from one prefill engine (src) to one decode engine (dst) in one interval."""

    src_engine_id: str
    dst_engine_id: str
    num_bytes: int = 0
    num_blocks: int = 0
    num_operations: int = 0
    durations: list[float] = field(default_factory=list)  # seconds of each successful pull
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    # num_bytes by the UCX transport that carried them ("unknown" where it could not be read)
    bytes_by_transport: dict[str, int] = field(default_factory=dict)
    # (expected, actual) transports -> pulls that fell back to a slower one than expected
    fallbacks: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return float(sum(self.durations))

    @property
    def num_failures(self) -> int:
        return sum(self.failures_by_reason.values())

    def record_failure(self, reason: str) -> None:
        key = reason if reason.startswith("refused:") else reason.split(":", 1)[0]
        self.failures_by_reason[key] = self.failures_by_reason.get(key, 0) + 1

    def merge(self, other: PairTransferStats) -> None:
        self.num_bytes += other.num_bytes
        self.num_blocks += other.num_blocks
        self.num_operations += other.num_operations
        self.durations.extend(other.durations)
        for reason, n in other.failures_by_reason.items():
            self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + n
        for transport, n in other.bytes_by_transport.items():
            self.bytes_by_transport[transport] = self.bytes_by_transport.get(transport, 0) + n
        for pair, n in other.fallbacks.items():
            self.fallbacks[pair] = self.fallbacks.get(pair, 0) + n


@dataclass(slots=True)
class UcxTransferStats(KVConnectorStats):
    """`KVConnectorStats` plus the per prefill→decode pair breakdown the metrics need.

    Series in `data`: `transfer_duration` (s), `bytes_transferred`, `num_failed_transfers`
    (1 each), `num_kv_expired_reqs` (1 each), as in vLLM's NIXL stats.
    """

    pairs: dict[tuple[str, str], PairTransferStats] = field(default_factory=dict)
    lease_expiries: int = 0

    def pair(self, src: str, dst: str) -> PairTransferStats:
        stats = self.pairs.get((src, dst))
        if stats is None:
            stats = self.pairs[(src, dst)] = PairTransferStats(src, dst)
        return stats

    def is_empty(self) -> bool:
        return not self.pairs and not self.lease_expiries and not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        KVConnectorStats.aggregate(self, other)
        assert isinstance(other, UcxTransferStats)
        for key, pair in other.pairs.items():
            self.pair(*key).merge(pair)
        self.lease_expiries += other.lease_expiries
        return self

    def clone_and_reset(self) -> KVConnectorStats:
        snapshot = UcxTransferStats(data=self.data, pairs=self.pairs, lease_expiries=self.lease_expiries)
        self.data, self.pairs, self.lease_expiries = {}, {}, 0
        return snapshot


@dataclass(slots=True)
class _Recv:
    """One request's pull: one `PullOp` per prefill rank read (one under equal TP)."""

    request_id: str
    engine_id: str  # the prefill engine
    local_block_ids: tuple[int, ...]
    ops: tuple[PullOp, ...] = ()
    open: set[int] = field(default_factory=set)  # xfer ids not ended yet
    # xfer id -> the local blocks a failed op fully delivered (None: it succeeded: all of its
    # blocks); an op absent never delivered (not ended yet, or dropped before it was sent)
    delivered: dict[int, set[int] | None] = field(default_factory=dict)
    reason: str | None = None  # the first failure
    num_bytes: int = 0
    seconds: float = 0.0
    bytes_by_transport: dict[str, int] = field(default_factory=dict)
    copying: list[Any] = field(default_factory=list)  # host staging: copies into the KV tensor under way


class ReadyFence(Protocol):
    """Completion of the compute that wrote a prefill's blocks (a CUDA event on the engine's
    stream: `connectors/vllm/kv_region.py`); `wait()` returns once it is done."""

    def wait(self) -> None: ...


@dataclass(slots=True)
class _Lease:
    block_ids: frozenset[int]
    expires_at: float
    readers_left: int
    active: int = 0
    ready: ReadyFence | None = None  # waited on before the first byte is served
    slots: dict[int, int] | None = None  # host staging: block id -> its slot in the pool (None: staged per pull)
    staged: Any = None  # host staging: the Future of the copy into the slots
    released: set[PeerKey] = field(default_factory=set)  # readers that ended a chunked read


class UcxWorkerConnector(WorkerConnector):
    """Worker-side `ucx` connector; see the module docstring for the contract."""

    def __init__(self, *, engine_id: str, epoch: int, tp_rank: int, tp_size: int, num_kv_heads: int,
                 compatibility_hash: str, kv_cache: Any = None, config: UcxConnectorConfig | None = None) -> None:
        self.config = config or UcxConnectorConfig()
        self.config.validate()
        problem = mapping_problem(tp_size, tp_size, num_kv_heads)
        if problem is not None:
            raise ValueError(problem)
        self.key = PeerKey(engine_id, epoch, tp_rank)
        self.tp_size = tp_size
        self.num_kv_heads = num_kv_heads
        self.compatibility_hash = compatibility_hash
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._transport: KVTransport | None = None
        self._metadata: UcxHandshakeMetadata | None = None
        self._peers: dict[PeerKey, UcxHandshakeMetadata] = {}
        self._xfer_ids = itertools.count(1)
        self._recvs: dict[str, _Recv] = {}
        self._by_xfer: dict[int, str] = {}
        self._queued: list[tuple[str, PullOp]] = []
        self._inflight = 0
        self._leases: dict[str, _Lease] = {}
        self._results = _Results()
        self._load_errors: set[int] = set()
        self._failure_reasons: dict[str, str] = {}
        self._stats = UcxTransferStats()
        self._last_renew = time.monotonic()
        self._staging: Any = None  # HostStaging when config.kv_staging == "host"
        self._op_slots: dict[int, tuple[Any, tuple[int, ...]]] = {}  # staging: xfer id -> (slot run, KV ids)
        # Writer, host staging of a lease staged per pull: pulls waiting for a run of slots
        # (FIFO), and the copies into the runs of pulls being served, by (reader, xfer id).
        self._serve_waiting: dict[tuple[PeerKey, int], tuple[PullRequest, Any]] = {}
        self._serve_copies: dict[tuple[PeerKey, int], Any] = {}
        self._expected = TransportExpectation.parse(self.config.expected_transports)
        self._peer_transports: dict[PeerKey, str] = {}  # the transport of the last pull from each writer
        self._warned_fallbacks: set[PeerKey] = set()
        if kv_cache is not None:
            self.register_kv_caches(kv_cache, None)

    # -- registration and handshake ------------------------------------------------------------

    def register_kv_caches(self, kv_cache: Any, spec: Any = None, *, transport: KVTransport | None = None) -> None:
        """Registers the rank's KV tensor (or a one-entry {name: tensor} dict) and starts UCX.

        The tensor must be contiguous with shape [num_blocks, heads_local, num_layers, 2,
        block_size, head_dim] (NHL2BD), on the CPU or on a GPU; everything the handshake needs is read
        from it (`spec` is accepted for the base API and not needed). A `KVRegion` (vLLM's own
        KV allocation and its layout, `connectors/kv_layout.py`) is registered as it is, in place. A GPU tensor is
        registered with UCX's CUDA transports (start-up fails naming what is missing), or with
        `kv_staging="host"` mirrored in pinned host memory. `transport` overrides the UCX tag
        transport (e.g. an RMA backend).
        """
        if self._transport is not None:
            raise RuntimeError("KV caches are already registered")
        tensor = kv_cache if isinstance(kv_cache, KVRegion) else _single_tensor(kv_cache)
        if not isinstance(tensor, KVRegion) and not hasattr(tensor, "is_contiguous") and self.config.kv_staging != "host":
            raise ValueError("a KV block source (not a tensor) is registered through host staging only")
        region, layout = self._describe_in_place(tensor) if isinstance(tensor, KVRegion) else self._describe(tensor)
        if self.config.kv_staging == "host" and not isinstance(tensor, KVRegion):
            from connectors.ucx.host_staging import HostStaging, default_pool_blocks

            num_slots = self.config.kv_staging_blocks or default_pool_blocks(layout.num_blocks,
                                                                             self.config.max_inflight_transfers)
            self._staging = HostStaging(tensor, min(num_slots, layout.num_blocks))
            region = _host_region(self._staging.slots)  # UCX sees the pool, the handshake the cache
        if transport is None:
            transport = self._make_transport(region, layout, tensor.layout if isinstance(tensor, KVRegion) else None)
        self._metadata = UcxHandshakeMetadata(self.key.engine_id, self.key.epoch, self.key.tp_rank, self.tp_size,
                                              self.compatibility_hash, transport.worker_address, layout,
                                              kv_transport=self.config.kv_transport,
                                              chunked_pulls=self.config.kv_transport == "ucx-tag",
                                              max_pull_blocks=self._staging.pool.num_slots if self._staging else 0)
        self._metadata.validate()
        self._region = region
        self._tensor = tensor  # keeps the memory alive while UCX may touch it
        transport.start(self)
        self._transport = transport

    def registered_bytes(self) -> tuple[int, int]:
        """(bytes registered with UCX, bytes of them that are a staging mirror of the KV cache
        rather than the cache itself); (0, 0) before `register_kv_caches`."""
        if getattr(self, "_region", None) is None:
            return 0, 0
        registered = int(self._region.nbytes)
        mirror = registered if self._staging is not None else 0
        return registered, mirror

    def staging_slots(self) -> tuple[int, int, int] | None:
        """Host staging: (slots in use, slots in the pool, most in use at once); None without staging."""
        if self._staging is None:
            return None
        with self._lock:
            pool = self._staging.pool
            return pool.num_used, pool.num_slots, pool.peak_used

    def _make_transport(self, region: Any, layout: KVRegionLayout, addressing: BlockAddressing | None = None
                        ) -> KVTransport:
        """The configured transport (`kv_transport`); NixlUnavailable when nixl is asked for and
        not installed. `addressing`: a region in another layout than NHL2BD (tag transport only)."""
        geometry = HeadGeometry(layout.num_local_heads, layout.head_block_nbytes)
        name = f"{self.config.kv_transport}-{self.key.engine_id}-{self.key.tp_rank}"
        if self.config.kv_transport == "nixl":
            if addressing is not None:
                raise ValueError(f"--kv-transport nixl moves NHL2BD regions only, this one is {layout.layout}; "
                                 "use ucx-tag")
            from connectors.ucx.nixl_transport import NixlTransport

            return NixlTransport(region, layout.block_nbytes, self.key, ucx_config=self.config.ucx_options(),
                                 serve_timeout_s=self.config.lease_s, name=name, geometry=geometry)
        from connectors.ucx.tag_transport import UcxTagTransport

        return UcxTagTransport(region, layout.block_nbytes, self.key, ucx_config=self.config.ucx_options(),
                               serve_timeout_s=self.config.lease_s, name=name, geometry=geometry,
                               addressing=addressing, num_blocks=layout.num_blocks if self._staging else None)

    def _describe_in_place(self, kv: KVRegion) -> tuple[Any, KVRegionLayout]:
        """A `KVRegion`: its whole allocation is the region UCX moves (zero copy) and its
        layout's name goes to the handshake ("vllm:LBHNC"...)."""
        if kv.memory.dim() != 1 or kv.memory.element_size() != 1 or kv.memory_type not in ("cpu", "cuda"):
            raise ValueError("KVRegion.memory must be a flat uint8 CPU or CUDA tensor")
        kv.layout.validate(kv.nbytes)
        head_start, head_end = rank_heads(self.key.tp_rank, self.tp_size, self.num_kv_heads)
        if kv.layout.num_local_heads != head_end - head_start:
            raise ValueError(f"the KV region holds {kv.layout.num_local_heads} heads, rank {self.key.tp_rank}/"
                             f"{self.tp_size} of {self.num_kv_heads} KV heads holds {head_end - head_start}")
        region = kv.memory.detach() if kv.memory_type == "cuda" else kv.memory.numpy()
        layout = KVRegionLayout(num_blocks=kv.layout.num_blocks, block_nbytes=kv.layout.block_nbytes,
                                num_layers=kv.layout.num_layers, block_size=kv.block_size, head_dim=kv.head_dim,
                                num_kv_heads=self.num_kv_heads, head_start=head_start, head_end=head_end,
                                dtype=kv.dtype, layout=LAYOUT_PREFIX + kv.layout.name, memory_type=kv.memory_type)
        return region, layout

    def _describe(self, tensor: Any) -> tuple[Any, KVRegionLayout]:
        """The region UCX moves (a flat uint8 view: numpy for host memory, the CUDA tensor
        itself for GPU memory; None for a staged block source, whose pool is the region) and
        its layout for the handshake."""
        source = not hasattr(tensor, "is_contiguous")  # a host_staging.BlockSource
        if len(tensor.shape) != 6 or not (source or tensor.is_contiguous()) or tensor.device.type not in ("cpu", "cuda"):
            raise ValueError("kv_cache must be a contiguous CPU or CUDA tensor [blocks, heads, layers, 2, block_size, "
                             f"head_dim], got shape {tuple(tensor.shape)} on {tensor.device}")
        num_blocks, heads, num_layers, two, block_size, head_dim = (int(d) for d in tensor.shape)
        head_start, head_end = rank_heads(self.key.tp_rank, self.tp_size, self.num_kv_heads)
        per_rank = head_end - head_start
        if two != 2 or heads != per_rank:
            raise ValueError(f"kv_cache dims 1 and 3 must be {per_rank} (heads of this rank) and 2, got {heads}, {two}")
        region = None if source else _cuda_region(tensor) if tensor.device.type == "cuda" else _host_region(tensor)
        nbytes = num_blocks * heads * num_layers * two * block_size * head_dim * _element_size(tensor.dtype)
        layout = KVRegionLayout(num_blocks=num_blocks, block_nbytes=nbytes // num_blocks, num_layers=num_layers,
                                block_size=block_size, head_dim=head_dim, num_kv_heads=self.num_kv_heads,
                                head_start=head_start, head_end=head_end,
                                dtype=str(tensor.dtype).removeprefix("torch."), layout=KV_LAYOUT,
                                memory_type=tensor.device.type)
        return region, layout

    def get_handshake_metadata(self) -> bytes:
        """This rank's encoded `UcxHandshakeMetadata` (for Hello)."""
        if self._metadata is None:
            raise RuntimeError("register_kv_caches() first")
        return self._metadata.encode()

    @property
    def handshake_metadata(self) -> UcxHandshakeMetadata:
        if self._metadata is None:
            raise RuntimeError("register_kv_caches() first")
        return self._metadata

    def add_peer(self, metadata: bytes | UcxHandshakeMetadata) -> PeerKey:
        """Registers a prefill rank and connects to it; a new epoch of a known engine replaces
        the old one (its pulls fail with peer_gone). Raises ValueError, changing nothing, on
        malformed or incompatible metadata."""
        meta = (metadata if isinstance(metadata, UcxHandshakeMetadata)
                else UcxHandshakeMetadata.decode(metadata, expected_hash=self.compatibility_hash,
                                                 expected_transport=self.config.kv_transport))
        if meta.kv_transport != self.config.kv_transport:
            raise ValueError(f"peer {meta.engine_id}: moves KV with --kv-transport {meta.kv_transport}, this engine "
                             f"with {self.config.kv_transport}: both engines of a pair must use the same KV transport")
        if meta.compatibility_hash != self.compatibility_hash:
            raise ValueError(f"peer {meta.engine_id}: compatibility hash differs from ours")
        meta.validate()
        mine = self.handshake_metadata.region
        if (meta.region.num_layers, meta.region.dtype, meta.region.block_size, meta.region.head_dim,
                meta.region.layout) != (mine.num_layers, mine.dtype, mine.block_size, mine.head_dim, mine.layout):
            raise ValueError(f"peer {meta.engine_id}: KV layout differs (layers, dtype, block size, head dim or "
                             f"layout {meta.region.layout} vs {mine.layout})")
        transport = self._require_transport()
        with self._lock:
            stale = [k for k in self._peers if k.engine_id == meta.engine_id and k.epoch != meta.epoch]
            for key in stale:
                self._drop_peer_locked(key)
            self._peers[meta.key] = meta
        transport.add_peer(meta.key, meta.worker_address)
        return meta.key

    def remove_peer(self, engine_id: str, epoch: int | None = None) -> None:
        """Forgets an engine's ranks (of `epoch`, or every epoch): their pulls fail with peer_gone."""
        with self._lock:
            for key in [k for k in self._peers if k.engine_id == engine_id and (epoch is None or k.epoch == epoch)]:
                self._drop_peer_locked(key)

    def _drop_peer_locked(self, key: PeerKey) -> None:
        del self._peers[key]
        self._peer_transports.pop(key, None)
        self._warned_fallbacks.discard(key)
        if self._transport is not None:
            self._transport.remove_peer(key)
        for rid, op in [(rid, op) for rid, op in self._queued if op.peer == key]:
            if (rid, op) in self._queued:  # (a failed chunk pull drops the rest of its read)
                self._queued.remove((rid, op))
                self._op_ended_locked(self._recvs[rid], op, "peer_gone", (), 0, 0.0)

    # -- decode side ---------------------------------------------------------------------------

    def start_pull(self, request_id: str, descriptor: KVTransferDescriptor, local_block_ids: list[int]) -> None:
        """Starts pulling `descriptor`'s blocks into `local_block_ids`.

        `local_block_ids` are the blocks still missing locally, in prompt order; with a local
        prefix cached only the LAST `len(local_block_ids)` remote blocks are read. Under a
        prefill TP other than ours the pull reads each of our head ranges from the prefill rank
        `head_map.read_plan` names (one transport op per rank read); the request ends once
        every op ended. Raises ValueError (no state change) for caller errors: a request already
        pulling, bad or duplicate local ids, more local than remote blocks. Problems of the
        descriptor (stale epoch, unknown peer, blocks out of range, unmappable TP) are transfer
        failures: the request is reported in `failed_recving` at the next drain.
        """
        self._require_transport()
        local = tuple(int(b) for b in local_block_ids)
        num_local_blocks = self.handshake_metadata.region.num_blocks
        if any(not 0 <= b < num_local_blocks for b in local) or len(set(local)) != len(local):
            raise ValueError(f"request {request_id}: local block ids must be distinct and in [0, {num_local_blocks})")
        if len(local) > len(descriptor.block_ids):
            raise ValueError(f"request {request_id}: {len(local)} local blocks for "
                             f"{len(descriptor.block_ids)} remote blocks")
        with self._lock:
            if request_id in self._recvs:
                raise ValueError(f"request {request_id} is already pulling")
            recv = _Recv(request_id, descriptor.engine_id, local)
            if not local:
                self._results.finished_recving.add(request_id)
                return
            plan, reason = self._plan_locked(descriptor)
            if reason is not None:
                self._fail_locked(recv, reason, set())
                return
            remote = [int(b) for b in descriptor.block_ids[len(descriptor.block_ids) - len(local):]]
            recv.ops = tuple(PullOp(next(self._xfer_ids), PeerKey(descriptor.engine_id, descriptor.epoch, read.src_rank),
                                    descriptor.request_id, self._segments(read, descriptor.tp_size, remote, local),
                                    self.config.transfer_timeout_s) for read in plan)
            chunked, too_big = self._chunked_locked(recv.ops)
            if too_big is not None:
                logger.error("cannot pull %s: %s", request_id, too_big)
                self._fail_locked(recv, "staging_pool_too_small", set())
                return
            recv.ops = chunked
            recv.open = {op.xfer_id for op in recv.ops}
            self._recvs[request_id] = recv
            self._queued.extend((request_id, op) for op in recv.ops)
            self._dispatch_locked()

    def _plan_locked(self, d: KVTransferDescriptor) -> tuple[tuple[HeadRead, ...], str | None]:
        """The head reads of a descriptor, or why it cannot be read."""
        known_epochs = {k.epoch for k in self._peers if k.engine_id == d.engine_id}
        if not known_epochs:
            return (), "peer_unknown"
        if d.epoch not in known_epochs:
            return (), "stale_epoch"
        if d.num_kv_heads != self.num_kv_heads:
            return (), "incompatible"
        if mapping_problem(d.tp_size, self.tp_size, self.num_kv_heads) is not None:
            return (), "unsupported_tp"
        plan = read_plan(self.key.tp_rank, self.tp_size, d.tp_size, self.num_kv_heads)
        mine = self.handshake_metadata.region
        for read in plan:
            meta = self._peers.get(PeerKey(d.engine_id, d.epoch, read.src_rank))
            if meta is None or meta.tp_size != d.tp_size:
                return (), "peer_unknown"
            if meta.region.head_block_nbytes != mine.head_block_nbytes:
                return (), "incompatible"
            if any(not 0 <= b < meta.region.num_blocks for b in d.block_ids):
                return (), "out_of_range"
        return plan, None

    def _segments(self, read: HeadRead, prefill_tp: int, remote: list[int],
                  local: tuple[int, ...]) -> tuple[Segment, ...]:
        """Block runs of one head read: whole blocks when both ranks hold exactly these heads,
        else head-range segments (one message per block)."""
        runs = coalesce(remote, list(local))
        src_start, src_end = rank_heads(read.src_rank, prefill_tp, self.num_kv_heads)
        if read.num_heads == self.handshake_metadata.region.num_local_heads == src_end - src_start:
            return tuple(runs)
        return tuple(Segment(s.remote_block, s.local_block, s.num_blocks, read.src_offset, read.dst_offset,
                             read.num_heads) for s in runs)

    def _chunked_locked(self, ops: tuple[PullOp, ...]) -> tuple[tuple[PullOp, ...], str | None]:
        """The ops with each read larger than a pull may be (our staging pool, or the writer's:
        its `max_pull_blocks`) split into chunk pulls of at most half that, so two run at once
        (one moving while the other is copied); or why a read cannot be pulled (a writer of an
        older build, which serves one pull per reader)."""
        out: list[PullOp] = []
        for op in ops:
            meta = self._peers[op.peer]
            limits = [n for n in (self._staging.pool.num_slots if self._staging else 0, meta.max_pull_blocks) if n]
            num_blocks = sum(s.num_blocks for s in op.segments)
            if not limits or num_blocks <= min(limits):
                out.append(op)
                continue
            if not meta.chunked_pulls:
                return (), (f"a pull of {num_blocks} blocks from one rank does not fit the KV staging pool of "
                            f"{min(limits)} blocks, and {op.peer.engine_id} (an older build) serves no chunked "
                            "pulls (raise --kv-staging-blocks)")
            half = max(1, min(limits) // 2)
            num_chunks = -(-num_blocks // half)
            for segments in split_segments(op.segments, -(-num_blocks // num_chunks)):
                out.append(dataclasses.replace(op, xfer_id=next(self._xfer_ids), segments=segments, chunked=True))
        return tuple(out), None

    def _dispatch_locked(self) -> None:
        while self._queued and self._inflight < self.config.max_inflight_transfers and self._transport is not None:
            request_id, op = self._queued[0]
            if self._staging is not None:
                staged = self._stage_op_locked(op)
                if staged is None:
                    return  # back-pressure: the pool has no free run for it yet; a returning run dispatches
                op = staged
            self._queued.pop(0)
            self._inflight += 1
            self._by_xfer[op.xfer_id] = request_id
            self._transport.pull(op)

    def _stage_op_locked(self, op: PullOp) -> PullOp | None:
        """The op landing in a run of staging slots (each segment in consecutive slots), or None
        while no run of its size is free."""
        assert self._staging is not None
        run = self._staging.pool.allocate(("pull", op.xfer_id), sum(s.num_blocks for s in op.segments))
        if run is None:
            return None
        segments: list[Segment] = []
        block_ids: list[int] = []
        at = run.start
        for seg in op.segments:
            segments.append(dataclasses.replace(seg, local_block=at))
            block_ids.extend(range(seg.local_block, seg.local_block + seg.num_blocks))
            at += seg.num_blocks
        self._op_slots[op.xfer_id] = (run, tuple(block_ids))
        return dataclasses.replace(op, segments=tuple(segments))

    def _free_slots_locked(self, owner: tuple[Any, ...]) -> None:
        if self._staging is not None and self._staging.pool.free(owner) is not None:
            self._dispatch_locked()  # queued pulls may fit now
            self._dispatch_serves_locked()  # ... and pulls waiting to be served

    def _free_slots_later(self, owner: tuple[Any, ...]) -> None:
        """Frees `owner`'s slots once the copies queued so far ran (one may still use them)."""
        def free() -> None:
            with self._lock:
                self._free_slots_locked(owner)

        assert self._staging is not None
        self._staging.later(free)

    def cancel(self, request_id: str) -> bool:
        """Decode: abandons a pull (no result is reported; late bytes are drained, not written).
        Prefill: unpins the request (later pulls are refused). True if the id was known."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is not None:
                self._lease_ended_locked(request_id, lease)
            recv = self._recvs.pop(request_id, None)
            if recv is None:
                return lease is not None
            self._queued = [(rid, op) for rid, op in self._queued if rid != request_id]
            for op in recv.ops:
                if self._by_xfer.pop(op.xfer_id, None) is not None:
                    self._inflight -= 1
                    if self._transport is not None:
                        self._transport.abandon(op.xfer_id)  # no late byte lands in its slots
                    if self._op_slots.pop(op.xfer_id, None) is not None:
                        self._free_slots_locked(("pull", op.xfer_id))
            for peer, rid in {(op.peer, op.request_id) for op in recv.ops if op.chunked and op.xfer_id in recv.open}:
                self._release_locked(peer, rid)
            self._dispatch_locked()
            copying = list(recv.copying)
        for future in copying:  # host staging: no copy into the KV tensor outlives the cancel
            future.exception()
        return True

    def on_pull_finished(self, result: PullResult) -> None:
        """Transport callback (progress thread)."""
        with self._lock:
            request_id = self._by_xfer.pop(result.xfer_id, None)
            if request_id is None:
                return  # cancelled
            self._inflight -= 1
            recv = self._recvs[request_id]
            op = next(o for o in recv.ops if o.xfer_id == result.xfer_id)
            self._note_transport_locked(recv, op, result)
            staged = self._op_slots.pop(result.xfer_id, None)
            if staged is not None:
                if result.ok:  # the bytes are in the slots: copy them into the KV tensor first
                    self._copy_in_locked(recv, op, result, *staged)
                    self._dispatch_locked()
                    return
                self._free_slots_locked(("pull", result.xfer_id))
                result = dataclasses.replace(result, done_segments=())  # slot ids: count nothing as received
            if result.ok:
                self._op_ended_locked(recv, op, None, (), result.num_bytes, result.seconds)
            else:
                self._op_ended_locked(recv, op, result.reason or "unknown", _block_ids(result.done_segments),
                                      result.num_bytes, result.seconds)
            self._dispatch_locked()

    def _copy_in_locked(self, recv: _Recv, op: PullOp, result: PullResult, run: Any,
                        block_ids: tuple[int, ...]) -> None:
        """Host staging: slots -> KV blocks on the stager thread; the op ends once they are in."""
        assert self._staging is not None
        first = op.segments[0]
        heads = (first.local_head, first.num_heads) if first.num_heads else None

        def copied(error: BaseException | None) -> None:
            with self._lock:
                self._free_slots_locked(("pull", op.xfer_id))
                if self._recvs.get(recv.request_id) is recv and op.xfer_id in recv.open:
                    if error is not None:
                        logger.error("copying pulled KV of %s out of the staging pool failed: %s", recv.request_id,
                                     error)
                    self._op_ended_locked(recv, op, None if error is None else "staging_error", (), result.num_bytes,
                                          result.seconds)
                self._dispatch_locked()

        recv.copying.append(self._staging.copy_in(run, block_ids, heads, then=copied))

    def _note_transport_locked(self, recv: _Recv, op: PullOp, result: PullResult) -> None:
        """Records the transport a pull used; a fallback below `expected_transports` is counted
        per pull and logged once per writer rank."""
        transport = result.transport or UNKNOWN
        recv.bytes_by_transport[transport] = recv.bytes_by_transport.get(transport, 0) + result.num_bytes
        if result.transport:
            self._peer_transports[op.peer] = transport
        if not self._expected.fallback(transport):
            return
        stats = self._stats.pair(recv.engine_id, self.key.engine_id)
        key = (self._expected.label, transport)
        stats.fallbacks[key] = stats.fallbacks.get(key, 0) + 1
        if op.peer not in self._warned_fallbacks:
            self._warned_fallbacks.add(op.peer)
            logger.warning("KV pulls from %s rank %d to %s rank %d use UCX transport %s, slower than the expected %s "
                           "(--expected-transports): check the NIC, UCX_TLS and UCX_NET_DEVICES", op.peer.engine_id,
                           op.peer.tp_rank, self.key.engine_id, self.key.tp_rank, transport, self._expected.label)

    def peer_transports(self) -> dict[PeerKey, str]:
        """Every known writer rank -> the UCX transport its last pull used ("" before any pull)."""
        with self._lock:
            return {key: self._peer_transports.get(key, "") for key in self._peers}

    def _op_ended_locked(self, recv: _Recv, op: PullOp, reason: str | None, received: Any, num_bytes: int,
                         seconds: float) -> None:
        """One op of a request ended; the request ends with its last op (failed if any failed,
        its valid blocks those every read delivered in full: a read's delivered blocks are
        those of its ops that succeeded plus what its failed ops fully delivered; see
        `_valid_locked`). `received` (the blocks a failed op delivered) is ignored when
        `reason` is None. A failed chunk pull ends its read: the read's pulls not yet sent are
        dropped (they deliver nothing); a chunked read whose last pull ended is released at
        the writer."""
        recv.open.discard(op.xfer_id)
        recv.delivered[op.xfer_id] = None if reason is None else set(received)
        stats = self._stats.pair(recv.engine_id, self.key.engine_id)
        stats.num_operations += 1
        recv.num_bytes += num_bytes
        recv.seconds = max(recv.seconds, seconds)
        if reason is not None:
            recv.reason = recv.reason or reason
            if op.chunked:
                dropped = [(rid, q) for rid, q in self._queued if rid == recv.request_id and q.peer == op.peer]
                for entry in dropped:
                    self._queued.remove(entry)
                    recv.open.discard(entry[1].xfer_id)
        if op.chunked and not any(o.peer == op.peer and o.xfer_id in recv.open for o in recv.ops):
            self._release_locked(op.peer, op.request_id)
        if recv.open:
            return
        del self._recvs[recv.request_id]
        if recv.reason is None:
            stats.num_bytes += recv.num_bytes
            for transport, n in recv.bytes_by_transport.items():
                stats.bytes_by_transport[transport] = stats.bytes_by_transport.get(transport, 0) + n
            stats.num_blocks += len(recv.local_block_ids)
            stats.durations.append(recv.seconds)
            self._stats.record("transfer_duration", recv.seconds)
            self._stats.record("bytes_transferred", recv.num_bytes)
            self._results.finished_recving.add(recv.request_id)
            self._changed.notify_all()
        else:
            self._fail_locked(recv, recv.reason, self._valid_locked(recv))

    def _valid_locked(self, recv: _Recv) -> set[int]:
        """The local blocks of a failed request that received all their bytes: in every read
        (one per prefill rank read, the same blocks each for other heads), from one of its ops."""
        by_read: dict[PeerKey, set[int]] = {}
        for op in recv.ops:
            got = by_read.setdefault(op.peer, set())
            if op.xfer_id in recv.delivered:
                delivered = recv.delivered[op.xfer_id]
                got |= _block_ids(op.segments) if delivered is None else delivered
        return set.intersection(*by_read.values()) if by_read else set()

    def _release_locked(self, peer: PeerKey, request_id: str) -> None:
        """Ends our chunked read of `request_id` at `peer` (its every pull ended)."""
        if self._transport is None:
            return
        try:
            self._transport.release(peer, request_id)
        except RuntimeError:
            pass  # the transport is stopping: the writer's lease runs out instead

    def _fail_locked(self, recv: _Recv, reason: str, received: set[int]) -> None:
        invalid = set(recv.local_block_ids) - received
        self._results.failed_recving.add(recv.request_id)
        self._changed.notify_all()
        self._failure_reasons[recv.request_id] = reason
        self._load_errors |= invalid
        self._stats.pair(recv.engine_id, self.key.engine_id).record_failure(reason)
        self._stats.record("num_failed_transfers", 1)
        logger.warning("KV pull of %s from %s failed: %s (%d invalid blocks)", recv.request_id, recv.engine_id,
                       reason, len(invalid))

    # -- prefill side --------------------------------------------------------------------------

    def expect_send(self, request_id: str, block_ids: list[int], lease_s: float | None = None,
                    num_readers: int = 1, ready: ReadyFence | None = None) -> None:
        """Pins `block_ids` of `request_id` for `num_readers` readers until they are done or the
        lease (default `config.lease_s`, renewed by live readers) runs out. Call it before the
        descriptor is handed out. `num_readers` is how many decode ranks read this rank
        (`head_map.readers_of`); 0 (a rank no reader needs, e.g. a replica of an MQA head) pins
        nothing and reports the id in `finished_sending` at the next drain. Raises ValueError
        (no state change) on a known id, ids out of range, or a bad lease / reader count.
        With host staging the blocks are copied into the pool now when a run of them is free,
        else each pull of them is when it arrives (`source_segments`).
        `ready`: the blocks' bytes are final only once it is done (GPU compute still queued);
        the first pull of them waits for it on the transport's thread before a byte moves."""
        num_blocks = self.handshake_metadata.region.num_blocks
        ids = frozenset(int(b) for b in block_ids)
        if any(not 0 <= b < num_blocks for b in ids):
            raise ValueError(f"request {request_id}: block ids must be in [0, {num_blocks})")
        lease = self.config.lease_s if lease_s is None else lease_s
        if lease <= 0 or num_readers < 0:
            raise ValueError(f"request {request_id}: lease_s must be > 0 and num_readers >= 0")
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id} is already pinned for sending")
            if num_readers == 0:
                self._results.finished_sending.add(request_id)
                self._changed.notify_all()
                return
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id} is already pinned for sending")
            pinned = _Lease(ids, time.monotonic() + lease, num_readers, ready=ready)
            if self._staging is not None:
                self._stage_out_locked(request_id, pinned)
            self._leases[request_id] = pinned
        if self._transport is not None:
            # The reader's pull usually follows within milliseconds: poll briefly for it
            # instead of paying a wake-up on a busy host.
            self._transport.expect_activity(_EXPECT_PULL_S)

    def _stage_out_locked(self, request_id: str, lease: _Lease) -> None:
        """Host staging: a run of slots for the request's blocks (ascending, so consecutive
        blocks stay consecutive) and the copy into them, which the first reader waits for
        (after the compute fence). A request larger than the pool, or one that finds no free
        run, is staged per pull instead (`source_segments`): its blocks stay pinned in the KV
        cache and each pull is copied into a run of its own when it arrives."""
        from connectors.ucx.host_staging import CopyFence

        assert self._staging is not None
        pool, ordered = self._staging.pool, sorted(lease.block_ids)
        run = pool.allocate(("send", request_id), len(ordered)) if pool.fits(len(ordered)) else None
        if run is None:
            return
        lease.slots = {b: run.start + i for i, b in enumerate(ordered)}
        lease.staged = self._staging.copy_out(ordered, run, after=lease.ready)
        lease.ready = CopyFence(lease.staged)

    def _lease_ended_locked(self, request_id: str, lease: _Lease) -> None:
        """A lease is gone: its staging slots return (after its copy, if still running); pulls
        of it waiting for slots are refused."""
        if self._staging is not None and lease.slots is None:
            self._dispatch_serves_locked()
        if lease.slots is None:
            return
        if lease.staged is not None and not lease.staged.done():
            self._free_slots_later(("send", request_id))
        else:
            self._free_slots_locked(("send", request_id))

    def source_segments(self, request: PullRequest, resume: Any = None) -> tuple[Segment, ...] | str | None:
        """Transport callback (writer, after `on_pull_request` accepted): with host staging the
        request's blocks are served from their slots: at once where the lease holds a run
        (a reason refusing the pull if it was cancelled since: its slots are gone); for a lease
        staged per pull None, and `resume(slot segments | reason)` once this pull's blocks are
        copied into a run of its own (waiting in line while no run is free). Without staging
        from where they are."""
        if self._staging is None:
            return request.segments
        with self._lock:
            lease = self._leases.get(request.request_id)
            if lease is None:
                return "unknown_request"
            if lease.slots is not None:
                slots = lease.slots
                return tuple(dataclasses.replace(seg, remote_block=slots[seg.remote_block])
                             for seg in request.segments)
            if resume is None:
                return "staging_pool_too_small"
            self._serve_waiting[(request.reader, request.xfer_id)] = (request, resume)
            self._dispatch_serves_locked()
            return None

    def _dispatch_serves_locked(self) -> None:
        """Writer, host staging: copies waiting pulls (in arrival order) into free runs; a pull
        whose lease ended meanwhile is refused."""
        assert self._staging is not None
        for key, (request, resume) in list(self._serve_waiting.items()):
            if request.request_id not in self._leases:
                del self._serve_waiting[key]
                resume("unknown_request")
                continue
            ids = [b for seg in request.segments for b in range(seg.remote_block, seg.remote_block + seg.num_blocks)]
            run = self._staging.pool.allocate(("serve", *key), len(ids))
            if run is None:
                return  # back-pressure: a returning run dispatches it
            del self._serve_waiting[key]
            segments, at = [], run.start
            for seg in request.segments:
                segments.append(dataclasses.replace(seg, remote_block=at))
                at += seg.num_blocks
            staged = tuple(segments)
            future = self._serve_copies[key] = self._staging.copy_out(ids, run)
            future.add_done_callback(
                lambda f, staged=staged, resume=resume: resume(staged if f.exception() is None else "staging_error"))

    def on_pull_request(self, request: PullRequest) -> str | None:
        """Transport callback: validates a reader's pull against our epoch and leases (after
        the lease's `ready` fence, if any, is done: the bytes are served right after)."""
        self._wait_ready(request.request_id)
        with self._lock:
            why = self._pull_problem_locked(request)
            if why is not None:
                self._stats.pair(self.key.engine_id, request.reader.engine_id).record_failure(f"refused:{why}")
                logger.warning("refused a pull of %s by %s: %s", request.request_id, request.reader, why)
                return why
            self._leases[request.request_id].active += 1
            return None

    def _pull_problem_locked(self, request: PullRequest) -> str | None:
        if request.engine_id != self.key.engine_id or request.epoch != self.key.epoch:
            return "stale_epoch"
        lease = self._leases.get(request.request_id)
        if lease is None:
            return "unknown_request"
        if time.monotonic() >= lease.expires_at:
            return "lease_expired"
        if any(b not in lease.block_ids for s in request.segments for b in range(s.remote_block,
                                                                               s.remote_block + s.num_blocks)):
            return "not_pinned"
        if (self._staging is not None and lease.slots is None
                and not self._staging.pool.fits(sum(s.num_blocks for s in request.segments))):
            return "staging_pool_too_small"  # a reader that does not chunk (an older build)
        return None

    def _wait_ready(self, request_id: str) -> None:
        """Waits (outside the lock) for the compute that wrote the request's blocks; once done,
        the fence is dropped so later readers do not wait again."""
        with self._lock:
            lease = self._leases.get(request_id)
            fence = lease.ready if lease is not None else None
        if fence is None:
            return
        fence.wait()
        with self._lock:
            if lease is not None:
                lease.ready = None

    def on_reader_done(self, request_id: str, reader: PeerKey, ok: bool) -> None:
        """Transport callback: a reader finished and every send of it completed (an unchunked
        pull; `on_serve_ended` says the same with the pull's id)."""
        self.on_serve_ended(request_id, reader, 0, ok, True)

    def on_serve_ended(self, request_id: str, reader: PeerKey, xfer_id: int, ok: bool, last: bool) -> None:
        """Transport callback: one accepted pull ended (every send completed and the reader
        said `done`, or it was refused after acceptance, or its reader was dropped): a run it
        was staged in returns; with `last` the reader's read ended too."""
        with self._lock:
            key = (reader, xfer_id)
            if self._staging is not None and xfer_id:
                self._serve_waiting.pop(key, None)
                copy = self._serve_copies.pop(key, None)
                if self._staging.pool.holds(("serve", *key)) is not None:
                    if copy is not None and not copy.done():
                        self._free_slots_later(("serve", *key))
                    else:
                        self._free_slots_locked(("serve", *key))
            lease = self._leases.get(request_id)
            if lease is None:
                return
            lease.active -= 1
            if last:
                lease.readers_left -= 1
            self._maybe_lease_done_locked(request_id, lease)

    def on_reader_released(self, request_id: str, reader: PeerKey) -> None:
        """Transport callback: `reader` ended its chunked read of `request_id` (counted once)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or reader in lease.released:
                return
            lease.released.add(reader)
            lease.readers_left -= 1
            self._maybe_lease_done_locked(request_id, lease)

    def _maybe_lease_done_locked(self, request_id: str, lease: _Lease) -> None:
        if lease.readers_left <= 0 and lease.active <= 0:
            del self._leases[request_id]
            self._lease_ended_locked(request_id, lease)
            self._results.finished_sending.add(request_id)
            self._changed.notify_all()

    def on_renew(self, request_ids: list[str], reader: PeerKey) -> None:
        """Transport callback: extends the leases of requests a live reader still wants."""
        with self._lock:
            until = time.monotonic() + self.config.lease_s
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is not None:
                    lease.expires_at = max(lease.expires_at, until)

    # -- draining --------------------------------------------------------------------------

    def get_transfer_results(self, finished_req_ids: frozenset[str] = frozenset()) -> TransferResults:
        """Drains what finished since the last call (each id once); also expires leases and
        renews the leases of our pending pulls. `finished_req_ids` is not needed: a sending id
        exists only after `expect_send`, which the service calls once the prefill finished.
        Invalid block ids of failed pulls come from `get_block_ids_with_load_errors()` (drain
        it in the same step), the reasons from `take_failure_reasons()`."""
        with self._lock:
            self._expire_leases_locked()
            renew = self._renewals_locked()
            r, self._results = self._results, _Results()
            transport = self._transport
        if transport is not None:
            for peer, rids in renew.items():
                transport.renew(peer, rids)
        self._record_staging()
        return TransferResults(frozenset(r.finished_sending), frozenset(r.finished_recving),
                               frozenset(r.failed_recving))

    def _record_staging(self) -> None:
        """Host staging: the copies' bytes and seconds since the last drain, as stats series."""
        if self._staging is None:
            return
        staged = self._staging.take_stats()
        if not staged.num_copies:
            return
        with self._lock:
            self._stats.record("host_staging_duration", staged.seconds)
            self._stats.record("host_staged_bytes", staged.num_bytes)

    def wait_for_results(self, timeout_s: float) -> bool:
        """Blocks until some transfer finished or failed since the last `get_transfer_results()`
        (True) or `timeout_s` passed (False). Lets a drain loop sleep instead of spinning."""
        with self._changed:
            return self._changed.wait_for(lambda: bool(self._results.finished_sending or self._results.finished_recving
                                                       or self._results.failed_recving), timeout_s)

    def take_failure_reasons(self) -> dict[str, str]:
        """Why each failed pull failed (request id -> reason, e.g. timeout, stale_epoch,
        peer_gone, out_of_range, refused:<why>) since the last call."""
        with self._lock:
            reasons, self._failure_reasons = self._failure_reasons, {}
        return reasons

    def _expire_leases_locked(self) -> None:
        now = time.monotonic()
        for rid, lease in list(self._leases.items()):
            if now >= lease.expires_at and lease.active <= 0:
                del self._leases[rid]
                self._lease_ended_locked(rid, lease)
                self._results.finished_sending.add(rid)
                logger.info("lease of %s expired before every reader was done", rid)
                self._stats.lease_expiries += 1
                self._stats.record("num_kv_expired_reqs", 1)

    def _renewals_locked(self) -> dict[PeerKey, list[str]]:
        now = time.monotonic()
        if now - self._last_renew < self.config.lease_s / 3 or not self._recvs:
            return {}
        self._last_renew = now
        renew: dict[PeerKey, list[str]] = defaultdict(list)
        for recv in self._recvs.values():
            for peer, rid in {(op.peer, op.request_id) for op in recv.ops if op.xfer_id in recv.open}:
                renew[peer].append(rid)
        return renew

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose pull failed (bytes not fully received), since the last call.
        They are recorded before the request shows up in `failed_recving`."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> UcxTransferStats | None:
        """Stats since the last call (per prefill→decode pair), or None when nothing happened."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, UcxTransferStats()
        return stats

    def num_pending(self) -> int:
        """Pulls in flight or queued plus requests pinned for sending (0 when idle)."""
        with self._lock:
            return len(self._recvs) + len(self._leases)

    # -- vLLM-style per-step hooks (the service drives pulls explicitly) -----------------------

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """No-op: pulls start from `start_pull`."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """No-op: KV arrives before the request is scheduled."""

    def save_kv_layer(self, layer_idx: int, kv_layer: Any) -> None:
        """No-op: prefill KV is read in place."""

    def wait_for_save(self) -> None:
        """No-op."""

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        return []

    def shutdown(self) -> None:
        """Stops the transport; in-flight pulls fail (reason shutdown). Idempotent."""
        with self._lock:
            transport, self._transport = self._transport, None
        if transport is not None:
            transport.shutdown()
        if self._staging is not None:
            self._staging.shutdown()
        with self._lock:  # whatever the transport did not end (queued, or not yet started)
            for request_id in list(self._recvs):
                recv = self._recvs.pop(request_id)
                self._fail_locked(recv, recv.reason or "shutdown", set())
            self._by_xfer.clear()
            self._queued.clear()
            self._inflight = 0

    def _require_transport(self) -> KVTransport:
        if self._transport is None:
            raise RuntimeError("register_kv_caches() first (or the connector is shut down)")
        return self._transport


def _block_ids(segments: tuple[Segment, ...]) -> set[int]:
    """The local block ids `segments` cover."""
    return {b for s in segments for b in range(s.local_block, s.local_block + s.num_blocks)}


def _element_size(dtype: Any) -> int:
    import torch

    return int(torch.empty(0, dtype=dtype).element_size())


def _host_region(tensor: Any) -> np.ndarray:
    import torch

    return tensor.view(-1).view(torch.uint8).numpy()


def _cuda_region(tensor: Any) -> Any:
    """The GPU tensor's bytes as a flat uint8 CUDA tensor (UCX reads `__cuda_array_interface__`)."""
    import torch

    return tensor.detach().view(-1).view(torch.uint8)


def _single_tensor(kv_caches: Any) -> Any:
    if isinstance(kv_caches, dict):
        if len(kv_caches) != 1:
            raise ValueError(f"expected one KV tensor per rank, got {len(kv_caches)}")
        return next(iter(kv_caches.values()))
    return kv_caches
