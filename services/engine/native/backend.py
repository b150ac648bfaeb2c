"""`NativeBackend`: pdserve's own engine (`LLMEngine` on an `EngineLoop`) behind the Engine API.

Request flow on a prefill engine: prefill → PREFILL_ONLY request → first token; the request's
prompt blocks stay pinned, every rank pins them for UCX readers, the answer carries the transfer
descriptor. Blocks are freed on the scheduler's ReleaseBlocks (every reader done), on a
Release/Abort, or when the lease runs out — whichever comes first; the rest are no-ops.

On a decode engine: decode with a descriptor → REMOTE_KV request (blocks allocated, local
prefix reused) → every rank pulls its heads of the missing blocks → the scheduler's KVReady
(all ranks received) or KVFailed (recompute) lets it run; tokens stream back. Without a
descriptor the engine computes the prompt itself (decode-only, or a migrated request).

A peer fetch's pin (a Prefill with `peer_fetch`, decision 0049) is a cache operation, not a
request to schedule: between two steps the prompt's cached full blocks are pinned as a finished
prefill's are and every rank pins them for the reader at once; nothing is computed, and the
descriptor covers only what is cached (a refusal when nothing is). Offload-tier hits are not
loaded back for it (that is a step's work): the reader computes them.

CPU offload tier (`--kv-offload-memory` > 0): the UCX scheduler connector delegates prefix
matches, saves and loads to an `OffloadScheduler`, every rank's `RankAgent` runs its
`OffloadWorker` and reports the tier's events on its control stream. A prompt whose blocks left
the device cache but are in the tier is loaded back instead of recomputed; those tokens count
as cached in the answers.

Threads: the asyncio loop (the servicer's calls), the engine-loop thread (owns the engine; every
engine call goes through `EngineLoop.call`), rank 0's control-client thread (verdicts).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from connectors.kv_verdicts import KVVerdict, PrefillLeases, RemoteKVWaits
from connectors.ucx.handshake import KVTransferDescriptor
from engine.batch_scheduler import NoFreeBlocksError
from engine.llm_engine import EngineLoad as NativeLoad
from engine.llm_engine import LLMEngine
from engine.request import RequestMode
from services.common.config import EngineConfig
from services.common.metrics import EngineMetrics
from services.common.request_owner import owner_of
from services.engine.backend import (
    BackendLoad,
    DecodeInput,
    DuplicateRequest,
    Inspection,
    InvalidRequest,
    NotCached,
    NotReady,
    OutOfBlocks,
    PeerTransport,
    PrefillInput,
    PrefillResult,
    RequestAborted,
    TokenDelta,
    check_reader_tp,
)
from services.engine.control_client import EngineLoad, SetRole
from services.engine.native.build import NativeEngine, build_native_engine
from services.engine.native.loop import Delivery, EngineLoop
from services.engine.native.peer_pin import pin_for_peer
from services.engine.role_state import EngineRole
from services.engine.verdicts import route_control_message

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Pending:
    """A live request on this engine: the engine loop's deliveries for it."""

    queue: asyncio.Queue[Delivery]


class NativeBackend:
    """An `EngineBackend` over pdserve's own engine."""

    def __init__(self, config: EngineConfig, engine_address: str) -> None:
        self.config = config
        self.engine_address = engine_address
        self._epoch = secrets.randbits(63) | 1
        self.parts: NativeEngine | None = None
        self.loop: EngineLoop | None = None
        self.metrics: EngineMetrics | None = None
        self.waits = RemoteKVWaits()  # decode: recompute locally if no KV verdict by then
        self.leases = PrefillLeases()  # prefill: pinned blocks freed when the lease runs out
        self._draining = False
        self.role_state = EngineRole(config.role)
        self._aio: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, _Pending] = {}
        self._last_load: NativeLoad | None = None
        self._stopping = threading.Event()  # shutdown() called: a build still running must not register

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def ready(self) -> bool:
        return self.loop is not None

    @property
    def failed(self) -> bool:
        return self.loop is not None and self.loop.failed.is_set()

    def set_draining(self, draining: bool) -> None:
        self._draining = draining

    # -- start-up (blocking part off the event loop) -------------------------------------------

    async def start(self) -> None:
        self._aio = asyncio.get_running_loop()
        await self._aio.run_in_executor(None, self._build)

    def _build(self) -> None:
        cfg = self.config
        parts = self.parts = build_native_engine(cfg, self._epoch, self.engine_address)
        parts.agent.set_inbox(lambda msg: route_control_message(msg, self))
        self._last_load = parts.engine.load()
        if parts.agent.registry is not None:
            self.metrics = EngineMetrics(parts.agent.registry, cfg.engine_id, cfg.role, tp_size=cfg.tp)
            self.metrics.track_load(self._current_load)
        loop = EngineLoop(parts.engine, deliver=self._deliver, flush_pending=parts.connector.has_pending,
                          after_step=self._after_step, periodic=self._periodic)
        loop.start()
        self.loop = loop  # ready before registering: no window where a routable engine is "starting"
        if self._stopping.is_set():  # stopped while the model loaded: never register
            return
        parts.agent.connect()
        logger.info("%s engine %s ready (epoch %x, tp %d, %s, %d KV blocks)", cfg.role, cfg.engine_id, self._epoch,
                    cfg.tp, parts.engine.device_plan.describe(), parts.engine.kv_cache_spec.num_blocks)

    def _current_load(self) -> NativeLoad:
        """The load the engine loop last saw (read by the metrics collector on scrape)."""
        assert self._last_load is not None
        return self._last_load

    def shutdown(self) -> None:
        self._stopping.set()
        if self.loop is not None:
            self.loop.stop()
        if self.parts is not None:
            self.parts.engine.shutdown()

    # -- engine-loop callbacks (engine-loop thread) ------------------------------------------

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
        if events and self.parts is not None:
            self.parts.agent.report_engine_events(events, time.time())
        if self.metrics is not None:
            self._record_step(self.metrics, seconds, deliveries, events)

    @staticmethod
    def _record_step(metrics: EngineMetrics, seconds: float, deliveries: list[Delivery], events: list[Any]) -> None:
        generated = sum(len(d.output.new_token_ids) for d in deliveries)
        metrics.observe_step(seconds, 0, generated)
        for d in deliveries:
            out = d.output
            if d.first:
                metrics.count_prefix_cache(out.num_prompt_tokens, out.num_cached_tokens)
            if out.finished and out.finish_reason is not None:
                metrics.count_finished(out.finish_reason)
        for event in events:
            metrics.count_kv_events(type(event).__name__, getattr(event, "medium", None) or "")

    def _periodic(self, engine: LLMEngine) -> None:
        load = self._last_load = engine.load()
        control = self.parts.agent.control if self.parts is not None else None
        if control is not None:
            control.set_load(EngineLoad(load.num_running, load.num_waiting, load.kv_usage,
                                        load.num_pinned, load.num_free_blocks), self._draining)
        now = time.monotonic()
        for rid in self.leases.expire(now):
            if engine.release(rid):
                logger.warning("released %s: its lease ran out before the scheduler released it", rid)
        for verdict in self.waits.expire(now):
            self._finish_remote(engine, verdict)
            logger.warning("%s: no KV verdict from the scheduler in time; recomputing locally", verdict.request_id)

    # -- the scheduler's verdicts (control-client thread → engine-loop thread) -----------------

    def on_kv_verdict(self, verdict: KVVerdict) -> None:
        self._call(lambda e: self._finish_remote(e, verdict))

    def on_release_blocks(self, request_id: str) -> None:
        self._call(lambda e: self._release(e, request_id))

    def on_set_role(self, msg: SetRole) -> None:
        """A new role: the Engine API admits its calls from now on (and the old role's for a
        grace period); whatever runs or is pinned goes on, and the KV cache stays as it is."""
        self.role_state.take(self.config.engine_id, msg.role, msg.role_epoch, msg.reason)

    async def sync_role(self) -> None:
        """Nothing to read: rank 0's SetRole reaches `on_set_role` in this process."""

    def on_scheduler_lost(self, scheduler_id: str) -> None:
        """Frees every pinned prefill of the lost replica's requests: nobody will release them.
        (Its decode legs end with their Decode streams, cancelled when its connection drops.)"""
        pinned = [rid for rid in self.leases.pinned() if owner_of(rid) == scheduler_id]
        if pinned:
            logger.warning("scheduler %s lost: releasing %d pinned prefill(s)", scheduler_id, len(pinned))
        for rid in pinned:
            self.on_release_blocks(rid)

    def _finish_remote(self, engine: LLMEngine, verdict: KVVerdict) -> None:
        self.waits.settle(verdict.request_id)
        try:
            engine.finish_remote_kv(verdict.request_id, verdict.ok, set(verdict.invalid_block_ids))
        except ValueError:
            pass  # already finished (deadline recompute, abort): the later verdict is a no-op

    def _release(self, engine: LLMEngine, request_id: str) -> bool:
        self.leases.unpin(request_id)
        # Every rank's send lease goes with the blocks (a reader that pulled nothing, e.g. on a
        # full local prefix hit, never ends it), so no stale lease can admit a pull of reused blocks.
        self._connector().queue_cancel(request_id)
        return engine.release(request_id)

    # -- requests (asyncio loop) ----------------------------------------------------------------

    def _call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        if self.loop is None:
            raise NotReady("engine is still starting")
        return asyncio.wrap_future(self.loop.call(fn), loop=self._aio)

    def _connector(self) -> Any:
        assert self.parts is not None
        return self.parts.connector

    async def _add(self, request_id: str, fn: Callable[[LLMEngine], Any]) -> _Pending:
        if request_id in self._pending:
            raise DuplicateRequest(f"request {request_id} is already running here")
        pending = _Pending(asyncio.Queue())
        self._pending[request_id] = pending
        try:
            await self._call(fn)
        except ValueError as e:
            del self._pending[request_id]
            raise InvalidRequest(str(e)) from None
        except NoFreeBlocksError as e:
            del self._pending[request_id]
            raise OutOfBlocks(str(e)) from None
        except asyncio.CancelledError:  # the caller left (its scheduler died) while the engine added it
            self._pending.pop(request_id, None)
            self._forget(request_id)
            raise
        return pending

    def _forget(self, request_id: str) -> None:
        """Ends a request nobody waits for, without waiting (the engine loop does it)."""
        def abort(engine: LLMEngine) -> bool:
            return engine.abort_request(request_id)

        self.leases.unpin(request_id)
        self._connector().queue_cancel(request_id)
        self._call(abort)

    async def prefill(self, request: PrefillInput) -> PrefillResult:
        rid, prompt, params = request.request_id, request.prompt_token_ids, request.sampling
        assert self.parts is not None
        check_reader_tp(self.config.tp, request.decode_tp_size, self.parts.engine.model_config.num_kv_heads)
        if request.peer_fetch:
            return await self._pin_for_peer(request)
        self._connector().set_reader_tp(rid, request.decode_tp_size)
        pending = await self._add(rid, lambda e: e.add_request(rid, prompt, params, mode=RequestMode.PREFILL_ONLY))
        try:
            delivery = await pending.queue.get()
        except asyncio.CancelledError:
            await self.abort(rid)
            raise
        finally:
            self._pending.pop(rid, None)
            tier_tokens = self._connector().pop_external_tokens(rid)
        out = delivery.output
        if out.finish_reason == "abort":
            raise RequestAborted(f"request {rid} was aborted")
        self.leases.pin(rid, time.monotonic() + self.config.lease_s * 2)
        reason = out.finish_reason if params.max_tokens == 1 or out.finish_reason == "stop" else None
        return PrefillResult(out.new_token_ids[0], out.text_delta, reason, out.num_cached_tokens + tier_tokens,
                             self._descriptor(rid, len(prompt), delivery.block_ids))

    async def _pin_for_peer(self, request: PrefillInput) -> PrefillResult:
        """A peer fetch's pin (`peer_pin.pin_for_peer`, between two steps: no compute, no
        token); the descriptor covers exactly the cached blocks pinned."""
        rid = request.request_id
        if rid in self._pending:
            raise DuplicateRequest(f"request {rid} is already running here")
        try:
            num_tokens, block_ids = await self._call(
                lambda e: pin_for_peer(e, self._connector(), rid, request.prompt_token_ids, request.decode_tp_size))
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        except asyncio.CancelledError:  # the caller left: a pin made meanwhile is released
            self._forget(rid)
            raise
        if not num_tokens:
            raise NotCached(f"request {rid}: no block of the prefix is cached here any more")
        self.leases.pin(rid, time.monotonic() + self.config.lease_s * 2)
        return PrefillResult(0, "", None, num_tokens, self._descriptor(rid, num_tokens, block_ids))

    def _descriptor(self, request_id: str, num_tokens: int, block_ids: list[int]) -> KVTransferDescriptor:
        cfg = self.config
        assert self.parts is not None
        num_blocks = -(-num_tokens // cfg.block_size)
        lease_until = time.time() + cfg.lease_s
        return KVTransferDescriptor(cfg.engine_id, self._epoch, request_id, tuple(block_ids[:num_blocks]), num_tokens,
                                    cfg.tp, cfg.block_size, self.parts.engine.model_config.num_kv_heads,
                                    int(lease_until * 1000))

    async def decode(self, request: DecodeInput) -> AsyncGenerator[TokenDelta, None]:
        rid = request.request_id
        info: dict[str, int] = {}
        if rid in self._pending:  # before `expect`: a duplicate must not touch the running one's wait
            raise DuplicateRequest(f"request {rid} is already running here")
        if request.descriptor is not None:
            self.waits.expect(rid, time.monotonic() + self.config.transfer_timeout_s * 3)
        try:
            pending = await self._add(rid, lambda e: self._add_decode(e, request, info))
        except BaseException:
            self.waits.discard(rid)
            raise
        try:
            async for delta in self._deltas(rid, pending, info):
                yield delta
        except (asyncio.CancelledError, GeneratorExit):  # the stream was cancelled, or closed mid-request
            self._forget(rid)
            raise
        finally:
            self._pending.pop(rid, None)
            self.waits.discard(rid)
            self._connector().pop_external_tokens(rid)

    def _add_decode(self, engine: LLMEngine, request: DecodeInput, info: dict[str, int]) -> None:
        """Engine-loop thread: adds the request and, with a descriptor, queues every rank's pull
        of the blocks not cached locally."""
        rid, prompt, descriptor = request.request_id, request.prompt_token_ids, request.descriptor
        # The descriptor's tokens come over the data plane: the whole prompt from a prefill
        # engine, or a prefix from a peer (a peer fetch), whose rest this engine computes.
        target = None
        if descriptor is not None and descriptor.num_tokens < len(prompt):
            target = descriptor.num_tokens
        engine.add_request(rid, prompt, request.sampling,
                           mode=RequestMode.REMOTE_KV if descriptor is not None else RequestMode.NORMAL,
                           output_token_ids=request.output_token_ids, remote_kv_tokens=target)
        if descriptor is not None:
            # A remote-KV request looks up its local prefix when added; a decode-local one only
            # when first scheduled, so its count comes with its first output (`_deltas`).
            cached = info["cached"] = engine.num_local_cached_tokens(rid)
            bs = self.config.block_size
            num_tokens = target if target is not None else len(prompt)
            local = engine.get_block_ids(rid)[cached // bs: -(-num_tokens // bs)]
            self._connector().queue_pull(rid, descriptor, local, request.trace_carrier)
            info["transferred"] = max(0, num_tokens - (cached // bs) * bs)

    async def _deltas(self, rid: str, pending: _Pending, info: dict[str, int]) -> AsyncGenerator[TokenDelta, None]:
        first = True
        while True:
            out = (await pending.queue.get()).output
            delta = TokenDelta(out.new_token_ids, out.text_delta, out.finish_reason)
            if first:
                cached = info.get("cached", out.num_cached_tokens)
                delta.num_cached_tokens = cached + self._connector().pop_external_tokens(rid)
                delta.num_transferred_tokens = info.get("transferred", 0)
                first = False
            yield delta
            if out.finished:
                return

    async def abort(self, request_id: str) -> bool:
        self.leases.unpin(request_id)
        self._connector().queue_cancel(request_id)
        return bool(await self._call(lambda e: e.abort_request(request_id)))

    async def release(self, request_id: str) -> bool:
        return bool(await self._call(lambda e: self._release(e, request_id)))

    async def load(self) -> BackendLoad:
        return _backend_load(await self._call(lambda e: e.load()))

    async def inspect(self) -> Inspection:
        def inspect(engine: LLMEngine) -> Inspection:
            leaks = list(engine.check_leaks())
            if self._pending:
                leaks.append(f"service: {len(self._pending)} requests in flight")
            if self.leases:
                leaks.append(f"service: {len(self.leases)} pinned leases")
            ucx = self.parts.agent.ucx if self.parts is not None else None
            if ucx is not None and ucx.num_pending():
                leaks.append(f"data plane: {ucx.num_pending()} transfers or leases pending")
            peers = ([PeerTransport(key.engine_id, key.epoch, key.tp_rank, transport)
                      for key, transport in sorted(ucx.peer_transports().items(),
                                                   key=lambda item: (item[0].engine_id, item[0].tp_rank))]
                     if ucx is not None else [])
            return Inspection(_backend_load(engine.load()), leaks, peers)

        return await self._call(inspect)


def _backend_load(load: NativeLoad) -> BackendLoad:
    return BackendLoad(load.num_running, load.num_waiting, load.num_pinned, load.num_waiting_for_remote_kv,
                       load.num_free_blocks, load.num_blocks, load.kv_usage)
