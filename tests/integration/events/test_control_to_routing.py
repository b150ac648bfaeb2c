"""Engines' KV events through real control streams (ControlClient -> Control servicer) into the
event plane: the prefix-aware policy routes to the engine holding the prefix, and an engine's
restart (new epoch) removes its entries from the index and from routing at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from connectors.hashing import BlockHasher
from connectors.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, event_from_proto
from pdserve.v1 import control_pb2_grpc
from pdserve.v1 import kv_events_pb2 as kpb
from pdserve.v1 import kv_events_pb2_grpc as kpb_grpc
from services.common.config import SchedulerConfig
from services.common.grpc_server import ServiceServer, insecure_channel
from services.engine.control_client import ControlClient, ControlHello, RankIdentity, StepReport
from services.scheduler.control import ControlServicer
from services.scheduler.events.plane import EventPlane
from services.scheduler.events.servicer import SERVICE_NAME
from services.scheduler.registry import EngineRegistry
from services.scheduler.routing import REASON_PREFIX, EngineView, RoutingRequest

HASHER = BlockHasher(block_size=16, seed="0")


@dataclass
class Scheduler:
    plane: EventPlane
    servicer: ControlServicer
    server: ServiceServer
    port: int
    clients: list[ControlClient] = field(default_factory=list)

    async def rank(self, engine_id: str, epoch: int, tp_rank: int = 0, tp_size: int = 1) -> ControlClient:
        identity = RankIdentity(engine_id, "prefill", epoch, tp_rank, tp_size)
        client = ControlClient(f"127.0.0.1:{self.port}", ControlHello(identity, "compat", "127.0.0.1:1", b"",
                                                                       hash_seed="0", block_size=16))
        self.clients.append(client)
        await asyncio.to_thread(client.start, 10.0)
        return client


@pytest.fixture
async def scheduler() -> AsyncIterator[Scheduler]:
    plane = EventPlane.from_config(SchedulerConfig())
    servicer = ControlServicer(EngineRegistry(block_size=16, hash_seed="0"), sink=plane.republisher,
                               heartbeat_interval_s=0.1)
    server = ServiceServer(["pdserve.v1.Control", SERVICE_NAME])
    control_pb2_grpc.add_ControlServicer_to_server(servicer, server.server)
    plane.add_to_server(server.server)
    port = server.bind("127.0.0.1", 0)
    await server.start()
    servicer.on_engine_up.append(plane.engine_up)  # an engine back from down
    s = Scheduler(plane, servicer, server, port)
    yield s
    for c in s.clients:
        await asyncio.to_thread(c.close)
    await servicer.stop()
    await server.stop(0)


async def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def stored(tokens: list[int]) -> KVEventBatch:
    hashes = HASHER.external_hashes(tokens)
    return KVEventBatch(1.0, [BlockStored(tuple(hashes), None, tuple(tokens), 16, medium="CPU")], 0)


async def test_routes_to_the_prefix_holder_and_forgets_a_restarted_engine(scheduler: Scheduler) -> None:
    shared = list(range(1000, 1064))  # 4 blocks of a shared system prompt
    await scheduler.rank("p0", 0xA0)
    p1 = await scheduler.rank("p1", 0xB1)
    sub = scheduler.plane.republisher.subscribe(0)
    seq = p1.report(StepReport(engine_events=stored(shared)))
    assert await asyncio.to_thread(p1.wait_acked, seq)
    await eventually(lambda: scheduler.plane.index.epoch_of("p1") == 0xB1)
    policy = scheduler.plane.routing_policy()
    engines = [EngineView("p0", 0xA0, "prefill"), EngineView("p1", 0xB1, "prefill")]
    for i in range(4):
        prompt = shared + [i] * 20
        d = policy.choose_prefill(RoutingRequest(HASHER.external_hashes(prompt), len(prompt)), engines)
        assert (d.engine_id, d.reason, d.matched_blocks) == ("p1", REASON_PREFIX, 4)
    # p1 restarts: a new epoch registers; its old entries go at once, with an AllBlocksCleared
    new_p1 = await scheduler.rank("p1", 0xB2)
    await eventually(lambda: scheduler.plane.index.match(HASHER.external_hashes(shared)) == {})
    seq = new_p1.report(StepReport(engine_events=stored(list(range(64)))))
    assert await asyncio.to_thread(new_p1.wait_acked, seq)
    await eventually(lambda: scheduler.plane.republisher.epoch_of("p1") == 0xB2)
    restarted = [EngineView("p0", 0xA0, "prefill"), EngineView("p1", 0xB2, "prefill")]
    d = policy.choose_prefill(RoutingRequest(HASHER.external_hashes(shared), len(shared)), restarted)
    assert d.matched_blocks == 0
    items = sub.take()
    batches = [(i.engine_id, i.epoch, i.batch.events) for i in items]  # type: ignore[union-attr]
    assert batches[0][:2] == ("p1", 0xB1) and isinstance(batches[0][2][0], BlockStored)
    assert [b for b in batches[1:] if b[:2] == ("p1", 0xB1)] == [("p1", 0xB1, [AllBlocksCleared()])]  # once
    # a late report of the dead epoch changes nothing
    scheduler.plane.republisher.publish("p1", 0xB1, stored(shared))
    assert scheduler.plane.index.match(HASHER.external_hashes(shared)) == {}


async def test_both_producers_reach_a_grpc_subscriber_once_in_order(scheduler: Scheduler) -> None:
    ranks = [await scheduler.rank("p2", 0xC2, r, 2) for r in range(2)]
    async with insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
        call = kpb_grpc.KVEventsStub(channel).Subscribe(kpb.SubscribeRequest(from_seq=0))
        tokens = list(range(48))
        hashes = HASHER.external_hashes(tokens)
        gpu_first = KVEventBatch(1.0, [BlockStored(tuple(hashes[:2]), None, tuple(tokens[:32]), 16, medium="CPU")], 0)
        gpu_next = KVEventBatch(2.0, [BlockStored(tuple(hashes[2:]), hashes[1], tuple(tokens[32:]), 16,
                                                  medium="CPU")], 0)
        offload = BlockStored(tuple(hashes[:2]), None, (), 0, medium="CPU_OFFLOAD")
        # rank 0: the block pool's events and its offload shard; rank 1: its shard only, later
        ranks[0].report(StepReport(engine_events=gpu_first, worker_events=[offload]))
        first_seq = ranks[0].report(StepReport(engine_events=gpu_next))
        assert await asyncio.to_thread(ranks[0].wait_acked, first_seq)  # streams are independent
        ranks[1].report(StepReport(engine_events=gpu_first))  # not rank 0: ignored
        seq = ranks[1].report(StepReport(worker_events=[offload]))
        assert await asyncio.to_thread(ranks[1].wait_acked, seq)
        msgs: list[kpb.EventStreamMessage] = []
        async with asyncio.timeout(10):
            while len(msgs) < 3:
                msgs.append(await call.read())
        assert [m.batch.seq for m in msgs] == [0, 1, 2]
        assert all((m.batch.engine_id, m.batch.epoch) == ("p2", 0xC2) for m in msgs)
        events = [event_from_proto(e) for m in msgs for e in m.batch.events]
        assert [(e.medium, e.block_hashes, e.parent_block_hash) for e in events] == [  # type: ignore[union-attr]
            ("CPU", tuple(hashes[:2]), None), ("CPU", tuple(hashes[2:]), hashes[1]),
            ("CPU_OFFLOAD", tuple(hashes[:2]), None)]
        with pytest.raises(asyncio.TimeoutError, match="^$"):  # exactly once
            await asyncio.wait_for(call.read(), 0.3)
        call.cancel()
