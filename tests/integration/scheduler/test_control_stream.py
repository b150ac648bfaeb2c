"""Control stream: real scheduler Control server, real ControlClients over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from scheduler_harness import ControlHarness, Inbox, eventually, hello

from connectors.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from pdserve.v1 import control_pb2 as pb
from pdserve.v1 import control_pb2_grpc
from services.common.grpc_server import insecure_channel
from services.engine.control_client import (
    ControlRefusedError,
    KVFailed,
    KVReady,
    PeerUpdate,
    ReleaseBlocks,
    StepReport,
    Welcome,
)
from services.scheduler.lifecycle import EngineRef
from services.scheduler.registry import RankId


async def test_welcome_carries_peers_and_peer_updates_announce_joins(harness: ControlHarness) -> None:
    p0 = await harness.connect(hello("p0", "prefill"))
    d_ranks = [await harness.connect(hello("d0", "decode", r, 2, epoch=555)) for r in range(2)]
    for c in d_ranks:
        assert c.welcome is not None
        assert [(p.rank.engine_id, p.handshake_metadata) for p in c.welcome.peers] == [("p0", b"p0/0")]
        assert [(r.engine_id, r.tp_rank) for r in c.welcome.expected_ranks] == [("d0", 0), ("d0", 1)]
        assert c.welcome.last_acked_seq == 0 and c.welcome.scheduler_id == "test"
    # The prefill rank learns about both decode ranks as they join.
    p_inbox = Inbox(p0)
    await eventually(lambda: len(p_inbox.of(PeerUpdate)) == 2)
    assert sorted(u.joined[0].rank.tp_rank for u in p_inbox.of(PeerUpdate)) == [0, 1]
    await harness.connect(hello("p1", "prefill", meta=b"ucx-p1"))
    inboxes = [Inbox(c) for c in d_ranks]

    def announced(inbox: Inbox) -> bool:
        return any(u.joined and u.joined[0].handshake_metadata == b"ucx-p1" for u in inbox.of(PeerUpdate))

    for inbox in inboxes:
        await eventually(lambda: announced(inbox))  # noqa: B023
    registry = harness.servicer.registry  # type: ignore[union-attr]
    assert {e.engine_id for e in registry.engines.values() if e.routable} == {"p0", "p1", "d0"}


@pytest.mark.parametrize("change, match", [
    (dict(compat="other-model"), "compatibility hash"),
    (dict(seed="42"), "hash seed"),
])
async def test_mismatch_is_refused_with_the_reason(harness: ControlHarness, change: dict, match: str) -> None:
    await harness.connect(hello("p0", "prefill"))
    bad = harness.client(hello("d0", "decode", **change))
    with pytest.raises(ControlRefusedError, match=match) as e:
        await asyncio.to_thread(bad.start, 10.0)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert set(harness.servicer.registry.engines) == {"p0"}  # type: ignore[union-attr]


async def _raw_stream(port: int, messages: list[pb.RankMessage], hold: float = 0.0) -> list[pb.SchedulerMessage]:
    async def gen() -> AsyncIterator[pb.RankMessage]:
        for m in messages:
            yield m
        await asyncio.sleep(hold)

    got: list[pb.SchedulerMessage] = []
    async with insecure_channel(f"127.0.0.1:{port}") as channel:
        async for m in control_pb2_grpc.ControlStub(channel).Connect(gen()):
            got.append(m)
    return got


def _raw_hello(engine_id: str = "x", tp_rank: int = 0, tp_size: int = 1, epoch: int = 9,
               role: int = pb.ROLE_PREFILL) -> pb.RankMessage:
    return pb.RankMessage(hello=pb.Hello(
        rank=pb.RankIdentity(engine_id=engine_id, role=role, epoch=epoch, tp_rank=tp_rank, tp_size=tp_size,
                             pp_size=1),
        compatibility_hash="compat-1", protocol_version=1, engine_address="127.0.0.1:1", hash_seed="0"))


@pytest.mark.parametrize("first, match", [
    (pb.RankMessage(heartbeat=pb.Heartbeat()), "first message must be a Hello"),
    (_raw_hello(tp_rank=3, tp_size=2), "outside"),
    (_raw_hello(role=pb.ROLE_UNSPECIFIED), "role"),
    (_raw_hello(epoch=0), "epoch"),
])
async def test_malformed_hello_is_invalid_argument(harness: ControlHarness, first: pb.RankMessage,
                                                   match: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError, match="INVALID_ARGUMENT") as e:
        await _raw_stream(harness.port, [first])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in (e.value.details() or "")
    assert harness.servicer.registry.engines == {}  # type: ignore[union-attr]


async def test_duplicate_seq_is_ignored_and_acked(harness: ControlHarness) -> None:
    report = pb.RankMessage(report=pb.StepReport(seq=1, finished_sending=["zz"]))
    got = await _raw_stream(harness.port, [_raw_hello(), report, report], hold=0.3)
    acks = [m.ack.seq for m in got if m.WhichOneof("payload") == "ack"]
    assert acks == [1, 1]
    counters = harness.servicer.counters  # type: ignore[union-attr]
    assert counters["reports_applied"] == 1 and counters["reports_duplicate"] == 1


async def test_transfer_completion_needs_every_decode_rank(harness: ControlHarness) -> None:
    servicer = harness.servicer
    assert servicer is not None
    p = await harness.connect(hello("p0", "prefill"))
    d = [await harness.connect(hello("d0", "decode", r, 2, epoch=777)) for r in range(2)]
    pref, dref = EngineRef("p0", p.hello.identity.epoch), EngineRef("d0", 777)
    servicer.tracker.start("ok", pref, dref)
    servicer.tracker.start("bad", pref, dref)
    p_in, d0_in, d1_in = Inbox(p), Inbox(d[0]), Inbox(d[1])
    seq = d[0].report(StepReport(finished_recving=["ok"]))
    assert await asyncio.to_thread(d[0].wait_acked, seq)
    assert d0_in.of(KVReady) == [] and p_in.of(ReleaseBlocks) == []
    d[1].report(StepReport(finished_recving=["ok"]))
    await eventually(lambda: d0_in.of(KVReady) == [KVReady("ok")])
    await eventually(lambda: p_in.of(ReleaseBlocks) == [ReleaseBlocks("ok")])
    assert d1_in.of(KVReady) == []  # only rank 0 of the decode engine is told
    d[0].report(StepReport(failed_recving=["bad"], invalid_block_ids=[4, 2]))
    d[1].report(StepReport(finished_recving=["bad"]))
    await eventually(lambda: len(d0_in.of(KVFailed)) == 1)
    failed = d0_in.of(KVFailed)[0]
    assert failed.request_id == "bad" and failed.invalid_block_ids == [2, 4]
    await eventually(lambda: ReleaseBlocks("bad") in p_in.of(ReleaseBlocks))
    assert servicer.tracker.transfers == {}


async def test_kv_ready_is_written_by_the_completing_report_s_reader_in_stream_order(harness: ControlHarness) -> None:
    servicer = harness.servicer
    assert servicer is not None
    p = await harness.connect(hello("p0", "prefill"))
    d = [await harness.connect(hello("d0", "decode", r, 2, epoch=778)) for r in range(2)]
    pref, dref = EngineRef("p0", p.hello.identity.epoch), EngineRef("d0", 778)
    d0_in = Inbox(d[0])
    await eventually(lambda: servicer.connections[RankId("d0", 0, 0)].queue.empty())
    # An idle rank-0 stream: the reader of the report that completes the transfer writes it.
    servicer.tracker.start("now", pref, dref)
    for rank in d:
        assert await asyncio.to_thread(rank.wait_acked, rank.report(StepReport(finished_recving=["now"])))
    await eventually(lambda: d0_in.of(KVReady) == [KVReady("now")])
    assert servicer.counters["sent_at_once"] == 1
    # A write in flight (the lock held) and a message queued: the outcome goes behind them.
    conn = servicer.connections[RankId("d0", 0, 0)]
    async with conn.write_lock:
        assert servicer.send_to_leader(dref, pb.SchedulerMessage(kv_ready=pb.KVReady(request_id="first")))
        servicer.tracker.start("later", pref, dref)
        for rank in d:
            rank.report(StepReport(finished_recving=["later"]))
        await eventually(lambda: servicer.tracker.transfers.get("later") is None)
    await eventually(lambda: d0_in.of(KVReady) == [KVReady("now"), KVReady("first"), KVReady("later")])
    assert servicer.counters["sent_at_once"] == 1


async def test_engine_and_worker_events_reach_the_sink(harness: ControlHarness) -> None:
    ranks = [await harness.connect(hello("p0", "prefill", r, 2, epoch=4242)) for r in range(2)]
    stored = BlockStored(block_hashes=(11,), parent_block_hash=None, token_ids=tuple(range(16)), block_size=16,
                         medium="CPU_OFFLOAD")
    ranks[0].report(StepReport(engine_events=KVEventBatch(ts=1.0, events=[AllBlocksCleared(medium="CPU")]),
                               worker_events=[stored]))
    seq = ranks[1].report(StepReport(worker_events=[stored]))
    assert await asyncio.to_thread(ranks[1].wait_acked, seq)
    await eventually(lambda: len(harness.sink.batches) == 2)
    (e1, ep1, b1), (e2, _, b2) = harness.sink.batches
    assert (e1, ep1, b1.events) == ("p0", 4242, [AllBlocksCleared(medium="CPU")])
    assert e2 == "p0" and b2.events == [stored]  # published once, after both ranks stored


async def test_reports_survive_a_scheduler_restart_exactly_once() -> None:
    h = ControlHarness()
    await h.start()
    client = await h.connect(hello("p0", "prefill"))
    try:
        for i in range(5):
            last = client.report(StepReport(finished_sending=[f"a{i}"]))
        assert await asyncio.to_thread(client.wait_acked, last)
        first = h.servicer
        assert first is not None and first.counters["reports_applied"] == 5
        port = h.port
        await h.stop()
        for i in range(3):  # made while the scheduler is down: buffered, unacked
            last = client.report(StepReport(finished_sending=[f"b{i}"]))
        assert client.num_unacked() == 3
        await h.start(port)
        assert await asyncio.to_thread(client.wait_acked, last, 15.0)
        second = h.servicer
        assert second is not None
        await eventually(lambda: second.counters["reports_applied"] == 3)
        assert second.counters["reports_duplicate"] == 0
        assert client.num_reconnects >= 1 and client.num_unacked() == 0
        # New reports after the restart continue the sequence.
        last = client.report(StepReport())
        assert last == 9 and await asyncio.to_thread(client.wait_acked, last)
        assert second.counters["reports_applied"] == 4
    finally:
        await asyncio.to_thread(client.close)
        await h.stop()


async def test_silent_rank_is_declared_dead_and_fails_over() -> None:
    h = ControlHarness(timeout_s=0.3)
    await h.start()
    down: list[tuple[EngineRef, str]] = []
    assert h.servicer is not None
    h.servicer.on_engine_down.append(lambda ref, reason: down.append((ref, reason)))
    try:
        d = await h.connect(hello("d0", "decode"))
        d_in = Inbox(d)
        stream = asyncio.ensure_future(_raw_stream(h.port, [_raw_hello("psilent", epoch=31)], hold=2.0))
        await eventually(lambda: any(u.joined for u in d_in.of(PeerUpdate)))
        h.servicer.tracker.start("r", EngineRef("psilent", 31), EngineRef("d0", d.hello.identity.epoch))
        await eventually(lambda: bool(down), timeout=5.0)
        assert down[0][0] == EngineRef("psilent", 31) and "silent" in down[0][1]
        await eventually(lambda: any(u.left for u in d_in.of(PeerUpdate)))
        await eventually(lambda: [m.request_id for m in d_in.of(KVFailed)] == ["r"])
        assert ("psilent", 31) in [(e, ep) for e, ep, b in h.sink.batches if b.events == [AllBlocksCleared()]]
        assert [e.engine_id for e in h.servicer.registry.routable(h.servicer.registry.engines["d0"].role)] == ["d0"]
        stream.cancel()
    finally:
        await asyncio.to_thread(d.close)
        await h.stop()


async def test_new_epoch_fences_the_old_stream(harness: ControlHarness) -> None:
    old = await harness.connect(hello("p0", "prefill", epoch=100))
    d = await harness.connect(hello("d0", "decode"))
    d_in = Inbox(d)
    await harness.connect(hello("p0", "prefill", epoch=200))
    await eventually(lambda: old.error is not None)
    assert old.error is not None and "fenced" in old.error.reason
    await eventually(lambda: any(u.left and u.left[0].epoch == 100 for u in d_in.of(PeerUpdate)))
    await eventually(lambda: any(u.joined and u.joined[0].rank.epoch == 200 for u in d_in.of(PeerUpdate)))
    assert harness.servicer.registry.engines["p0"].epoch == 200  # type: ignore[union-attr]
    assert isinstance(d.welcome, Welcome)


async def test_messages_for_a_reconnecting_rank_are_held_and_delivered(harness: ControlHarness) -> None:
    servicer = harness.servicer
    assert servicer is not None
    h = hello("d0", "decode", epoch=8080)
    first = await harness.connect(h)
    await asyncio.to_thread(first.close)
    await eventually(lambda: not servicer.connections)
    ref = EngineRef("d0", 8080)
    assert servicer.send_to_leader(ref, pb.SchedulerMessage(kv_ready=pb.KVReady(request_id="held")))
    assert not servicer.send_to_leader(EngineRef("d0", 1), pb.SchedulerMessage(kv_ready=pb.KVReady(request_id="x")))
    again = await harness.connect(h)
    inbox = Inbox(again)
    await eventually(lambda: inbox.of(KVReady) == [KVReady("held")])
    assert servicer.held == {}


async def test_heartbeat_load_and_draining_reach_the_registry(harness: ControlHarness) -> None:
    from services.engine.control_client import EngineLoad

    client = await harness.connect(hello("d0", "decode"))
    registry = harness.servicer.registry  # type: ignore[union-attr]
    client.set_load(EngineLoad(num_running=3, num_waiting=1, kv_usage=0.5, num_free_blocks=10))
    client.heartbeat_now()
    await eventually(lambda: registry.engines["d0"].load.num_running == 3)
    assert registry.engines["d0"].load.kv_usage == 0.5 and registry.engines["d0"].routable
    client.set_load(None, draining=True)
    await eventually(lambda: registry.engines["d0"].draining)
    assert not registry.engines["d0"].routable


async def test_closed_rank_stream_takes_its_engine_down_quickly(harness: ControlHarness) -> None:
    servicer = harness.servicer
    assert servicer is not None
    p = await harness.connect(hello("p0", "prefill", epoch=606))
    d = await harness.connect(hello("d0", "decode"))
    d_in = Inbox(d)
    servicer.tracker.start("r", EngineRef("p0", 606), EngineRef("d0", d.hello.identity.epoch))
    await asyncio.to_thread(p.close)  # a killed prefill process: the stream closes, nothing comes back
    await eventually(lambda: [m.request_id for m in d_in.of(KVFailed)] == ["r"])
    await eventually(lambda: any(u.left for u in d_in.of(PeerUpdate)))
    assert EngineRef("p0", 606) in servicer.down
    back = await harness.connect(hello("p0", "prefill", epoch=606))  # the same process reconnecting
    await eventually(lambda: EngineRef("p0", 606) not in servicer.down)
    assert back.welcome is not None


async def test_a_stalled_scheduler_loop_does_not_take_down_ranks_that_kept_beating() -> None:
    """The scheduler's loop blocks past the heartbeat timeout while a rank (its own thread) keeps
    beating into the socket: the sweep that runs right after the stall must not call it silent
    (it would on wall time alone), and a rank that really goes silent is still found."""
    h = ControlHarness(timeout_s=0.3)
    await h.start()
    servicer = h.servicer
    assert servicer is not None
    down: list[tuple[EngineRef, str]] = []
    servicer.on_engine_down.append(lambda ref, reason: down.append((ref, reason)))
    try:
        p = await h.connect(hello("p0", "prefill", epoch=707))
        await asyncio.sleep(0.2)  # a few beats (every 0.05 s) and monitor ticks
        import time

        time.sleep(1.0)  # the loop stalls: no stream is read, no timer runs
        servicer.check_heartbeats()  # the sweep runs first, before the beats that waited are read
        assert down == [] and servicer.stalls.total_s >= 0.9
        await asyncio.sleep(0.6)  # two timeouts of a live loop: the beats count again
        assert down == [] and servicer.registry.engines["p0"].routable
        stream = asyncio.ensure_future(_raw_stream(h.port, [_raw_hello("psilent", epoch=32)], hold=3.0))
        await eventually(lambda: bool(down), timeout=5.0)  # silence on a live loop still counts
        assert down[0][0] == EngineRef("psilent", 32) and "silent" in down[0][1]
        stream.cancel()
    finally:
        await asyncio.to_thread(p.close)
        await h.stop()


async def test_packed_reports_buffered_for_a_new_scheduler_reach_an_older_one_unpacked() -> None:
    """A rank packs worker events for a scheduler that accepts them; reports buffered while it
    restarts as one that does not (an older version) are resent as plain `worker_events`."""
    h = ControlHarness()
    await h.start()
    client = await h.connect(hello("p0", "prefill", epoch=808))
    try:
        assert client.welcome is not None and client.welcome.accepts_packed_worker_events
        port = h.port
        await h.stop()
        event = BlockStored((77,), None, (), 16, medium="CPU_OFFLOAD")
        last = client.report(StepReport(worker_events=[event]))  # packed: the last Welcome allowed it
        await h.start(port)
        old = h.servicer
        assert old is not None
        old.accepts_packed_worker_events = False
        seen: list[bool] = []
        apply = old.apply_report
        old.apply_report = lambda engine, rank_id, report: (  # type: ignore[method-assign]
            seen.append(bool(report.packed_worker_events)), apply(engine, rank_id, report))[-1]
        assert await asyncio.to_thread(client.wait_acked, last, 15.0)
        assert seen == [False]
        assert [b.events for _, _, b in h.sink.batches if b.events != [AllBlocksCleared()]] == [[event]]
    finally:
        await asyncio.to_thread(client.close)
        await h.stop()
