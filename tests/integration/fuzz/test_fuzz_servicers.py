"""Every servicer method of a real cluster fed random and mutated protobuf messages.

The scheduler runs in this process (its own event-loop thread, so `leaks()` and the registry can
be read); one prefill and one decode engine run as processes with real UCX between them. For
every method: random well-formed messages (hypothesis strategies from the descriptors) and
byte-mutated encodings, sent raw. A call may be refused with any status the servicer chooses,
but never with UNKNOWN (an unhandled exception: a crash) and, on a unary call, never by running
into the deadline (a hang); mutated bytes that do not parse get INVALID_ARGUMENT with the reason.
Afterwards: the scheduler and both engines report no leaks, no bogus engine registered, and the
cluster still serves a real request. Drain (which legitimately stops an engine taking work) goes
last. Budget: well under a minute of fuzzing on two cores.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from proto_strategies import mutated, seeded

from pdserve.v1 import control_pb2, engine_pb2, generation_pb2, kv_events_pb2
from services.client import Client
from services.common.config import SchedulerConfig, load_config
from services.common.grpc_server import CHANNEL_OPTIONS
from services.local_cluster import ClusterSpec, LocalCluster
from services.scheduler.service import SchedulerService

T = TypeVar("T")
UNARY_TIMEOUT_S = 5.0
STREAM_TIMEOUT_S = 3.0
LONG_LIVED_TIMEOUT_S = 0.5
CRASH = grpc.StatusCode.UNKNOWN


class ThreadedScheduler:
    """A SchedulerService on its own event loop in a daemon thread."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="scheduler-loop", daemon=True)
        self.thread.start()
        self.service: SchedulerService = self.run(self._start(config))

    @staticmethod
    async def _start(config: SchedulerConfig) -> SchedulerService:
        service = SchedulerService(config)
        await service.start()
        return service

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def read(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the scheduler's loop (its state is not thread-safe)."""
        async def call() -> T:
            return fn()

        return self.run(call())

    def close(self) -> None:
        self.run(self.service.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@dataclass
class FuzzCluster:
    scheduler: ThreadedScheduler
    engines: LocalCluster
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    prefilled: list[str] = field(default_factory=list)  # accepted Prefill ids, released at the end
    codes: dict[str, set[str]] = field(default_factory=dict)

    def channel(self, name: str) -> grpc.Channel:
        if name not in self.channels:
            s = self.scheduler.service
            target = {"client": f"127.0.0.1:{s.port}", "control": f"127.0.0.1:{s.control_port}",
                      "events": f"127.0.0.1:{s.events_port}"}.get(name) or self.engines.components[name].address
            self.channels[name] = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        return self.channels[name]

    def engine_ids(self) -> set[str]:
        from services.scheduler.registry import Role

        registry = self.scheduler.service.registry
        return self.scheduler.read(lambda: {e.engine_id for r in Role for e in registry.by_role(r)})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzCluster]:
    config = load_config(SchedulerConfig, env={}, overrides={
        "port": 0, "control_port": 0, "events_port": 0, "metrics_port": 0, "heartbeat_interval_s": 0.2})
    scheduler = ThreadedScheduler(config)
    s = scheduler.service
    spec = ClusterSpec(port=s.port, control_port=s.control_port, events_port=s.events_port, torch_threads=1,
                       kv_cache_memory="64MiB", log_dir=str(tmp_path_factory.mktemp("fuzz")),
                       env={"PDSERVE_TRANSFER_TIMEOUT_S": "2"})
    engines = LocalCluster(spec)
    try:
        engines.start_engines(timeout=240)
        yield FuzzCluster(scheduler, engines)
    finally:
        engines.stop()
        scheduler.close()


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck))


@dataclass(frozen=True, slots=True)
class Method:
    where: str  # "client", "control", "events" or an engine name
    path: str  # /package.Service/Method
    request: Descriptor
    kind: str  # unary_unary, unary_stream, stream_stream
    examples: int
    long_lived: bool = False  # a stream that stays open by design (deadline is not a hang)
    seed: Message | None = None  # a valid request, so accepting paths are fuzzed too
    timeout_s: float = STREAM_TIMEOUT_S  # for streams; unary calls get UNARY_TIMEOUT_S


_HELLO = control_pb2.RankMessage(hello=control_pb2.Hello(
    rank=control_pb2.RankIdentity(engine_id="fuzz-engine", role=control_pb2.ROLE_DECODE, epoch=5, tp_size=1),
    compatibility_hash="not-the-cluster's", protocol_version=1, engine_address="127.0.0.1:1"))
_SAMPLING = generation_pb2.SamplingParams(max_tokens=2)
METHODS = [
    Method("client", "/pdserve.v1.Generation/Generate", generation_pb2.GenerateRequest.DESCRIPTOR, "unary_stream", 40,
           seed=generation_pb2.GenerateRequest(text="Hello", sampling=_SAMPLING), timeout_s=15.0),
    Method("client", "/pdserve.v1.Generation/GetServerInfo", generation_pb2.GetServerInfoRequest.DESCRIPTOR,
           "unary_unary", 10),
    Method("client", "/pdserve.v1.Generation/ListModels", generation_pb2.ListModelsRequest.DESCRIPTOR,
           "unary_unary", 10),
    Method("control", "/pdserve.v1.Control/Connect", control_pb2.RankMessage.DESCRIPTOR, "stream_stream", 30,
           long_lived=True, seed=_HELLO),
    Method("events", "/pdserve.v1.KVEvents/Subscribe", kv_events_pb2.SubscribeRequest.DESCRIPTOR, "unary_stream", 20,
           long_lived=True, seed=kv_events_pb2.SubscribeRequest(from_seq=0)),
    Method("prefill-0", "/pdserve.v1.Engine/Prefill", engine_pb2.PrefillRequest.DESCRIPTOR, "unary_unary", 30,
           seed=engine_pb2.PrefillRequest(request_id="fuzz-p", prompt_token_ids=[1, 2, 3, 4, 5], sampling=_SAMPLING)),
    Method("decode-0", "/pdserve.v1.Engine/Decode", engine_pb2.DecodeRequest.DESCRIPTOR, "unary_stream", 25,
           seed=engine_pb2.DecodeRequest(request_id="fuzz-d", prompt_token_ids=[1, 2, 3], sampling=_SAMPLING)),
    Method("prefill-0", "/pdserve.v1.Engine/Abort", engine_pb2.AbortRequest.DESCRIPTOR, "unary_unary", 15,
           seed=engine_pb2.AbortRequest(request_id="fuzz-p")),
    Method("decode-0", "/pdserve.v1.Engine/Abort", engine_pb2.AbortRequest.DESCRIPTOR, "unary_unary", 10),
    Method("prefill-0", "/pdserve.v1.Engine/Release", engine_pb2.ReleaseRequest.DESCRIPTOR, "unary_unary", 15,
           seed=engine_pb2.ReleaseRequest(request_id="fuzz-p")),
    Method("decode-0", "/pdserve.v1.Engine/Inspect", engine_pb2.InspectRequest.DESCRIPTOR, "unary_unary", 5),
]
DRAIN = Method("decode-0", "/pdserve.v1.Engine/Drain", engine_pb2.DrainRequest.DESCRIPTOR, "unary_unary", 5)


def call_raw(cluster: FuzzCluster, method: Method, payload: bytes | list[bytes]
             ) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """Sends raw request bytes; returns the status, its details and (at most 3) raw responses."""
    channel = cluster.channel(method.where)
    stream_timeout = LONG_LIVED_TIMEOUT_S if method.long_lived else method.timeout_s
    received: list[bytes] = []
    try:
        if method.kind == "unary_unary":
            received.append(channel.unary_unary(method.path)(payload, timeout=UNARY_TIMEOUT_S))
            return grpc.StatusCode.OK, "", received
        if method.kind == "unary_stream":
            call = channel.unary_stream(method.path)(payload, timeout=stream_timeout)
        else:
            assert isinstance(payload, list)
            call = channel.stream_stream(method.path)(iter(payload), timeout=stream_timeout)
        for response in call:
            received.append(response)
            if len(received) >= 3:
                call.cancel()
                break
        return grpc.StatusCode.OK, "", received
    except grpc.RpcError as e:
        return e.code(), e.details() or "", received


def parses(method: Method, payload: bytes | list[bytes]) -> bool:
    """Whether the server can parse the request: a unary payload, or a stream's first message
    (a stream may legitimately end on an earlier message's verdict before a later bad one)."""
    data = payload[0] if isinstance(payload, list) else payload
    try:
        message_factory.GetMessageClass(method.request).FromString(data)
    except Exception:  # noqa: BLE001 - the server's guard treats any decoder failure as malformed
        return False
    return True


def check(cluster: FuzzCluster, method: Method, payload: bytes | list[bytes], well_formed: bool,
          request_id: str = "") -> None:
    code, details, received = call_raw(cluster, method, payload)
    cluster.codes.setdefault(method.path, set()).add(code.name)
    assert code != CRASH, f"{method.path}: unhandled exception in the servicer"
    if well_formed:
        assert not details.startswith("malformed request"), f"{method.path}: a well-formed message refused: {details}"
    elif not parses(method, payload):
        assert (code, details.startswith(f"malformed request for {method.path}: ")) == \
            (grpc.StatusCode.INVALID_ARGUMENT, True), f"{method.path}: unparseable bytes got {code.name} {details!r}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        waiting_for_kv = method.path.endswith("/Decode")  # a descriptor makes it wait for remote KV by design
        assert method.long_lived or (method.kind != "unary_unary" and (received or waiting_for_kv)), \
            f"{method.path}: no answer within the deadline (a hang)"
    assert code != grpc.StatusCode.INTERNAL, f"{method.path}: INTERNAL"
    if method.path.endswith("/Prefill") and code == grpc.StatusCode.OK and request_id:
        cluster.prefilled.append(request_id)


def fuzz_well_formed(cluster: FuzzCluster, method: Method) -> None:
    if method.kind == "stream_stream":
        strategy: st.SearchStrategy[Any] = st.lists(seeded(method.request, method.seed), min_size=1, max_size=4)
    else:
        strategy = seeded(method.request, method.seed)

    @fuzz_settings(method.examples)
    @given(strategy)
    def run(msg: Any) -> None:
        if isinstance(msg, list):
            check(cluster, method, [m.SerializeToString() for m in msg], True)
        else:
            check(cluster, method, msg.SerializeToString(), True, getattr(msg, "request_id", ""))

    run()


def fuzz_mutated(cluster: FuzzCluster, method: Method) -> None:
    strategy: st.SearchStrategy[Any] = mutated(method.request, method.seed)
    if method.kind == "stream_stream":
        strategy = st.lists(strategy, min_size=1, max_size=3)

    @fuzz_settings(method.examples)
    @given(strategy)
    def run(payload: Any) -> None:
        request_id = ""
        if method.path.endswith("/Prefill") and not isinstance(payload, list):
            try:
                request_id = engine_pb2.PrefillRequest.FromString(payload).request_id
            except Exception:  # noqa: BLE001 - unparseable: the server refuses it too
                pass
        check(cluster, method, payload, False, request_id)

    run()


def assert_still_answers(cluster: FuzzCluster) -> None:
    stub_info = cluster.channel("client").unary_unary(
        "/pdserve.v1.Generation/GetServerInfo", request_serializer=generation_pb2.GetServerInfoRequest.SerializeToString,
        response_deserializer=generation_pb2.ServerInfo.FromString)
    info = stub_info(generation_pb2.GetServerInfoRequest(), timeout=UNARY_TIMEOUT_S)
    assert (info.num_prefill_engines, info.num_decode_engines) == (1, 1)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.where}:{m.path.rsplit('/', 1)[1]}")
def test_fuzz_method(cluster: FuzzCluster, method: Method) -> None:
    fuzz_well_formed(cluster, method)
    fuzz_mutated(cluster, method)
    assert_still_answers(cluster)
    assert cluster.engine_ids() == {"prefill-0", "decode-0"}, "a fuzzed message registered an engine"


def test_cluster_still_serves_and_nothing_leaked(cluster: FuzzCluster) -> None:
    release = cluster.channel("prefill-0").unary_unary(
        "/pdserve.v1.Engine/Release", request_serializer=engine_pb2.ReleaseRequest.SerializeToString,
        response_deserializer=engine_pb2.ReleaseResponse.FromString)
    for request_id in cluster.prefilled:  # accepted prefills hold their blocks until released (by design)
        release(engine_pb2.ReleaseRequest(request_id=request_id), timeout=UNARY_TIMEOUT_S)
    with Client(f"127.0.0.1:{cluster.scheduler.service.port}") as client:
        result = client.generate("The capital of France is", max_tokens=6, temperature=0.0, ignore_eos=True,
                                 timeout=60)
    assert result.finish_reason == "length" and len(result.token_ids) == 6
    deadline = time.monotonic() + 20
    while (leaks := cluster.scheduler.read(cluster.scheduler.service.leaks)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leaks == []
    assert cluster.engines.wait_no_leaks(timeout=20) == {}
    print("status codes seen:", {k.rsplit("/", 1)[1]: sorted(v) for k, v in cluster.codes.items()})


def test_fuzz_drain_last(cluster: FuzzCluster) -> None:
    """Any parseable DrainRequest drains the engine (it has no fields to refuse): after it the
    decode engine refuses new work, still answers, and leaks nothing."""
    fuzz_mutated(cluster, DRAIN)
    fuzz_well_formed(cluster, DRAIN)
    decode = cluster.channel("decode-0").unary_stream(
        "/pdserve.v1.Engine/Decode", request_serializer=engine_pb2.DecodeRequest.SerializeToString,
        response_deserializer=engine_pb2.DecodeResponse.FromString)
    with pytest.raises(grpc.RpcError, match="UNAVAILABLE") as e:
        list(decode(engine_pb2.DecodeRequest(request_id="after-drain", prompt_token_ids=[1, 2, 3]), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in (e.value.details() or "")
    assert cluster.engines.wait_no_leaks(timeout=10) == {}

