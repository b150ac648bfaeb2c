"""Compact batches (BlockStored only, or mixed with BlockRemoved) through the event plane:
republished, indexed, counted, filtered, replayed and put on the wire exactly as the same events
in a plain batch; gRPC subscribers that ask get consecutive batches in one message. About 1 s."""

from __future__ import annotations

import zmq

from connectors import compact_events as ce
from connectors.kv_events import (
    MEDIUM_CPU,
    MEDIUM_CPU_OFFLOAD,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from pdserve.v1 import kv_events_pb2 as pb
from services.scheduler.event_sink import CompactBatch
from services.scheduler.events import EventFilter, EventRepublisher, NoticeKind, SequencedBatch, StreamNotice
from services.scheduler.events.servicer import GrpcRingCodec, encode_item, encode_items
from services.scheduler.events.zmq_publisher import ZmqEventPublisher, encode_payload
from services.scheduler.prefix_index import DEFAULT_MEDIUM, InMemoryPrefixIndex


def events(*hashes: int, medium: str = MEDIUM_CPU_OFFLOAD) -> list[BlockStored]:
    return [BlockStored((h,), None, (), 16, medium=medium) for h in hashes]


def compact(*hashes: int, medium: str = MEDIUM_CPU_OFFLOAD, ts: float = 2.0) -> CompactBatch:
    c = ce.encode(events(*hashes, medium=medium))
    assert c is not None
    return CompactBatch(ts, c)


def twin_planes() -> tuple[EventRepublisher, EventRepublisher]:
    return tuple(EventRepublisher(InMemoryPrefixIndex(max_entries=5), ring_size=4, subscriber_buffer=8,  # type: ignore[return-value]
                                  ring_codec=GrpcRingCodec()) for _ in range(2))


def test_a_compact_batch_is_republished_as_the_same_events_would_be() -> None:
    fast, plain = twin_planes()
    subs = [rp.subscribe(None) for rp in (fast, plain)]
    for hashes in ((1, 2, 3), (4, 5), (2, 6)):  # the bound of 5 evicts
        assert fast.publish_seq("e", 1, compact(*hashes)) == plain.publish_seq("e", 1, KVEventBatch(2.0, events(*hashes)))
    assert list(fast.index.entries()) == list(plain.index.entries())  # type: ignore[attr-defined]
    assert fast.stats() == plain.stats() and fast.stats().events_by_type == {"BlockStored": 7}
    got, want = subs[0].take(), subs[1].take()
    assert [i.batch.events for i in got] == [i.batch.events for i in want]  # type: ignore[union-attr]
    for a, b in zip(got, want, strict=True):
        assert encode_item(a) == encode_item(b)  # gRPC bytes
    for a, b in zip(fast.replay(1), plain.replay(1), strict=True):  # from the packed ring
        assert (a.seq, a.batch.events) == (b.seq, b.batch.events)


def test_filters_select_a_compact_batch_whole_or_not_at_all() -> None:
    rp = EventRepublisher(InMemoryPrefixIndex())
    by_medium = rp.subscribe(None, EventFilter(media=frozenset({MEDIUM_CPU})))
    by_type = rp.subscribe(None, EventFilter(types=frozenset({BlockStored})))
    rp.publish_seq("e", 1, compact(1, 2))
    rp.publish_seq("e", 1, compact(3, medium=MEDIUM_CPU))
    assert [i.seq for i in by_medium.take()] == [1]  # type: ignore[union-attr]
    assert [i.seq for i in by_type.take()] == [0, 1]  # type: ignore[union-attr]


def test_zmq_payload_of_a_compact_batch_is_vllms_encoding() -> None:
    rp = EventRepublisher(InMemoryPrefixIndex())
    zmq_pub = ZmqEventPublisher(rp, "inproc://compact-test", context=zmq.Context())
    b = compact(7, 8, 9, ts=3.25)
    sb = SequencedBatch(0, "e", 1, b)
    assert zmq_pub.payload_of(sb) == encode_payload(KVEventBatch(3.25, events(7, 8, 9)))


def test_consecutive_batches_share_a_message_when_asked() -> None:
    items = [SequencedBatch(i, "e", 1, compact(10 + i)) for i in range(5)]
    notice = StreamNotice(NoticeKind.RESYNC, 3, "behind")
    stream = [*items[:3], notice, *items[3:]]
    messages = [pb.EventStreamMessage.FromString(w) for w in encode_items(stream, 2)]
    assert [([b.seq for b in m.batches], m.WhichOneof("payload")) for m in messages] == [
        ([0, 1], None), ([], "batch"), ([], "notice"), ([3, 4], None)]
    assert messages[0].batches[1] == pb.EventStreamMessage.FromString(encode_item(items[1])).batch
    assert encode_items(stream, 1) == [encode_item(i) for i in stream]  # not asked: one per message


def mixed_events(step: int) -> list[BlockStored | BlockRemoved]:
    """Step `step` stores three blocks and removes two of the previous step's, in between."""
    base = 10 * step
    return [BlockStored((base + 1,), None, (), 16, medium=MEDIUM_CPU_OFFLOAD),
            BlockRemoved((base - 9, base - 8), MEDIUM_CPU_OFFLOAD),
            BlockStored((base + 2, base + 3), base + 1, (), 16, medium=MEDIUM_CPU_OFFLOAD)]


def mixed(step: int, ts: float = 2.0) -> CompactBatch:
    c = ce.encode(mixed_events(step), mixed=True)
    assert c is not None and c.mixed
    return CompactBatch(ts, c, 1)


def test_a_mixed_compact_batch_is_republished_as_the_same_events_would_be() -> None:
    fast, plain = twin_planes()
    zmq_pub = ZmqEventPublisher(fast, "inproc://compact-mixed", context=zmq.Context())
    subs = [rp.subscribe(None) for rp in (fast, plain)]
    for step in range(1, 5):  # the bound of 5 evicts; removals free room
        want = KVEventBatch(2.0, list(mixed_events(step)), 1)
        assert fast.publish_seq("e", 1, mixed(step)) == plain.publish_seq("e", 1, want)
        assert list(fast.index.entries()) == list(plain.index.entries())  # type: ignore[attr-defined]
    assert fast.stats() == plain.stats() and fast.stats().events_by_type == {"BlockStored": 8, "BlockRemoved": 4}
    got, want = subs[0].take(), subs[1].take()
    assert [i.batch.events for i in got] == [i.batch.events for i in want]  # type: ignore[union-attr]
    for a, b in zip(got, want, strict=True):
        assert encode_item(a) == encode_item(b)  # gRPC bytes
        assert zmq_pub.payload_of(a) == encode_payload(b.batch)  # type: ignore[union-attr]  # ZMQ bytes
    for a, b in zip(fast.replay(1), plain.replay(1), strict=True):  # from the packed ring
        assert (a.seq, a.batch.events) == (b.seq, b.batch.events)


def test_filters_take_the_selected_kind_of_a_mixed_batch() -> None:
    rp = EventRepublisher(InMemoryPrefixIndex())
    stored_only = rp.subscribe(None, EventFilter(types=frozenset({BlockStored})))
    removed_only = rp.subscribe(None, EventFilter(types=frozenset({BlockRemoved})))
    both = rp.subscribe(None, EventFilter(types=frozenset({BlockStored, BlockRemoved}),
                                          media=frozenset({MEDIUM_CPU_OFFLOAD})))
    cleared_only = rp.subscribe(None, EventFilter(types=frozenset({AllBlocksCleared})))
    other_medium = rp.subscribe(None, EventFilter(media=frozenset({MEDIUM_CPU})))
    b = mixed(1)
    rp.publish_seq("e", 1, b)
    events = mixed_events(1)
    assert [i.batch.events for i in stored_only.take()] == [[events[0], events[2]]]  # type: ignore[union-attr]
    assert [i.batch.events for i in removed_only.take()] == [[events[1]]]  # type: ignore[union-attr]
    assert [i.batch for i in both.take()] == [b]  # type: ignore[union-attr]  # whole: its bytes as they are
    assert cleared_only.take() == [] and other_medium.take() == []


def test_metrics_count_a_mixed_batch_by_kind() -> None:
    from services.scheduler.events.metrics import _by_type_and_medium

    assert _by_type_and_medium(mixed(1)) == _by_type_and_medium(KVEventBatch(2.0, list(mixed_events(1)))) == {
        ("BlockStored", MEDIUM_CPU_OFFLOAD): 2, ("BlockRemoved", MEDIUM_CPU_OFFLOAD): 1}
    only_removed = ce.encode([BlockRemoved((1,), None)], mixed=True)
    assert only_removed is not None
    assert _by_type_and_medium(CompactBatch(1.0, only_removed)) == _by_type_and_medium(
        KVEventBatch(1.0, [BlockRemoved((1,), None)])) == {("BlockRemoved", DEFAULT_MEDIUM): 1}
