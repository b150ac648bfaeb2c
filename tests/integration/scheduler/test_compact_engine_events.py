"""Rank 0's engine events in compact form (StepReport.compact_engine_events): published, indexed
and put on the wire exactly as the same events through the protobuf path; what does not qualify
keeps that path; a report resent to an older scheduler goes back to it; malformed ones are
dropped, counted and acked with nothing applied. Real Control server and clients over loopback;
about 2 s in all."""

from __future__ import annotations

import zmq
from scheduler_harness import ControlHarness, eventually, exchange, hello

from connectors import compact_events
from connectors.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    event_from_proto,
    event_to_proto,
)
from pdserve.v1 import control_pb2 as pb
from services.engine.control_client import (
    RankIdentity,
    StepReport,
    Welcome,
    downgrade_report,
    report_to_proto,
)
from services.scheduler.event_sink import CompactBatch, ProtoBackedBatch
from services.scheduler.events import EventRepublisher, SequencedBatch
from services.scheduler.events.servicer import encode_item
from services.scheduler.events.zmq_publisher import ZmqEventPublisher
from services.scheduler.prefix_index import InMemoryPrefixIndex


def _engine_stored(*hashes: int, lora: bool = False) -> list[BlockStored]:
    """vLLM GPU block-pool BlockStored: a chain of hashes with token ids, a parent, block size,
    per-block extra keys, the group and its spec kind (which the protobuf form drops), and
    (optionally) a LoRA."""
    return [BlockStored((h, h + 1), h - 1 if i else None, tuple(range(h, h + 32)), 16,
                        lora_id=3 if lora else None, medium=MEDIUM_GPU, lora_name="ad" if lora else None,
                        extra_keys=(None, ("ad",)) if lora else (None, None), group_idx=0,
                        kv_cache_spec_kind="full_attention")
            for i, h in enumerate(hashes)]


def _wire(batch: KVEventBatch, engine_id: str) -> tuple[bytes, bytes]:
    """The batch's gRPC EventBatch bytes and ZMQ payload as the event plane publishes them
    (under one engine id, so only the events and their header can differ)."""
    rp = EventRepublisher(InMemoryPrefixIndex())
    sb = SequencedBatch(5, engine_id, 7, batch)
    return encode_item(sb), ZmqEventPublisher(rp, "inproc://he3-compact", context=zmq.Context()).payload_of(sb)


async def test_compact_engine_events_publish_what_the_protobuf_path_does(harness: ControlHarness) -> None:
    servicer = harness.servicer
    assert servicer is not None
    servicer.verify_compact = True  # the client's three forms agree, event by event
    servicer.accepts_compact_engine_events = False  # an older scheduler: the protobuf path
    old = await harness.connect(hello("q0", "prefill", epoch=90))
    servicer.accepts_compact_engine_events = True
    new = await harness.connect(hello("q1", "prefill", tp_rank=0, tp_size=2, epoch=91))
    other = await harness.connect(hello("q1", "prefill", tp_rank=1, tp_size=2, epoch=91))
    assert old.welcome is not None and not old.welcome.accepts_compact_engine_events
    assert new.welcome is not None and new.welcome.accepts_compact_engine_events
    steps = [KVEventBatch(1.5, _engine_stored(100, 102, 104, lora=True), 2),
             KVEventBatch(2.5, _engine_stored(200), None),
             KVEventBatch(3.5, [*_engine_stored(300), BlockRemoved((100,), medium=MEDIUM_GPU)], 0),
             KVEventBatch(4.5, [AllBlocksCleared()], None)]
    for step in steps:
        old.report(StepReport(engine_events=step))
        new.report(StepReport(engine_events=step))
    other.report(StepReport(engine_events=steps[0]))  # not rank 0: ignored on both paths
    await eventually(lambda: len(harness.sink.batches) == 2 * len(steps))
    got = {e: [b for e2, _, b in harness.sink.batches if e2 == e] for e in ("q0", "q1")}
    assert [type(b) for b in got["q1"]] == [CompactBatch, CompactBatch, ProtoBackedBatch, ProtoBackedBatch]
    assert all(type(b) is ProtoBackedBatch for b in got["q0"])
    for step, proto, compact in zip(steps, got["q0"], got["q1"], strict=True):
        assert (compact.ts, compact.data_parallel_rank, list(compact.events)) == (
            step.ts, step.data_parallel_rank, [event_from_proto(event_to_proto(e)) for e in step.events])
        assert _wire(compact, "e") == _wire(proto, "e")  # gRPC and ZMQ bytes
    planes = [EventRepublisher(InMemoryPrefixIndex()) for _ in range(2)]
    for plane, batches in zip(planes, (got["q0"], got["q1"]), strict=True):
        for b in batches:
            plane.publish_seq("e", 1, b)
    assert list(planes[0].index.entries()) == list(planes[1].index.entries())  # type: ignore[attr-defined]
    assert planes[0].stats() == planes[1].stats()
    assert servicer.counters["reports_malformed"] == 0


def test_a_report_resent_to_an_older_scheduler_carries_the_same_engine_events() -> None:
    identity = RankIdentity("q2", "prefill", 92, 0, 1)
    report = StepReport(engine_events=KVEventBatch(6.5, _engine_stored(400, 402), 1),
                        worker_events=[BlockStored((9,), None, (), 16, medium="CPU_OFFLOAD")])
    compact = report_to_proto(1, report, identity, packed=True, compact=True, compact_engine=True)
    assert compact.HasField("compact_engine_events") and not compact.engine_events.events
    downgrade_report(compact, Welcome([], [], 0, 1.0, "old", accepts_packed_worker_events=True))
    assert compact == report_to_proto(1, report, identity, packed=True)


def _hello_msg() -> pb.RankMessage:
    return pb.RankMessage(hello=pb.Hello(
        rank=pb.RankIdentity(engine_id="q3", role=pb.ROLE_PREFILL, epoch=93, tp_rank=0, tp_size=2, pp_size=1),
        compatibility_hash="compat-1", protocol_version=1, engine_address="127.0.0.1:1", hash_seed="0"))


async def test_malformed_compact_engine_events_are_dropped_counted_and_acked(harness: ControlHarness) -> None:
    from pdserve.v1 import kv_events_pb2 as kpb

    def report(seq: int, *hashes: int) -> pb.RankMessage:
        c = compact_events.encode(_engine_stored(*hashes))
        assert c is not None
        return pb.RankMessage(report=pb.StepReport(
            seq=seq, engine_events=kpb.EventBatch(ts=1.0), compact_engine_events=compact_events.to_proto(c),
            finished_sending=[f"r{seq}"]))

    short = report(1, 500)
    short.report.compact_engine_events.block_hashes = b"\x00" * 12
    both = report(2, 500)
    both.report.engine_events.events.append(event_to_proto(_engine_stored(7)[0]))
    miscounted = report(3, 500, 502)
    miscounted.report.compact_engine_events.msgpack_events = b"\x91\xc0"
    garbled = report(4, 500)
    garbled.report.compact_engine_events.events_wire = b"\xff\xff"
    got = await exchange(harness.port, [_hello_msg(), short, both, miscounted, garbled, report(5, 500)], hold=0.4)
    assert [m.ack.seq for m in got if m.WhichOneof("payload") == "ack"][-1] == 5
    counters = harness.servicer.counters  # type: ignore[union-attr]
    assert counters["reports_malformed_compact_events"] == 4 and counters["reports_malformed"] == 4
    assert counters["reports_applied"] == 1
    assert [list(b.events) for _, _, b in harness.sink.batches] == [
        [event_from_proto(event_to_proto(e)) for e in _engine_stored(500)]]
    # nothing else of the dropped reports applied: only the good one's transfer result waits for rank 1
    assert harness.servicer.aggregator.pending_reports()["q3"].sending == 1  # type: ignore[union-attr]

