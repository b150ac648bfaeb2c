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

The reader side is `PullSide` (connectors/ucx/pull_side.py), the writer side `ServeSide`
(connectors/ucx/serve_side.py), the state both share `WorkerState` (connectors/ucx/
worker_state.py); this class joins them and holds registration, cancel and the drain.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from connectors.base import KVConnectorMetadata, WorkerConnector
from connectors.head_map import mapping_problem, rank_heads
from connectors.kv_events import KVCacheEvent
from connectors.kv_layout import LAYOUT_PREFIX, KVRegion
from connectors.outputs import TransferResults
from connectors.ucx.config import UcxConnectorConfig
from connectors.ucx.handshake import KV_LAYOUT, KVRegionLayout, PeerKey, UcxHandshakeMetadata
from connectors.ucx.pull_side import PullSide
from connectors.ucx.serve_side import ServeSide
from connectors.ucx.transfer_stats import UcxTransferStats
from connectors.ucx.transport import BlockAddressing, HeadGeometry, KVTransport
from connectors.ucx.worker_state import PendingResults


class UcxWorkerConnector(PullSide, ServeSide, WorkerConnector):
    """Worker-side `ucx` connector; see the module docstring for the contract."""

    def __init__(self, *, engine_id: str, epoch: int, tp_rank: int, tp_size: int, num_kv_heads: int,
                 compatibility_hash: str, kv_cache: Any = None, config: UcxConnectorConfig | None = None) -> None:
        config = config or UcxConnectorConfig()
        config.validate()
        problem = mapping_problem(tp_size, tp_size, num_kv_heads)
        if problem is not None:
            raise ValueError(problem)
        super().__init__(key=PeerKey(engine_id, epoch, tp_rank), tp_size=tp_size, num_kv_heads=num_kv_heads,
                         compatibility_hash=compatibility_hash, config=config)
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

    # -- both sides ----------------------------------------------------------------------------

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
            r, self._results = self._results, PendingResults()
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
