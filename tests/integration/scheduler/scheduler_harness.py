"""Test harness: a real Control server on 127.0.0.1:0 and real ControlClients (each in its own
thread)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pdserve.v1 import control_pb2 as pb
from pdserve.v1 import control_pb2_grpc
from services.common.grpc_server import ServiceServer, insecure_channel
from services.engine.control_client import ControlClient, ControlHello, RankIdentity
from services.scheduler.control import ControlServicer
from services.scheduler.event_sink import RecordingEventSink
from services.scheduler.registry import EngineRegistry

_epochs = itertools.count(1001)


def hello(engine_id: str, role: str, tp_rank: int = 0, tp_size: int = 1, *, epoch: int | None = None,
          compat: str = "compat-1", seed: str | None = "0", meta: bytes = b"") -> ControlHello:
    identity = RankIdentity(engine_id, role, epoch or next(_epochs), tp_rank, tp_size)
    return ControlHello(identity, compat, "127.0.0.1:7000", meta or f"{engine_id}/{tp_rank}".encode(),
                        hash_seed=seed, block_size=16)


@dataclass
class ControlHarness:
    timeout_s: float = 5.0
    server: ServiceServer | None = None
    servicer: ControlServicer | None = None
    port: int = 0
    sink: RecordingEventSink = field(default_factory=RecordingEventSink)
    clients: list[ControlClient] = field(default_factory=list)

    async def start(self, port: int = 0) -> None:
        registry = EngineRegistry(block_size=16, hash_seed="0", heartbeat_timeout_s=self.timeout_s)
        self.servicer = ControlServicer(registry, sink=self.sink, heartbeat_interval_s=0.05, scheduler_id="test")
        self.server = ServiceServer(["pdserve.v1.Control"])
        control_pb2_grpc.add_ControlServicer_to_server(self.servicer, self.server.server)
        self.port = self.server.bind("127.0.0.1", port)
        await self.server.start()
        self.servicer.start_monitor()

    async def stop(self) -> None:
        assert self.server is not None and self.servicer is not None
        await self.servicer.stop()
        await self.server.stop(0)

    def client(self, h: ControlHello) -> ControlClient:
        c = ControlClient(f"127.0.0.1:{self.port}", h, backoff_initial_s=0.02, backoff_max_s=0.2)
        self.clients.append(c)
        return c

    async def connect(self, h: ControlHello) -> ControlClient:
        c = self.client(h)
        await asyncio.to_thread(c.start, 10.0)
        return c


async def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)




async def exchange(port: int, messages: list[pb.RankMessage], hold: float) -> list[pb.SchedulerMessage]:
    """Sends `messages` on one raw Control stream, keeps it open `hold` s more, and returns
    everything the scheduler sent back (for malformed input a ControlClient would refuse)."""
    async def gen() -> AsyncIterator[pb.RankMessage]:
        for m in messages:
            yield m
        await asyncio.sleep(hold)

    async with insecure_channel(f"127.0.0.1:{port}") as channel:
        return [m async for m in control_pb2_grpc.ControlStub(channel).Connect(gen())]


class Inbox:
    """Collects a client's polled messages across polls."""

    def __init__(self, client) -> None:  # type: ignore[no-untyped-def]
        self.client = client
        self.items: list = []

    def of(self, kind: type) -> list:
        self.items += self.client.poll()
        return [m for m in self.items if isinstance(m, kind)]
