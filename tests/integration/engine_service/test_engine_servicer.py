"""`EngineServicer` over a scripted `EngineBackend`, through a real gRPC server on 127.0.0.1:0:
the status-code table, the checks every backend gets for free (readiness, drain, role, request
id, epoch, block size), conversion both ways, and cancellation reaching the backend. Real
backends are covered end to end (tests/e2e, tests/vllm). About 3 s, no torch."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import pytest

from connectors.ucx.handshake import KVTransferDescriptor
from pdserve.v1 import engine_pb2 as pb
from pdserve.v1 import engine_pb2_grpc as pb_grpc
from pdserve.v1 import generation_pb2 as gen_pb
from services.common.config import EngineConfig
from services.common.grpc_server import ServiceServer, insecure_channel
from services.engine.backend import (
    BackendError,
    BackendLoad,
    DecodeInput,
    DuplicateRequest,
    Inspection,
    InvalidRequest,
    NotCached,
    NotReady,
    OutOfBlocks,
    PrefillInput,
    PrefillResult,
    RequestAborted,
    TokenDelta,
)
from services.engine.role_state import EngineRole
from services.engine.servicer import EngineServicer

EPOCH = 0x1235


class ScriptedBackend:
    """Answers from a script; records what reached it."""

    def __init__(self) -> None:
        self.ready = True
        self.failed = False
        self.epoch = EPOCH
        self.draining = False
        self.error: BackendError | None = None
        self.prefills: list[PrefillInput] = []
        self.decodes: list[DecodeInput] = []
        self.cancelled: list[str] = []
        self.closed: list[str] = []
        self.stream = False
        self.released: list[str] = []
        self.busy = 0
        self.hold = asyncio.Event()
        self.role_state = EngineRole("decode")
        self.pending_roles: list[tuple[str, int]] = []  # taken where the backend reads them on sync_role
        self.role_syncs = 0

    async def start(self) -> None: ...

    async def sync_role(self) -> None:
        self.role_syncs += 1
        for role, role_epoch in self.pending_roles:
            self.role_state.apply(role, role_epoch)
        self.pending_roles = []

    def set_draining(self, draining: bool) -> None:
        self.draining = draining

    def shutdown(self) -> None: ...

    async def prefill(self, request: PrefillInput) -> PrefillResult:
        self.prefills.append(request)
        if self.error is not None:
            raise self.error
        descriptor = KVTransferDescriptor("p0", EPOCH, request.request_id, (4, 5), len(request.prompt_token_ids),
                                          1, 16, 2, 99)
        return PrefillResult(7, "x", None, 16, descriptor)

    async def decode(self, request: DecodeInput) -> AsyncGenerator[TokenDelta, None]:
        self.decodes.append(request)
        if self.error is not None:
            raise self.error
        try:
            while self.stream:  # a delta ready at every step: the call is mostly sending
                yield TokenDelta([1], "a", None)
            yield TokenDelta([1, 2], "ab", None, num_cached_tokens=16, num_transferred_tokens=32)
            await self.hold.wait()
            yield TokenDelta([3], "c", "length")
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.closed.append(request.request_id)

    async def abort(self, request_id: str) -> bool:
        return request_id == "known"

    async def release(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True

    async def load(self) -> BackendLoad:
        return BackendLoad(self.busy, 0, 0, 0, 10, 12)

    async def inspect(self) -> Inspection:
        return Inspection(BackendLoad(1, 2, 3, 4, 5, 6), ["a leak"])


@pytest.fixture(params=["decode"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[tuple[ScriptedBackend, pb_grpc.EngineStub,
                                                                        EngineServicer]]:
    backend = ScriptedBackend()
    backend.role_state = EngineRole(request.param, grace_s=0.0)
    servicer = EngineServicer(EngineConfig(role=request.param, engine_id="e0", drain_timeout_s=0.3), backend)
    server = ServiceServer(["pdserve.v1.Engine"])
    pb_grpc.add_EngineServicer_to_server(servicer, server.server)
    port = server.bind("127.0.0.1", 0)
    await server.start()
    channel = insecure_channel(f"127.0.0.1:{port}")
    try:
        yield backend, pb_grpc.EngineStub(channel), servicer
    finally:
        await channel.close()
        await server.stop(0)


def _decode(rid: str = "r1", *, block_size: int = 16) -> pb.DecodeRequest:
    descriptor = pb.TransferDescriptor(engine_id="p0", epoch=3, request_id=rid, block_ids=[4, 5], num_tokens=20,
                                       tp_size=1, block_size=block_size, num_kv_heads=2)
    return pb.DecodeRequest(request_id=rid, prompt_token_ids=list(range(20)), output_token_ids=[9],
                            sampling=gen_pb.SamplingParams(max_tokens=3, temperature=0.0), descriptor=descriptor)


async def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError, match=r"status = StatusCode\.") as info:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call  # type: ignore[misc]
    return info.value.code()


async def test_decode_converts_both_ways_and_streams_deltas(engine) -> None:
    backend, stub, _ = engine
    backend.hold.set()
    responses = [r async for r in stub.Decode(_decode())]
    (seen,) = backend.decodes
    assert seen.request_id == "r1" and seen.prompt_token_ids == list(range(20)) and seen.output_token_ids == [9]
    assert seen.sampling.max_tokens == 3 and seen.sampling.temperature == 0.0
    assert seen.descriptor == KVTransferDescriptor("p0", 3, "r1", (4, 5), 20, 1, 16, 2, 0)
    assert [list(r.token_ids) for r in responses] == [[1, 2], [3]]
    assert (responses[0].num_cached_tokens, responses[0].num_transferred_tokens) == (16, 32)
    assert responses[1].finish_reason == gen_pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize(("error", "code"), [
    (InvalidRequest("max_tokens must be >= 1"), grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequest("request r1 is already running here"), grpc.StatusCode.ALREADY_EXISTS),
    (OutOfBlocks("not enough free KV blocks"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestAborted("request r1 was aborted"), grpc.StatusCode.ABORTED),
    (NotReady("engine is still starting"), grpc.StatusCode.UNAVAILABLE),
    (NotCached("no block of the prefix is cached here any more"), grpc.StatusCode.FAILED_PRECONDITION),
])
async def test_backend_errors_map_to_status_codes_with_their_message(engine, error, code) -> None:
    backend, stub, _ = engine
    backend.error = error
    with pytest.raises(grpc.aio.AioRpcError, match=code.name) as info:
        async for _ in stub.Decode(_decode()):
            pass
    assert info.value.code() == code and info.value.details() == str(error)


async def test_a_decode_engine_serves_a_peer_fetch_prefill(engine) -> None:
    """Decision 0043: a Prefill with `peer_fetch` (a holder pinning a prefix for another engine's
    pull) is accepted by an engine of either role and reaches the backend marked as such."""
    backend, stub, _ = engine
    response = await stub.Prefill(pb.PrefillRequest(request_id="f", prompt_token_ids=[1, 2], peer_fetch=True))
    (seen,) = backend.prefills
    assert seen.peer_fetch and seen.request_id == "f" and response.descriptor.engine_id


async def test_a_prefill_engine_serves_a_peer_fetch_decode_with_a_descriptor_only(engine) -> None:
    """Decision 0046: a Decode with `peer_fetch` (a prefill engine pulling a peer's prefix into
    its cache) is accepted whatever the role; without the descriptor it pulls, refused."""
    backend, stub, _ = engine
    backend.role_state.apply("prefill", 1, "test")  # grace 0: a plain Decode is refused now
    assert await _code(stub.Decode(_decode())) == grpc.StatusCode.FAILED_PRECONDITION
    backend.hold.set()
    fetch = _decode("f")
    fetch.peer_fetch = True
    assert [list(r.token_ids) async for r in stub.Decode(fetch)] == [[1, 2], [3]]
    (seen,) = backend.decodes
    assert seen.request_id == "f" and seen.descriptor is not None
    fetch.ClearField("descriptor")
    fetch.request_id = "g"
    assert await _code(stub.Decode(fetch)) == grpc.StatusCode.INVALID_ARGUMENT
    assert len(backend.decodes) == 1  # refused before the backend


async def test_admission_follows_the_role_set_in_place(engine) -> None:
    backend, stub, servicer = engine
    assert backend.role_state.apply("prefill", 1, "test") is not None  # grace 0: the old role's calls end now
    assert await _code(stub.Decode(_decode())) == grpc.StatusCode.FAILED_PRECONDITION
    inspected = await stub.Inspect(pb.InspectRequest())
    assert inspected.role == "prefill"
    backend.role_state.apply("mixed", 2)
    assert await _code(stub.Prefill(pb.PrefillRequest(request_id="p", prompt_token_ids=[1]))) \
        == grpc.StatusCode.FAILED_PRECONDITION  # mixed engines take Decode (their prompts come with it)


async def test_a_role_changed_in_another_process_is_read_before_a_call_is_refused(engine) -> None:
    """Decision 0047: a vLLM engine's SetRole reaches its rank-0 worker, not the service. A call
    the role last seen would refuse makes the servicer read the role first: the new role's calls
    are served as soon as the scheduler routes them; a call neither role takes is still refused."""
    backend, stub, _ = engine
    backend.pending_roles = [("prefill", 1)]
    response = await stub.Prefill(pb.PrefillRequest(request_id="p", prompt_token_ids=[1, 2]))
    assert response.descriptor.engine_id and backend.role_state.role == "prefill" and backend.role_syncs == 1
    assert await _code(stub.Decode(_decode())) == grpc.StatusCode.FAILED_PRECONDITION
    assert backend.role_syncs == 2 and not backend.decodes
    await stub.Prefill(pb.PrefillRequest(request_id="q", prompt_token_ids=[1]))
    assert backend.role_syncs == 2, "a call the role admits reads nothing"


async def test_checks_every_backend_gets(engine) -> None:
    backend, stub, servicer = engine
    assert await _code(stub.Prefill(pb.PrefillRequest(request_id="p", prompt_token_ids=[1]))) \
        == grpc.StatusCode.FAILED_PRECONDITION  # a decode engine
    assert await _code(stub.Decode(_decode(""))) == grpc.StatusCode.INVALID_ARGUMENT
    assert await _code(stub.Decode(_decode(block_size=32))) == grpc.StatusCode.INVALID_ARGUMENT
    assert await _code(stub.Release(pb.ReleaseRequest(request_id="x", epoch=EPOCH + 2))) \
        == grpc.StatusCode.FAILED_PRECONDITION
    assert backend.decodes == [] and backend.released == []  # refused before the backend
    assert (await stub.Release(pb.ReleaseRequest(request_id="x", epoch=EPOCH))).found
    assert (await stub.Abort(pb.AbortRequest(request_id="known"))).found
    assert not (await stub.Abort(pb.AbortRequest(request_id="other"))).found
    inspected = await stub.Inspect(pb.InspectRequest())
    assert (inspected.epoch, inspected.num_blocks, list(inspected.leaks)) == (EPOCH, 6, ["a leak"])
    backend.ready = False
    assert await _code(stub.Decode(_decode())) == grpc.StatusCode.UNAVAILABLE
    assert await _code(stub.Inspect(pb.InspectRequest())) == grpc.StatusCode.UNAVAILABLE
    backend.ready = True
    backend.busy = 1
    drained = await stub.Drain(pb.DrainRequest())  # times out after drain_timeout_s, still busy
    assert drained.num_running == 1 and backend.draining and servicer.draining
    assert await _code(stub.Decode(_decode())) == grpc.StatusCode.UNAVAILABLE


async def test_a_cancelled_call_cancels_the_backend_stream(engine) -> None:
    backend, stub, _ = engine
    call = stub.Decode(_decode("c1"))
    first = await call.read()
    assert list(first.token_ids) == [1, 2]
    call.cancel()
    for _ in range(100):
        if backend.cancelled:
            break
        await asyncio.sleep(0.01)
    assert backend.cancelled == ["c1"]


async def test_a_call_cancelled_while_a_response_is_sent_closes_the_backend_stream(engine) -> None:
    """The cancel lands in gRPC's send, not in the backend's stream: the stream's end closes it
    (with the garbage collector off, nothing else would free a handler caught in a cycle), or
    the backend's request stays in flight."""
    backend, stub, _ = engine
    backend.stream = True
    calls = []
    gc.disable()
    try:
        for i in range(5):
            call = stub.Decode(_decode(f"s{i}"))
            calls.append(call)
            for _ in range(3):
                await call.read()
            call.cancel()
        for _ in range(200):
            if len(backend.closed) == 5:
                break
            await asyncio.sleep(0.01)
    finally:
        gc.enable()
    assert sorted(backend.closed) == [f"s{i}" for i in range(5)]


@pytest.mark.parametrize("engine", ["prefill"], indirect=True)
async def test_prefill_converts_both_ways(engine) -> None:
    backend, stub, _ = engine
    sampling = gen_pb.SamplingParams(max_tokens=1, temperature=0.0, top_k=5, seed=3, stop=["."])
    response = await stub.Prefill(pb.PrefillRequest(request_id="p1", prompt_token_ids=[5, 6, 7], sampling=sampling))
    (seen,) = backend.prefills
    assert (seen.request_id, seen.prompt_token_ids) == ("p1", [5, 6, 7])
    assert (seen.sampling.max_tokens, seen.sampling.top_k, seen.sampling.seed, seen.sampling.stop) == (1, 5, 3, ["."])
    assert (response.first_token_id, response.first_token_text, response.num_cached_tokens) == (7, "x", 16)
    assert response.finish_reason == gen_pb.FINISH_REASON_UNSPECIFIED
    d = response.descriptor
    assert (d.engine_id, d.epoch, d.request_id, list(d.block_ids), d.num_tokens, d.lease_expires_unix_ms) \
        == ("p0", EPOCH, "p1", [4, 5], 3, 99)
