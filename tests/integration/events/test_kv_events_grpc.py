"""KVEvents over a real gRPC server: order, exactly-once, parent chains and media from both
producers (block pool and the aggregated offload tier), replay, snapshot, resume, resync."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from connectors.aggregator import KVOutputAggregator
from connectors.hashing import BlockHasher
from connectors.kv_events import BlockStored, KVEventBatch, event_from_proto
from connectors.outputs import KVConnectorOutput
from pdserve.v1 import kv_events_pb2 as pb
from pdserve.v1 import kv_events_pb2_grpc as pb_grpc
from services.common.config import SchedulerConfig
from services.common.grpc_server import ServiceServer, insecure_channel
from services.scheduler.events.plane import EventPlane
from services.scheduler.events.servicer import SERVICE_NAME

HASHER = BlockHasher(block_size=4)
TIMEOUT = 10.0


class Cluster:
    def __init__(self, plane: EventPlane, server: ServiceServer, channel: grpc.aio.Channel) -> None:
        self.plane = plane
        self.server = server
        self.stub = pb_grpc.KVEventsStub(channel)


async def start(ring: int = 64, buffer: int = 64) -> tuple[EventPlane, ServiceServer, grpc.aio.Channel]:
    config = SchedulerConfig(event_ring_size=ring, subscriber_buffer=buffer)
    plane = EventPlane.from_config(config)
    server = ServiceServer([SERVICE_NAME])
    plane.add_to_server(server.server)
    port = server.bind("127.0.0.1", 0)
    await server.start()
    plane.start()
    return plane, server, insecure_channel(f"127.0.0.1:{port}")


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    plane, server, channel = await start()
    yield Cluster(plane, server, channel)
    await channel.close()
    await server.stop(None)
    plane.close()


async def read(call: Any, n: int) -> list[Any]:
    out: list[Any] = []
    async with asyncio.timeout(TIMEOUT):
        while len(out) < n:
            out.append(await call.read())
    return out


def gpu_batch(tokens: list[int], start_block: int) -> KVEventBatch:
    hashes = HASHER.external_hashes(tokens)
    new = hashes[start_block:]
    parent = hashes[start_block - 1] if start_block else None
    toks = tuple(tokens[start_block * 4:len(hashes) * 4])
    return KVEventBatch(1.0, [BlockStored(tuple(new), parent, toks, 4, medium="GPU")], 0)


async def test_both_producers_in_order_exactly_once_with_chains_and_media(cluster: Cluster) -> None:
    rp = cluster.plane.republisher
    call = cluster.stub.Subscribe(pb.SubscribeRequest())
    await asyncio.sleep(0.2)  # the subscription is live once the server handler ran
    tokens = list(range(24))
    hashes = HASHER.external_hashes(tokens)
    # producer 1: the engine's block pool (rank 0), two steps of one request
    rp.publish("p0", 11, gpu_batch(tokens[:8], 0))
    # producer 2: the offload tier on both TP ranks, aggregated (published once, when whole)
    agg = KVOutputAggregator()
    agg.register_engine("p0", 11, [0, 1])
    offload = BlockStored(tuple(hashes[:2]), None, (), 0, medium="CPU_OFFLOAD")
    first = agg.add_report("p0", 11, 0, KVConnectorOutput(kv_cache_events=(offload,)))
    assert first.events == []
    rp.publish("p0", 11, KVEventBatch(2.0, first.events))  # empty: not published
    second = agg.add_report("p0", 11, 1, KVConnectorOutput(kv_cache_events=(offload,)))
    rp.publish("p0", 11, KVEventBatch(2.0, second.events))
    again = agg.add_report("p0", 11, 1, KVConnectorOutput(kv_cache_events=(offload,)))
    rp.publish("p0", 11, KVEventBatch(2.0, again.events))  # a repeat is absorbed
    rp.publish("p0", 11, gpu_batch(tokens, 2))
    msgs = await read(call, 3)
    assert [m.batch.seq for m in msgs] == [0, 1, 2]
    events = [event_from_proto(e) for m in msgs for e in m.batch.events]
    assert all(m.batch.engine_id == "p0" and m.batch.epoch == 11 for m in msgs)
    assert msgs[0].batch.data_parallel_rank == 0 and not msgs[1].batch.HasField("data_parallel_rank")
    assert [(e.medium, e.block_hashes, e.parent_block_hash) for e in events] == [  # type: ignore[union-attr]
        ("GPU", tuple(hashes[:2]), None),
        ("CPU_OFFLOAD", tuple(hashes[:2]), None),
        ("GPU", tuple(hashes[2:]), hashes[1]),
    ]
    assert events[2].token_ids == tuple(tokens[8:])  # type: ignore[union-attr]
    with pytest.raises(asyncio.TimeoutError, match="^$"):  # exactly once: nothing else arrives
        await asyncio.wait_for(call.read(), 0.3)
    call.cancel()


async def test_replay_snapshot_and_resume(cluster: Cluster) -> None:
    rp = cluster.plane.republisher
    for i in range(10):
        rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((i,), None, (), 4, medium="GPU")]))
    call = cluster.stub.Subscribe(pb.SubscribeRequest(from_seq=3))
    got = await read(call, 7)
    assert [m.batch.seq for m in got] == list(range(3, 10))
    call.cancel()
    for i in range(10, 13):  # published while nobody listens
        rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((i,), None, (), 4, medium="GPU")]))
    resumed = cluster.stub.Subscribe(pb.SubscribeRequest(from_seq=got[-1].batch.seq + 1))
    rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((13,), None, (), 4, medium="GPU")]))
    assert [m.batch.seq for m in await read(resumed, 4)] == [10, 11, 12, 13]
    resumed.cancel()


async def test_older_than_ring_gets_snapshot_then_live() -> None:
    plane, server, channel = await start(ring=4)
    try:
        rp = plane.republisher
        for i in range(10):
            rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((i,), None, (), 4, medium="GPU")]))
        call = pb_grpc.KVEventsStub(channel).Subscribe(pb.SubscribeRequest(from_seq=2))
        begin, snap, end = await read(call, 3)
        assert begin.notice.kind == pb.StreamNotice.SNAPSHOT_BEGIN and "older" in begin.notice.reason
        assert sorted(snap.batch.events[0].block_stored.block_hashes) == list(range(10))
        assert snap.batch.seq == 0 and snap.batch.events[0].block_stored.medium == "GPU"
        assert end.notice.kind == pb.StreamNotice.SNAPSHOT_END and end.notice.next_seq == 10
        rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((99,), None, (), 4, medium="GPU")]))
        assert (await read(call, 1))[0].batch.seq == 10
        call.cancel()
    finally:
        await channel.close()
        await server.stop(None)


async def test_slow_subscriber_is_resynced_while_the_publisher_keeps_going() -> None:
    plane, server, channel = await start(ring=1000, buffer=8)
    try:
        rp = plane.republisher
        stub = pb_grpc.KVEventsStub(channel)
        slow = stub.Subscribe(pb.SubscribeRequest())
        await asyncio.sleep(0.2)
        big = tuple(range(2**63, 2**63 + 5000))  # ~50 kB per batch: flow control stalls an unread stream
        for i in range(200):
            rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored(big[:-1] + (10_000 + i,), None, (), 4,
                                                               medium="GPU")]))
            await asyncio.sleep(0)  # let the server write what it can
        assert rp.next_seq == 200  # the publisher never waited for the slow subscriber
        assert rp.stats().num_resyncs >= 1
        assert max(rp.subscriber_lags()) <= 8  # bounded memory
        assert rp.next_seq == 200
        rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((7,), None, (), 4, medium="GPU")]))
        # A consumer following the protocol: its view must end equal to the index, every live
        # batch must be the expected next seq, and each RESYNC must be followed by a snapshot.
        view: set[int] = set()
        expected, kinds, in_snapshot = 0, [], False
        async with asyncio.timeout(TIMEOUT):
            while expected <= 200:
                m = await slow.read()
                if m.WhichOneof("payload") == "notice":
                    kinds.append(m.notice.kind)
                    if m.notice.kind == pb.StreamNotice.SNAPSHOT_BEGIN:
                        view, in_snapshot = set(), True
                    elif m.notice.kind == pb.StreamNotice.SNAPSHOT_END:
                        expected, in_snapshot = m.notice.next_seq, False
                    continue
                assert in_snapshot or m.batch.seq == expected
                if not in_snapshot:
                    expected += 1
                view.update(h for e in m.batch.events for h in e.block_stored.block_hashes)
        assert kinds[:3] == [pb.StreamNotice.RESYNC, pb.StreamNotice.SNAPSHOT_BEGIN, pb.StreamNotice.SNAPSHOT_END]
        assert len(kinds) == 3 * kinds.count(pb.StreamNotice.RESYNC)
        assert view == {h for p in plane.index.snapshot() for h in p.block_hashes}
        slow.cancel()
    finally:
        await channel.close()
        await server.stop(None)


async def test_bad_subscribe_request_is_invalid_argument(cluster: Cluster) -> None:
    for req in (pb.SubscribeRequest(types=[pb.EVENT_TYPE_UNSPECIFIED]), pb.SubscribeRequest(engine_ids=[""])):
        call = cluster.stub.Subscribe(req)
        with pytest.raises(grpc.aio.AioRpcError, match="INVALID_ARGUMENT") as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert cluster.plane.republisher.stats().num_subscribers == 0


async def test_snapshot_request_names_positions_and_waits_for_convergence(cluster: Cluster) -> None:
    """`snapshot=true`: SNAPSHOT_BEGIN names each engine's report position and the replica; a
    replica still converging refuses with UNAVAILABLE; with from_seq it is malformed."""
    cluster.plane.republisher.scheduler_id = "s1"
    cluster.plane.republisher.position_of = lambda engine_id, epoch: 7
    cluster.plane.republisher.publish("p0", 3, gpu_batch(list(range(32)), 0))
    begin, *_ = await read(cluster.stub.Subscribe(pb.SubscribeRequest(snapshot=True)), 3)
    assert begin.notice.kind == pb.StreamNotice.SNAPSHOT_BEGIN and begin.notice.scheduler_id == "s1"
    assert [(p.engine_id, p.epoch, p.position) for p in begin.notice.positions] == [("p0", 3, 7)]
    with pytest.raises(grpc.aio.AioRpcError, match="INVALID_ARGUMENT"):
        await cluster.stub.Subscribe(pb.SubscribeRequest(snapshot=True, from_seq=0)).read()
    cluster.plane.servicer.converged = lambda: False
    with pytest.raises(grpc.aio.AioRpcError, match="not converged") as err:
        await cluster.stub.Subscribe(pb.SubscribeRequest(snapshot=True)).read()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_filtered_subscription(cluster: Cluster) -> None:
    rp = cluster.plane.republisher
    call = cluster.stub.Subscribe(pb.SubscribeRequest(from_seq=0, media=["CPU_OFFLOAD"],
                                                      types=[pb.EVENT_TYPE_BLOCK_STORED]))
    rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((1,), None, (), 4, medium="GPU")]))
    rp.publish("p1", 1, KVEventBatch(1.0, [BlockStored((2,), None, (), 0, medium="CPU_OFFLOAD")]))
    (m,) = await read(call, 1)
    assert (m.batch.seq, m.batch.engine_id, list(m.batch.events[0].block_stored.block_hashes)) == (1, "p1", [2])
    call.cancel()
