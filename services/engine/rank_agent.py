"""`RankAgent`: what every rank process of an engine runs beside its model shard.

The engine's `rank_init` hook builds one per rank (in that rank's process). It owns the rank's
UCX worker connector and the rank's control streams to the scheduler replicas (one each,
`ControlFanout`):

- at `register_kv_caches` it starts UCX over the rank's KV tensor, registers with the
  scheduler (Hello carries the UCX handshake metadata) and, on a decode rank, connects to every
  prefill rank the Welcome names — endpoints exist before the first request;
- every step it applies the data-plane commands of the step plan (`start_load_kv`);
- a drain thread reports finished / failed transfers and per-pair stats on the control stream
  as soon as they happen (transfers finish between steps, not in them);
- with a CPU offload tier (`RankAgentFactory.offload`, from `--kv-offload-memory`) it owns the
  rank's `OffloadWorker`: the tier's part of the step plan (`UcxConnectorMetadata.offload`) is
  loaded before the forward and saved after it, and the worker's events (BlockStored /
  BlockRemoved / AllBlocksCleared of the tier's medium) go on this rank's control stream as
  `StepReport.worker_events`, where the scheduler's aggregator publishes a BlockStored once every
  rank reported it;
- rank 0's agent also hands the scheduler's KVReady / KVFailed / ReleaseBlocks (and a lost
  replica's `SchedulerLost`) to the engine service through `set_inbox`;
- with tracing on, every traced pull (its `PullCommand.trace_carrier` holds the W3C context of
  a sampled decode span) gets a `kv_transfer` span on this rank, child of that decode span,
  from `start_pull` until the drain sees it finish (or fail, or be cancelled).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from connectors.base import KVConnectorMetadata, WorkerConnector
from connectors.head_map import mapping_problem, readers_of, source_ranks
from connectors.kv_events import KVCacheEvent
from connectors.offload import OffloadRankInit, OffloadWorker
from connectors.outputs import KVConnectorOutput, KVConnectorStats, TransferResults
from connectors.ucx.config import UcxConnectorConfig
from connectors.ucx.handshake import UcxHandshakeMetadata
from connectors.ucx.scheduler import UcxConnectorMetadata
from connectors.ucx.transfer_stats import UcxTransferStats
from connectors.ucx.worker import UcxWorkerConnector
from services.common.bound_ports import PortsFile
from services.common.metrics import (
    KVMemoryMetrics,
    MetricsServer,
    TransferMetrics,
    metrics_port_for_rank,
    start_metrics_server,
)
from services.common.security import ChannelSecurity
from services.common.tracing import ComponentTracer, extract_carrier, flush_tracing, process_tracer
from services.engine.control_client import (
    ControlHello,
    ControlMessage,
    PeerUpdate,
    RankIdentity,
    SetRole,
    StepReport,
    TransferStat,
    Welcome,
)
from services.engine.control_fanout import ControlFanout

logger = logging.getLogger(__name__)

DRAIN_INTERVAL_S = 0.002
PROTOCOL_VERSION = 1


def compatibility_hash(model_config: Any, kv_spec: Any, hash_seed: str, kv_transport: str = "ucx-tag") -> str:
    """Digest of everything two engines must agree on to exchange KV blocks. The KV transport
    is a part only when it is not the default, so tag-transport hashes stay what they were."""
    parts = [
        f"proto={PROTOCOL_VERSION}", f"arch={model_config.architecture}", f"vocab={model_config.vocab_size}",
        f"hidden={model_config.hidden_size}", f"layers={model_config.num_layers}",
        f"kv_heads={model_config.num_kv_heads}", f"head_dim={model_config.head_dim}",
        f"dtype={model_config.dtype}", f"device={kv_spec.device_kind}", f"block_size={kv_spec.block_size}",
        f"layout={kv_spec.layout}",
        f"hash=sha256_cbor:{hash_seed}",
    ]
    if kv_transport != "ucx-tag":
        parts.append(f"kv_transport={kv_transport}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


@dataclass(slots=True)
class RankAgentFactory:
    """The engine's `rank_init` hook (picklable: it travels to spawned rank processes)."""

    engine_id: str
    role: str
    epoch: int
    scheduler: str
    engine_address: str
    num_kv_heads: int
    compat_hash: str
    hash_seed: str
    block_size: int
    transfer_timeout_s: float
    lease_s: float
    max_inflight: int
    ucx_tls: str = ""
    ucx_net_devices: str = ""
    expected_transports: str = ""  # connectors/ucx/ep_info.py TransportExpectation
    dtype: str = ""  # stated in Hello beside the compatibility hash (which covers it too)
    device_kind: str = ""
    kv_transport: str = "ucx-tag"  # or "nixl" (connectors/ucx/nixl_transport.py)
    kv_staging: str = "none"  # "host": KV bounces through a bounded pinned pool (connectors/ucx/host_staging.py)
    kv_staging_blocks: int = 0  # the pool's blocks (0: the transfer window)
    metrics_port: int = 0  # rank r serves /metrics on metrics_port + r; 0 disables
    metrics_any_port: bool = False  # metrics_port 0: every rank serves /metrics on a port the OS picks
    ports_file: str = ""  # where every rank reports the ports it bound (services/common/bound_ports.py)
    security: ChannelSecurity | None = None  # TLS to the scheduler, the engine's certificate as identity
    offload: OffloadRankInit | None = None  # the CPU offload tier's per-rank half; None = no tier

    def __call__(self, rank: int, tp_size: int, kv_cache: Any, spec: Any) -> RankAgent:
        return RankAgent(self, rank, tp_size)


class RankAgent(WorkerConnector):
    """One rank's data plane and control stream (see the module docstring)."""

    def __init__(self, factory: RankAgentFactory, rank: int, tp_size: int) -> None:
        self.factory = factory
        self.identity = RankIdentity(factory.engine_id, factory.role, factory.epoch, rank, tp_size)
        self.role_epoch = 0  # the role generation `identity.role` belongs to (SetRole)
        config = UcxConnectorConfig(transfer_timeout_s=factory.transfer_timeout_s, lease_s=factory.lease_s,
                                    max_inflight_transfers=factory.max_inflight, ucx_tls=factory.ucx_tls,
                                    ucx_net_devices=factory.ucx_net_devices, kv_staging=factory.kv_staging,
                                    kv_staging_blocks=factory.kv_staging_blocks,
                                    kv_transport=factory.kv_transport,
                                    expected_transports=factory.expected_transports)
        self.ucx = UcxWorkerConnector(engine_id=factory.engine_id, epoch=factory.epoch, tp_rank=rank,
                                      tp_size=tp_size, num_kv_heads=factory.num_kv_heads,
                                      compatibility_hash=factory.compat_hash, config=config)
        self.control: ControlFanout | None = None
        self.metrics: TransferMetrics | None = None
        self.kv_memory: KVMemoryMetrics | None = None
        self.registry: CollectorRegistry | None = None
        self._metrics_server: MetricsServer | None = None
        port = 0 if factory.metrics_any_port and not factory.metrics_port else (
            metrics_port_for_rank(factory.metrics_port, rank))
        if port is not None:
            self.registry = CollectorRegistry()
            self.metrics = TransferMetrics(self.registry)
            self.kv_memory = KVMemoryMetrics(self.registry)
            self._metrics_server = start_metrics_server(port, self.registry)
            PortsFile(factory.ports_file).report("metrics_port", self._metrics_server.port, rank)
        self._inbox: Callable[[ControlMessage], None] | None = None
        self._peer_fetch = False  # the latest Welcome's: peer fetch on, a prefill rank connects to its peers
        self._tracer: ComponentTracer | None = None
        if factory.role == "decode":  # only decode ranks make spans (kv_transfer)
            self._tracer = process_tracer("decode", {"pdserve.engine_id": factory.engine_id, "pdserve.rank": rank})
        self._spans: dict[str, Any] = {}  # request id -> open kv_transfer span (tracing on only)
        self._spans_lock = threading.Lock()
        self._stop = threading.Event()
        self._drain_thread: threading.Thread | None = None
        self.offload: OffloadWorker | None = None
        if factory.offload is not None:
            self.offload = factory.offload(rank, tp_size, None, None)

    # -- set-up ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: Any, spec: Any = None) -> None:
        """Starts UCX over the rank's KV tensor. Ranks 1..tp-1 register with the scheduler now;
        rank 0 waits for `connect()`, which the engine service calls once its engine loop runs,
        so the engine never becomes routable before it can serve."""
        self.ucx.register_kv_caches(kv_cache, spec)
        if self.kv_memory is not None:
            registered, mirror = self.ucx.registered_bytes()
            self.kv_memory.set(self.factory.engine_id, self.factory.role, self.identity.tp_rank,
                                               registered, mirror)
        if self.offload is not None:
            self.offload.register_kv_caches(kv_cache, spec)
        if self.identity.tp_rank != 0:
            self.connect()

    def connect(self) -> None:
        """Registers this rank (Hello carries the UCX handshake metadata) and starts draining."""
        f = self.factory
        hello = ControlHello(self.identity, f.compat_hash, f.engine_address, self.ucx.get_handshake_metadata(),
                             hash_seed=f.hash_seed, block_size=f.block_size, dtype=f.dtype or None,
                             device_kind=f.device_kind or None)
        self.control = ControlFanout(f.scheduler, hello, on_message=self._on_message, security=f.security)
        self.control.start(timeout=None)
        self._drain_thread = threading.Thread(target=self._drain_loop, name=f"rank{self.identity.tp_rank}-drain",
                                              daemon=True)
        self._drain_thread.start()

    def set_inbox(self, inbox: Callable[[ControlMessage], None]) -> None:
        """Rank 0: where KVReady / KVFailed / ReleaseBlocks go (called from the client thread)."""
        self._inbox = inbox

    def _on_message(self, msg: ControlMessage) -> None:
        if isinstance(msg, Welcome):
            # With peer fetch on a prefill rank pulls too (decision 0046): it connects as well.
            self._peer_fetch = msg.peer_fetch
            if self.identity.role != "prefill" or self._peer_fetch:
                for peer in msg.peers:
                    self._add_peer(peer.handshake_metadata)
        elif isinstance(msg, SetRole):
            self._set_role(msg)
        elif isinstance(msg, PeerUpdate):
            if self.identity.role != "prefill" or self._peer_fetch:
                for peer in msg.joined:
                    self._add_peer(peer.handshake_metadata)
                for left in msg.left:
                    self.ucx.remove_peer(left.engine_id, left.epoch)
        elif self._inbox is not None:
            self._inbox(msg)

    def _set_role(self, msg: SetRole) -> None:
        """Takes the scheduler's new role for this rank (next role generation only), hands it on
        to the engine (rank 0's inbox), then tells every replica in heartbeats and Hellos — in
        that order, so the engine admits the new role's calls before any scheduler routes them.
        Peers stay connected: pulls from KV the old role pinned run to their end."""
        if msg.role_epoch != self.role_epoch + 1:
            logger.info("rank %d: ignoring SetRole %s (role epoch %d, ours %d)", self.identity.tp_rank, msg.role,
                        msg.role_epoch, self.role_epoch)
            return
        self.identity = dataclasses.replace(self.identity, role=msg.role)
        self.role_epoch = msg.role_epoch
        if self._inbox is not None:
            self._inbox(msg)
        if self.control is not None:
            self.control.set_role(msg.role, msg.role_epoch)

    def _add_peer(self, blob: bytes) -> None:
        """Connects to a prefill rank this rank reads KV heads from (under its TP size)."""
        try:
            meta = UcxHandshakeMetadata.decode(blob, expected_hash=self.factory.compat_hash)
            heads, tp = self.factory.num_kv_heads, self.identity.tp_size
            problem = mapping_problem(meta.tp_size, tp, heads)
            if problem is not None:
                logger.info("not connecting to %s (tp %d): %s", meta.engine_id, meta.tp_size, problem)
            elif meta.tp_rank in source_ranks(self.identity.tp_rank, tp, meta.tp_size, heads):
                self.ucx.add_peer(meta)
        except (ValueError, TypeError) as e:
            logger.warning("ignoring a peer with bad handshake metadata: %s", e)

    # -- per step -------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        if not isinstance(meta, UcxConnectorMetadata):
            return
        if meta.offload is not None:
            if self.offload is None:
                logger.error("the step plan carries offload commands but this rank has no offload tier")
            else:
                self.offload.start_load_kv(meta.offload)
        for send in meta.sends:
            try:
                tp, heads = self.identity.tp_size, self.factory.num_kv_heads
                readers = readers_of(self.identity.tp_rank, tp, send.reader_tp_size or tp, heads)
                self.ucx.expect_send(send.request_id, send.block_ids, num_readers=readers)
            except ValueError as e:
                logger.error("cannot pin %s for sending: %s", send.request_id, e)
        for pull in meta.pulls:
            if self._tracer is not None and pull.trace_carrier:
                self._start_span(pull)
            try:
                self.ucx.start_pull(pull.request_id, pull.descriptor, pull.local_block_ids)
            except ValueError as e:
                logger.error("cannot pull %s: %s", pull.request_id, e)
                self._end_span(pull.request_id, f"not started: {e}")
                self._report(StepReport(failed_recving=[pull.request_id],
                                        invalid_block_ids=list(pull.local_block_ids)))
        for request_id in meta.cancels:
            self.ucx.cancel(request_id)
            self._end_span(request_id, "cancelled")

    def _start_span(self, pull: Any) -> None:
        """Opens the pull's kv_transfer span (before start_pull: the drain may end it at once)."""
        assert self._tracer is not None
        d = pull.descriptor
        num_blocks = len(pull.local_block_ids)
        attributes: dict[str, str | int | float | bool] = {
            "pdserve.engine_id": self.identity.engine_id, "pdserve.rank": self.identity.tp_rank,
            "pdserve.kv.blocks": num_blocks, "pdserve.kv.bytes": num_blocks * self._block_nbytes(),
            "pdserve.peer.engine_id": d.engine_id, "pdserve.peer.epoch": d.epoch,
            "pdserve.peer.rank": self.identity.tp_rank}
        span = self._tracer.start("kv_transfer", request_id=pull.request_id,
                                  parent=extract_carrier(pull.trace_carrier), attributes=attributes)
        with self._spans_lock:
            old = self._spans.pop(pull.request_id, None)
            if span is not None:
                self._spans[pull.request_id] = span
        if old is not None:
            old.end()

    def _block_nbytes(self) -> int:
        try:
            return int(self.ucx.handshake_metadata.region.block_nbytes)
        except RuntimeError:  # KV caches not registered yet
            return 0

    def _end_span(self, request_id: str, error: str | None = None) -> None:
        """Ends the request's kv_transfer span, if one is open; `error` marks it failed."""
        if self._tracer is None:
            return
        with self._spans_lock:
            span = self._spans.pop(request_id, None)
        if span is None:
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def wait_for_layer_load(self, layer_idx: int) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, kv_layer: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        if self.offload is not None:
            self.offload.wait_for_save()

    def get_transfer_results(self, finished_req_ids: frozenset[str] = frozenset()) -> TransferResults:
        # The drain thread reports transfers as they finish; the per-step collection sees none.
        return TransferResults(frozenset(), frozenset(), frozenset())

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        return self.offload.get_kv_connector_kv_cache_events() if self.offload is not None else []

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The offload tier's copy stats of the step (drained; not exported yet)."""
        return self.offload.get_kv_connector_stats() if self.offload is not None else None

    def report_output(self, output: KVConnectorOutput) -> None:
        """The engine's per-step hook (engine.workers): this rank's worker-side KV events go on
        its control stream as `worker_events` (transfer results go by the drain thread)."""
        if output.kv_cache_events:
            self._report(StepReport(worker_events=list(output.kv_cache_events)))

    def get_handshake_metadata(self) -> bytes | None:
        return self.ucx.get_handshake_metadata()

    # -- reporting ------------------------------------------------------------------------------

    def report_engine_events(self, events: list[KVCacheEvent], ts: float) -> None:
        """Rank 0: the engine's block-pool events of one step."""
        from connectors.kv_events import KVEventBatch

        self._report(StepReport(engine_events=KVEventBatch(ts=ts, events=events)))

    def _report(self, report: StepReport) -> None:
        if self.control is not None:
            self.control.report(report)

    def _drain_loop(self) -> None:
        while not self._stop.wait(DRAIN_INTERVAL_S):
            try:
                self._drain_once()
            except Exception:  # keep draining: one bad report must not stop the data plane
                logger.exception("draining transfer results failed")

    def _drain_once(self) -> None:
        results = self.ucx.get_transfer_results()
        invalid = self.ucx.get_block_ids_with_load_errors()
        stats = self.ucx.get_kv_connector_stats()
        self._record_metrics(stats)
        has_results = bool(results.finished_sending or results.finished_recving or results.failed_recving)
        if has_results:
            self._on_results(results, invalid)
        if self._tracer is not None:
            for request_id in results.finished_recving:
                self._end_span(request_id)
            for request_id in results.failed_recving:
                self._end_span(request_id, "KV pull failed")
        if not has_results and (stats is None or stats.is_empty()):
            return
        self._report(StepReport(finished_sending=sorted(results.finished_sending),
                                finished_recving=sorted(results.finished_recving),
                                failed_recving=sorted(results.failed_recving),
                                invalid_block_ids=sorted(invalid), transfer_stats=_stats(stats)))

    def _on_results(self, results: TransferResults, invalid: set[int]) -> None:
        """Called on the drain thread with each non-empty batch of transfer results, before they
        are reported to the scheduler; a subclass that must see them overrides it."""

    def _record_metrics(self, stats: UcxTransferStats | None) -> None:
        if self.metrics is None:
            return
        self.metrics.set_inflight(self.identity.engine_id, self.ucx.num_pending())
        if stats is None:
            return
        for (src, dst), pair in stats.pairs.items():
            self.metrics.record_interval(src, dst, num_bytes=pair.num_bytes, num_blocks=pair.num_blocks,
                                         durations=pair.durations, failures_by_reason=pair.failures_by_reason,
                                         bytes_by_transport=pair.bytes_by_transport, fallbacks=pair.fallbacks)
        if stats.lease_expiries:
            self.metrics.count_lease_expiry(self.identity.engine_id, stats.lease_expiries)

    def shutdown(self) -> None:
        self._stop.set()
        if self._drain_thread is not None:
            self._drain_thread.join(timeout=2)
            self._drain_once()
        if self.control is not None:
            self.control.close()
        self.ucx.shutdown()
        if self.offload is not None:
            self.offload.shutdown()
        if self._tracer is not None:
            for request_id in list(self._spans):
                self._end_span(request_id, "rank shut down")
            flush_tracing()
        if self._metrics_server is not None:
            self._metrics_server.close()


def _stats(stats: UcxTransferStats | None) -> list[TransferStat]:
    if stats is None:
        return []
    out = []
    for (src, dst), pair in stats.pairs.items():
        out.append(TransferStat(src, dst, pair.num_bytes, pair.seconds, pair.num_operations, pair.num_failures,
                                dict(pair.failures_by_reason)))
    return out
