"""Mixed compact steps (BlockStored and BlockRemoved of one medium and group, CompactEvents.kinds):
worker events (merged and per rank, §3's counting) and rank 0's engine events are published and
indexed exactly as the protobuf path publishes the same events to a scheduler that does not read
kinds; reports resent to such a scheduler go back to that path; malformed kinds are dropped,
counted and acked with nothing applied. Real Control server and clients over loopback; about
3 s in all."""

from __future__ import annotations

import asyncio
import dataclasses

import zmq
from scheduler_harness import ControlHarness, eventually, exchange, hello

from connectors import compact_events
from connectors.kv_events import (
    MEDIUM_CPU_OFFLOAD,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    event_from_proto,
    event_to_proto,
)
from pdserve.v1 import control_pb2 as pb
from pdserve.v1 import kv_events_pb2 as kpb
from services.engine.control_client import (
    ControlClient,
    RankIdentity,
    StepReport,
    Welcome,
    downgrade_report,
    report_to_proto,
)
from services.scheduler.event_sink import CompactBatch
from services.scheduler.events import EventRepublisher, SequencedBatch
from services.scheduler.events.servicer import encode_item
from services.scheduler.events.zmq_publisher import ZmqEventPublisher
from services.scheduler.prefix_index import InMemoryPrefixIndex


def s(*hashes: int, medium: str = MEDIUM_CPU_OFFLOAD) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 16, medium=medium)


def r(*hashes: int, medium: str = MEDIUM_CPU_OFFLOAD) -> BlockRemoved:
    return BlockRemoved(tuple(hashes), medium)


def _at(batch: KVEventBatch, ts: float) -> KVEventBatch:
    """The batch with another ts (worker batches are stamped at publication)."""
    if type(batch) is CompactBatch:
        return CompactBatch(ts, batch.compact, batch.data_parallel_rank)
    return dataclasses.replace(batch, ts=ts)


def _wire(batch: KVEventBatch) -> tuple[bytes, bytes]:
    """The gRPC EventBatch bytes and ZMQ payload the event plane publishes for the batch."""
    rp = EventRepublisher(InMemoryPrefixIndex())
    sb = SequencedBatch(5, "e", 7, batch)
    return encode_item(sb), ZmqEventPublisher(rp, "inproc://hf3-mixed", context=zmq.Context()).payload_of(sb)


async def _report(client: ControlClient, report: StepReport) -> None:
    seq = client.report(report)
    assert await asyncio.to_thread(client.wait_acked, seq, 5.0)


async def test_mixed_steps_publish_what_the_protobuf_path_does(harness: ControlHarness) -> None:
    servicer = harness.servicer
    assert servicer is not None
    servicer.verify_compact = True  # the client's three forms agree, event by event
    servicer.accepts_mixed_compact_events = False  # a scheduler before kinds: mixed steps as protobuf
    old = [await harness.connect(hello("m0", "prefill", tp_rank=i, tp_size=2, epoch=60)) for i in range(2)]
    servicer.accepts_mixed_compact_events = True
    new = [await harness.connect(hello("m1", "prefill", tp_rank=i, tp_size=2, epoch=61)) for i in range(2)]
    assert old[0].welcome is not None and not old[0].welcome.accepts_mixed_compact_events
    assert new[0].welcome is not None and new[0].welcome.accepts_mixed_compact_events
    merged: list[list[KVCacheEvent]] = [
        [s(1, 2), s(3)],  # BlockStored only
        [r(1, 2), s(4), r(3)],  # mixed, no hash both stored and removed: the ranks' joint mask
        [s(5), r(5), s(7)],  # block 5 stored and removed by each rank: never whole, only 7 published
    ]
    per_rank = [s(6), r(4)]  # removed at rank 0's report, stored once rank 1's comes
    # vLLM's GPU block pool at full cache: a store (with the fields the protobuf form reshapes) and an eviction
    engine = KVEventBatch(8.5, [BlockStored((100, 101), None, tuple(range(32)), 16, medium=MEDIUM_GPU,
                                            extra_keys=(None, None), group_idx=0, kv_cache_spec_kind="full_attention"),
                                BlockRemoved((90,), MEDIUM_GPU, 0)], 1)
    for ranks in (old, new):
        for events in merged:
            await _report(ranks[0], StepReport(worker_events=events, merged_event_ranks=(1,)))
        for rank in ranks:
            await _report(rank, StepReport(worker_events=per_rank))
        await _report(ranks[0], StepReport(engine_events=engine))
    await eventually(lambda: len(harness.sink.batches) == 12)
    got = {e: [b for e2, _, b in harness.sink.batches if e2 == e] for e in ("m0", "m1")}
    assert [type(b) is CompactBatch for b in got["m0"]] == [True, False, False, False, False, False]
    assert [type(b) is CompactBatch for b in got["m1"]] == [True, True, False, False, False, True]
    assert [list(b.events) for b in got["m1"]] == [
        merged[0], merged[1], [s(7)], [r(4)], [s(6)], [event_from_proto(event_to_proto(e)) for e in engine.events]]
    for proto, compact in zip(got["m0"], got["m1"], strict=True):
        assert list(proto.events) == list(compact.events)
        assert _wire(_at(proto, 1.0)) == _wire(_at(compact, 1.0))  # gRPC and ZMQ bytes
    assert (got["m1"][-1].ts, got["m1"][-1].data_parallel_rank) == (8.5, 1)
    planes = [EventRepublisher(InMemoryPrefixIndex()) for _ in range(2)]
    for plane, batches in zip(planes, (got["m0"], got["m1"]), strict=True):
        for b in batches:
            plane.publish_seq("e", 1, b)
    assert list(planes[0].index.entries()) == list(planes[1].index.entries())  # type: ignore[attr-defined]
    assert planes[0].stats() == planes[1].stats()
    assert planes[1].stats().events_by_type == {"BlockStored": 6, "BlockRemoved": 4}
    assert servicer.counters["reports_malformed"] == 0
    a, b = servicer.aggregator._engines["m0"], servicer.aggregator._engines["m1"]
    assert (a.blocks, a.live) == (b.blocks, b.live)
    assert {k: list(v) for k, v in a.pending_blocks.items()} == {k: list(v) for k, v in b.pending_blocks.items()}


def test_a_mixed_report_resent_to_a_scheduler_without_kinds_goes_as_protobuf() -> None:
    identity = RankIdentity("m2", "prefill", 62, 0, 1)
    report = StepReport(engine_events=KVEventBatch(6.5, [s(400, medium=MEDIUM_GPU), r(3, medium=MEDIUM_GPU)], 1),
                        worker_events=[r(9), s(10)])
    m = report_to_proto(1, report, identity, packed=True, compact=True, compact_engine=True, mixed=True)
    assert m.compact_engine_events.kinds == b"\x01\x02" and m.compact_worker_events.kinds == b"\x02\x01"
    compact_only = Welcome([], [], 0, 1.0, "old", accepts_packed_worker_events=True,
                           accepts_compact_worker_events=True, accepts_compact_engine_events=True)
    downgrade_report(m, compact_only)
    assert m == report_to_proto(1, report, identity, packed=True, compact=True, compact_engine=True)
    assert not m.HasField("compact_engine_events") and m.packed_worker_events
    stored_only = StepReport(worker_events=[s(11)])
    kept = report_to_proto(2, stored_only, identity, compact=True, mixed=True)
    downgrade_report(kept, compact_only)  # no kinds: an older compact-aware scheduler reads it as it is
    assert kept.HasField("compact_worker_events")


def _hello_msg() -> pb.RankMessage:
    return pb.RankMessage(hello=pb.Hello(
        rank=pb.RankIdentity(engine_id="m3", role=pb.ROLE_PREFILL, epoch=63, tp_rank=0, tp_size=2, pp_size=1),
        compatibility_hash="compat-1", protocol_version=1, engine_address="127.0.0.1:1", hash_seed="0"))


def _mixed_report(seq: int, engine: bool = False) -> pb.RankMessage:
    c = compact_events.encode([s(500), r(7)], mixed=True)
    assert c is not None
    m = pb.StepReport(seq=seq, finished_sending=[f"r{seq}"])
    if engine:
        m.engine_events.CopyFrom(kpb.EventBatch(ts=1.0))
        m.compact_engine_events.CopyFrom(compact_events.to_proto(c))
    else:
        m.compact_worker_events.CopyFrom(compact_events.to_proto(c))
    return pb.RankMessage(report=m)


async def test_malformed_kinds_are_dropped_counted_and_acked(harness: ControlHarness) -> None:
    short = _mixed_report(1)
    short.report.compact_worker_events.kinds = b"\x02"
    unknown = _mixed_report(2)
    unknown.report.compact_worker_events.kinds = b"\x01\x04"
    engine_unknown = _mixed_report(3, engine=True)
    engine_unknown.report.compact_engine_events.kinds = b"\x03\x02"
    good = _mixed_report(4, engine=True)
    got = await exchange(harness.port, [_hello_msg(), short, unknown, engine_unknown, good], hold=0.4)
    assert [m.ack.seq for m in got if m.WhichOneof("payload") == "ack"][-1] == 4
    counters = harness.servicer.counters  # type: ignore[union-attr]
    assert counters["reports_malformed_compact_kinds"] == 3
    assert counters["reports_malformed_compact_events"] == 3 and counters["reports_malformed"] == 3
    assert counters["reports_applied"] == 1
    assert [list(b.events) for _, _, b in harness.sink.batches] == [
        [event_from_proto(event_to_proto(e)) for e in (s(500), r(7))]]
    # nothing else of the dropped reports applied: no worker block, one transfer waiting for rank 1
    aggregator = harness.servicer.aggregator  # type: ignore[union-attr]
    assert aggregator.pending_reports()["m3"].sending == 1 and aggregator._engines["m3"].blocks == {}

