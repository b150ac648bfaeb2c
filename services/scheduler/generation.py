"""The `Generation` servicer: validate, tokenize, hash, route, run the prefill and decode legs on
the engines and relay the token stream. Each request's state is one `Request` (request.py),
owned by the `RequestTable` from admission to its end; this servicer moves it as the legs run.

Contracts (see generation.proto):
- Bad input is refused before any state changes (INVALID_ARGUMENT / NOT_FOUND with a message);
  no engine with room gets
  RESOURCE_EXHAUSTED, no healthy decode engine UNAVAILABLE; a draining scheduler UNAVAILABLE.
- Responses echo the client's request id (a generated one when empty). Engines see a
  scheduler-unique id (`<client id>.<random>@<scheduler id>`), so a client reusing an id never
  collides with an earlier request's state on an engine or in the aggregator, and every rank
  knows which scheduler replica owns the request.
- A request with `output_token_ids` (resumed after its replica died) runs decode-only with
  prompt + those tokens, its chunks indexed after them.
- One deadline per request: the client's gRPC deadline or `default_deadline_s`, whichever is
  sooner; every engine call carries what is left. Past it: DEADLINE_EXCEEDED, both legs aborted.
- The stream is chunks (`index` = position of the chunk's first token in the output, with no
  gap and no repeat, across migrations too), then exactly one Complete with usage.
- Prefill failure: `prefill_failure_policy` recompute (the decode engine computes the prompt) or
  retry (another prefill engine, up to `max_prefill_attempts`, then recompute).
- Decode failure before the end (stream error, engine declared dead, stream ended without a
  finish reason): the request continues on another decode engine with the prompt plus every
  token already streamed, up to `max_migrations` times; the client sees neither an error nor a
  repeated token.
- Peer fetch (decision 0043, `route.fetch`): the holder pins the prefix through a Prefill with
  `peer_fetch` (at most `peer_fetch_timeout_s`), then the decode engine pulls it with the
  descriptor and computes the rest; the holder is `Request.prefill` for the release-once rule. A
  failed pin sends the Decode without a descriptor; a failed pull is recomputed by the decode
  engine (KVFailed). Either is counted (`pdserve_kv_peer_fetch_failures_total`); the output
  never changes. A remote request's fetch (`route.fetch.into_prefill`, decision 0046) runs
  before its prefill: the prefill engine pulls the prefix into its cache (prefill_fetch.py).
- Client cancel or deadline: both legs get an Abort, the prefill blocks are released; whichever
  of done / abort / lease comes first releases them, exactly once (counted in the RequestTable's outcomes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc

from connectors.hashing import BlockHasher
from pdserve.v1 import engine_pb2 as eng_pb
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc as gen_grpc
from services.common.config import SchedulerConfig
from services.common.request_owner import owned_id
from services.common.security import component_channel_security
from services.common.tracing import ComponentTracer, tracing_active
from services.common.version import __version__
from services.scheduler.admission import Admission
from services.scheduler.control import ControlServicer
from services.scheduler.engine_channels import EngineChannels
from services.scheduler.engine_views import EngineViews
from services.scheduler.lifecycle import RUNNING, EngineRef, ReleaseCause, RequestState
from services.scheduler.load_window import ArrivedRequest, FinishedRequest, LoadWindow
from services.scheduler.path_costs import PathCosts
from services.scheduler.peer_fetch import PeerFetch
from services.scheduler.prefill_fetch import PrefillFetch
from services.scheduler.registry import EngineState, Role
from services.scheduler.request import Request
from services.scheduler.request_table import RequestTable
from services.scheduler.routing import EngineView, Route, Router, RoutingDecision, RoutingRequest
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.tokenization import ModelFacts, PromptTokenizer
from services.scheduler.transfers import OutcomeKind, TransferOutcome
from services.scheduler.validation import Limits, RequestError, validate

logger = logging.getLogger(__name__)

ABORT_RPC_TIMEOUT_S = 2.0
# The scheduler does not see which UCX transport carried a pull (the engines do: Engine.Inspect's
# peer_transports, pdserve_transfer_bytes_total); peer-fetch metrics say "ucx".
PEER_FETCH_TRANSPORT = "ucx"
STREAM_END_TIMEOUT_S = 1.0
MIN_FETCH_TIMEOUT_S = 0.5  # a peer fetch's pin waits at least this (see _fetch_timeout_s)


async def _read_to_end(responses: AsyncIterator[Any]) -> None:
    """Reads a finished engine stream to its end (the status) so the traced call's CLIENT span
    ends with the call, not when the garbage collector closes the iterator; bounded, best effort."""
    async def drain() -> None:
        async for _ in responses:
            pass

    try:
        await asyncio.wait_for(drain(), STREAM_END_TIMEOUT_S)
    except (TimeoutError, grpc.aio.AioRpcError):
        pass


class LegFailed(Exception):
    """An engine leg failed in a way the scheduler recovers from (retry, recompute, migrate)."""


_FINISH_FROM_ENGINE = {gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH}


def _target_s(sampling: gen_pb.SamplingParams, name: str) -> float | None:
    """A latency target of the request in seconds (validated positive), None when unset."""
    return float(getattr(sampling, name)) / 1000.0 if sampling.HasField(name) else None  # type: ignore[arg-type]


class GenerationServicer(gen_grpc.GenerationServicer):
    """Client API of the scheduler (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, *, facts: ModelFacts, tokenizer: PromptTokenizer | None,
                 control: ControlServicer, router: Router, admission: Admission, table: RequestTable,
                 channels: EngineChannels | None = None, telemetry: SchedulerTelemetry | None = None) -> None:
        self.config = config
        self.telemetry = telemetry or SchedulerTelemetry()
        self.metrics = self.telemetry.metrics
        self.facts = facts
        self.tokenizer = tokenizer
        self.control = control
        self.registry = control.registry
        self.router = router
        self.admission = admission
        self.engine_views = EngineViews(self.registry, admission, router.path.costs)
        # Finished requests for the role planner (services/scheduler/roles.py); None: no planner.
        self.load_window: LoadWindow | None = None
        self.table = table
        self.channels = channels or EngineChannels(component_channel_security(config))
        self.hasher = BlockHasher(config.block_size, config.hash_seed)
        self.limits = Limits(config.max_prompt_tokens or facts.max_model_len - 1, config.max_new_tokens,
                             config.default_max_tokens)
        self.draining = False
        self.tracer = ComponentTracer("scheduler")
        self.prefill_fetch = PrefillFetch(self)
        self._background: set[asyncio.Task[Any]] = set()
        control.on_transfer_outcome = self.on_transfer_outcome
        control.on_engine_down.append(self.on_engine_down)

    # -- RPCs ---------------------------------------------------------------------------------

    async def GetServerInfo(self, request: gen_pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> gen_pb.ServerInfo:
        return gen_pb.ServerInfo(version=__version__, model=self.facts.name, max_model_len=self.facts.max_model_len,
                                 vocab_size=self.facts.vocab_size, block_size=self.config.block_size,
                                 num_prefill_engines=len(self.registry.routable(Role.PREFILL)),
                                 num_decode_engines=len(self.registry.routable(Role.DECODE)),
                                 has_chat_template=self.tokenizer is not None and self.tokenizer.has_chat_template,
                                 scheduler_id=self.control.scheduler_id)

    async def ListModels(self, request: gen_pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> gen_pb.ListModelsResponse:
        return gen_pb.ListModelsResponse(models=[gen_pb.ModelCard(name=self.facts.name,
                                                                  max_model_len=self.facts.max_model_len)])

    async def Generate(self, request: gen_pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gen_pb.GenerateResponse]:
        try:
            async with contextlib.aclosing(self.generate(request, context.time_remaining())) as responses:
                async for response in responses:
                    yield response
        except RequestError as e:
            await context.abort(e.code, e.message)

    async def generate(self, message: gen_pb.GenerateRequest,
                       time_remaining: float | None) -> AsyncGenerator[gen_pb.GenerateResponse, None]:
        """One request's whole lifecycle, for every front end (the gRPC Generate RPC, the HTTP
        API): chunks, then one Complete. A refusal raises RequestError before the first
        response; a failure later raises it mid-stream. Cancelling the consuming task (client
        gone) or closing the iterator ends the request as cancelled, both legs aborted.
        `time_remaining` is the client's own deadline in seconds (None: the default one)."""
        arrived = time.monotonic()
        with self.tracer.span("generate", request_id=message.request_id or None) as span:
            try:
                with self.tracer.span("route") as route_span:
                    request, route = self._admit(message, time_remaining, arrived)
                    if route_span.is_recording():
                        self._trace_route(span, route_span, request, route)
            except RequestError:
                self.metrics.request_rejected()
                raise
            self.metrics.request_started(request.num_prompt_tokens)
            self.telemetry.routed(route, self.router.policy.name, self.config.block_size)
            state, reason = RequestState.ABORTED, "cancelled"
            try:
                async for response in self._run(request, route):
                    paused = time.monotonic()
                    yield response
                    request.outside_s += time.monotonic() - paused
                state, reason = RequestState.FINISHED, "done"
            except RequestError as e:
                state, reason = self._end_state(e)
                raise
            finally:
                if request.ttft_s is not None and span.is_recording():
                    span.set_attribute("pdserve.ttft_ms", 1000.0 * request.ttft_s)
                self._end(request, state, reason)

    @staticmethod
    def _trace_route(span: Any, route_span: Any, request: Request, route: Route) -> None:
        """Span attributes: the engines' request id (client id + suffix) and the routing decision."""
        span.set_attribute("pdserve.request_id", request.request_id)
        span.set_attribute("pdserve.client_request_id", request.client_id)
        span.set_attribute("pdserve.prompt_tokens", request.num_prompt_tokens)
        route_span.set_attribute("pdserve.request_id", request.request_id)
        route_span.set_attribute("pdserve.route.decode", route.decode.engine_id or "")
        route_span.set_attribute("pdserve.route.prefill", route.prefill.engine_id or "")
        route_span.set_attribute("pdserve.route.reason", route.prefill.reason)
        route_span.set_attribute("pdserve.route.matched_blocks", route.prefill.matched_blocks)
        if route.fetch is not None:
            route_span.set_attribute("pdserve.route.peer_fetch.holder", route.fetch.holder_id)
            route_span.set_attribute("pdserve.route.peer_fetch.blocks", route.fetch.num_blocks)
            route_span.set_attribute("pdserve.route.peer_fetch.pull_tokens", route.fetch.num_pull_tokens)
            route_span.set_attribute("pdserve.route.peer_fetch.predicted_ms", 1000.0 * route.fetch.predicted_s)
        if route.path is not None:
            route_span.set_attribute("pdserve.route.path", route.path.path)
            route_span.set_attribute("pdserve.route.path_reason", route.path.reason)
            route_span.set_attribute("pdserve.route.uncached_tokens", route.path.num_uncached_tokens)
            route_span.set_attribute("pdserve.route.predicted_ms", 1000.0 * route.path.predicted_s)
            if route.path.predicted_ttft_s is not None:
                route_span.set_attribute("pdserve.route.predicted_ttft_ms", 1000.0 * route.path.predicted_ttft_s)
            if route.path.alternative_ttft_s is not None:
                route_span.set_attribute("pdserve.route.alternative_ttft_ms",
                                         1000.0 * route.path.alternative_ttft_s)

    @staticmethod
    def _end_state(e: RequestError) -> tuple[RequestState, str]:
        if e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestState.ABORTED, "deadline"
        return RequestState.FAILED, e.code.name.lower()

    # -- admission and routing ----------------------------------------------------------------

    def _admit(self, message: gen_pb.GenerateRequest, time_remaining: float | None,
               arrived: float) -> tuple[Request, Route]:
        """Validates and routes; raises RequestError with nothing changed, else takes the slots."""
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the scheduler is draining")
        valid = validate(message, self.facts, self.limits, self.tokenizer)
        client_id = message.request_id or uuid.uuid4().hex
        request_id = f"{message.request_id}.{uuid.uuid4().hex[:12]}" if message.request_id else client_id
        request_id = owned_id(request_id, self.control.scheduler_id)  # engines tell the owning replica
        timeout = self.config.default_deadline_s
        if time_remaining is not None:
            timeout = min(timeout, time_remaining)
        if timeout <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline has already passed")
        hashes = self.hasher.external_hashes(valid.prompt_token_ids)
        ttft, itl = _target_s(valid.sampling, "ttft_target_ms"), _target_s(valid.sampling, "itl_target_ms")
        busy = self.engine_views.full() if self.router.fetch is not None else ()
        route = self.router.route(RoutingRequest(hashes, len(valid.prompt_token_ids), ttft, itl),
                                  self._views(Role.PREFILL), self._views(Role.DECODE), busy=busy)
        if valid.output_token_ids:  # resumed: the decode engine computes prompt + outputs
            route = dataclasses.replace(route, prefill=RoutingDecision(None, "resumed"), fetch=None)
        if route.decode.engine_id is None or route.path is None:
            raise self._no_decode_error(frozenset())
        own_itl = itl
        if itl is None and self.config.path_itl_target_ms > 0:
            itl = self.config.path_itl_target_ms / 1000.0
        request = self.table.admit(request_id, valid, timeout, client_id=client_id, arrived=arrived)
        if self.load_window is not None:  # the planner reads what arrives, not only what finished
            num_prompt = len(valid.prompt_token_ids)
            self.load_window.arrived(ArrivedRequest(arrived, num_prompt, num_prompt - route.path.num_uncached_tokens,
                                                    valid.max_tokens, ttft, own_itl))
        request.path, request.path_reason, request.itl_target_s = route.path, route.path.reason, itl
        # A fetch into the decode engine is this request's own pull; one into its prefill engine
        # is a pull of its own (prefill_fetch.py), before the prefill.
        request.peer_fetch = route.fetch if route.fetch is not None and not route.fetch.into_prefill else None
        decode_engine = self.registry.engines.get(route.decode.engine_id)
        request.decode_tp_size = decode_engine.tp_size if decode_engine is not None else 0
        self._take_slot(request, route.decode.engine_id)
        if route.prefill.engine_id is not None:
            self._take_slot(request, route.prefill.engine_id)
        prefilling = route.prefill.engine_id or route.decode.engine_id
        self._add_backlog(request, prefilling, route.path.num_uncached_tokens)
        self._register_itl(request, route.decode.engine_id)
        return request, route

    # -- path costs: backlog, measurements, ITL targets ---------------------------------------

    @property
    def costs(self) -> PathCosts:
        return self.router.path.costs

    def _add_backlog(self, request: Request, engine_id: str, num_tokens: int) -> None:
        request.backlog = (engine_id, self.costs.add_backlog(engine_id, num_tokens))

    def _settle_backlog(self, request: Request, engine_id: str, seconds: float | None) -> None:
        """The engine computed (or gave up on) this request's prompt; `seconds` since dispatch
        of a remote prefill feeds the prefill fit (None: nothing to learn)."""
        if request.backlog is None or request.backlog[0] != engine_id:
            return
        _, ticket = request.backlog
        request.backlog = None
        self.costs.settle_backlog(engine_id, ticket, seconds)

    def _register_itl(self, request: Request, engine_id: str | None) -> None:
        """Moves the request's ITL target to the decode engine it runs on (None: removes it)."""
        if request.itl_target_s is None:
            return
        if request.itl_engine is not None:
            self.costs.remove_itl_target(request.itl_engine, request.itl_target_s)
        request.itl_engine = engine_id
        if engine_id is not None:
            self.costs.add_itl_target(engine_id, request.itl_target_s)

    def _views(self, role: Role, exclude: frozenset[str] = frozenset()) -> list[EngineView]:
        """The routable engines of `role` with room, as views (kept between requests where
        unchanged: `EngineViews`)."""
        return self.engine_views.views(role, exclude)

    def _no_decode_error(self, exclude: frozenset[str]) -> RequestError:
        if any(e.engine_id not in exclude for e in self.registry.routable(Role.DECODE)):
            return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"every decode engine has {self.admission.max_inflight_per_engine} requests in request")
        return RequestError(grpc.StatusCode.UNAVAILABLE, "no healthy decode engine")

    def _take_slot(self, request: Request, engine_id: str) -> None:
        if self.admission.try_acquire(engine_id):
            request.slots.append(engine_id)

    def _give_slot(self, request: Request, engine_id: str) -> None:
        if engine_id in request.slots:
            request.slots.remove(engine_id)
            self.admission.release(engine_id)

    def _engine(self, engine_id: str) -> EngineState:
        engine = self.registry.engine(engine_id)
        if engine is None or not engine.routable:
            raise LegFailed(f"engine {engine_id} is not available")
        return engine

    # -- the request path ---------------------------------------------------------------------

    async def _run(self, request: Request, route: Route) -> AsyncIterator[gen_pb.GenerateResponse]:
        descriptor: eng_pb.TransferDescriptor | None = None
        if route.prefill.engine_id is not None:
            fetched = 0
            if route.fetch is not None and route.fetch.into_prefill:  # decision 0046
                fetched = await self.prefill_fetch.run(request, route.fetch)
            response = await self._prefill_leg(request, route.prefill.engine_id)
            if response is not None and route.fetch is not None and fetched:
                self.prefill_fetch.settle(request, route.fetch, fetched)
            if response is not None:
                yield self._chunk(request, [response.first_token_id], response.first_token_text)
                if response.finish_reason in _FINISH_FROM_ENGINE:
                    yield self._complete(request, response.finish_reason)
                    return
                descriptor = response.descriptor
        elif route.fetch is not None:
            descriptor = await self._peer_fetch_leg(request, route.fetch)
        async for out in self._decode_leg(request, route.decode.engine_id or "", descriptor):
            yield out

    def _remaining(self, request: Request) -> float:
        remaining = self.table.remaining(request)
        if remaining <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"request deadline exceeded after {time.monotonic() - request.arrived:.3f} s")
        return remaining

    def _leg_error(self, request: Request, e: BaseException, what: str) -> Exception:
        """Maps an engine call's failure to LegFailed (recoverable) or RequestError (final)."""
        if isinstance(e, asyncio.CancelledError):
            task = asyncio.current_task()
            if request.engine_failed is None or (task is not None and task.cancelling()):
                raise e
            return LegFailed(f"{what}: {request.engine_failed}")
        assert isinstance(e, grpc.aio.AioRpcError)
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and request.deadline <= self.table.clock():
            return RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline exceeded")
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"engine refused the request: {e.details()}")
        return LegFailed(f"{what}: {e.code().name} {e.details()}")

    async def _prefill_leg(self, request: Request, engine_id: str) -> eng_pb.PrefillResponse | None:
        """Runs prefill (with retries per policy); None means decode-only recompute."""
        while True:
            try:
                engine = self._engine(engine_id)
                request.start_prefill(EngineRef(engine.engine_id, engine.epoch))
                response = await self._call_prefill(request, engine)
                self._give_slot(request, engine_id)
                return response
            except LegFailed as failure:
                logger.warning("request %s: prefill on %s failed: %s", request.request_id, engine_id, failure)
                self._settle_backlog(request, engine_id, None)
                self._give_slot(request, engine_id)
                self._abort_on(engine_id, request.request_id)
                next_engine = self._next_prefill(request, engine_id)
                self.telemetry.prefill_failed(retried=next_engine is not None)
                request.prefill_failed(engine_id, retry=next_engine is not None)
                if next_engine is None:
                    return None  # decode-only: the decode engine computes the prompt
                engine_id = next_engine
                self._take_slot(request, engine_id)

    async def _peer_fetch_leg(self, request: Request, fetch: PeerFetch) -> eng_pb.TransferDescriptor | None:
        """Asks the holder to pin the prompt's first `fetch.num_blocks` blocks for the target's
        pull (a Prefill with `peer_fetch`: pdserve's engine pins what it still caches of them
        without computing, decision 0049, so the descriptor may cover fewer, and the target
        computes the rest; a vLLM engine computes what it no longer caches); the descriptor, or
        None when the holder cannot (the target then computes the whole prompt). Waits at most
        `peer_fetch_timeout_s`: a slow holder costs no more than that."""
        request.fetch_started_at = time.monotonic()
        try:
            engine = self._engine(fetch.holder_id)
            if engine.epoch != fetch.holder_epoch:
                raise LegFailed(f"holder {fetch.holder_id} restarted")
            request.start_prefill(EngineRef(engine.engine_id, engine.epoch))
            message = eng_pb.PrefillRequest(request_id=request.request_id,
                                            prompt_token_ids=request.valid.prompt_token_ids[:fetch.num_tokens],
                                            sampling=gen_pb.SamplingParams(max_tokens=1, temperature=0.0),
                                            decode_tp_size=request.decode_tp_size, peer_fetch=True)
            call = self.channels.stub(engine).Prefill(message, timeout=self._fetch_timeout_s(request, fetch))
            request.call = call
            started = time.monotonic()
            try:
                response: eng_pb.PrefillResponse = await call
            finally:
                request.outside_s += time.monotonic() - started
                request.call = None
            d = response.descriptor
            if (d.engine_id, d.epoch) != (engine.engine_id, engine.epoch) or not d.block_ids \
                    or not 0 < d.num_tokens <= min(fetch.num_tokens, len(d.block_ids) * fetch.block_size):
                raise LegFailed(f"holder answered {len(d.block_ids)} blocks ({d.num_tokens} tokens) of "
                                f"{d.engine_id!r} epoch {d.epoch:#x}")
        except (LegFailed, grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            if isinstance(e, asyncio.CancelledError) and request.engine_failed is None:
                raise  # the client left
            request.engine_failed = None
            logger.info("request %s: peer fetch from %s failed, recomputing: %s", request.request_id,
                        fetch.holder_id, e)
            self._peer_fetch_failed(request, fetch, "pin_failed")
            if request.state == RequestState.PREFILLING:
                self._abort_on(fetch.holder_id, request.request_id)
                request.prefill_failed(fetch.holder_id, retry=False)
            return None
        request.peer_fetch_pinned(self._lease_deadline(d.lease_expires_unix_ms))
        return d

    def _fetch_timeout_s(self, request: Request, fetch: PeerFetch) -> float:
        """How long the holder's pin (and a prefill engine's pull) may take: `peer_fetch_timeout_s`,
        and no more than twice the TTFT predicted without the fetch (at least
        `MIN_FETCH_TIMEOUT_S`): one that slow has lost what the fetch was to save (a busy
        holder's queue, seconds on a loaded host)."""
        limit = self.config.peer_fetch_timeout_s
        if fetch.without_s is not None:
            limit = min(limit, max(MIN_FETCH_TIMEOUT_S, 2.0 * fetch.without_s))
        return min(self._remaining(request), limit)

    def _peer_fetch_failed(self, request: Request, fetch: PeerFetch, reason: str) -> None:
        if request.peer_fetch_failed:
            return
        request.peer_fetch_failed = True
        self.metrics.peer_fetch_failed(fetch.holder_id, fetch.target_id, PEER_FETCH_TRANSPORT, reason)

    def _next_prefill(self, request: Request, failed: str) -> str | None:
        if self.config.prefill_failure_policy != "retry" or request.num_prefill_attempts >= self.config.max_prefill_attempts:
            return None
        views = self._views(Role.PREFILL, frozenset(request.failed_prefill_engines | {failed}))
        if not views:
            return None
        return self.router.policy.choose_prefill(RoutingRequest([], request.num_prompt_tokens), views).engine_id

    async def _call_prefill(self, request: Request, engine: EngineState) -> eng_pb.PrefillResponse:
        message = eng_pb.PrefillRequest(request_id=request.request_id, prompt_token_ids=request.valid.prompt_token_ids,
                                        sampling=request.valid.sampling, decode_tp_size=request.decode_tp_size)
        self._dispatched(request)
        call = self.channels.stub(engine).Prefill(message, timeout=self._remaining(request))
        request.call = call
        try:
            started = time.monotonic()
            try:
                response: eng_pb.PrefillResponse = await call
            finally:
                request.outside_s += time.monotonic() - started
            self._settle_backlog(request, engine.engine_id, time.monotonic() - started)
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
            raise self._leg_error(request, e, "prefill") from None
        finally:
            request.call = None
        d = response.descriptor
        if response.finish_reason not in _FINISH_FROM_ENGINE and (d.engine_id != engine.engine_id
                                                                  or d.epoch != engine.epoch):
            raise LegFailed(f"prefill answered for engine {d.engine_id!r} epoch {d.epoch:#x}, "
                            f"expected {engine.engine_id!r} epoch {engine.epoch:#x}")
        request.prefill_done(self._lease_deadline(d.lease_expires_unix_ms), response.num_cached_tokens)
        return response

    def _dispatched(self, request: Request) -> None:
        request.engine_failed = None
        if not request.dispatched:
            request.dispatched = True
            self.metrics.observe_queue_time(time.monotonic() - request.arrived)

    def _lease_deadline(self, lease_expires_unix_ms: int) -> float:
        if lease_expires_unix_ms:
            return self.table.clock() + (lease_expires_unix_ms / 1000.0 - time.time())
        return self.table.clock() + self.config.lease_s

    async def _decode_leg(self, request: Request, engine_id: str,
                          descriptor: eng_pb.TransferDescriptor | None) -> AsyncIterator[gen_pb.GenerateResponse]:
        while True:
            try:
                engine = self._engine(engine_id)
                ref = EngineRef(engine.engine_id, engine.epoch)
                if request.decode is None:
                    request.start_decode(ref)
                else:
                    request.migrate(ref)
                if descriptor is not None and request.prefill is not None:
                    self.control.tracker.start(request.request_id, request.prefill, ref)
                self._register_itl(request, engine.engine_id)
                async for out in self._stream_decode(request, engine, descriptor):
                    yield out
                return
            except LegFailed as failure:
                logger.warning("request %s: decode on %s failed: %s", request.request_id, engine_id, failure)
                self.metrics.count_migration("decode_failed")
                self._settle_backlog(request, engine_id, None)
                engine_id = self._migration_target(request, engine_id)
                descriptor = None

    def _migration_target(self, request: Request, failed: str) -> str:
        self._drop_transfer(request, ReleaseCause.TRANSFER_FAILED)
        self._abort_on(failed, request.request_id)
        self._give_slot(request, failed)
        if request.num_migrations >= self.config.max_migrations:
            raise RequestError(grpc.StatusCode.UNAVAILABLE,
                               f"decode failed {request.num_migrations + 1} times; giving up")
        exclude = frozenset(request.failed_decode_engines | {failed})
        choice = self.router.choose_decode(self._views(Role.DECODE, exclude))
        if choice.engine_id is None:
            raise self._no_decode_error(exclude)
        if request.decode is None:  # the failure came before the decode leg opened
            request.failed_decode_engines.add(failed)
        self._take_slot(request, choice.engine_id)
        return choice.engine_id

    async def _stream_decode(self, request: Request, engine: EngineState,
                             descriptor: eng_pb.TransferDescriptor | None) -> AsyncIterator[gen_pb.GenerateResponse]:
        message = eng_pb.DecodeRequest(request_id=request.request_id, prompt_token_ids=request.valid.prompt_token_ids,
                                       output_token_ids=request.output_token_ids, sampling=request.valid.sampling)
        if descriptor is not None:
            message.descriptor.CopyFrom(descriptor)
        self._dispatched(request)
        call = self.channels.stub(engine).Decode(message, timeout=self._remaining(request))
        request.call = call
        request.leg_started_at, request.kv_ready_at = time.monotonic(), None
        first = True
        try:
            responses = aiter(call)
            while True:
                waiting = time.monotonic()
                try:
                    response = await anext(responses)
                except StopAsyncIteration:
                    break
                finally:
                    request.outside_s += time.monotonic() - waiting
                if first and descriptor is not None:
                    self._transferred(request, engine.engine_id, response.num_transferred_tokens)
                if first:
                    self._settle_backlog(request, engine.engine_id, None)  # see PathCosts: not sampled
                    request.num_cached_tokens = max(request.num_cached_tokens, response.num_cached_tokens)
                    first = False
                if response.token_ids:
                    yield self._chunk(request, list(response.token_ids), response.text)
                if response.finish_reason in _FINISH_FROM_ENGINE:
                    yield self._complete(request, response.finish_reason)
                    if tracing_active():
                        await _read_to_end(responses)
                    return
                if response.finish_reason == gen_pb.FINISH_REASON_ABORT:
                    raise LegFailed("the decode engine aborted the request")
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
            raise self._leg_error(request, e, "decode") from None
        finally:
            request.call = None
            call.cancel()  # closed early (the client left): the engine's stream ends now, not at GC
        raise LegFailed("decode stream ended without a finish reason")

    def _transferred(self, request: Request, decode_id: str, num_tokens: int) -> None:
        """The decode engine reported the prompt tokens it pulled; with the KVReady time this is
        one sample of the pair's transfer cost."""
        if request.peer_fetch_engine_id and not request.prefill_engine_id:  # a peer's prefix, pulled
            self._peer_fetched(request, decode_id, num_tokens)
            return
        request.num_transferred_tokens = num_tokens
        self.metrics.count_transferred_tokens(num_tokens)
        if request.kv_ready_at is not None and request.prefill_engine_id:
            self.costs.observe_transfer(request.prefill_engine_id, decode_id, num_tokens,
                                        request.kv_ready_at - request.leg_started_at)

    def _peer_fetched(self, request: Request, decode_id: str, num_tokens: int) -> None:
        """A peer fetch's outcome: the tokens pulled (0 when the pull failed and the decode
        engine recomputed them), one sample of the pair's transfer fit, the metrics."""
        holder = request.peer_fetch_engine_id
        if request.peer_fetch_failed:
            return
        request.num_peer_fetched_tokens = num_tokens
        num_blocks = -(-num_tokens // self.config.block_size)
        engine = self.registry.engine(holder)
        block_bytes = engine.kv_block_bytes if engine is not None else 0
        seconds = None
        if request.kv_ready_at is not None:
            seconds = request.kv_ready_at - (request.fetch_started_at or request.leg_started_at)
            self.costs.observe_transfer(holder, decode_id, num_tokens, request.kv_ready_at - request.leg_started_at)
        self.metrics.peer_fetched(holder, decode_id, PEER_FETCH_TRANSPORT, num_blocks, num_blocks * block_bytes,
                                  seconds)

    def _chunk(self, request: Request, token_ids: list[int], text: str) -> gen_pb.GenerateResponse:
        now = time.monotonic()
        if request.first_token_at is None:
            self.metrics.observe_ttft(now - request.arrived, request.path_name)
            self.metrics.count_first_tokens(len(token_ids))
            self._first_token(request, now)
        else:
            self.metrics.observe_inter_token_latency(now - request.last_token_at, len(token_ids))
            if len(request.output_token_ids) >= 2:  # the gap before the second token holds the transfer
                decode_id = request.decode.engine_id if request.decode is not None else None
                self.costs.observe_itl((now - request.last_token_at) / len(token_ids), decode_id, now)
        index = request.stream(token_ids, now)
        return gen_pb.GenerateResponse(request_id=request.client_id,
                                       chunk=gen_pb.Chunk(token_ids=token_ids, text=text, index=index))

    def _first_token(self, request: Request, now: float) -> None:
        """The decision's outcome: the actual TTFT beside the prediction, fed back to the cost
        model when the request took the path decided (not after a failed prefill or a migration)."""
        request.ttft_s = now - request.arrived
        decision = request.path
        if decision is None or decision.predicted_ttft_s is None:
            return
        if request.peer_fetch_engine_id:  # a fetch's error, not the local path's: only recorded
            self.metrics.observe_path_ttft_error("peer_fetch", abs(decision.predicted_ttft_s - request.ttft_s)
                                                 / request.ttft_s)
            return
        local = not request.prefill_engine_id
        if local != decision.local or (not local and request.prefill_engine_id != decision.prefill_id) \
                or request.num_migrations:
            return
        self.metrics.observe_path_ttft_error(decision.path,
                                             abs(decision.predicted_ttft_s - request.ttft_s) / request.ttft_s)
        if local:
            uncached = max(1, request.num_prompt_tokens - request.num_cached_tokens)
            self.costs.observe_local_prefill(decision.decode_id, now, uncached)
        self.router.path.observe_ttft(decision, request.ttft_s)

    def _count_tiers(self, request: Request) -> None:
        """The request's prompt tokens by where their KV came from (the dashboard's hit rate by tier)."""
        own, peer = request.num_cached_tokens, request.num_peer_fetched_tokens
        self.metrics.count_prompt_tiers(own, peer, max(0, request.num_prompt_tokens - own - peer))

    def _complete(self, request: Request, finish_reason: int) -> gen_pb.GenerateResponse:
        if self.load_window is not None:
            self.load_window.finished(_finished(request))
        usage = gen_pb.Usage(prompt_tokens=request.num_prompt_tokens, cached_tokens=request.num_cached_tokens,
                             transferred_tokens=request.num_transferred_tokens,
                             generated_tokens=len(request.output_token_ids),
                             peer_fetched_tokens=request.num_peer_fetched_tokens)
        self._count_tiers(request)
        complete = gen_pb.Complete(finish_reason=finish_reason, usage=usage,  # type: ignore[arg-type]
                                   prefill_engine_id=request.prefill_engine_id,
                                   decode_engine_id=request.decode.engine_id if request.decode else "",
                                   num_migrations=request.num_migrations, path_reason=request.path_reason,
                                   scheduler_overhead_ms=1000.0 * max(0.0, time.monotonic() - request.arrived
                                                                       - request.outside_s),
                                   ttft_ms=1000.0 * (request.ttft_s or 0.0),
                                   peer_fetch_engine_id=request.peer_fetch_engine_id
                                   if request.num_peer_fetched_tokens else "")
        if request.path is not None and request.path.predicted_ttft_s is not None:
            complete.predicted_ttft_ms = 1000.0 * request.path.predicted_ttft_s
            if request.path.alternative_ttft_s is not None:
                complete.alternative_ttft_ms = 1000.0 * request.path.alternative_ttft_s
        return gen_pb.GenerateResponse(request_id=request.client_id, complete=complete)

    # -- the end of a request -----------------------------------------------------------------

    def _end(self, request: Request, state: RequestState, reason: str) -> None:
        """Ends a request once: aborts live legs, releases prefill blocks, frees slots."""
        if not self.table.owns(request):
            return
        if not request.done:
            if state == RequestState.FINISHED and request.state not in RUNNING:
                state = RequestState.FAILED
            request.finish(state, reason)
        if request.state != RequestState.FINISHED:
            if request.decode is not None:
                self._abort_on(request.decode.engine_id, request.request_id)
            if request.prefill is not None and not request.prefill_pinned:
                self._abort_on(request.prefill.engine_id, request.request_id)
        cause = ReleaseCause.FINISHED if request.state == RequestState.FINISHED else ReleaseCause.ABORT
        self._drop_transfer(request, cause)
        self._abort_counters(request)
        for engine_id in list(request.slots):
            self._give_slot(request, engine_id)
        if request.backlog is not None:
            self._settle_backlog(request, request.backlog[0], None)
        self._register_itl(request, None)
        self.table.remove(request)
        outcome = {RequestState.FINISHED: "success", RequestState.FAILED: "error"}.get(
            request.state, "deadline" if reason == "deadline" else "cancelled")
        if not request.internal:
            self.metrics.request_finished(outcome, time.monotonic() - request.arrived, request.path_name)

    def _abort_counters(self, request: Request) -> None:
        """Drops the request's pending transfer counters (late reports of it are absorbed) on
        every engine it was sent to — its prefill and decode engines and those it left — not
        on every engine: per request that was O(engines) work and as many remembered ids."""
        aggregator = self.control.aggregator
        for engine_id in request.engines_sent_to():
            if aggregator.engine_epoch(engine_id) is not None:
                aggregator.abort(request.request_id, engine_id)

    def _drop_transfer(self, request: Request, cause: ReleaseCause) -> None:
        """Stops tracking the request's transfer and releases its prefill blocks (once)."""
        self.control.tracker.cancel(request.request_id)
        if request.prefill is not None and request.release_prefill(cause):
            self.control.release(request.prefill, request.request_id)

    def _abort_on(self, engine_id: str, request_id: str) -> None:
        engine = self.registry.engine(engine_id)
        if engine is None:
            return
        stub = self.channels.stub(engine)

        async def abort() -> None:
            try:
                await stub.Abort(eng_pb.AbortRequest(request_id=request_id), timeout=ABORT_RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                logger.debug("abort of %s on %s failed: %s", request_id, engine_id, e.code().name)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- hooks from the Control servicer ------------------------------------------------------

    def on_transfer_outcome(self, outcome: TransferOutcome) -> None:
        """Applies the release-once rule, then delivers the outcome to its engine."""
        request = self.table.get(outcome.request_id)
        if outcome.kind == OutcomeKind.RELEASE:
            cause = ReleaseCause.TRANSFER_FAILED if outcome.failed else ReleaseCause.TRANSFERRED
            if request is None:
                self.table.release_noops[cause] += 1
                return
            if not request.release_prefill(cause):
                return
        elif outcome.kind == OutcomeKind.KV_READY and request is not None:
            request.kv_arrived(time.monotonic())
        elif outcome.kind == OutcomeKind.KV_FAILED and request is not None and request.peer_fetch is not None \
                and request.peer_fetch_engine_id:
            self._peer_fetch_failed(request, request.peer_fetch, "transfer_failed")
        self.control.deliver(outcome)

    def on_engine_down(self, ref: EngineRef, reason: str) -> None:
        """Fails the legs running on a dead engine over (their calls are cancelled)."""
        for request in self.table:
            if request.prefill == ref and request.prefill_pinned:
                request.release_prefill(ReleaseCause.ENGINE_GONE)
            if request.on_leg(ref):
                request.cancel_leg(f"engine {ref.engine_id} down: {reason}")

    # -- drain --------------------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> bool:
        """Refuses new requests and waits for the in-flight ones; True when none is left."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.table and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.table

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.channels.close()


def _finished(request: Request) -> FinishedRequest:
    """A finished request as the role planner's load window sees it."""
    n = len(request.output_token_ids)
    itl = None
    if n > 1 and request.first_token_at is not None:
        itl = (request.last_token_at - request.first_token_at) / (n - 1)
    return FinishedRequest(time.monotonic(), request.arrived, request.num_prompt_tokens, request.num_cached_tokens, n,
                           request.ttft_s, itl, None, request.itl_target_s, request.valid.max_tokens)
