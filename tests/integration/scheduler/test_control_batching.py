"""Control stream at scale: several reports per message (ReportBatch, one Ack) and coalesced
PeerUpdate joins, throttled Acks, packed worker events. Real Control server and clients over
loopback; about 5 s in all."""

from __future__ import annotations

import asyncio

from scheduler_harness import ControlHarness, eventually, exchange, hello

from pdserve.v1 import control_pb2 as pb
from services.engine.control_client import ControlClient, PeerUpdate, StepReport
from services.scheduler.control import ControlServicer, RankConnection
from services.scheduler.registry import EngineRegistry, RankId, Role


def _hello_msg(engine_id: str = "x", epoch: int = 9) -> pb.RankMessage:
    return pb.RankMessage(hello=pb.Hello(
        rank=pb.RankIdentity(engine_id=engine_id, role=pb.ROLE_PREFILL, epoch=epoch, tp_rank=0, tp_size=1,
                             pp_size=1),
        compatibility_hash="compat-1", protocol_version=1, engine_address="127.0.0.1:1", hash_seed="0"))


def _batch(*seqs: int) -> pb.RankMessage:
    return pb.RankMessage(reports=pb.ReportBatch(reports=[pb.StepReport(seq=s, finished_sending=[f"r{s}"])
                                                          for s in seqs]))



async def test_report_batch_is_applied_in_order_and_acked_once(harness: ControlHarness) -> None:
    got = await exchange(harness.port, [_hello_msg(), _batch(1, 2, 3), _batch(2, 3, 4)], hold=0.3)
    welcome = got[0].welcome
    assert welcome.max_reports_per_message > 1
    assert [m.ack.seq for m in got if m.WhichOneof("payload") == "ack"] == [3, 4]
    counters = harness.servicer.counters  # type: ignore[union-attr]
    assert counters["reports_applied"] == 4 and counters["reports_duplicate"] == 2
    assert counters["report_batches"] == 2
    # The metric counts each applied report (one update per message), not each message.
    prometheus = harness.servicer.telemetry.prometheus  # type: ignore[union-attr]
    assert prometheus.get_sample_value("pdserve_scheduler_rank_reports_total", {"kind": "rank"}) == 4
    assert prometheus.get_sample_value("pdserve_scheduler_rank_reports_total", {"kind": "merged"}) is None


def test_default_ack_interval_is_a_few_heartbeats_capped() -> None:
    """Acks are writes, the costliest message per stream: by default one per stream per
    ACK_INTERVAL_BEATS heartbeat intervals, at most MAX_ACK_INTERVAL_S (decision 0045)."""
    from services.scheduler.control import ACK_INTERVAL_BEATS, MAX_ACK_INTERVAL_S

    def interval(beat_s: float) -> float:
        registry = EngineRegistry(block_size=16, hash_seed="0", heartbeat_timeout_s=60.0)
        return ControlServicer(registry, heartbeat_interval_s=beat_s).ack_interval_s

    assert interval(0.05) == 0.05 * ACK_INTERVAL_BEATS
    assert interval(1.0) == MAX_ACK_INTERVAL_S == 4.0
    assert interval(30.0) == MAX_ACK_INTERVAL_S


async def test_control_client_sends_queued_reports_together(harness: ControlHarness) -> None:
    client = harness.client(hello("p0", "prefill"))
    seqs = [client.report(StepReport(finished_sending=[f"q{i}"])) for i in range(40)]  # queued before start
    await asyncio.to_thread(client.start, 10.0)
    assert await asyncio.to_thread(client.wait_acked, seqs[-1])
    counters = harness.servicer.counters  # type: ignore[union-attr]
    assert counters["reports_applied"] == 40 and counters["report_batches"] >= 1
    assert client.num_unacked() == 0


async def test_joins_of_one_loop_turn_share_one_peer_update_per_stream() -> None:
    servicer = ControlServicer(EngineRegistry(block_size=16, hash_seed="0"), scheduler_id="t")
    early = RankConnection(RankId("d0", 0, 0), 1, 5, Role.DECODE, asyncio.Queue())
    late = RankConnection(RankId("d1", 0, 0), 2, 6, Role.DECODE, asyncio.Queue())
    prefill = RankConnection(RankId("p9", 0, 0), 3, 7, Role.PREFILL, asyncio.Queue())
    servicer.connections = {c.rank_id: c for c in (early, late, prefill)}
    peers = [pb.PeerInfo(rank=pb.RankIdentity(engine_id=f"p{i}", tp_rank=0, tp_size=1), engine_address=f"a{i}")
             for i in range(5)]
    for i, peer in enumerate(peers):
        servicer._announce_joined(Role.DECODE, peer)
        if i == 2:
            late.welcomed_at = servicer._announced  # its Welcome held p0..p2
    await asyncio.sleep(0)
    assert early.queue.qsize() == 1 and late.queue.qsize() == 1 and prefill.queue.empty()
    first, second = early.queue.get_nowait(), late.queue.get_nowait()
    assert [p.engine_address for p in first.peer_update.joined] == ["a0", "a1", "a2", "a3", "a4"]  # type: ignore[union-attr]
    assert [p.engine_address for p in second.peer_update.joined] == ["a3", "a4"]  # type: ignore[union-attr]
    # A later broadcast (e.g. a left) goes after the pending joins, never before them.
    servicer._announce_joined(Role.DECODE, peers[0])
    servicer._broadcast(Role.DECODE, pb.SchedulerMessage(peer_update=pb.PeerUpdate(left=[peers[0].rank])))
    kinds = [bool(early.queue.get_nowait().peer_update.joined) for _ in range(2)]  # type: ignore[union-attr]
    assert kinds == [True, False]


async def test_every_decode_rank_learns_each_prefill_rank_exactly_once(harness: ControlHarness) -> None:
    decode = [await harness.connect(hello(f"d{i}", "decode")) for i in range(2)]
    tasks = [asyncio.ensure_future(exchange(harness.port, [_hello_msg(f"p{i}", 100 + i)], hold=1.5))
             for i in range(12)]
    await eventually(lambda: len(harness.servicer.registry.engines) == 14)  # type: ignore[union-attr]
    for client in decode:
        seen: list[str] = []
        welcome = client.welcome
        assert welcome is not None
        seen += [p.rank.engine_id for p in welcome.peers]

        def complete(client: ControlClient = client, seen: list[str] = seen) -> bool:
            seen.extend(p.rank.engine_id for m in client.poll() if isinstance(m, PeerUpdate) for p in m.joined)
            return len([e for e in seen if e.startswith("p")]) >= 12

        await eventually(complete)
        await asyncio.sleep(0.2)
        complete()
        assert sorted(e for e in seen if e.startswith("p")) == sorted(f"p{i}" for i in range(12))
        # Peer fetch off (the harness's default): decode ranks learn no decode engine.
        assert [e for e in seen if e.startswith("d")] == []
    await asyncio.gather(*tasks)


async def test_acks_are_throttled_per_stream_and_cumulative(harness: ControlHarness) -> None:
    harness.servicer.ack_interval_s = 0.5  # type: ignore[union-attr]
    reports = [pb.RankMessage(report=pb.StepReport(seq=s, finished_sending=[f"r{s}"])) for s in range(1, 41)]
    got = await exchange(harness.port, [_hello_msg(), *reports], hold=1.2)
    assert got[0].welcome.ack_interval_ms == 500
    acks = [m.ack.seq for m in got if m.WhichOneof("payload") == "ack"]
    assert acks[0] == 1  # a stream's first report is acknowledged at once
    assert acks[-1] == 40 and acks == sorted(acks) and len(acks) < 10  # then once per interval
    assert harness.servicer.counters["reports_applied"] == 40  # type: ignore[union-attr]


def _packed(seq: int, hashes: list[int], **batch_fields: object) -> pb.RankMessage:
    from connectors.kv_events import MEDIUM_CPU_OFFLOAD, BlockStored, event_to_proto
    from pdserve.v1 import kv_events_pb2

    events = [event_to_proto(BlockStored((h,), None, (), 16, medium=MEDIUM_CPU_OFFLOAD)) for h in hashes]
    packed = kv_events_pb2.EventBatch(events=events, **batch_fields).SerializeToString()  # type: ignore[arg-type]
    return pb.RankMessage(report=pb.StepReport(seq=seq, packed_worker_events=packed))


async def test_packed_worker_events_are_decoded_once_and_republished_as_sent(harness: ControlHarness) -> None:
    from connectors.kv_events import MEDIUM_CPU_OFFLOAD, BlockStored, KVEventBatch
    from pdserve.v1 import kv_events_pb2
    from services.scheduler.event_sink import ProtoBackedBatch
    from services.scheduler.events.republisher import SequencedBatch
    from services.scheduler.events.servicer import batch_to_proto, encode_item

    assert harness.servicer is not None
    harness.servicer.accepts_compact_worker_events = False  # the packed path: a scheduler before compact events
    ranks = [await harness.connect(hello("p0", "prefill", tp_rank=r, tp_size=2, epoch=77)) for r in range(2)]
    assert all(c.welcome is not None and c.welcome.accepts_packed_worker_events for c in ranks)
    events = [BlockStored((h,), None, (), 16, medium=MEDIUM_CPU_OFFLOAD) for h in (11, 12, 13)]
    for c in ranks:  # ControlClient packs for a scheduler that accepts it
        c.report(StepReport(worker_events=events))
    await eventually(lambda: len(harness.sink.batches) == 1)
    servicer = harness.servicer
    assert servicer is not None
    assert (servicer.worker_events.misses, servicer.worker_events.hits) == (1, 1)
    engine_id, epoch, batch = harness.sink.batches[0]
    assert isinstance(batch, ProtoBackedBatch) and batch.events_wire and list(batch.events) == events
    wire = encode_item(SequencedBatch(5, engine_id, epoch, batch))
    expected = batch_to_proto(5, engine_id, epoch, KVEventBatch(batch.ts, list(events)))
    assert kv_events_pb2.EventStreamMessage.FromString(wire).batch == expected


async def test_malformed_packed_worker_events_are_dropped_and_acked(harness: ControlHarness) -> None:
    both = _packed(2, [2])
    both.report.worker_events.add().all_blocks_cleared.SetInParent()
    garbage = pb.RankMessage(report=pb.StepReport(seq=3, packed_worker_events=b"\xff\xff\xff"))
    got = await exchange(harness.port, [_hello_msg(), _packed(1, [1], ts=2.5), both, garbage, _packed(4, [4])],
                          hold=0.4)
    assert [m.ack.seq for m in got if m.WhichOneof("payload") == "ack"][-1] == 4
    counters = harness.servicer.counters  # type: ignore[union-attr]
    assert counters["reports_malformed"] == 3 and counters["reports_applied"] == 1
    assert [b.events[0].block_hashes for _, _, b in harness.sink.batches] == [(4,)]


def _stored(*hashes: int) -> list:  # type: ignore[type-arg]
    from connectors.kv_events import MEDIUM_CPU_OFFLOAD, BlockStored

    return [BlockStored((h,), None, (), 16, medium=MEDIUM_CPU_OFFLOAD) for h in hashes]


def _reports_by_kind(servicer: ControlServicer | None) -> dict[str, float | None]:
    """pdserve_scheduler_rank_reports_total by kind (None: that kind never counted)."""
    assert servicer is not None
    read = servicer.telemetry.prometheus.get_sample_value
    return {kind: read("pdserve_scheduler_rank_reports_total", {"kind": kind}) for kind in ("rank", "merged")}


async def test_one_report_per_engine_step_counts_the_events_for_every_merged_rank(harness: ControlHarness) -> None:
    ranks = [await harness.connect(hello("p0", "prefill", tp_rank=r, tp_size=4, epoch=78)) for r in range(4)]
    assert all(c.welcome is not None and c.welcome.accepts_merged_worker_events for c in ranks)
    servicer = harness.servicer
    assert servicer is not None
    # Ranks 0, 1, 2 in one message: the blocks are not whole until rank 3 holds them too (§3).
    seq = ranks[0].report(StepReport(worker_events=_stored(21, 22), merged_event_ranks=(1, 2)))
    assert await asyncio.to_thread(ranks[0].wait_acked, seq)
    assert harness.sink.batches == []
    ranks[3].report(StepReport(worker_events=_stored(21, 22)))
    await eventually(lambda: len(harness.sink.batches) == 1)
    assert list(harness.sink.batches[0][2].events) == _stored(21, 22)
    # A whole step from rank 0 alone: published at once; the others' reports carry transfers only.
    ranks[0].report(StepReport(worker_events=_stored(23), merged_event_ranks=(3, 1, 2)))
    await eventually(lambda: len(harness.sink.batches) == 2)
    assert list(harness.sink.batches[1][2].events) == _stored(23)
    for c in ranks[1:]:
        c.report(StepReport(finished_sending=["req-1"]))
    await eventually(lambda: servicer.counters["reports_applied"] == 6)
    assert len(harness.sink.batches) == 2 and len(servicer.worker_events) == 0  # nothing cached for copies to come
    # A repeat of a merged step by a listed rank itself is absorbed (a rank counts once per event).
    ranks[2].report(StepReport(worker_events=_stored(23)))
    await eventually(lambda: servicer.counters["reports_applied"] == 7)
    assert len(harness.sink.batches) == 2
    # The metric tells which protocol the engine speaks: two merged reports, five of one rank.
    assert _reports_by_kind(servicer) == {"rank": 5.0, "merged": 2.0}


async def test_malformed_merged_event_ranks_are_dropped_and_acked(harness: ControlHarness) -> None:
    def merged(seq: int, ranks: list[int], hashes: list[int]) -> pb.RankMessage:
        m = _packed(seq, hashes) if hashes else pb.RankMessage(report=pb.StepReport(seq=seq))
        m.report.merged_event_ranks.extend(ranks)
        return m

    hello_msg = _hello_msg("x", 9)
    hello_msg.hello.rank.tp_size = 2
    bad = [merged(1, [2], [1]), merged(2, [1, 1], [2]), merged(3, [0], [3]), merged(4, [1], [])]
    got = await exchange(harness.port, [hello_msg, *bad, merged(5, [1], [5])], hold=0.4)
    assert got[0].welcome.accepts_merged_worker_events
    assert [m.ack.seq for m in got if m.WhichOneof("payload") == "ack"][-1] == 5
    counters = harness.servicer.counters  # type: ignore[union-attr]
    assert counters["reports_malformed"] == 4 and counters["reports_applied"] == 1
    assert [b.events[0].block_hashes for _, _, b in harness.sink.batches] == [(5,)]
    assert _reports_by_kind(harness.servicer) == {"rank": None, "merged": 1.0}  # dropped reports are not counted


async def test_control_client_refuses_merged_events_the_scheduler_does_not_accept(harness: ControlHarness) -> None:
    import pytest

    servicer = harness.servicer
    assert servicer is not None
    servicer.accepts_merged_worker_events = False
    client = await harness.connect(hello("p1", "prefill", tp_rank=0, tp_size=2, epoch=79))
    with pytest.raises(ValueError, match="does not accept merged worker events"):
        client.report(StepReport(worker_events=_stored(1), merged_event_ranks=(1,)))
    with pytest.raises(ValueError, match="merged_event_ranks without worker events"):
        client.report(StepReport(merged_event_ranks=(1,)))
    assert client.last_seq == 0


async def test_a_merged_report_still_counts_the_senders_own_transfer_results(harness: ControlHarness) -> None:
    ranks = [await harness.connect(hello("p2", "prefill", tp_rank=r, tp_size=2, epoch=80)) for r in range(2)]
    servicer = harness.servicer
    assert servicer is not None
    ranks[0].report(StepReport(finished_sending=["rq"], worker_events=_stored(31), merged_event_ranks=(1,)))
    await eventually(lambda: len(harness.sink.batches) == 1)
    assert servicer.aggregator.pending_reports()["p2"].sending == 1  # rank 0's share of "rq", not rank 1's
    ranks[1].report(StepReport(finished_sending=["rq"]))
    await eventually(lambda: servicer.aggregator.pending_reports()["p2"].sending == 0)


def _compact(seq: int, hashes: list[int]) -> pb.RankMessage:
    from connectors import compact_events

    c = compact_events.encode(_stored(*hashes))
    assert c is not None
    return pb.RankMessage(report=pb.StepReport(seq=seq, compact_worker_events=compact_events.to_proto(c)))


async def test_compact_worker_events_are_published_without_decoding(harness: ControlHarness) -> None:
    from services.scheduler.event_sink import CompactBatch

    servicer = harness.servicer
    assert servicer is not None
    servicer.verify_compact = True  # the client's three forms agree, event by event
    ranks = [await harness.connect(hello("p3", "prefill", tp_rank=r, tp_size=2, epoch=81)) for r in range(2)]
    assert all(c.welcome is not None and c.welcome.accepts_compact_worker_events for c in ranks)
    ranks[0].report(StepReport(worker_events=_stored(41, 42), merged_event_ranks=(1,),
                               finished_sending=["c1"], merged_transfer_ranks=(1,)))
    await eventually(lambda: len(harness.sink.batches) == 1)
    batch = harness.sink.batches[0][2]
    assert isinstance(batch, CompactBatch) and batch.compact.hashes == [41, 42]
    assert list(batch.events) == _stored(41, 42)
    assert servicer.aggregator.pending_reports()["p3"].sending == 0  # "c1" counted for both ranks
    # Per-rank compact reports: whole once both ranks hold a block; a block already published is not again.
    ranks[0].report(StepReport(worker_events=_stored(42, 43)))
    ranks[1].report(StepReport(worker_events=_stored(42, 43)))
    await eventually(lambda: len(harness.sink.batches) == 2)
    assert list(harness.sink.batches[1][2].events) == _stored(43)
    assert servicer.counters["reports_malformed"] == 0 and servicer.worker_events.misses == 0


async def test_a_rank_sends_packed_events_to_a_scheduler_without_compact_events(harness: ControlHarness) -> None:
    from services.scheduler.event_sink import CompactBatch, ProtoBackedBatch

    assert harness.servicer is not None
    harness.servicer.accepts_compact_worker_events = False  # an older scheduler
    client = await harness.connect(hello("p4", "prefill", epoch=82))
    client.report(StepReport(worker_events=_stored(51)))
    await eventually(lambda: len(harness.sink.batches) == 1)
    batch = harness.sink.batches[0][2]
    assert isinstance(batch, ProtoBackedBatch) and not isinstance(batch, CompactBatch)
    assert list(batch.events) == _stored(51)


async def test_malformed_compact_worker_events_are_dropped_counted_and_acked(harness: ControlHarness) -> None:
    short = _compact(1, [61, 62])
    short.report.compact_worker_events.block_hashes = b"\x00" * 12
    both = _compact(2, [61])
    both.report.packed_worker_events = b"\x32\x00"
    miscounted = _compact(3, [61, 62])
    miscounted.report.compact_worker_events.msgpack_events = b"\x91\xc0"
    got = await exchange(harness.port, [_hello_msg(), short, both, miscounted, _compact(4, [61, 62])], hold=0.4)
    assert [m.ack.seq for m in got if m.WhichOneof("payload") == "ack"][-1] == 4
    counters = harness.servicer.counters  # type: ignore[union-attr]
    assert counters["reports_malformed_compact_events"] == 3 and counters["reports_malformed"] == 3
    assert counters["reports_applied"] == 1
    # nothing of the dropped reports counted: the good one published both blocks
    assert [list(b.events) for _, _, b in harness.sink.batches] == [_stored(61, 62)]


async def test_one_report_carries_every_decode_ranks_finished_receive(harness: ControlHarness) -> None:
    from test_control_stream import Inbox

    from services.engine.control_client import KVFailed, KVReady, ReleaseBlocks
    from services.scheduler.lifecycle import EngineRef

    servicer = harness.servicer
    assert servicer is not None
    p = await harness.connect(hello("p5", "prefill"))
    d = [await harness.connect(hello("d5", "decode", r, 4, epoch=85)) for r in range(4)]
    assert all(c.welcome is not None and c.welcome.accepts_merged_transfer_results for c in d)
    pref, dref = EngineRef("p5", p.hello.identity.epoch), EngineRef("d5", 85)
    for rid in ("one", "part", "bad"):
        servicer.tracker.start(rid, pref, dref)
    p_in, d0_in = Inbox(p), Inbox(d[0])
    # Every rank's receive in one message: KVReady at once, the prefill blocks released.
    d[0].report(StepReport(finished_recving=["one"], merged_transfer_ranks=(1, 2, 3)))
    await eventually(lambda: d0_in.of(KVReady) == [KVReady("one")])
    await eventually(lambda: p_in.of(ReleaseBlocks) == [ReleaseBlocks("one")])
    # Ranks 0-2 in one message: not ready until rank 3 reports too (§3: every expected rank);
    # rank 1 repeating its own share is counted once.
    d[0].report(StepReport(finished_recving=["part"], merged_transfer_ranks=(2, 1)))
    seq = d[1].report(StepReport(finished_recving=["part"]))
    assert await asyncio.to_thread(d[1].wait_acked, seq)
    assert d0_in.of(KVReady) == [KVReady("one")]
    d[3].report(StepReport(finished_recving=["part"]))
    await eventually(lambda: d0_in.of(KVReady) == [KVReady("one"), KVReady("part")])
    # Failures and invalid blocks count for every listed rank alike.
    d[2].report(StepReport(failed_recving=["bad"], invalid_block_ids=[7], merged_transfer_ranks=(0, 1, 3)))
    await eventually(lambda: len(d0_in.of(KVFailed)) == 1)
    assert d0_in.of(KVFailed)[0].request_id == "bad" and d0_in.of(KVFailed)[0].invalid_block_ids == [7]
    assert servicer.tracker.transfers == {} and servicer.aggregator.pending_reports()["d5"].recving == 0


async def test_malformed_merged_transfer_ranks_are_dropped_and_change_nothing(harness: ControlHarness) -> None:
    def merged(seq: int, ranks: list[int], sending: list[str]) -> pb.RankMessage:
        return pb.RankMessage(report=pb.StepReport(seq=seq, finished_sending=sending, merged_transfer_ranks=ranks))

    hello_msg = _hello_msg("y", 19)
    hello_msg.hello.rank.tp_size = 2
    # outside the engine, repeated, the sender's own, no transfer results
    bad = [merged(1, [2], ["a"]), merged(2, [1, 1], ["b"]), merged(3, [0], ["c"]), merged(4, [1], [])]
    got = await exchange(harness.port, [hello_msg, *bad, merged(5, [1], ["e"])], hold=0.4)
    assert got[0].welcome.accepts_merged_transfer_results
    assert [m.ack.seq for m in got if m.WhichOneof("payload") == "ack"][-1] == 5
    servicer = harness.servicer
    assert servicer is not None
    assert servicer.counters["reports_malformed"] == 4 and servicer.counters["reports_applied"] == 1
    # nothing of the dropped reports was counted: no id pending; "e" was whole (ranks 0 and 1)
    assert servicer.aggregator.pending_reports()["y"].sending == 0


async def test_control_client_refuses_merged_transfers_the_scheduler_does_not_accept(
        harness: ControlHarness) -> None:
    import pytest

    servicer = harness.servicer
    assert servicer is not None
    servicer.accepts_merged_transfer_results = False
    client = await harness.connect(hello("p6", "prefill", tp_rank=0, tp_size=2, epoch=86))
    with pytest.raises(ValueError, match="does not accept merged transfer results"):
        client.report(StepReport(finished_sending=["s"], merged_transfer_ranks=(1,)))
    with pytest.raises(ValueError, match="merged_transfer_ranks without transfer results"):
        client.report(StepReport(merged_transfer_ranks=(1,)))
    assert client.last_seq == 0


async def test_per_rank_compact_copies_of_a_step_are_decoded_and_applied_once(harness: ControlHarness) -> None:
    """Every rank of a tp 4 engine sends each step's compact events itself (the per-rank protocol,
    through ControlClient): each step is published once, whole, after its last rank's copy, and
    parsed once (the other copies are joined, EventJoiner), also with a rank behind."""
    from services.scheduler.event_sink import CompactBatch

    servicer = harness.servicer
    assert servicer is not None
    servicer.verify_compact = True
    ranks = [await harness.connect(hello("p7", "prefill", tp_rank=r, tp_size=4, epoch=87)) for r in range(4)]
    steps = [_stored(100 + 3 * s, 101 + 3 * s, 102 + 3 * s) for s in range(3)]

    async def send(r: int, events: list) -> None:  # type: ignore[type-arg]
        applied = servicer.counters["reports_applied"]
        ranks[r].report(StepReport(worker_events=events))
        await eventually(lambda: servicer.counters["reports_applied"] == applied + 1)

    for events in steps[:2]:
        for r in (2, 0, 3, 1):
            await send(r, events)
    assert len(harness.sink.batches) == 2
    for r in (1, 2, 0):  # rank 3 is behind: step 2 waits for it
        await send(r, steps[2])
    assert len(harness.sink.batches) == 2
    await send(3, steps[2])
    await eventually(lambda: len(harness.sink.batches) == 3)
    assert all(isinstance(b, CompactBatch) for _, _, b in harness.sink.batches)
    assert [list(b.events) for _, _, b in harness.sink.batches] == steps
    assert servicer.joiner.num_decoded == 3 and servicer.joiner.num_joined == 9
    assert servicer.counters["reports_applied"] == 12 and servicer.counters["reports_malformed"] == 0
    assert servicer.aggregator.pending_reports()["p7"].blocks == 0


async def test_copies_noted_before_an_engine_goes_down_are_published_before_its_clear(
        harness: ControlHarness) -> None:
    """Rank 1 drops block 5 and stores it again; its second copy of that step completes the
    block (ranks 0 and 2 still hold it) but waits for rank 2's copy: when the engine goes down
    first, the block is published before the engine's AllBlocksCleared, as it was reported."""
    from connectors.kv_events import MEDIUM_CPU_OFFLOAD, AllBlocksCleared, BlockRemoved, BlockStored
    from services.scheduler.lifecycle import EngineRef

    servicer = harness.servicer
    assert servicer is not None
    ranks = [await harness.connect(hello("p8", "prefill", tp_rank=r, tp_size=3, epoch=88)) for r in range(3)]
    assert servicer._monitor_task is not None
    servicer._monitor_task.cancel()  # no heartbeat sweep: it would apply the noted copy on its own

    async def send(r: int, events: list) -> None:  # type: ignore[type-arg]
        applied = servicer.counters["reports_applied"]
        ranks[r].report(StepReport(worker_events=events))
        await eventually(lambda: servicer.counters["reports_applied"] == applied + 1)

    for r in range(3):
        await send(r, _stored(5))
    await send(1, [BlockRemoved((5,), MEDIUM_CPU_OFFLOAD)])
    await send(0, _stored(5))  # rank 0 holds it already: nothing changes
    await send(1, _stored(5))  # completes block 5 again, but is noted: rank 2's copy is to come
    servicer.engine_down(EngineRef("p8", 88), "test")
    kinds = [[type(e) for e in b.events] for _, _, b in harness.sink.batches]
    assert kinds == [[BlockStored], [BlockRemoved], [BlockStored], [AllBlocksCleared]]
