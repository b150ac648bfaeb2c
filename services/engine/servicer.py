"""`EngineServicer`: the Engine gRPC API (Prefill, Decode, Abort, Release, Drain, Inspect) over
any `EngineBackend`.

Everything that does not depend on which engine runs lives here: readiness and drain answers,
the role check, request-id and epoch checks, the `prefill` / `decode` spans (continuing the
scheduler's W3C context; the decode span's context rides the pull to every rank), and the one
table that maps a backend's typed errors to gRPC status codes. No engine imports: protobuf is
converted by `services.engine.convert`, engines are reached through the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterator

import grpc

from pdserve.v1 import engine_pb2 as pb
from pdserve.v1 import engine_pb2_grpc as pb_grpc
from services.common.config import EngineConfig
from services.common.tracing import ComponentTracer, trace_carrier
from services.engine import convert
from services.engine.backend import (
    BackendError,
    BackendLoad,
    DuplicateRequest,
    EngineBackend,
    InvalidRequest,
    NotCached,
    NotReady,
    OutOfBlocks,
    RequestAborted,
)

DRAIN_POLL_S = 0.1

STATUS: dict[type[BackendError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    DuplicateRequest: grpc.StatusCode.ALREADY_EXISTS,
    OutOfBlocks: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestAborted: grpc.StatusCode.ABORTED,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    NotCached: grpc.StatusCode.FAILED_PRECONDITION,
}


class _Refusal(Exception):
    """A backend error caught in a sync context manager, aborted with afterwards."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@contextlib.contextmanager
def _status_codes() -> Iterator[None]:
    try:
        yield
    except BackendError as e:
        raise _Refusal(STATUS.get(type(e), grpc.StatusCode.INTERNAL), str(e)) from e


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(self, config: EngineConfig, backend: EngineBackend) -> None:
        self.config = config
        self.role = config.role
        self.backend = backend
        self.draining = False
        self.tracer = ComponentTracer(config.role)

    def start_draining(self) -> None:
        """New Prefill / Decode calls are refused from now on; the scheduler is told."""
        self.draining = True
        self.backend.set_draining(True)

    async def wait_drained(self, timeout: float) -> BackendLoad:
        """Waits until no request runs, waits or is pinned (or timeout); returns the last load."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            load = await self.backend.load()
            if load.num_busy == 0 or asyncio.get_running_loop().time() >= deadline:
                return load
            await asyncio.sleep(DRAIN_POLL_S)

    # -- checks -----------------------------------------------------------------------------

    async def _check_started(self, context: grpc.aio.ServicerContext) -> None:
        if not self.backend.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still starting")

    async def _check_admits(self, context: grpc.aio.ServicerContext, role: str | None, request_id: str) -> None:
        """`role`: the leg the call serves ("prefill" / "decode"); None: either (a peer fetch)."""
        await self._check_started(context)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is draining")
        if role is not None and not self.backend.role_state.admits(role):
            await self.backend.sync_role()  # a role changed in another process (vLLM's rank 0) is read now
        if role is not None and not self.backend.role_state.admits(role):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this is a {self.backend.role_state.role} engine")
        if not request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must be non-empty")

    # -- RPCs -------------------------------------------------------------------------------

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        with self.tracer.span("prefill", request_id=request.request_id,
                              attributes={"pdserve.engine_id": self.config.engine_id,
                                          "pdserve.prompt_tokens": len(request.prompt_token_ids)}) as span:
            # A peer fetch pins a prefix held here for another engine's pull: either role serves it.
            await self._check_admits(context, None if request.peer_fetch else "prefill", request.request_id)
            try:
                with _status_codes():
                    result = await self.backend.prefill(convert.prefill_from_proto(request))
            except _Refusal as e:
                await context.abort(e.code, str(e))
            span.set_attribute("pdserve.cached_tokens", result.num_cached_tokens)
            span.set_attribute("pdserve.kv.blocks", len(result.descriptor.block_ids))
            return convert.prefill_to_proto(request.request_id, result)

    async def Decode(self, request: pb.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeResponse]:
        try:
            async with contextlib.aclosing(self._decode(request, context)) as responses:
                async for response in responses:
                    yield response
        except _Refusal as e:
            await context.abort(e.code, str(e))

    async def _decode(self, request: pb.DecodeRequest,
                      context: grpc.aio.ServicerContext) -> AsyncGenerator[pb.DecodeResponse, None]:
        with self.tracer.span("decode", request_id=request.request_id,
                              attributes={"pdserve.engine_id": self.config.engine_id,
                                          "pdserve.prompt_tokens": len(request.prompt_token_ids),
                                          "pdserve.remote_kv": request.HasField("descriptor")}):
            # A peer fetch pulls a prefix into this engine's cache for a prompt it prefills next:
            # either role serves it (decision 0046); it needs the descriptor it pulls.
            await self._check_admits(context, None if request.peer_fetch else "decode", request.request_id)
            remote = request.HasField("descriptor")
            if request.peer_fetch and not remote:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a peer_fetch Decode needs a descriptor")
            if remote and request.descriptor.block_size != self.config.block_size:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"descriptor block_size "
                                    f"{request.descriptor.block_size} != {self.config.block_size}")
            carrier = trace_carrier() if remote else None  # the decode span's context, for every rank
            with _status_codes():
                deltas = self.backend.decode(convert.decode_from_proto(request, carrier))
                async with contextlib.aclosing(deltas):
                    async for delta in deltas:
                        yield convert.delta_to_proto(request.request_id, delta)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._check_started(context)
        return pb.AbortResponse(found=await self.backend.abort(request.request_id))

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        await self._check_started(context)
        epoch = self.backend.epoch
        if request.epoch and request.epoch != epoch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"epoch {request.epoch:x} is not this engine's ({epoch:x})")
        return pb.ReleaseResponse(found=await self.backend.release(request.request_id))

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        self.start_draining()
        if not self.backend.ready:
            return pb.DrainResponse()  # nothing can run on an engine still starting
        load = await self.wait_drained(self.config.drain_timeout_s)
        return pb.DrainResponse(num_pinned=load.num_pinned, num_running=load.num_running)

    async def Inspect(self, request: pb.InspectRequest, context: grpc.aio.ServicerContext) -> pb.InspectResponse:
        await self._check_started(context)
        found = await self.backend.inspect()
        load = found.load
        return pb.InspectResponse(engine_id=self.config.engine_id, epoch=self.backend.epoch, role=self.backend.role_state.role,
                                  num_running=load.num_running, num_waiting=load.num_waiting,
                                  num_pinned=load.num_pinned, num_waiting_for_remote_kv=load.num_waiting_for_remote_kv,
                                  num_free_blocks=load.num_free_blocks, num_blocks=load.num_blocks, leaks=found.leaks,
                                  peer_transports=[pb.PeerTransport(engine_id=p.engine_id, epoch=p.epoch,
                                                                    tp_rank=p.tp_rank, transport=p.transport)
                                                   for p in found.peer_transports])
