"""Replica-to-replica snapshots under mTLS and bearer tokens (services/scheduler/peer_snapshots.py):
two real SchedulerServices whose KVEvents require a client certificate and a token from a token
file, one real ControlFanout engine rank reporting KV events to both. A replica stopped and
started again while the engine runs takes the blocks stored before from its peer's snapshot,
authenticating with the file's events-scoped token, and converges to the peer's index; a
replica presenting a wrong token is refused UNAUTHENTICATED, logs it, and stays not ready past
its converge timeout. About 3 s."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from connectors.kv_events import BlockStored, KVEventBatch
from services.common.certs import LocalPki, make_local_pki
from services.common.config import SchedulerConfig, load_config
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.security import ChannelSecurity, open_channel
from services.engine.control_client import ControlHello, RankIdentity, StepReport
from services.engine.control_fanout import ControlFanout
from services.local_cluster import free_port
from services.scheduler.peer_snapshots import peer_token
from services.scheduler.service import SchedulerService
from services.scheduler.tokenization import ModelFacts

FACTS = ModelFacts("scripted", vocab_size=1000, max_model_len=512)
GENERATE_ONLY = "generate-only-0123456789"
EVENTS = "events-scope-0123456789"
WRONG = "wrong-token-0123456789"


@pytest.fixture
def pki(tmp_path: Path) -> LocalPki:
    return make_local_pki(tmp_path / "pki")


def replica_config(tmp_path: Path, pki: LocalPki, **overrides: Any) -> SchedulerConfig:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GENERATE_ONLY} generate\n{EVENTS} events\n")
    return load_config(SchedulerConfig, env={}, overrides={
        "port": 0, "control_port": 0, "events_port": 0, "metrics_port": 0, "heartbeat_interval_s": 0.05,
        "tls_cert": str(pki.server_cert), "tls_key": str(pki.server_key), "tls_ca": str(pki.ca_cert),
        "tls_require_client_cert": True, "auth_tokens_file": str(tokens), **overrides})


async def start(config: SchedulerConfig) -> SchedulerService:
    service = SchedulerService(config, facts=FACTS)
    await service.start()
    return service


async def ready(service: SchedulerService, pki: LocalPki) -> bool:
    """The replica's KVEvents health (SERVING only once converged), over its TLS port."""
    security = ChannelSecurity(ca=str(pki.ca_cert), cert=str(pki.client_cert), key=str(pki.client_key))
    async with open_channel(f"127.0.0.1:{service.events_port}", security, CHANNEL_OPTIONS) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.KVEvents"), timeout=3)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def index_of(service: SchedulerService) -> set[tuple[str, str | None, int | bytes]]:
    return {(p.engine_id, p.medium, h) for p in service.plane.index.snapshot() for h in p.block_hashes}


async def eventually(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def stored(*hashes: int) -> StepReport:
    return StepReport(engine_events=KVEventBatch(time.time(), [BlockStored(hashes, None, (), 16, medium="GPU")]))


@pytest.fixture
async def survivor(tmp_path: Path, pki: LocalPki) -> AsyncIterator[SchedulerService]:
    service = await start(replica_config(tmp_path, pki))
    try:
        yield service
    finally:
        await service.stop(0)


def test_peer_token_is_the_first_with_the_events_scope(tmp_path: Path, pki: LocalPki) -> None:
    assert peer_token(replica_config(tmp_path, pki)) == EVENTS
    own = tmp_path / "peer-token"
    own.write_text(f"{WRONG}\n")
    assert peer_token(replica_config(tmp_path, pki, peer_token_file=str(own))) == WRONG
    (tmp_path / "generate-only").write_text(f"{GENERATE_ONLY} generate\n")
    with pytest.raises(ValueError, match="events scope"):
        peer_token(replica_config(tmp_path, pki, auth_tokens_file=str(tmp_path / "generate-only")))
    with pytest.raises(ValueError, match="peer_token_file: cannot read"):
        peer_token(replica_config(tmp_path, pki, peer_token_file=str(tmp_path / "missing")))


async def test_restarted_replica_converges_through_auth_and_a_wrong_token_stays_not_ready(
        tmp_path: Path, pki: LocalPki, survivor: SchedulerService, caplog: pytest.LogCaptureFixture) -> None:
    peers = f"127.0.0.1:{survivor.events_port}"
    a_config = replica_config(tmp_path, pki, peers=peers, control_port=free_port(), events_port=free_port())
    a = await start(a_config)
    engine = ControlFanout(f"127.0.0.1:{a.control_port},127.0.0.1:{survivor.control_port}",
                           ControlHello(RankIdentity("prefill-0", "prefill", 7, 0, 1), "compat", "127.0.0.1:7000",
                                        b"meta"),
                           security=ChannelSecurity(ca=str(pki.ca_cert), cert=str(pki.server_cert),
                                                    key=str(pki.server_key)))
    wrong_config = replica_config(tmp_path, pki, peers=peers, peer_token_file=str(tmp_path / "wrong"),
                                  converge_timeout_s=0.3)
    (tmp_path / "wrong").write_text(WRONG)
    wrong: SchedulerService | None = None
    try:
        await asyncio.to_thread(engine.start, 10.0)
        for i in range(3):
            engine.report(stored(10 * i + 1, 10 * i + 2))
        await eventually(lambda: len(index_of(a)) == len(index_of(survivor)) == 6)

        # Replica a restarts (same ports): an empty index, the engine's stream begins after the
        # reports already acknowledged, so those blocks can only come from the survivor.
        await a.stop(0)
        a = await start(a_config)
        assert not a.converged
        await eventually(lambda: a.converged)
        assert a.peer_snapshots is not None and a.peer_snapshots.num_snapshots >= 1 and not a.peer_snapshots.refused
        assert await ready(a, pki)
        engine.report(stored(99))
        await eventually(lambda: len(index_of(survivor)) == 7)
        await eventually(lambda: index_of(a) == index_of(survivor))

        # A replica whose token the peer does not accept: refused with a clear status, logged,
        # and not ready even after its converge timeout (no engine needs to be missing).
        with caplog.at_level(logging.ERROR, logger="services.scheduler.peer_snapshots"):
            wrong = await start(wrong_config)
            assert wrong.peer_snapshots is not None
            await eventually(lambda: bool(wrong.peer_snapshots and wrong.peer_snapshots.refused))
            await asyncio.sleep(0.6)
        assert wrong.peer_snapshots.refused == {peers: "UNAUTHENTICATED: invalid bearer token"}
        assert not wrong.converged and not await ready(wrong, pki)
        assert [r for r in caplog.records if "refused this replica's snapshot request" in r.getMessage()
                and "UNAUTHENTICATED" in r.getMessage()], caplog.text
    finally:
        await asyncio.to_thread(engine.close)
        await a.stop(0)
        if wrong is not None:
            await wrong.stop(0)
