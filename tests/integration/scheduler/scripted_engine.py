"""A scripted Engine service for the scheduler's Generation tests: a real gRPC server with a real
ControlClient, but no model. Real engines are exercised by the end-to-end tests.

Output token i (0-based, over the whole answer) is `BASE + i`, so any gap or repeat across a
migration is visible. A decode leg with a descriptor reports finished_recving on the control
stream and waits for KVReady (or KVFailed) before streaming, as a real decode engine does.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc

from pdserve.v1 import engine_pb2 as pb
from pdserve.v1 import engine_pb2_grpc
from pdserve.v1 import generation_pb2 as gen_pb
from services.common.grpc_server import ServiceServer
from services.engine.control_client import (
    ControlClient,
    ControlHello,
    ControlMessage,
    KVFailed,
    KVReady,
    RankIdentity,
    ReleaseBlocks,
    StepReport,
)

BASE = 100
_epochs = itertools.count(5001)


class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine_id: str, role: str, control_port: int, *, token_delay_s: float = 0.0,
                 fail_decode_after: int | None = None, fail_prefill: bool = False) -> None:
        self.engine_id = engine_id
        self.role = role
        self.epoch = next(_epochs)
        self.control_port = control_port
        self.token_delay_s = token_delay_s
        self.fail_decode_after = fail_decode_after
        self.fail_prefill = fail_prefill
        self.pinned: set[str] = set()
        self.released: list[str] = []
        self.aborted: list[str] = []
        self.decode_requests: list[pb.DecodeRequest] = []
        self.kv_outcomes: list[ControlMessage] = []
        self._kv_events: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.server = ServiceServer(["pdserve.v1.Engine"])
        engine_pb2_grpc.add_EngineServicer_to_server(self, self.server.server)
        self.client: ControlClient | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        port = self.server.bind("127.0.0.1", 0)
        await self.server.start()
        identity = RankIdentity(self.engine_id, self.role, self.epoch, 0, 1)
        hello = ControlHello(identity, "compat-1", f"127.0.0.1:{port}", b"meta", hash_seed="0", block_size=16)
        self.client = ControlClient(f"127.0.0.1:{self.control_port}", hello, on_message=self._on_message,
                                    backoff_initial_s=0.02, backoff_max_s=0.2)
        await asyncio.to_thread(self.client.start, 10.0)

    async def stop(self) -> None:
        if self.client is not None:
            await asyncio.to_thread(self.client.close)
        await self.server.stop(0)

    def _on_message(self, msg: ControlMessage) -> None:
        """Runs on the ControlClient thread."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._handle, msg)

    def _handle(self, msg: ControlMessage) -> None:
        if isinstance(msg, ReleaseBlocks):
            self.released.append(msg.request_id)
            self.pinned.discard(msg.request_id)
        elif isinstance(msg, KVReady | KVFailed):
            self.kv_outcomes.append(msg)
            self._kv_events.setdefault(msg.request_id, asyncio.Event()).set()

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if self.fail_prefill:
            await context.abort(grpc.StatusCode.INTERNAL, "scripted prefill failure")
        self.pinned.add(request.request_id)
        num_blocks = len(request.prompt_token_ids) // 16
        descriptor = pb.TransferDescriptor(engine_id=self.engine_id, epoch=self.epoch, request_id=request.request_id,
                                           block_ids=list(range(num_blocks)),
                                           num_tokens=len(request.prompt_token_ids), tp_size=1, block_size=16)
        finish = gen_pb.FINISH_REASON_LENGTH if request.sampling.max_tokens == 1 else gen_pb.FINISH_REASON_UNSPECIFIED
        return pb.PrefillResponse(request_id=request.request_id, first_token_id=BASE, descriptor=descriptor,
                                  num_cached_tokens=0, finish_reason=finish, first_token_text="t0")

    async def Decode(self, request: pb.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeResponse]:
        self.decode_requests.append(request)
        transferred = 0
        if request.HasField("descriptor"):
            assert self.client is not None
            self.client.report(StepReport(finished_recving=[request.request_id]))
            await self._kv_events.setdefault(request.request_id, asyncio.Event()).wait()
            transferred = request.descriptor.num_tokens
        start = len(request.output_token_ids)
        max_tokens = request.sampling.max_tokens
        for i in range(start, max_tokens):
            if self.fail_decode_after is not None and i - start >= self.fail_decode_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted decode crash")
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            finish = gen_pb.FINISH_REASON_LENGTH if i == max_tokens - 1 else gen_pb.FINISH_REASON_UNSPECIFIED
            yield pb.DecodeResponse(request_id=request.request_id, token_ids=[BASE + i], text=f"t{i}",
                                    finish_reason=finish, num_transferred_tokens=transferred if i == start else 0)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self.aborted.append(request.request_id)
        self.pinned.discard(request.request_id)
        return pb.AbortResponse(found=True)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        self.pinned.discard(request.request_id)
        return pb.ReleaseResponse(found=True)
