"""EventRepublisher: one seq, ring replay, snapshots, bounded subscribers, epochs, filters."""

import threading
from typing import Any

import pytest

from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from services.scheduler.events import (
    EventFilter,
    EventRepublisher,
    NoticeKind,
    SequencedBatch,
    SnapshotBatch,
    StreamNotice,
)
from services.scheduler.prefix_index import InMemoryPrefixIndex


def batch(*hashes: int, medium: str = "GPU", parent: int | None = None) -> KVEventBatch:
    return KVEventBatch(1.0, [BlockStored(tuple(hashes), parent, (), 16, medium=medium)])


def make(ring: int = 8, buffer: int = 4) -> EventRepublisher:
    return EventRepublisher(InMemoryPrefixIndex(), ring_size=ring, subscriber_buffer=buffer)


def seqs(items: list) -> list[int]:
    return [i.seq for i in items if isinstance(i, SequencedBatch)]


def test_one_sequence_over_engines_in_order_and_into_the_index() -> None:
    rp = make()
    sub = rp.subscribe(None)
    assert rp.publish_seq("a", 1, batch(1)) == 0
    assert rp.publish_seq("b", 2, batch(1, 2)) == 1
    assert rp.publish_seq("a", 1, KVEventBatch(2.0)) is None  # empty: nothing published
    assert rp.publish_seq("a", 1, batch(2, parent=1)) == 2
    items: list[Any] = sub.take()
    assert seqs(items) == [0, 1, 2]
    assert [(i.engine_id, i.epoch) for i in items] == [("a", 1), ("b", 2), ("a", 1)]
    assert rp.index.match([1, 2])["a"].num_blocks == 2
    assert sub.take() == []
    assert rp.stats().num_events == 3


def test_bad_input_is_refused_and_changes_nothing() -> None:
    rp = make()
    for args, message in ((("", 1, batch(1)), "KV events need an engine id"), (("a", -1, batch(1)), "epoch must be >= 0"),
                          (("a", 1, KVEventBatch(1.0, ["x"])), "not a KV event")):  # type: ignore[list-item]
        with pytest.raises(ValueError, match=message):
            rp.publish_seq(*args)  # type: ignore[arg-type]
    assert rp.next_seq == 0 and rp.index.stats().num_entries == 0
    with pytest.raises(ValueError, match="from_seq"):
        rp.subscribe(-1)


def test_replay_inside_the_ring_is_exact() -> None:
    rp = make(ring=8)
    for i in range(12):
        rp.publish_seq("a", 1, batch(i))
    assert rp.oldest_seq == 4
    assert seqs(rp.subscribe(4).take()) == list(range(4, 12))
    assert seqs(rp.subscribe(10).take()) == [10, 11]
    assert rp.subscribe(12).take() == []  # fully caught up
    assert [b.seq for b in rp.replay(0)] == list(range(4, 12))  # vLLM: starts at the oldest
    assert rp.replay(12) == []


def test_older_than_the_ring_gets_a_snapshot_then_live() -> None:
    rp = make(ring=2)
    for i in range(5):
        rp.publish_seq("a", 7, batch(i))
    rp.publish_seq("a", 7, KVEventBatch(1.0, [BlockRemoved((0,), "GPU")]))
    sub = rp.subscribe(1)
    items = sub.take()
    assert isinstance(items[0], StreamNotice) and items[0].kind is NoticeKind.SNAPSHOT_BEGIN
    assert "older than the replay ring" in items[0].reason
    assert items[-1] == StreamNotice(NoticeKind.SNAPSHOT_END, 6)
    snap = [i for i in items if isinstance(i, SnapshotBatch)]
    hashes = [h for s in snap for e in s.batch.events for h in e.block_hashes]  # type: ignore[union-attr]
    assert sorted(hashes) == [1, 2, 3, 4] and {(s.engine_id, s.epoch) for s in snap} == {("a", 7)}
    rp.publish_seq("a", 7, batch(9))
    assert seqs(sub.take()) == [6]


def test_from_seq_ahead_of_the_publisher_means_restart_and_snapshots() -> None:
    rp = make()
    rp.publish_seq("a", 1, batch(1))
    items = rp.subscribe(500).take()
    assert isinstance(items[0], StreamNotice) and "ahead of the publisher" in items[0].reason


def test_disconnect_and_resume_misses_nothing() -> None:
    rp = make(ring=16)
    sub = rp.subscribe(0)
    for i in range(3):
        rp.publish_seq("a", 1, batch(i))
    got = seqs(sub.take())
    sub.close()
    for i in range(3, 7):
        rp.publish_seq("a", 1, batch(i))
    got += seqs(rp.subscribe(got[-1] + 1).take())
    assert got == list(range(7))


def test_slow_subscriber_is_resynced_and_publisher_keeps_going() -> None:
    rp = make(ring=4, buffer=3)
    slow, fast = rp.subscribe(None), rp.subscribe(None)
    wakes = []
    slow._wake = lambda: wakes.append(1)
    fast_seen = []
    for i in range(10):
        rp.publish_seq("a", 1, batch(i))
        fast_seen += seqs(fast.take())
    assert fast_seen == list(range(10)) and fast.num_resyncs == 0
    assert slow.lag == 0 and slow.num_resyncs == 1 and wakes  # buffer freed at once, told
    items = slow.take()
    assert [i.kind for i in items if isinstance(i, StreamNotice)] == [
        NoticeKind.RESYNC, NoticeKind.SNAPSHOT_BEGIN, NoticeKind.SNAPSHOT_END]
    assert items[-1].next_seq == 10  # type: ignore[union-attr]
    snap_hashes = {h for i in items if isinstance(i, SnapshotBatch) for e in i.batch.events
                   for h in e.block_hashes}  # type: ignore[union-attr]
    assert snap_hashes == set(range(10))
    rp.publish_seq("a", 1, batch(10))
    assert seqs(slow.take()) == [10]
    assert rp.stats().num_resyncs == 1


def test_new_epoch_publishes_all_blocks_cleared_and_refuses_the_dead_epoch() -> None:
    rp = make()
    sub = rp.subscribe(None)
    rp.publish_seq("a", 1, batch(1, 2))
    rp.register_epoch("a", 2)
    assert rp.index.match([1]) == {}
    items = sub.take()
    assert [(i.seq, i.epoch, i.batch.events) for i in items[1:]] == [(1, 1, [AllBlocksCleared()])]  # type: ignore[union-attr]
    assert rp.publish_seq("a", 1, batch(1)) is None
    assert rp.index.match([1]) == {} and rp.stats().num_stale_batches == 1
    rp.publish_seq("a", 3, batch(5))  # a publish with a new epoch does the same implicitly
    assert [i.batch.events[0] for i in sub.take()][0] == AllBlocksCleared()  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="already replaced"):
        rp.register_epoch("a", 2)
    rp.remove_engine("a")
    assert rp.index.match([5]) == {} and rp.index.epoch_of("a") is None
    assert isinstance(sub.take()[0].batch.events[0], AllBlocksCleared)  # type: ignore[union-attr]


def test_filters_by_engine_medium_and_type() -> None:
    rp = make()
    gpu = rp.subscribe(None, EventFilter(media=frozenset({"GPU"})))
    eng_b = rp.subscribe(None, EventFilter(engine_ids=frozenset({"b"})))
    removed = rp.subscribe(None, EventFilter(types=frozenset({BlockRemoved})))
    rp.publish_seq("a", 1, KVEventBatch(1.0, [BlockStored((1,), None, (), 16, medium="CPU_OFFLOAD"),
                                          BlockStored((2,), None, (), 16, medium=None)]))
    rp.publish_seq("b", 1, KVEventBatch(1.0, [BlockRemoved((9,), "CPU"), AllBlocksCleared("CPU")]))
    g = gpu.take()
    assert [(i.seq, [e.block_hashes for e in i.batch.events]) for i in g] == [(0, [(2,)])]  # type: ignore[union-attr]
    assert seqs(g) == [0] and seqs(gpu.take()) == []
    # AllBlocksCleared without a medium concerns every medium
    rp.publish_seq("b", 1, KVEventBatch(1.0, [AllBlocksCleared()]))
    assert seqs(gpu.take()) == [2]
    assert seqs(eng_b.take()) == [1, 2]
    r = removed.take()
    assert seqs(r) == [1] and r[0].batch.events == [BlockRemoved((9,), "CPU")]  # type: ignore[union-attr]
    snap = rp.subscribe(0, EventFilter(types=frozenset({BlockRemoved})))
    assert seqs(snap.take()) == [1]


def test_publish_from_many_threads_keeps_one_gapless_sequence() -> None:
    rp = make(ring=10_000, buffer=10_000)
    sub = rp.subscribe(None)

    def produce(engine: str) -> None:
        for i in range(200):
            rp.publish_seq(engine, 1, batch(i))

    threads = [threading.Thread(target=produce, args=(f"e{n}",)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got: list[Any] = []
    while items := sub.take(1000):
        got += items
    assert seqs(got) == list(range(800))
    per_engine: dict[str, list[Any]] = {}
    for i in got:
        per_engine.setdefault(i.engine_id, []).append(i.batch.events[0].block_hashes[0])
    assert all(v == list(range(200)) for v in per_engine.values())


def test_packed_ring_replays_the_batches_published() -> None:
    """With GrpcRingCodec the ring holds bytes; replays (plain and filtered) equal the originals."""
    from services.scheduler.events.servicer import GrpcRingCodec, encode_item

    rp = EventRepublisher(InMemoryPrefixIndex(), ring_size=4, subscriber_buffer=8, ring_codec=GrpcRingCodec())
    published = [KVEventBatch(float(i), [BlockStored((10 + i,), None, (1, 2), 16, medium="GPU"),
                                         BlockRemoved((i,), medium="CPU")], data_parallel_rank=i % 2 or None)
                 for i in range(6)]
    for b in published:
        rp.publish("e", 1, b)
    replayed = rp.replay(0)
    assert [sb.seq for sb in replayed] == [2, 3, 4, 5]  # the ring's 4
    for sb in replayed:
        assert sb.batch == published[sb.seq]
        assert sb.wire["grpc"] == encode_item(SequencedBatch(sb.seq, sb.engine_id, sb.epoch, sb.batch))
    only_gpu = rp.subscribe(3, EventFilter(media=frozenset({"GPU"}))).take()
    assert [(i.seq, i.batch.events) for i in only_gpu if isinstance(i, SequencedBatch)] == [
        (s, published[s].events[:1]) for s in (3, 4, 5)]


def test_proto_backed_batch_encodes_like_its_events() -> None:
    """The gRPC form copied from a report's protobuf events equals converting the events."""
    from connectors.kv_events import event_to_proto
    from services.scheduler.event_sink import ProtoBackedBatch
    from services.scheduler.events.servicer import batch_to_proto

    events = [BlockStored((5, 6), 4, (1, 2, 3), 16, lora_id=2, medium="CPU_OFFLOAD", group_idx=1),
              BlockRemoved((7,), medium="GPU"), AllBlocksCleared("CPU")]
    backed = ProtoBackedBatch(2.5, list(events), 0, proto_events=[event_to_proto(e) for e in events])
    plain = KVEventBatch(2.5, list(events), 0)
    assert (batch_to_proto(3, "e", 9, backed).SerializeToString()
            == batch_to_proto(3, "e", 9, plain).SerializeToString())
