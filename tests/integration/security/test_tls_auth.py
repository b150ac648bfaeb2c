"""A real SchedulerService (all three gRPC servers) under mTLS + bearer tokens + limits, called
by real gRPC clients and real ControlClients with good, missing and foreign credentials."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.v1 import control_pb2 as ctl_pb
from pdserve.v1 import control_pb2_grpc, generation_pb2_grpc, kv_events_pb2_grpc
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import kv_events_pb2 as ev_pb
from services.common.certs import COMPONENT_NAME, LocalPki, make_local_pki
from services.common.config import SchedulerConfig, load_config
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.security import ChannelSecurity, open_channel
from services.engine.control_client import ControlClient, ControlHello, RankIdentity
from services.local_cluster import free_port
from services.scheduler.service import SchedulerService
from services.scheduler.tokenization import ModelFacts

FACTS = ModelFacts("scripted", vocab_size=1000, max_model_len=512)
GOOD = "good-token-0123456789"
WRONG = "wrong-token-0123456789"
EVENTS_ONLY = "events-only-0123456789"
GENERATE_ONLY = "generate-only-0123456789"
Code: TypeAlias = grpc.StatusCode


async def start_service(tmp_path: Path, pki: LocalPki | None, **overrides: Any) -> SchedulerService:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{EVENTS_ONLY} events\n{GENERATE_ONLY} generate\n")
    tls = {"tls_cert": str(pki.server_cert), "tls_key": str(pki.server_key), "tls_ca": str(pki.ca_cert)} if pki else {}
    config = load_config(SchedulerConfig, env={"PDSERVE_AUTH_TOKENS": GOOD}, overrides={
        "port": 0, "control_port": 0, "events_port": 0, "metrics_port": 0, "heartbeat_interval_s": 0.05,
        "auth_tokens_file": str(tokens), **tls, **overrides})
    service = SchedulerService(config, facts=FACTS)
    await service.start()
    return service


@pytest.fixture
def pki(tmp_path: Path) -> LocalPki:
    return make_local_pki(tmp_path / "pki")


@pytest.fixture
def foreign(tmp_path: Path) -> LocalPki:
    """Certificates from another CA (same names, same usages)."""
    return make_local_pki(tmp_path / "foreign", ca_name="some other CA")


@pytest.fixture
async def mtls_service(tmp_path: Path, pki: LocalPki) -> AsyncIterator[SchedulerService]:
    service = await start_service(tmp_path, pki, tls_require_client_cert=True, health_port=free_port(),
                                  tls_peer_name=COMPONENT_NAME)
    try:
        yield service
    finally:
        await service.stop(0)


def client(pki: LocalPki, token: str = "") -> ChannelSecurity:
    return ChannelSecurity(ca=str(pki.ca_cert), cert=str(pki.client_cert), key=str(pki.client_key), token=token)


async def call_code(target: str, security: ChannelSecurity | None, rpc: str) -> Code:
    """Runs one RPC of the client API or KVEvents and returns its status code (OK when the call
    got as far as the servicer's answer; for Subscribe: when the stream stayed open for a second,
    as refusals come at once)."""
    metadata = security.metadata() if security is not None else ()
    async with open_channel(target, security, CHANNEL_OPTIONS) as channel:
        try:
            if rpc == "Subscribe":
                call = kv_events_pb2_grpc.KVEventsStub(channel).Subscribe(
                    ev_pb.SubscribeRequest(), timeout=1, metadata=metadata)
                try:
                    await call.read()
                except grpc.aio.AioRpcError as e:
                    if e.code() != Code.DEADLINE_EXCEEDED:
                        raise
                call.cancel()
            else:
                stub = generation_pb2_grpc.GenerationStub(channel)
                if rpc == "Generate":
                    # An empty prompt: a servicer that is reached answers INVALID_ARGUMENT.
                    async for _ in stub.Generate(gen_pb.GenerateRequest(request_id="r"), timeout=3, metadata=metadata):
                        pass
                elif rpc == "GetServerInfo":
                    await stub.GetServerInfo(gen_pb.GetServerInfoRequest(), timeout=3, metadata=metadata)
                else:
                    await stub.ListModels(gen_pb.ListModelsRequest(), timeout=3, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return Code.OK


REACHED = {"Generate": Code.INVALID_ARGUMENT, "GetServerInfo": Code.OK, "ListModels": Code.OK, "Subscribe": Code.OK}


@pytest.mark.parametrize("rpc", sorted(REACHED))
async def test_every_public_rpc_refuses_bad_credentials_with_the_right_code(
        mtls_service: SchedulerService, pki: LocalPki, foreign: LocalPki, rpc: str) -> None:
    s = mtls_service
    target = f"127.0.0.1:{s.events_port if rpc == 'Subscribe' else s.port}"
    wrong_scope = GENERATE_ONLY if rpc == "Subscribe" else EVENTS_ONLY
    cases: list[tuple[str, ChannelSecurity | None, Code]] = [
        ("plaintext", ChannelSecurity(token=GOOD), Code.UNAVAILABLE),
        ("no client certificate", ChannelSecurity(ca=str(pki.ca_cert), token=GOOD), Code.UNAVAILABLE),
        ("certificate of another CA", ChannelSecurity(ca=str(pki.ca_cert), cert=str(foreign.client_cert),
                                                      key=str(foreign.client_key), token=GOOD), Code.UNAVAILABLE),
        ("server not trusted", ChannelSecurity(ca=str(foreign.ca_cert), cert=str(pki.client_cert),
                                               key=str(pki.client_key), token=GOOD), Code.UNAVAILABLE),
        ("no token", client(pki), Code.UNAUTHENTICATED),
        ("wrong token", client(pki, WRONG), Code.UNAUTHENTICATED),
        ("token without the scope", client(pki, wrong_scope), Code.PERMISSION_DENIED),
        ("good", client(pki, GOOD), REACHED[rpc]),
    ]
    for name, security, expected in cases:
        assert await call_code(target, security, rpc) == expected, name
    assert s.guard.refused["missing_token"] == 1 and s.guard.refused["bad_token"] == 1
    # The server closes its count of a stream after the client has seen the status.
    await _eventually(lambda: s.leaks() == [])


async def test_health_and_reflection_stay_open(mtls_service: SchedulerService, pki: LocalPki) -> None:
    """No token needed for probes; under TLS the plaintext health port answers the kubelet."""
    async with open_channel(f"127.0.0.1:{mtls_service.port}", client(pki), CHANNEL_OPTIONS) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for resp in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(ask(), timeout=3):
            assert "pdserve.v1.Generation" in {x.name for x in resp.list_services_response.service}
            break
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mtls_service.config.health_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError, match="UNIMPLEMENTED") as e:
            await generation_pb2_grpc.GenerationStub(channel).GetServerInfo(gen_pb.GetServerInfoRequest(), timeout=3)
        assert e.value.code() == Code.UNIMPLEMENTED, "the health port serves nothing else"


def rank_hello(engine_id: str, role: str, secret: bytes) -> ControlHello:
    return ControlHello(RankIdentity(engine_id, role, 7, 0, 1), "compat", "127.0.0.1:7000", secret)


async def register(target: str, hello: ControlHello, security: ChannelSecurity | None,
                   timeout: float = 10.0) -> ControlClient:
    c = ControlClient(target, hello, backoff_initial_s=0.02, backoff_max_s=0.1, security=security)
    try:
        await asyncio.to_thread(c.start, timeout)
    except BaseException:
        await asyncio.to_thread(c.close)
        raise
    return c


async def test_control_stream_needs_an_engine_certificate_and_hides_handshake_metadata(
        mtls_service: SchedulerService, pki: LocalPki, foreign: LocalPki) -> None:
    target = f"127.0.0.1:{mtls_service.control_port}"
    engine_identity = ChannelSecurity(ca=str(pki.ca_cert), cert=str(pki.server_cert), key=str(pki.server_key))
    prefill = await register(target, rank_hello("prefill-0", "prefill", b"ucx-address-of-prefill-0"), engine_identity)
    clients = [prefill]
    try:
        intruders: dict[str, tuple[ChannelSecurity | None, Code]] = {
            "plaintext": (None, Code.UNAVAILABLE),
            "no certificate": (ChannelSecurity(ca=str(pki.ca_cert)), Code.UNAVAILABLE),
            "certificate of another CA": (ChannelSecurity(ca=str(pki.ca_cert), cert=str(foreign.server_cert),
                                                          key=str(foreign.server_key)), Code.UNAVAILABLE),
            # Same CA, but an API client's certificate: it does not name the cluster's components.
            "client certificate": (client(pki), Code.PERMISSION_DENIED),
        }
        for name, (security, code) in intruders.items():
            with pytest.raises(TimeoutError, match="no Welcome from the scheduler"):
                await register(target, rank_hello(f"intruder-{name}", "decode", b"x"), security, timeout=1.0)
            # The raw stream: refused before a Hello could be read (TLS layer or peer-name check).
            async with open_channel(target, security, CHANNEL_OPTIONS) as channel:
                call = control_pb2_grpc.ControlStub(channel).Connect(timeout=3)
                with pytest.raises(grpc.aio.AioRpcError, match=f"{code.name}") as e:
                    await call.write(ctl_pb.RankMessage(hello=ctl_pb.Hello()))
                    await call.read()
                assert e.value.code() == code, name
        registered = {e.engine_id for role in ("prefill", "decode") for e in _engines(mtls_service, role)}
        assert registered == {"prefill-0"}, "no intruder registered"
        # A decode rank with the cluster's certificate does get the prefill rank's metadata.
        decode = await register(target, rank_hello("decode-0", "decode", b"ucx-address-of-decode-0"), engine_identity)
        clients.append(decode)
        assert decode.welcome is not None
        assert [p.handshake_metadata for p in decode.welcome.peers] == [b"ucx-address-of-prefill-0"]
    finally:
        for c in clients:
            await asyncio.to_thread(c.close)


def _engines(service: SchedulerService, role: str) -> list[Any]:
    from services.scheduler.registry import Role

    return list(service.registry.by_role(Role(role)))


async def test_limits_answer_resource_exhausted_and_invalid_argument(tmp_path: Path) -> None:
    """Plaintext on loopback: limits hold without TLS too. The rate limit is per client (here:
    per token), streams are counted per client, oversized messages and prompts are refused."""
    tokens = {name: f"{name}-token-0123456789" for name in ("rate", "streams", "sizes")}
    service = await start_service(tmp_path, None, auth_tokens=",".join(tokens.values()), rate_limit_rps=0.2,
                                  rate_limit_burst=3, max_streams_per_client=1, max_message_bytes=64 * 1024,
                                  max_prompt_tokens=32, max_new_tokens=16)
    target = f"127.0.0.1:{service.port}"
    events = f"127.0.0.1:{service.events_port}"
    try:
        rate = ChannelSecurity(token=tokens["rate"])
        assert [await call_code(target, rate, "GetServerInfo") for _ in range(4)] == [Code.OK] * 3 + [
            Code.RESOURCE_EXHAUSTED]

        sec = ChannelSecurity(token=tokens["streams"])
        async with open_channel(events, sec, CHANNEL_OPTIONS) as channel:
            first = kv_events_pb2_grpc.KVEventsStub(channel).Subscribe(ev_pb.SubscribeRequest(),
                                                                        metadata=sec.metadata())
            await _eventually(lambda: service.guard.streams.total() == 1)
            assert await call_code(events, sec, "Subscribe") == Code.RESOURCE_EXHAUSTED
            assert service.guard.streams.total() == 1
            first.cancel()
        await _eventually(lambda: service.guard.streams.total() == 0)
        assert await call_code(events, sec, "Subscribe") == Code.OK, "a closed stream frees its slot"

        sizes = ChannelSecurity(token=tokens["sizes"])
        cases: list[tuple[gen_pb.GenerateRequest, Code, str]] = [
            (gen_pb.GenerateRequest(text="x" * 100_000), Code.RESOURCE_EXHAUSTED, ""),
            (gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[1] * 33)), Code.INVALID_ARGUMENT, "limit is 32"),
            (gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[1]), sampling=gen_pb.SamplingParams(max_tokens=17)),
             Code.INVALID_ARGUMENT, "max_tokens must be in [1, 16]"),
        ]
        async with open_channel(target, sizes, CHANNEL_OPTIONS) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for request, code, message in cases:
                with pytest.raises(grpc.aio.AioRpcError, match=f"{code.name}") as e:
                    async for _ in stub.Generate(request, timeout=3, metadata=sizes.metadata()):
                        pass
                assert e.value.code() == code and message in (e.value.details() or "")
        assert service.leaks() == []
        assert service.guard.refused["rate"] == 1 and service.guard.refused["streams"] == 1
        sample = service.telemetry.prometheus.get_sample_value
        assert sample("pdserve_scheduler_client_refused_total", {"reason": "rate"}) == 1
        assert sample("pdserve_scheduler_client_refused_total", {"reason": "streams"}) == 1
        assert sample("pdserve_scheduler_client_streams") == 0
    finally:
        await service.stop(0)


async def _eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)

