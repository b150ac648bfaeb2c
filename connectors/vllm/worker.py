"""`VllmWorkerHalf`: the worker side of `PdserveConnector`, one per vLLM worker rank.

At `register_kv_caches` it registers vLLM's own KV allocation with the data plane, in place
(`kv_region.describe_kv_caches`: its layout read off the tensors, CPU or CUDA; no copy), and
starts a `RankAgent` over it — the same agent a pdserve engine's rank runs: UCX worker
connector over the region, the rank's own control stream (Hello with engine id,
epoch, rank, tp size and the UCX handshake metadata), a drain thread that reports
finished_sending / finished_recving / failed_recving with invalid block ids and per-pair stats
to the pdserve scheduler as they happen. Ranks 1..tp-1 register at once; rank 0 registers on
`connect()`, which the engine service calls once vLLM's engine runs, so the engine is never
routable before it can serve. Rank 0 also forwards vLLM's block-pool KV events
(`BlockPoolEventForwarder`) and receives the scheduler's ReleaseBlocks / KVFailed, and keeps the
role changes (SetRole) every rank's agent took for the engine service, which reads them
(`role_changes`): vLLM's `kv_both` connector prefills and decodes whatever the role, so a role
is only what the Engine API admits (decision 0047).

Per step (vLLM calls these on the worker's step thread):
- `start_load_kv`: starts the plan's pulls (each run of consecutive blocks as the ranges the
  layout makes of it — one per layer for vLLM's CPU layout, one for a block-outermost one —
  written straight into vLLM's blocks) and applies its cancels;
- `wait_for_save` (after the forward was queued): pins each finished prompt's blocks
  (`expect_send`) with a `ComputeFence` — a CUDA event recorded on vLLM's stream, which the
  data plane waits for before serving the first byte (None on the CPU, where the forward has
  run) — before the step's output leaves the engine;
- `take_finished`: what vLLM must hear this step (failed pulls with their invalid block ids,
  so vLLM recomputes from the first invalid block); a held prefill is reported finished_sending
  once its readers are done, its lease ran out, the pdserve scheduler released it, or it was
  cancelled.

With `kv_staging="host"` (the explicit, measured fallback) the rank registers the data plane's
bounded staging pool instead (`connectors/ucx/host_staging.py` over `staging.KVStaging`, CPU
tensors only): a finished prompt's blocks are copied into block-major slots when pinned at
`wait_for_save`, a pull's out of them into vLLM's tensors before it is reported, both on the
stager thread; the pool's bytes show in `pdserve_engine_kv_mirror_bytes`.

Contracts: every pull vLLM waits on is reported to vLLM exactly once; every pinned prefill is
reported finished_sending exactly once; vLLM ids are reported, pdserve ids travel on the wire.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from connectors.head_map import readers_of
from connectors.kv_events import KVCacheEvent
from connectors.outputs import TransferResults
from connectors.ucx.handshake import KV_LAYOUT
from connectors.vllm.events import BlockPoolEventForwarder
from connectors.vllm.kv_region import ComputeFence, FenceFactory, describe_kv_caches
from connectors.vllm.params import PdserveConnectorConfig, PdserveConnectorMetadata, PullSpec
from connectors.vllm.staging import KVStaging
from services.common.metrics import EngineMetrics
from services.common.request_owner import owner_of
from services.common.security import ChannelSecurity
from services.engine.control_client import (
    ControlMessage,
    EngineLoad,
    KVFailed,
    ReleaseBlocks,
    SchedulerLost,
    SetRole,
    StepReport,
)
from services.engine.rank_agent import RankAgent, RankAgentFactory, compatibility_hash

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class VllmFinished:
    """One step's completions, in vLLM's request ids."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the compatibility hash needs of vLLM's model config (duck-typed for `compatibility_hash`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str


@dataclass(frozen=True, slots=True)
class _KVSpec:
    block_size: int
    layout: str  # the registered region's: "vllm:LBHNC"..., or "NHL2BD/vllm-staging" (the mirror)
    device_kind: str  # where vLLM's KV lives (read from its tensors)


@dataclass(frozen=True, slots=True)
class KVMemory:
    """What a rank registered with the data plane: `num_bytes_registered`, and of those the bytes
    of a copy of vLLM's KV (`num_mirror_bytes`, 0 unless `kv_staging="host"`)."""

    layout: str
    device_kind: str
    num_bytes_registered: int
    num_mirror_bytes: int


class _TeeRankAgent(RankAgent):
    """A `RankAgent` whose drain also hands each transfer result to the vLLM worker half."""

    def __init__(self, factory: RankAgentFactory, rank: int, tp_size: int, tee: Any) -> None:
        super().__init__(factory, rank, tp_size)
        self._tee = tee

    def _on_results(self, results: TransferResults, invalid: set[int]) -> None:
        self._tee(results, invalid)


class VllmWorkerHalf:
    """See the module docstring."""

    def __init__(self, config: PdserveConnectorConfig, *, rank: int, tp_size: int, model: ModelShape,
                 block_size: int) -> None:
        self.config = config
        self.rank = rank
        self.tp_size = tp_size
        self.model = model
        self.block_size = block_size
        self.staging: KVStaging | None = None
        self.memory: KVMemory | None = None
        self.fences: FenceFactory = ComputeFence.record
        self._device: Any = None
        self.agent: _TeeRankAgent | None = None
        self.events: BlockPoolEventForwarder | None = None
        self._lock = threading.Lock()
        self._pulls: dict[str, PullSpec] = {}  # pdserve id -> live pull
        self._sends: dict[str, str] = {}  # pdserve id -> vllm id, pinned prefills
        self._done = TransferResults(frozenset(), frozenset(), frozenset())
        self._invalid: set[int] = set()
        self._released: set[str] = set()  # pdserve ids the scheduler released or failed (rank 0)
        self._failed_by_scheduler: set[str] = set()
        self._roles: list[SetRole] = []  # rank 0: the role changes taken, in order (the engine service reads them)
        self._meta: PdserveConnectorMetadata | None = None
        self.metrics: EngineMetrics | None = None  # rank 0 with --metrics-port: the engine's load gauges
        self._last_load: Any = EngineLoad(0, 0, 0.0, 0, 0)  # read by the gauges at each scrape

    # -- set-up ----------------------------------------------------------------------------------

    def compatibility_hash(self) -> str:
        """Covers the registered layout and device kind, so only engines whose KV lies alike pair."""
        memory = self._require_memory()
        return compatibility_hash(self.model, _KVSpec(self.block_size, memory.layout, memory.device_kind),
                                  self.config.hash_seed)

    def register_kv_caches(self, kv_caches: dict[str, Any], *, num_blocks: int | None = None,
                           layout_name: str | None = None) -> None:
        """Registers vLLM's KV in place (or its mirror with `kv_staging="host"`) and starts the
        rank's agent. `num_blocks`: vLLM's block count (None: the views' first dim);
        `layout_name`: the KVCacheLayout vLLM resolved, checked against the strides."""
        region: Any
        if self.config.kv_staging == "host":
            self.staging = KVStaging(kv_caches)
            if self.staging.block_size != self.block_size:
                raise ValueError(f"vLLM's KV tensors hold {self.staging.block_size}-token blocks, the engine is "
                                 f"configured for {self.block_size}")
            region = self.staging  # the pool's blocks come from it; the pool's bytes are known once registered
            self.memory = KVMemory(f"{KV_LAYOUT}/vllm-staging", "cpu", 0, 0)
            self._device = self.staging.device
        else:
            first = next(iter(kv_caches.values()), None)
            region = describe_kv_caches(kv_caches, num_blocks=num_blocks or (int(first.shape[0]) if first is not None
                                                                              else 1),
                                        block_size=self.block_size, head_dim=self.model.head_dim,
                                        layout_name=layout_name)
            self.memory = KVMemory(f"vllm:{region.layout.name}", region.memory_type, region.nbytes, 0)
            self._device = region.memory.device
        self._start_agent(region)

    def _start_agent(self, region: Any) -> None:
        memory = self._require_memory()
        c = self.config
        security = ChannelSecurity(c.tls_ca, c.tls_cert, c.tls_key, c.tls_server_name) if c.tls_ca else None
        factory = RankAgentFactory(
            engine_id=c.engine_id, role=c.role, epoch=c.epoch, scheduler=c.scheduler, engine_address=c.engine_address,
            num_kv_heads=self.model.num_kv_heads, compat_hash=self.compatibility_hash(), hash_seed=c.hash_seed,
            block_size=self.block_size, transfer_timeout_s=c.transfer_timeout_s, lease_s=c.lease_s,
            max_inflight=c.max_inflight_transfers, ucx_tls=c.ucx_tls, ucx_net_devices=c.ucx_net_devices,
            metrics_port=c.metrics_port, metrics_any_port=c.metrics_any_port,
            ports_file=c.ports_file, security=security, kv_staging=c.kv_staging,
            kv_staging_blocks=c.kv_staging_blocks,
            device_kind=memory.device_kind)  # in Hello: the scheduler sizes the heartbeat timeout by it
        self.agent = _TeeRankAgent(factory, self.rank, self.tp_size, self._on_results)
        if self.rank == 0:
            self.agent.set_inbox(self._on_control)
            if self.agent.registry is not None:
                self.metrics = EngineMetrics(self.agent.registry, c.engine_id, c.role, tp_size=self.tp_size)
                self.metrics.track_load(lambda: self._last_load)
        self.agent.register_kv_caches(region)
        if self.staging is not None:  # what the pool registered (the hash covered only the layout)
            registered, mirror = self.agent.ucx.registered_bytes()
            memory = self.memory = KVMemory(memory.layout, memory.device_kind, registered, mirror)
        if self.agent.kv_memory is not None:  # what vLLM's region holds, over the agent's generic count
            self.agent.kv_memory.set(c.engine_id, c.role, self.rank, memory.num_bytes_registered,
                                     memory.num_mirror_bytes)
        logger.info("vLLM rank %d/%d: %d bytes of %s KV (%s) registered with the UCX data plane, %d mirrored",
                    self.rank, self.tp_size, memory.num_bytes_registered, memory.device_kind, memory.layout,
                    memory.num_mirror_bytes)

    def _require_memory(self) -> KVMemory:
        if self.memory is None:
            raise RuntimeError("register_kv_caches() first")
        return self.memory

    def connect(self) -> None:
        """Rank 0: registers with the pdserve scheduler and starts forwarding vLLM's KV events
        (idempotent; other ranks registered at `register_kv_caches`)."""
        agent = self._require_agent()
        if self.rank != 0 or agent.control is not None:
            return
        if self.config.events_endpoint:
            self.events = BlockPoolEventForwarder(self.config.events_endpoint, self._report_engine_events)
            self.events.start()
        agent.connect()

    def _report_engine_events(self, events: list[KVCacheEvent], ts: float) -> None:
        if self.metrics is not None:
            for event in events:
                self.metrics.count_kv_events(type(event).__name__, getattr(event, "medium", None) or "")
        self._require_agent().report_engine_events(events, ts)

    def report_load(self, load: EngineLoad, draining: bool) -> None:
        """Rank 0: the engine's load for the next heartbeat and the /metrics gauges."""
        self._last_load = load
        agent = self._require_agent()
        if self.rank == 0 and agent.control is not None:
            agent.control.set_load(load, draining)

    def _on_control(self, msg: ControlMessage) -> None:
        """Control-client thread (rank 0): the scheduler's verdicts."""
        if isinstance(msg, ReleaseBlocks):
            with self._lock:
                self._released.add(msg.request_id)
        elif isinstance(msg, KVFailed):
            with self._lock:
                self._failed_by_scheduler.add(msg.request_id)
        elif isinstance(msg, SchedulerLost):  # its requests' pinned prefills: nobody will release them
            with self._lock:
                self._released.update(rid for rid in self._sends if owner_of(rid) == msg.scheduler_id)
        elif isinstance(msg, SetRole):  # the rank agent took it (next role generation only)
            with self._lock:
                self._roles.append(msg)

    def role_changes(self, after_role_epoch: int) -> list[tuple[str, int, str]]:
        """Rank 0: the role changes taken since role generation `after_role_epoch`, oldest first,
        as (role, role_epoch, reason). The engine service applies them to the role its Engine API
        admits (`services.engine.vllm.backend`): a SetRole reaches this worker, not the service."""
        with self._lock:
            return [(m.role, m.role_epoch, m.reason) for m in self._roles if m.role_epoch > after_role_epoch]

    def _on_results(self, results: TransferResults, invalid: set[int]) -> None:
        """Drain thread: results the pdserve scheduler is being told, kept for vLLM."""
        with self._lock:
            d = self._done
            self._done = TransferResults(d.finished_sending | results.finished_sending,
                                         d.finished_recving | results.finished_recving,
                                         d.failed_recving | results.failed_recving)
            self._invalid |= invalid

    # -- per step --------------------------------------------------------------------------------

    def start_load_kv(self, meta: PdserveConnectorMetadata) -> None:
        agent = self._require_agent()
        self._meta = meta
        if any(pull.local_block_ids for pull in meta.pulls):
            # Blocks just given to these requests may still be touched by compute queued before
            # (their previous owner's): write into them only after it ran.
            fence = self.fences(self._device)
            if fence is not None:
                fence.wait()
        for pull in meta.pulls:
            with self._lock:
                self._pulls[pull.request_id] = pull
            try:
                agent.ucx.start_pull(pull.request_id, pull.descriptor, list(pull.local_block_ids))
            except ValueError as e:
                logger.error("cannot pull %s: %s", pull.request_id, e)
                agent._report(StepReport(failed_recving=[pull.request_id],
                                         invalid_block_ids=list(pull.local_block_ids)))
                self._on_results(TransferResults(frozenset(), frozenset(), frozenset([pull.request_id])),
                                 set(pull.local_block_ids))
        for cancel in meta.cancels:
            agent.ucx.cancel(cancel.request_id)
            with self._lock:
                self._released.add(cancel.request_id)

    def wait_for_save(self) -> None:
        meta, self._meta = self._meta, None
        if meta is None or not meta.sends:
            return
        agent = self._require_agent()
        fence = self.fences(self._device)  # after the forward that wrote these blocks was queued
        for send in meta.sends:
            with self._lock:
                self._sends[send.request_id] = send.vllm_id
            # Pinned for the decode ranks that read this rank's KV heads under the reader's TP.
            readers = readers_of(self.rank, self.tp_size, send.reader_tp_size or self.tp_size, self.model.num_kv_heads)
            try:
                agent.ucx.expect_send(send.request_id, list(send.block_ids), num_readers=readers, ready=fence)
            except ValueError as e:  # held by vLLM all the same: report it sent at once
                logger.error("cannot pin %s for sending: %s", send.request_id, e)
                with self._lock:
                    self._released.add(send.request_id)

    def take_finished(self) -> VllmFinished:
        """What vLLM must hear this step (see the module docstring)."""
        with self._lock:
            done, self._done = self._done, TransferResults(frozenset(), frozenset(), frozenset())
            invalid, self._invalid = self._invalid, set()
            released, self._released = self._released, set()
            failed_by_scheduler, self._failed_by_scheduler = self._failed_by_scheduler, set()
        out = VllmFinished(invalid_block_ids=invalid)
        self._finish_pulls(done, failed_by_scheduler, out)
        self._finish_sends(done.finished_sending | released, out)
        return out

    def _finish_pulls(self, done: TransferResults, failed_by_scheduler: set[str], out: VllmFinished) -> None:
        agent = self._require_agent()
        failed = set(done.failed_recving)
        for request_id in failed_by_scheduler:  # the scheduler gave up on it (e.g. its prefill engine died)
            if request_id in self._pulls and request_id not in done.finished_recving:
                agent.ucx.cancel(request_id)
                failed.add(request_id)
                out.invalid_block_ids |= set(self._pulls[request_id].local_block_ids)
        with self._lock:
            ended = [(rid, self._pulls.pop(rid)) for rid in (done.finished_recving | failed) if rid in self._pulls]
        for request_id, pull in ended:
            if pull.vllm_waits:
                out.finished_recving.add(pull.vllm_id)
                if request_id in failed:
                    out.failed_recving.add(pull.vllm_id)

    def _finish_sends(self, request_ids: set[str] | frozenset[str], out: VllmFinished) -> None:
        agent = self._require_agent()
        for request_id in request_ids:
            with self._lock:
                vllm_id = self._sends.pop(request_id, None)
            if vllm_id is not None:
                agent.ucx.cancel(request_id)  # unpin (a no-op when the readers already ended it)
                out.finished_sending.add(vllm_id)
            else:
                with self._lock:  # a cancelled pull: report it to vLLM as received
                    pull = self._pulls.pop(request_id, None)
                if pull is not None and pull.vllm_waits:
                    out.finished_recving.add(pull.vllm_id)

    def release(self, request_id: str) -> bool:
        """Ends a pinned prefill from outside the control stream (Release / Abort RPC); it is
        reported finished_sending at the next step. True if this rank held it."""
        with self._lock:
            if request_id not in self._sends:
                return False
            self._released.add(request_id)
            return True

    def num_pinned(self) -> int:
        with self._lock:
            return len(self._sends)

    def num_pulling(self) -> int:
        with self._lock:
            return sum(1 for pull in self._pulls.values() if pull.vllm_waits)

    # -- inspection / end ------------------------------------------------------------------------

    def leaks(self) -> list[str]:
        """What this rank still holds (empty when idle)."""
        leaks = []
        with self._lock:
            if self._pulls:
                leaks.append(f"rank {self.rank}: {len(self._pulls)} pulls tracked for vLLM")
            if self._sends:
                leaks.append(f"rank {self.rank}: {len(self._sends)} pinned prefills tracked for vLLM")
        if self.agent is not None and self.agent.ucx.num_pending():
            leaks.append(f"rank {self.rank}: data plane has {self.agent.ucx.num_pending()} transfers or leases pending")
        return leaks

    def shutdown(self) -> None:
        if self.events is not None:
            self.events.stop()
        if self.agent is not None:
            self.agent.shutdown()

    def _require_agent(self) -> _TeeRankAgent:
        if self.agent is None:
            raise RuntimeError("register_kv_caches() first")
        return self.agent
