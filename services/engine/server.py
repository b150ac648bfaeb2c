"""The engine service: what `pdserve prefill` and `pdserve decode` run.

One process per engine (rank 0; ranks 1..tp-1 are spawned by the engine). It serves the
`Engine` gRPC API (Prefill, Decode, Abort, Release, Drain) over an `LLMEngine` driven by an
`EngineLoop`, with a `RankAgent` per rank for the UCX data plane and the control stream.

Request flow on a prefill engine: Prefill → PREFILL_ONLY request → first token; the request's
prompt blocks stay pinned, every rank pins them for UCX readers, the answer carries the transfer
descriptor. Blocks are freed on the scheduler's ReleaseBlocks (every reader done), on a
Release/Abort RPC, or when the lease runs out — whichever comes first; the rest are no-ops.

On a decode engine: Decode with a descriptor → REMOTE_KV request (blocks allocated, local
prefix reused) → every rank pulls its heads of the missing blocks → the scheduler's KVReady
(all ranks received) or KVFailed (recompute) lets it run; tokens stream back. Without a
descriptor the engine computes the prompt itself (decode-only, or a migrated request).

CPU offload tier (`--kv-offload-memory` > 0): the UCX scheduler connector delegates prefix
matches, saves and loads to an `OffloadScheduler`, every rank's `RankAgent` runs its
`OffloadWorker` and reports the tier's events on its control stream. A prompt whose blocks left
the device cache but are in the tier is loaded back instead of recomputed; those tokens count
as cached in the Prefill / Decode answers.

Tracing (on from the OTEL_* environment, see services.common.tracing): the Engine RPCs get SERVER
spans continuing the scheduler's W3C context, Prefill a `prefill` span and Decode a `decode` span
(request id attribute), and the decode span's context rides the pull command to every rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from connectors.ucx.handshake import KVTransferDescriptor
from connectors.ucx.scheduler import UcxSchedulerConnector
from engine.batch_scheduler import NoFreeBlocksError
from engine.llm_engine import LLMEngine
from engine.request import RequestMode, SamplingParams
from pdserve.v1 import engine_pb2 as pb
from pdserve.v1 import engine_pb2_grpc as pb_grpc
from pdserve.v1 import generation_pb2 as gen_pb
from services.common.config import EngineConfig
from services.common.grpc_server import ServiceServer, install_drain_handler
from services.common.metrics import EngineMetrics
from services.common.security import component_channel_security, component_server_security, peer_name_guards
from services.common.tracing import ComponentTracer, server_interceptors, trace_carrier
from services.engine.control_client import ControlMessage, EngineLoad, KVFailed, KVReady, ReleaseBlocks
from services.engine.loop import Delivery, EngineLoop
from services.engine.rank_agent import RankAgent, RankAgentFactory, compatibility_hash

logger = logging.getLogger(__name__)

FINISH = {"stop": gen_pb.FINISH_REASON_STOP, "length": gen_pb.FINISH_REASON_LENGTH,
          "abort": gen_pb.FINISH_REASON_ABORT, None: gen_pb.FINISH_REASON_UNSPECIFIED}
DEFAULT_MAX_TOKENS = 16
FAILED_EXIT_GRACE_S = 5.0


def sampling_from_proto(p: gen_pb.SamplingParams) -> SamplingParams:
    """Engine sampling params from the wire; unset tunables take the engine defaults."""
    params = SamplingParams(max_tokens=p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
                            stop=list(p.stop), stop_token_ids=[int(t) for t in p.stop_token_ids])
    if p.HasField("temperature"):
        params.temperature = p.temperature
    if p.HasField("top_p"):
        params.top_p = p.top_p
    if p.HasField("top_k"):
        params.top_k = p.top_k
    if p.HasField("seed"):
        params.seed = p.seed
    if p.HasField("ignore_eos"):
        params.ignore_eos = p.ignore_eos
    return params


def descriptor_from_proto(d: pb.TransferDescriptor) -> KVTransferDescriptor:
    return KVTransferDescriptor(d.engine_id, d.epoch, d.request_id, tuple(d.block_ids), d.num_tokens, d.tp_size,
                                d.block_size, d.num_kv_heads, d.lease_expires_unix_ms)


@dataclass(slots=True)
class _Pending:
    """A live request on this engine, as the servicer sees it."""

    queue: asyncio.Queue[Delivery]
    remote_deadline: float | None = None  # decode: recompute locally if KV is not ready by then


class EngineService(pb_grpc.EngineServicer):
    def __init__(self, config: EngineConfig, engine_address: str) -> None:
        self.config = config
        self.role = config.role
        self.engine_address = engine_address
        self.epoch = secrets.randbits(63) | 1
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self.agent: RankAgent | None = None
        self.connector: UcxSchedulerConnector | None = None
        self.draining = False
        self._aio: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, _Pending] = {}
        self._pinned_until: dict[str, float] = {}
        self.metrics: EngineMetrics | None = None
        self._last_load: Any = None
        self.tracer = ComponentTracer(config.role)

    # -- start-up -------------------------------------------------------------------------------

    def build(self) -> None:
        """Loads the model, allocates KV, starts every rank and registers with the scheduler
        (blocking; run it off the event loop)."""
        from engine.config import ModelConfig
        from engine.demo_model import demo_model_dir
        from engine.kv_cache import make_kv_cache_spec
        from engine.llm_engine import resolve_device, resolve_dtype
        from engine.workers import DTYPES

        cfg = self.config
        model = cfg.model or str(demo_model_dir())
        # The same dtype and KV spec the engine will resolve, so the compatibility hash is its own.
        kind = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, kind)
        model_config = ModelConfig.from_dir(model, dtype=dtype, max_model_len=cfg.max_model_len)
        spec = make_kv_cache_spec(model_config, block_size=cfg.block_size, memory_bytes=cfg.kv_cache_bytes,
                                  tp_size=cfg.tp, num_blocks=None, element_size=DTYPES[dtype].itemsize,
                                  device_kind=kind)
        factory = RankAgentFactory(
            engine_id=cfg.engine_id, role=cfg.role, epoch=self.epoch, scheduler=cfg.scheduler,
            engine_address=self.engine_address, num_kv_heads=model_config.num_kv_heads,
            compat_hash=compatibility_hash(model_config, spec, cfg.hash_seed), hash_seed=cfg.hash_seed,
            block_size=cfg.block_size, transfer_timeout_s=cfg.transfer_timeout_s, lease_s=cfg.lease_s,
            max_inflight=cfg.max_inflight_transfers, ucx_tls=cfg.ucx_tls, ucx_net_devices=cfg.ucx_net_devices,
            kv_staging=cfg.kv_staging, dtype=dtype, device_kind=kind, metrics_port=cfg.metrics_port, security=component_channel_security(cfg))
        offload: Any = None
        if cfg.kv_offload_bytes > 0:
            from connectors.offload import build_offload

            medium = cfg.kv_medium or ("GPU" if resolve_device(cfg.device).startswith("cuda") else "CPU")
            offload, factory.offload = build_offload(
                memory_bytes=cfg.kv_offload_bytes, block_size=cfg.block_size, block_nbytes=spec.block_nbytes,
                working_medium=medium, hash_seed=cfg.hash_seed)
            logger.info("CPU offload tier: %d blocks per rank (%s), medium %s", offload.num_cpu_blocks,
                        cfg.kv_offload_memory, factory.offload.medium)
        self.connector = UcxSchedulerConnector(cfg.block_size, offload=offload)
        self.engine = LLMEngine(model, tp=cfg.tp, kv_cache_memory=cfg.kv_cache_memory, block_size=cfg.block_size,
                                max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                max_model_len=cfg.max_model_len, dtype=cfg.dtype, device=cfg.device,
                                hash_seed=cfg.hash_seed, kv_medium=cfg.kv_medium, torch_threads=cfg.torch_threads,
                                rank_init=factory, scheduler_connector=self.connector, devices=cfg.devices,
                                gpu_memory_fraction=cfg.gpu_memory_fraction)
        self.agent = self.engine.workers.rank0.connector
        assert isinstance(self.agent, RankAgent)
        self.agent.set_inbox(self._on_control_message)
        if self.agent.registry is not None:
            self.metrics = EngineMetrics(self.agent.registry, cfg.engine_id, cfg.role, tp_size=cfg.tp)
            self.metrics.track_load(lambda: self._last_load)
        self._last_load = self.engine.load()
        self.loop = EngineLoop(self.engine, deliver=self._deliver, flush_pending=self.connector.has_pending,
                               after_step=self._after_step, periodic=self._periodic)
        self.loop.start()
        self.agent.connect()
        logger.info("%s engine %s ready (epoch %x, tp %d, %s, %d KV blocks)", cfg.role, cfg.engine_id, self.epoch,
                    cfg.tp, self.engine.device_plan.describe(), self.engine.kv_cache_spec.num_blocks)

    def attach(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop

    # -- engine loop callbacks (engine-loop thread) -------------------------------------------

    def _deliver(self, deliveries: list[Delivery]) -> None:
        assert self._aio is not None
        self._aio.call_soon_threadsafe(self._dispatch, deliveries)

    def _dispatch(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            pending = self._pending.get(d.output.request_id)
            if pending is not None:
                pending.queue.put_nowait(d)

    def _after_step(self, engine: LLMEngine, seconds: float, deliveries: list[Delivery]) -> None:
        events = engine.take_events()
        if events and self.agent is not None:
            self.agent.report_engine_events(events, time.time())
        if self.metrics is not None:
            self._record_step(seconds, deliveries, events)

    def _record_step(self, seconds: float, deliveries: list[Delivery], events: list[Any]) -> None:
        assert self.metrics is not None
        generated = sum(len(d.output.new_token_ids) for d in deliveries)
        self.metrics.observe_step(seconds, 0, generated)
        for d in deliveries:
            out = d.output
            if d.first:
                self.metrics.count_prefix_cache(out.num_prompt_tokens, out.num_cached_tokens)
            if out.finished and out.finish_reason is not None:
                self.metrics.count_finished(out.finish_reason)
        for event in events:
            self.metrics.count_kv_events(type(event).__name__, getattr(event, "medium", None) or "")

    def _periodic(self, engine: LLMEngine) -> None:
        load = self._last_load = engine.load()
        if self.agent is not None and self.agent.control is not None:
            self.agent.control.set_load(EngineLoad(load.num_running, load.num_waiting, load.kv_usage,
                                                   load.num_pinned, load.num_free_blocks), self.draining)
        now = time.monotonic()
        for rid in [r for r, until in self._pinned_until.items() if until <= now]:
            del self._pinned_until[rid]
            if engine.release(rid):
                logger.warning("released %s: its lease ran out before the scheduler released it", rid)
        for rid, pending in list(self._pending.items()):
            if pending.remote_deadline is not None and pending.remote_deadline <= now:
                pending.remote_deadline = None
                self._finish_remote(engine, rid, ok=False, invalid=set())
                logger.warning("%s: no KV verdict from the scheduler in time; recomputing locally", rid)

    def _on_control_message(self, msg: ControlMessage) -> None:
        """Control-client thread: hand the scheduler's verdicts to the engine loop."""
        assert self.loop is not None
        if isinstance(msg, KVReady):
            self.loop.call(lambda e: self._finish_remote(e, msg.request_id, ok=True, invalid=set()))
        elif isinstance(msg, KVFailed):
            invalid = set(msg.invalid_block_ids)
            self.loop.call(lambda e: self._finish_remote(e, msg.request_id, ok=False, invalid=invalid))
        elif isinstance(msg, ReleaseBlocks):
            self.loop.call(lambda e: self._release(e, msg.request_id))

    def _finish_remote(self, engine: LLMEngine, request_id: str, *, ok: bool, invalid: set[int]) -> None:
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.remote_deadline = None
        try:
            engine.finish_remote_kv(request_id, ok, invalid)
        except ValueError:
            pass  # already finished (deadline recompute, abort): the later verdict is a no-op

    def _release(self, engine: LLMEngine, request_id: str) -> bool:
        self._pinned_until.pop(request_id, None)
        # Every rank's send lease goes with the blocks (a reader that pulled nothing, e.g. on a
        # full local prefix hit, never ends it), so no stale lease can admit a pull of reused blocks.
        if self.connector is not None:
            self.connector.queue_cancel(request_id)
        return engine.release(request_id)

    # -- RPCs -----------------------------------------------------------------------------------

    async def _check_ready(self, context: grpc.aio.ServicerContext, role: str) -> None:
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still starting")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is draining")
        if self.role != role:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this is a {self.role} engine")

    async def _add(self, context: grpc.aio.ServicerContext, request_id: str, fn: Any,
                   remote_deadline: float | None = None) -> _Pending:
        if not request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must be non-empty")
        if request_id in self._pending:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} is already running here")
        assert self.loop is not None
        pending = _Pending(asyncio.Queue(), remote_deadline)
        self._pending[request_id] = pending
        try:
            await asyncio.wrap_future(self.loop.call(fn))
        except ValueError as e:
            del self._pending[request_id]
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoFreeBlocksError as e:
            del self._pending[request_id]
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return pending

    async def _abort_in_engine(self, request_id: str) -> None:
        assert self.loop is not None and self.connector is not None
        self._pinned_until.pop(request_id, None)
        self.connector.queue_cancel(request_id)
        await asyncio.wrap_future(self.loop.call(lambda e: e.abort_request(request_id)))

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        with self.tracer.span("prefill", request_id=request.request_id,
                              attributes={"pdserve.engine_id": self.config.engine_id,
                                          "pdserve.prompt_tokens": len(request.prompt_token_ids)}) as span:
            response = await self._prefill(request, context)
            span.set_attribute("pdserve.cached_tokens", response.num_cached_tokens)
            span.set_attribute("pdserve.kv.blocks", len(response.descriptor.block_ids))
            return response

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        await self._check_ready(context, "prefill")
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        params = sampling_from_proto(request.sampling)
        pending = await self._add(context, rid, lambda e: e.add_request(rid, prompt, params,
                                                                         mode=RequestMode.PREFILL_ONLY))
        try:
            delivery = await pending.queue.get()
        except asyncio.CancelledError:
            await self._abort_in_engine(rid)
            raise
        finally:
            self._pending.pop(rid, None)
            tier_tokens = self.connector.pop_external_tokens(rid) if self.connector is not None else 0
        out = delivery.output
        if out.finish_reason == "abort":
            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was aborted")
        cfg = self.config
        lease_until = time.time() + cfg.lease_s
        self._pinned_until[rid] = time.monotonic() + cfg.lease_s * 2
        assert self.engine is not None
        num_blocks = -(-len(prompt) // cfg.block_size)
        descriptor = pb.TransferDescriptor(
            engine_id=cfg.engine_id, epoch=self.epoch, request_id=rid, block_ids=delivery.block_ids[:num_blocks],
            num_tokens=len(prompt), tp_size=cfg.tp, block_size=cfg.block_size,
            num_kv_heads=self.engine.model_config.num_kv_heads, lease_expires_unix_ms=int(lease_until * 1000))
        reason = out.finish_reason if params.max_tokens == 1 or out.finish_reason == "stop" else None
        return pb.PrefillResponse(request_id=rid, first_token_id=out.new_token_ids[0], descriptor=descriptor,
                                  num_cached_tokens=out.num_cached_tokens + tier_tokens,
                                  finish_reason=FINISH[reason],
                                  first_token_text=out.text_delta)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeResponse]:
        with self.tracer.span("decode", request_id=request.request_id,
                              attributes={"pdserve.engine_id": self.config.engine_id,
                                          "pdserve.prompt_tokens": len(request.prompt_token_ids),
                                          "pdserve.remote_kv": request.HasField("descriptor")}):
            async with contextlib.aclosing(self._decode(request, context)) as responses:
                async for response in responses:
                    yield response

    async def _decode(self, request: pb.DecodeRequest,
                      context: grpc.aio.ServicerContext) -> AsyncGenerator[pb.DecodeResponse, None]:
        await self._check_ready(context, "decode")
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        outputs = list(request.output_token_ids)
        params = sampling_from_proto(request.sampling)
        remote = request.HasField("descriptor")
        if remote:
            descriptor = descriptor_from_proto(request.descriptor)
            if descriptor.block_size != self.config.block_size:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"descriptor block_size {descriptor.block_size} != {self.config.block_size}")
        deadline = time.monotonic() + self.config.transfer_timeout_s * 3 if remote else None
        info: dict[str, int] = {}
        carrier = trace_carrier() if remote else None  # the decode span's context, for every rank

        def add(engine: LLMEngine) -> None:
            engine.add_request(rid, prompt, params, mode=RequestMode.REMOTE_KV if remote else RequestMode.NORMAL,
                               output_token_ids=outputs)
            cached = engine.num_local_cached_tokens(rid)
            info["cached"] = cached
            if remote:
                assert self.connector is not None
                bs = self.config.block_size
                local = engine.get_block_ids(rid)[cached // bs: -(-len(prompt) // bs)]
                self.connector.queue_pull(rid, descriptor, local, carrier)
                info["transferred"] = len(prompt) - (cached // bs) * bs

        pending = await self._add(context, rid, add, deadline)
        first = True
        try:
            while True:
                delivery = await pending.queue.get()
                out = delivery.output
                resp = pb.DecodeResponse(request_id=rid, token_ids=out.new_token_ids, text=out.text_delta,
                                         finish_reason=FINISH[out.finish_reason])
                if first:
                    assert self.connector is not None
                    resp.num_cached_tokens = info.get("cached", 0) + self.connector.pop_external_tokens(rid)
                    resp.num_transferred_tokens = info.get("transferred", 0)
                    first = False
                yield resp
                if out.finished:
                    return
        except asyncio.CancelledError:
            await self._abort_in_engine(rid)
            raise
        finally:
            self._pending.pop(rid, None)
            if self.connector is not None:
                self.connector.pop_external_tokens(rid)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still starting")
        rid = request.request_id
        assert self.loop is not None and self.connector is not None
        self._pinned_until.pop(rid, None)
        self.connector.queue_cancel(rid)
        found = await asyncio.wrap_future(self.loop.call(lambda e: e.abort_request(rid)))
        return pb.AbortResponse(found=bool(found))

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still starting")
        if request.epoch and request.epoch != self.epoch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"epoch {request.epoch:x} is not this engine's ({self.epoch:x})")
        assert self.loop is not None
        rid = request.request_id
        found = await asyncio.wrap_future(self.loop.call(lambda e: self._release(e, rid)))
        return pb.ReleaseResponse(found=bool(found))

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        self.draining = True
        load = await self.wait_drained(self.config.drain_timeout_s)
        return pb.DrainResponse(num_pinned=load.num_pinned, num_running=load.num_running)

    async def Inspect(self, request: pb.InspectRequest, context: grpc.aio.ServicerContext) -> pb.InspectResponse:
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still starting")
        assert self.loop is not None

        def inspect(engine: LLMEngine) -> tuple[Any, list[str]]:
            leaks = list(engine.check_leaks())
            if self._pending:
                leaks.append(f"service: {len(self._pending)} requests in flight")
            if self._pinned_until:
                leaks.append(f"service: {len(self._pinned_until)} pinned leases")
            if self.agent is not None and self.agent.ucx.num_pending():
                leaks.append(f"data plane: {self.agent.ucx.num_pending()} transfers or leases pending")
            return engine.load(), leaks

        load, leaks = await asyncio.wrap_future(self.loop.call(inspect))
        return pb.InspectResponse(engine_id=self.config.engine_id, epoch=self.epoch, role=self.role,
                                  num_running=load.num_running, num_waiting=load.num_waiting,
                                  num_pinned=load.num_pinned, num_waiting_for_remote_kv=load.num_waiting_for_remote_kv,
                                  num_free_blocks=load.num_free_blocks, num_blocks=load.num_blocks, leaks=leaks)

    async def wait_drained(self, timeout: float) -> Any:
        """Waits until no request runs, waits or is pinned (or timeout); returns the last load."""
        assert self.loop is not None
        deadline = time.monotonic() + timeout
        while True:
            load = await asyncio.wrap_future(self.loop.call(lambda e: e.load()))
            busy = load.num_running + load.num_waiting + load.num_pinned + load.num_waiting_for_remote_kv
            if busy == 0 or time.monotonic() >= deadline:
                return load
            await asyncio.sleep(0.1)

    def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        if self.engine is not None:
            self.engine.shutdown()


async def serve(config: EngineConfig) -> None:
    """Runs one engine service until SIGTERM/SIGINT (then drains)."""
    server = ServiceServer(["pdserve.v1.Engine"], max_message_bytes=config.max_message_bytes,
                           interceptors=[*peer_name_guards(config, ["pdserve.v1.Engine"]), *server_interceptors()])
    port = server.bind(config.host, config.port, component_server_security(config, require_client_cert=True))
    if config.health_port:
        server.bind_health(config.host, config.health_port)
    advertise = config.advertise_host or (config.host if config.host not in ("0.0.0.0", "::") else socket.getfqdn())
    service = EngineService(config, f"{advertise}:{port}")
    service.attach(asyncio.get_running_loop())
    pb_grpc.add_EngineServicer_to_server(service, server.server)
    await server.start()
    logger.info("%s engine %s: Engine API on %s:%d, building the engine", config.role, config.engine_id,
                config.host, port)

    async def drain() -> None:
        service.draining = True
        await server.set_serving(False)
        if service.loop is not None:
            load = await service.wait_drained(config.drain_timeout_s)
            logger.info("drained (%d pinned, %d running left)", load.num_pinned, load.num_running)

    stopped = install_drain_handler(drain)
    try:
        await asyncio.get_running_loop().run_in_executor(None, service.build)
        await server.set_serving(True)
        await _until_stopped_or_failed(stopped, service)
    finally:
        await server.stop(1.0)
        service.shutdown()


async def _until_stopped_or_failed(stopped: asyncio.Event, service: EngineService) -> None:
    """Returns on SIGTERM/SIGINT; raises when the engine loop died, so the process exits
    non-zero instead of lingering registered-but-dead (a supervisor restarts it)."""
    while not stopped.is_set():
        if service.loop is not None and service.loop.failed.is_set():
            # Clean-up with a dead rank can block (UCX, collectives, non-daemon threads): give it
            # a few seconds, then leave hard so a supervisor restarts the engine.
            watchdog = threading.Timer(FAILED_EXIT_GRACE_S, os._exit, args=(1,))
            watchdog.daemon = True
            watchdog.start()
            raise RuntimeError(f"engine {service.config.engine_id}: the engine loop died (see the step error "
                               "above); exiting")
        try:
            await asyncio.wait_for(stopped.wait(), 0.5)
        except TimeoutError:
            pass


def run_engine(args: Any, role: str) -> int:
    """`pdserve prefill` / `pdserve decode`: config from YAML + env + flags, logging and
    tracing for this process, then serve until SIGTERM."""
    from services.common.config import load_config
    from services.common.logs import setup_logging
    from services.common.tracing import setup_tracing, shutdown_tracing

    config = load_config(EngineConfig, args, overrides={"role": role})
    if not config.engine_id:
        config.engine_id = f"{role}-{socket.gethostname()}"
    setup_logging(config.log_level, config.engine_id)
    setup_tracing(role, attributes={"pdserve.engine_id": config.engine_id, "pdserve.rank": 0})
    try:
        asyncio.run(serve(config))
    finally:
        shutdown_tracing()  # flush batched spans (after the SIGTERM drain too)
    return 0
