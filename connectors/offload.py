"""CPU offload tier: full device blocks are copied to a host-memory pool and loaded back on a
prefix hit, so a prompt evicted from the device cache need not be recomputed.

Roles:

- `OffloadScheduler` (torch-free) owns the tier's index: block hash -> CPU slot, with its own
  LRU and a fixed number of slots (the budget). Each step, `build_connector_meta` asks every rank
  to save the blocks that become full in this step's chunks and are not in the tier yet
  (write-through after compute, so an eviction from the device cache later loses nothing), and
  to load the tier hits that `update_state_after_alloc` assigned to device blocks. Loads are
  synchronous: they complete in `start_load_kv`, before the forward pass of the same step.
- `OffloadWorker` (one per rank) holds the rank's shard of the pool, a tensor of shape
  `[num_cpu_blocks, *kv_cache.shape[1:]]`, and executes the metadata: loads in
  `start_load_kv`, saves in `wait_for_save` (after the forward wrote the blocks). It emits its
  own events with the tier's medium: `BlockRemoved` for hashes it overwrites, then `BlockStored`
  (vLLM's offload form: parent None, no token ids, `block_size` 0) for what it saved. The
  aggregator publishes a `BlockStored` only once every rank stored its shard.

Every rank receives the same metadata, so every rank's pool mirrors the scheduler's index. The
medium defaults to `CPU`; use `CPU_OFFLOAD` where the working cache itself is in host memory.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from connectors.base import (
    ConnectorRequest,
    KVConnectorMetadata,
    SchedulerConnector,
    WorkerConnector,
    register_connector,
)
from connectors.hashing import DEFAULT_HASH_SEED, BlockHash, BlockHasher, to_external
from connectors.kv_events import (
    MEDIUM_CPU,
    MEDIUM_CPU_OFFLOAD,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from connectors.outputs import KVConnectorOutput, KVConnectorStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Copy device block `block_id` into CPU slot `slot`; it holds the block with `block_hash`
    (64-bit external form)."""

    block_id: int
    slot: int
    block_hash: int


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Copy CPU slot `slot` into device block `block_id`."""

    slot: int
    block_id: int


@dataclass(frozen=True, slots=True)
class OffloadMetadata(KVConnectorMetadata):
    loads: tuple[BlockLoad, ...] = ()
    saves: tuple[BlockSave, ...] = ()
    clear: bool = False

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.clear)


def num_cpu_blocks_for(memory_bytes: int, block_nbytes: int) -> int:
    """Slots a host-memory budget holds for blocks of `block_nbytes` bytes (per rank)."""
    if block_nbytes < 1:
        raise ValueError(f"block_nbytes must be >= 1, got {block_nbytes}")
    return memory_bytes // block_nbytes


@dataclass(slots=True)
class _Tracked:
    request: ConnectorRequest
    hashes: list[BlockHash] = field(default_factory=list)
    num_saved: int = 0  # leading full blocks already saved or found in the tier


class OffloadScheduler(SchedulerConnector):
    """Scheduler side of the CPU tier (see the module docstring)."""

    def __init__(self, block_size: int, num_cpu_blocks: int, hash_seed: str = DEFAULT_HASH_SEED) -> None:
        if num_cpu_blocks < 1:
            raise ValueError(f"num_cpu_blocks must be >= 1, got {num_cpu_blocks}")
        self.hasher = BlockHasher(block_size, hash_seed)
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU: first = evicted next
        self._free_slots = list(range(num_cpu_blocks - 1, -1, -1))
        self._tracked: dict[str, _Tracked] = {}
        self._matches: dict[str, tuple[int, list[BlockHash]]] = {}
        self._loads: list[BlockLoad] = []
        self._clear = False
        self.num_hit_tokens = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._slots)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    # -- loading ----------------------------------------------------------------------------

    def _hashes(self, request: ConnectorRequest, num_full: int) -> list[BlockHash]:
        # Hashed here with the tier's own hasher (same algorithm and seed as the engine's).
        tracked = self._tracked.get(request.request_id)
        hashes = tracked.hashes if tracked is not None else []
        if len(hashes) < num_full:
            parent = hashes[-1] if hashes else None
            hashes.extend(self.hasher.hash_blocks(request.all_token_ids[:num_full * self.block_size],
                                                  parent=parent, start_block=len(hashes)))
        return hashes[:num_full]

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Consecutive tier hits after the local prefix, leaving at least one token to compute.
        Loads are synchronous (False). The only state it touches is a memo of the latest match
        per request, which `update_state_after_alloc` consumes (repeating the call is harmless)."""
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        start = num_computed_tokens // bs
        limit = (len(request.all_token_ids) - 1) // bs
        hits: list[BlockHash] = []
        for block_hash in self._hashes(request, limit)[start:]:
            if block_hash not in self._slots:
                break
            hits.append(block_hash)
        if not hits:
            self._matches.pop(request.request_id, None)
            return 0, False
        self._matches[request.request_id] = (start, hits)
        return len(hits) * bs, False

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        if not num_external_tokens or match is None:
            return
        start, hits = match
        n = num_external_tokens // self.block_size
        if n > len(hits) or start + n > len(block_ids):
            raise ValueError(f"request {request.request_id}: {num_external_tokens} external tokens do not "
                             f"match the {len(hits)} tier blocks found for it")
        for i, block_hash in enumerate(hits[:n]):
            self._slots.move_to_end(block_hash)
            self._loads.append(BlockLoad(self._slots[block_hash], block_ids[start + i]))
        self.num_hit_tokens += num_external_tokens

    # -- saving -----------------------------------------------------------------------------

    def on_new_request(self, request: ConnectorRequest) -> None:
        self._tracked[request.request_id] = _Tracked(request)

    def _slot_for(self, block_hash: BlockHash) -> int:
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            _, slot = self._slots.popitem(last=False)
        self._slots[block_hash] = slot
        return slot

    def build_connector_meta(self, step: Any) -> KVConnectorMetadata:
        """`step` is the engine's StepPlan: its chunks (request_id, token_ids, start_pos,
        block_ids), preempted_ids and finished_ids."""
        saves: list[BlockSave] = []
        for chunk in getattr(step, "chunks", ()):
            tracked = self._tracked.get(chunk.request_id)
            if tracked is None:
                continue
            num_full = min((chunk.start_pos + len(chunk.token_ids)) // self.block_size, len(chunk.block_ids))
            if num_full <= tracked.num_saved:
                continue
            hashes = self._hashes(tracked.request, num_full)
            for i in range(tracked.num_saved, num_full):
                if hashes[i] in self._slots:
                    self._slots.move_to_end(hashes[i])
                else:
                    saves.append(BlockSave(chunk.block_ids[i], self._slot_for(hashes[i]), to_external(hashes[i])))
            tracked.num_saved = num_full
        for request_id in getattr(step, "finished_ids", ()):
            self._forget(request_id)
        meta = OffloadMetadata(tuple(self._loads), tuple(saves), self._clear)
        self._loads = []
        self._clear = False
        return meta

    def request_finished(self, request: ConnectorRequest,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def _forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self._matches.pop(request_id, None)

    def reset_cache(self) -> bool | None:
        """Empties the tier; the workers emit AllBlocksCleared for its medium next step."""
        self._slots.clear()
        self._free_slots = list(range(self.num_cpu_blocks - 1, -1, -1))
        self._clear = True
        return True


class OffloadWorker(WorkerConnector):
    """Worker side of the CPU tier: this rank's shard of the host pool (see the module doc).

    `report` (optional) receives this rank's per-step output; the engine calls it through
    `report_output` (e.g. to send it on the rank's control stream).
    """

    report_output: Callable[[KVConnectorOutput], None] | None = None

    def __init__(self, num_cpu_blocks: int, medium: str = MEDIUM_CPU, pin_memory: bool = True,
                 report: Callable[[KVConnectorOutput], None] | None = None) -> None:
        if num_cpu_blocks < 1:
            raise ValueError(f"num_cpu_blocks must be >= 1, got {num_cpu_blocks}")
        self.num_cpu_blocks = num_cpu_blocks
        self.medium = medium
        self.pin_memory = pin_memory
        self.report_output = report
        self.kv_cache: Any = None
        self.pool: Any = None
        self._slot_hash: dict[int, int] = {}
        self._saves: tuple[BlockSave, ...] = ()
        self._events: list[KVCacheEvent] = []
        self._stats = KVConnectorStats()

    def register_kv_caches(self, kv_cache: Any, spec: Any) -> None:
        import torch

        self.kv_cache = kv_cache
        pin = self.pin_memory and kv_cache.device.type == "cuda"
        self.pool = torch.zeros((self.num_cpu_blocks, *kv_cache.shape[1:]), dtype=kv_cache.dtype,
                                device="cpu", pin_memory=pin)
        logger.info("CPU offload tier: %d blocks, %.1f MiB on this rank", self.num_cpu_blocks,
                    self.pool.numel() * self.pool.element_size() / 2**20)

    def _require_cache(self) -> None:
        if self.kv_cache is None:
            raise RuntimeError("OffloadWorker: register_kv_caches was not called")

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        if not isinstance(meta, OffloadMetadata):
            raise TypeError(f"OffloadWorker expects OffloadMetadata, got {type(meta).__name__}")
        if meta.clear:
            self._slot_hash.clear()
            self._events.append(AllBlocksCleared(self.medium))
        self._saves = meta.saves
        if meta.loads:
            import torch

            self._require_cache()
            t0 = time.perf_counter()
            slots = torch.tensor([ld.slot for ld in meta.loads], dtype=torch.long)
            blocks = torch.tensor([ld.block_id for ld in meta.loads], dtype=torch.long,
                                  device=self.kv_cache.device)
            self.kv_cache.index_copy_(0, blocks, self.pool.index_select(0, slots).to(self.kv_cache.device))
            self._record("load", len(meta.loads), time.perf_counter() - t0)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Loads are whole-block and complete in `start_load_kv`."""

    def save_kv_layer(self, layer_idx: int, kv_layer: Any) -> None:
        """Saves are whole-block, in `wait_for_save`."""

    def wait_for_save(self) -> None:
        saves, self._saves = self._saves, ()
        if not saves:
            return
        import torch

        self._require_cache()
        t0 = time.perf_counter()
        blocks = torch.tensor([s.block_id for s in saves], dtype=torch.long, device=self.kv_cache.device)
        slots = torch.tensor([s.slot for s in saves], dtype=torch.long)
        self.pool.index_copy_(0, slots, self.kv_cache.index_select(0, blocks).to("cpu"))
        self._record("save", len(saves), time.perf_counter() - t0)
        removed = []
        for save in saves:
            old = self._slot_hash.get(save.slot)
            if old is not None:
                removed.append(old)
            self._slot_hash[save.slot] = save.block_hash
        if removed:
            self._events.append(BlockRemoved(tuple(removed), self.medium))
        self._events.append(BlockStored(tuple(s.block_hash for s in saves), None, (), 0, medium=self.medium))

    def _record(self, kind: str, num_blocks: int, seconds: float) -> None:
        nbytes = num_blocks * self.pool[0].numel() * self.pool.element_size()
        self._stats.record(f"{kind}_bytes", float(nbytes))
        self._stats.record(f"{kind}_seconds", seconds)

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def slot_hashes(self) -> dict[int, int]:
        """CPU slot -> 64-bit hash of the block it holds on this rank."""
        return dict(self._slot_hash)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None if self._stats.is_empty() else self._stats.clone_and_reset()

    def shutdown(self) -> None:
        self.pool = None
        self.kv_cache = None


@dataclass(frozen=True, slots=True)
class OffloadRankInit:
    """The engine's `rank_init` hook for the tier: every rank gets its own `OffloadWorker`.

    Picklable (it travels to the spawned rank processes). `reports`, when given, holds one
    callable per rank that receives that rank's per-step output (picklable too, e.g. the `put`
    of a multiprocessing queue, or the rank's control-stream sender).
    """

    num_cpu_blocks: int
    medium: str = MEDIUM_CPU
    reports: tuple[Callable[[KVConnectorOutput], None], ...] | None = None

    def __call__(self, rank: int, tp_size: int, kv_cache: Any, spec: Any) -> OffloadWorker:
        if self.reports is not None and len(self.reports) != tp_size:
            raise ValueError(f"OffloadRankInit has {len(self.reports)} report callables for tp {tp_size}")
        report = self.reports[rank] if self.reports is not None else None
        return OffloadWorker(self.num_cpu_blocks, medium=self.medium, report=report)


def offload_medium(working_medium: str) -> str:
    """The tier's event medium: `CPU` (vLLM's name) unless the working cache is itself in host
    memory (`CPU`), then `CPU_OFFLOAD`, so the two tiers stay distinguishable."""
    return MEDIUM_CPU_OFFLOAD if working_medium == MEDIUM_CPU else MEDIUM_CPU


def build_offload(*, memory_bytes: int, block_size: int, block_nbytes: int, working_medium: str,
                  hash_seed: str = DEFAULT_HASH_SEED,
                  reports: tuple[Callable[[KVConnectorOutput], None], ...] | None = None,
                  ) -> tuple[OffloadScheduler, OffloadRankInit]:
    """Both halves for an engine with `--kv-offload-memory` (bytes per rank): pass the first as
    `scheduler_connector` and the second as `rank_init`."""
    num = num_cpu_blocks_for(memory_bytes, block_nbytes)
    if num < 1:
        raise ValueError(f"--kv-offload-memory of {memory_bytes} bytes holds no block of {block_nbytes} bytes")
    return (OffloadScheduler(block_size, num, hash_seed),
            OffloadRankInit(num, offload_medium(working_medium), reports))


register_connector("offload", OffloadScheduler, OffloadWorker)
