"""Compact worker events: the three forms agree with the events they were encoded from, framing
errors are refused by name, and the array paths of the aggregator and the prefix index leave the
same state as the event paths (hypothesis, after any history), for BlockStored runs and for mixed
steps with BlockRemoved (kind bytes). About 12 s."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors import compact_events as ce
from connectors.aggregator import KVOutputAggregator
from connectors.kv_events import (
    MEDIUM_CPU,
    MEDIUM_CPU_OFFLOAD,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from connectors.outputs import KVConnectorOutput
from connectors.wire import encode_batch
from services.scheduler.prefix_index import InMemoryPrefixIndex


def stored(*hashes: int, medium: str | None = MEDIUM_CPU_OFFLOAD, group: int | None = None,
           parent: int | None = None, tokens: tuple[int, ...] = ()) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tokens, 16, medium=medium, group_idx=group)


def test_the_three_forms_describe_the_events() -> None:
    events = [stored(2**64 - 1 - i, 7 + i, parent=3, tokens=(1, 2, 3)) for i in range(20)]  # > 15: 0xdc header
    c = ce.encode(events)
    assert c is not None and c.num_events == 20 and c.key == (MEDIUM_CPU_OFFLOAD, None)
    back = ce.from_proto(ce.to_proto(c))
    assert back == c and back.events() == events
    assert back.hashes == [h for e in events for h in e.block_hashes] and back.sizes == [2] * 20
    ce.verify(back)
    for dp in (None, 0, 3):  # the ZMQ payload is encode_batch's bytes
        assert ce.zmq_payload(back.msgpack_events, 12.5, dp) == encode_batch(KVEventBatch(12.5, list(events), dp))
    grouped = ce.encode([stored(1, medium=None, group=2)])
    assert grouped is not None and ce.from_proto(ce.to_proto(grouped)).key == (None, 2)


@pytest.mark.parametrize("events", [
    [], [stored(1), stored(2, medium=MEDIUM_CPU)], [stored(1, group=0), stored(2)], [stored()],
    [stored(1), BlockRemoved((1,))], [AllBlocksCleared()], [BlockStored((b"\x01" * 32,), None, (), 16)],
    [stored(2**64)], [stored(1, parent=2**64)], [BlockStored((1,), b"\x02" * 32, (), 16)],
])
def test_only_stored_runs_of_one_medium_and_group_with_int_hashes_qualify(events: list[KVCacheEvent]) -> None:
    assert ce.encode(events) is None


def test_fields_the_protobuf_form_reshapes_are_encoded_as_it_carries_them() -> None:
    from connectors.kv_events import event_from_proto, event_to_proto

    # vLLM's GPU block-pool events: per-block extra keys, the group's spec kind, a locality
    events = [BlockStored((5, 6), 4, tuple(range(32)), 16, medium="GPU", extra_keys=(None, ("lora", 3)),
                          group_idx=0, kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=8,
                          locality="x"), stored(7, medium="GPU", group=0)]
    c = ce.encode(events)
    assert c is not None
    ce.verify(ce.from_proto(ce.to_proto(c)))
    as_carried = [event_from_proto(event_to_proto(e)) for e in events]
    assert c.events() == as_carried and as_carried[0] != events[0] and as_carried[1] == events[1]
    assert ce.zmq_payload(c.msgpack_events, 1.0, 0) == encode_batch(KVEventBatch(1.0, as_carried, 0))


def _proto(**change: object) -> object:
    m = ce.to_proto(ce.encode([stored(1), stored(2, 3)]))  # type: ignore[arg-type]
    for name, value in change.items():
        if name == "hashes_per_event":
            del m.hashes_per_event[:]
            m.hashes_per_event.extend(value)  # type: ignore[arg-type]
        else:
            setattr(m, name, value)
    return m


@pytest.mark.parametrize(("change", "error"), [
    ({"block_hashes": b"\x00" * 20}, "not a multiple of 8"),
    ({"hashes_per_event": [1, 1]}, "sums to 2, block_hashes holds 3"),
    ({"hashes_per_event": [3, 0]}, "an event without block hashes"),
    ({"hashes_per_event": []}, "no events"),
    ({"msgpack_events": b"\x93\x01\x02\x03"}, "msgpack_events lists 3 events, hashes_per_event 2"),
    ({"msgpack_events": b"\x81\x01\x02"}, "does not start with an array"),
    ({"msgpack_events": b""}, "msgpack_events is empty"),
    ({"events_wire": b"\xff\xff\xff"}, "events_wire is not an EventBatch"),
    ({"events_wire": b""}, "exactly the 2 events"),
    ({"events_wire": b"\x08\x05" + ce.encode([stored(1), stored(2, 3)]).events_wire},  # type: ignore[union-attr]
     "exactly the 2 events and nothing else"),
])
def test_malformed_framing_is_refused_by_name(change: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ce.from_proto(_proto(**change))


def test_verify_names_forms_that_disagree() -> None:
    a, b = ce.encode([stored(1), stored(2)]), ce.encode([stored(1), stored(5)])
    assert a is not None and b is not None
    with pytest.raises(ValueError, match="block_hashes differ"):
        ce.verify(ce.CompactEvents(a.events_wire, a.msgpack_events, b.hashes, a.sizes, a.medium, a.group_idx))
    with pytest.raises(ValueError, match="msgpack_events differ"):
        ce.verify(ce.CompactEvents(a.events_wire, b.msgpack_events, a.hashes, a.sizes, a.medium, a.group_idx))
    with pytest.raises(ValueError, match="is not a BlockStored of"):
        ce.verify(ce.CompactEvents(a.events_wire, a.msgpack_events, a.hashes, a.sizes, MEDIUM_CPU, a.group_idx))


HASHES = st.integers(1, 8)
EVENT = st.one_of(
    st.builds(lambda hs: stored(*hs, medium=MEDIUM_CPU, group=0), st.lists(HASHES, min_size=1, max_size=3, unique=True)),
    st.builds(lambda hs: BlockRemoved(tuple(hs), MEDIUM_CPU, 0), st.lists(HASHES, min_size=1, max_size=3, unique=True)),
    st.builds(AllBlocksCleared, st.one_of(st.none(), st.just(MEDIUM_CPU))),
)
RUN = st.lists(st.lists(HASHES, min_size=1, max_size=3), min_size=1, max_size=5).map(
    lambda runs: tuple(stored(*hs, medium=MEDIUM_CPU, group=0) for hs in runs))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_shared_hashes_equal_shared_events(data: st.DataObject) -> None:
    """`add_shared_hashes` (a compact report) leaves the state `add_shared_events` leaves for the
    same BlockStored run and publishes the same events, in order, after any history."""
    num_ranks = data.draw(st.integers(1, 4), label="num_ranks")
    history = data.draw(st.lists(st.tuples(st.integers(0, num_ranks - 1), st.lists(EVENT, max_size=4)),
                                 max_size=10), label="history")
    steps = data.draw(st.lists(st.tuples(st.sets(st.integers(0, num_ranks - 1), min_size=1), RUN),
                               min_size=1, max_size=4), label="steps")
    arrays, objects = KVOutputAggregator(clock=lambda: 5.0), KVOutputAggregator(clock=lambda: 5.0)
    for a in (arrays, objects):
        a.register_engine("e", 0, range(num_ranks))
    for rank, events in history:
        for a in (arrays, objects):
            a.add_report("e", 0, rank, KVConnectorOutput(kv_cache_events=tuple(events)))
    for ranks, run in steps:
        c = ce.encode(run)
        assert c is not None
        published = arrays.add_shared_hashes("e", 0, ranks, c.key, c.hashes, c.sizes)
        want = objects.add_shared_events("e", 0, ranks, run).events
        assert (list(run) if published is None else [run[i] for i in published]) == want
        x, y = arrays._engines["e"], objects._engines["e"]
        assert (x.blocks, x.live, x.pending_blocks) == (y.blocks, y.live, y.pending_blocks)


def test_shared_hashes_validate_before_applying() -> None:
    a = KVOutputAggregator()
    a.register_engine("e", 3, range(2))
    with pytest.raises(ValueError, match="not one of the expected ranks"):
        a.add_shared_hashes("e", 3, [0, 2], (None, None), [1], [1])
    with pytest.raises(ValueError, match="do not split into events"):
        a.add_shared_hashes("e", 3, [0, 1], (None, None), [1, 2], [1])
    with pytest.raises(ValueError, match="current epoch is 3"):
        a.add_shared_hashes("e", 2, [0, 1], (None, None), [1], [1])
    assert a._engines["e"].blocks == {}
    assert a.add_shared_hashes("e", 3, [0, 1], (None, None), [1, 2], [1, 1]) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(RUN, st.lists(EVENT, min_size=1, max_size=3)), min_size=1, max_size=8),
       st.integers(1, 12))
def test_index_apply_stored_equals_apply(batches: list[tuple[KVCacheEvent, ...]], bound: int) -> None:
    """The index fed compact runs (hashes and sizes) holds what it holds fed the events, in the
    same LRU order, evictions included."""
    arrays, objects = InMemoryPrefixIndex(max_entries=bound), InMemoryPrefixIndex(max_entries=bound)
    for events in batches:
        c = ce.encode(list(events))
        if c is None:
            arrays.apply("e", 1, list(events))
        else:
            arrays.apply_stored("e", 1, c.medium, c.hashes, c.sizes)
        objects.apply("e", 1, list(events))
        assert list(arrays.entries()) == list(objects.entries())
        assert arrays.stats() == objects.stats()


# -- mixed steps: BlockStored and BlockRemoved of one medium and group, with kind bytes ----------

def removed(*hashes: int, medium: str | None = MEDIUM_CPU_OFFLOAD, group: int | None = None) -> BlockRemoved:
    return BlockRemoved(tuple(hashes), medium, group)


def test_a_mixed_step_keeps_its_order_in_the_three_forms_and_the_kinds() -> None:
    events = [removed(9), stored(1, 2, parent=8), removed(3, 4), removed(5), stored(6),
              *[stored(100 + i) for i in range(14)]]  # > 15 events: the 0xdc list header
    assert ce.encode(events) is None  # not for a scheduler that does not read kinds
    c = ce.encode(events, mixed=True)
    assert c is not None and c.kinds == bytes([2, 1, 2, 2, 1] + [1] * 14) and c.mixed
    assert (c.num_stored, c.num_removed, c.event_types) == (16, 3, frozenset({BlockStored, BlockRemoved}))
    back = ce.from_proto(ce.to_proto(c))
    assert back == c and back.events() == events
    ce.verify(back)
    assert [(r.kind, r.start, r.stop, r.hash_start, r.hash_stop) for r in back.runs()] == [
        (2, 0, 1, 0, 1), (1, 1, 2, 1, 3), (2, 2, 4, 3, 6), (1, 4, 19, 6, 21)]
    for dp in (None, 2):
        assert ce.zmq_payload(back.msgpack_events, 4.5, dp) == encode_batch(KVEventBatch(4.5, list(events), dp))
    # a removal's locality is dropped by the protobuf form: so it is by the compact one
    local = ce.encode([stored(1), BlockRemoved((2,), MEDIUM_CPU_OFFLOAD, None, "LOCAL")], mixed=True)
    assert local is not None and local.events() == [stored(1), removed(2)]
    ce.verify(local)
    assert ce.zmq_payload(local.msgpack_events, 1.0, 0) == encode_batch(KVEventBatch(1.0, [stored(1), removed(2)], 0))
    only_removed = ce.encode([removed(1), removed(2)], mixed=True)
    assert only_removed is not None and only_removed.event_types == frozenset({BlockRemoved})
    # a step of BlockStored only has no kinds (the form every compact-aware scheduler reads)
    plain = ce.encode([stored(1)], mixed=True)
    assert plain is not None and plain.kinds == b"" and ce.to_proto(plain) == ce.to_proto(ce.encode([stored(1)]))


@pytest.mark.parametrize("events", [
    [stored(1), AllBlocksCleared()], [stored(1), removed(2, medium=MEDIUM_CPU)], [stored(1), removed(2, group=1)],
    [stored(1), removed()], [removed(2**64)], [stored(1), BlockRemoved((b"\x01" * 32,), MEDIUM_CPU_OFFLOAD)],
])
def test_mixed_steps_qualify_only_with_one_medium_and_group_and_int_hashes(events: list[KVCacheEvent]) -> None:
    assert ce.encode(events, mixed=True) is None


@pytest.mark.parametrize(("kinds", "error"), [
    (b"\x01\x02", "kinds holds 2 bytes for 3 events"),
    (b"\x01\x02\x01\x02", "kinds holds 4 bytes for 3 events"),
    (b"\x01\x03\x02", "unknown kind byte 0x03 at event 1"),
    (b"\x00\x02\x01", "unknown kind byte 0x00 at event 0"),
])
def test_malformed_kinds_are_refused_by_name(kinds: bytes, error: str) -> None:
    m = ce.to_proto(ce.encode([stored(1), removed(2), stored(3)], mixed=True))  # type: ignore[arg-type]
    m.kinds = kinds
    with pytest.raises(ce.KindsError, match=error):
        ce.from_proto(m)


def test_verify_names_a_kind_that_disagrees_with_the_event() -> None:
    c = ce.encode([stored(1), removed(2)], mixed=True)
    assert c is not None
    with pytest.raises(ValueError, match=r"BlockRemoved\(.*\) is not a BlockStored of"):
        ce.verify(ce.CompactEvents(c.events_wire, c.msgpack_events, c.hashes, c.sizes, c.medium, c.group_idx,
                                   b"\x01\x01"))


MIXED = st.lists(st.tuples(st.booleans(), st.lists(HASHES, min_size=1, max_size=3, unique=True)),
                 min_size=1, max_size=6).map(
    lambda evs: tuple(stored(*hs, medium=MEDIUM_CPU, group=0) if is_stored else BlockRemoved(tuple(hs), MEDIUM_CPU, 0)
                      for is_stored, hs in evs))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mixed_hashes_equal_shared_events_and_each_rank_reporting_them(data: st.DataObject) -> None:
    """`add_shared_hashes` with kinds (a mixed compact report) leaves the state that
    `add_shared_events` leaves for the same events and publishes the same events in the same
    order; and both equal §3's oracle for mixed steps, every rank reporting the events itself
    (the same state, the same events as a multiset), after any history."""
    num_ranks = data.draw(st.integers(1, 4), label="num_ranks")
    history = data.draw(st.lists(st.tuples(st.integers(0, num_ranks - 1), st.lists(EVENT, max_size=4)),
                                 max_size=10), label="history")
    steps = data.draw(st.lists(st.tuples(st.sets(st.integers(0, num_ranks - 1), min_size=1), MIXED),
                               min_size=1, max_size=4), label="steps")
    now = [5.0]
    arrays, objects, each = (KVOutputAggregator(clock=lambda: now[0]) for _ in range(3))
    for a in (arrays, objects, each):
        a.register_engine("e", 0, range(num_ranks))
    for rank, events in history:
        now[0] += 1
        for a in (arrays, objects, each):
            a.add_report("e", 0, rank, KVConnectorOutput(kv_cache_events=tuple(events)))
    for ranks, step in steps:
        now[0] += 1
        c = ce.encode(step, mixed=True)
        assert c is not None
        published = arrays.add_shared_hashes("e", 0, ranks, c.key, c.hashes, c.sizes, c.kinds)
        got = list(step) if published is None else [step[i] for i in published]
        assert got == objects.add_shared_events("e", 0, ranks, step).events
        want = [e for r in sorted(ranks) for e in each.add_report("e", 0, r, KVConnectorOutput(kv_cache_events=step)).events]
        if c.mixed:  # (BlockStored only: the fifth pass's joint-mask path, its own test above)
            assert sorted(map(repr, got)) == sorted(map(repr, want))
        x, y, z = arrays._engines["e"], objects._engines["e"], each._engines["e"]
        assert (x.blocks, x.live, x.pending_blocks) == (y.blocks, y.live, y.pending_blocks) \
            == (z.blocks, z.live, z.pending_blocks)


def test_mixed_hashes_validate_kinds_before_applying() -> None:
    a = KVOutputAggregator()
    a.register_engine("e", 3, range(2))
    with pytest.raises(ce.KindsError, match="kinds holds 1 bytes for 2 events"):
        a.add_shared_hashes("e", 3, [0, 1], (None, None), [1, 2], [1, 1], b"\x02")
    with pytest.raises(ce.KindsError, match="unknown kind byte 0x07"):
        a.add_shared_hashes("e", 3, [0, 1], (None, None), [1, 2], [1, 1], b"\x01\x07")
    assert a._engines["e"].blocks == {}
    # block 1 stored and removed by each rank in one step was never whole (rank by rank, as §3
    # counts): only block 2 is published
    assert a.add_shared_hashes("e", 3, [0, 1], (None, None), [1, 2, 1], [1, 1, 1], b"\x01\x01\x02") == [1]
    assert a._engines["e"].blocks == {(None, None): {2: 0b11}}
    # no hash both stored and removed: the joint mask, every event published once, in order
    assert a.add_shared_hashes("e", 3, [0, 1], (None, None), [3, 2], [1, 1], b"\x01\x02") is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(MIXED, RUN, st.lists(EVENT, min_size=1, max_size=3)), min_size=1, max_size=8),
       st.integers(1, 12))
def test_index_apply_compact_equals_apply(batches: list[tuple[KVCacheEvent, ...]], bound: int) -> None:
    """The index fed mixed compact batches (hashes, sizes, kinds) holds what it holds fed the
    events, in the same LRU order, evictions included."""
    arrays, objects = InMemoryPrefixIndex(max_entries=bound), InMemoryPrefixIndex(max_entries=bound)
    for events in batches:
        c = ce.encode(list(events), mixed=True)
        if c is None:
            arrays.apply("e", 1, list(events))
        else:
            arrays.apply_compact("e", 1, c.medium, c.hashes, c.sizes, c.kinds)
        objects.apply("e", 1, list(events))
        assert list(arrays.entries()) == list(objects.entries())
        assert arrays.stats() == objects.stats()


def test_the_bench_builds_what_the_encoder_gives() -> None:
    """`bench events`' byte templates for a step with BlockRemoved (compact and protobuf) are
    the encoders' bytes for the same events."""
    from bench.events_load import stamped_compact_wire, step_events, step_events_wire
    from connectors.kv_events import event_to_proto
    from pdserve.v1 import kv_events_pb2 as kpb

    # The send time's last microsecond odd or even: the hashes' last byte starts at 128 or 0.
    for now in (2.5, 2.500001, 1764770000.123456, 1764770000.123457):
        for n, prev, gone in ((8, 1.25, 2), (20, 1.25, 10), (8, None, 2), (4, 3.5, 0), (64, None, 0), (1, None, 0), (128, None, 0), (200, None, 0)):
            events = step_events(now, n, prev, gone)
            assert sum(type(e) is BlockRemoved for e in events) == (gone if prev is not None else 0)
            assert stamped_compact_wire(now, n, prev, gone) == \
                ce.to_proto(ce.encode(events, mixed=True)).SerializeToString()
            assert step_events_wire(now, n, prev, gone) == kpb.EventBatch(
                events=[event_to_proto(e) for e in events]).SerializeToString()


def test_the_bench_subscribers_read_what_a_full_decode_reads() -> None:
    """`bench events`' ZMQ subscribers read a message's event count and first hash from its
    head: the same as decoding it whole, in vLLM's map form and the legacy array form."""
    from bench.events_load import step_events
    from bench.events_subscribers import zmq_batch_full, zmq_batch_head

    for n, prev, gone in ((1, None, 0), (15, None, 0), (16, None, 0), (64, 1.25, 16), (200, None, 0)):
        events = step_events(2.5, n, prev, gone)
        for legacy in (False, True):
            payload = encode_batch(KVEventBatch(2.5, events, data_parallel_rank=3), legacy=legacy)
            assert zmq_batch_head(payload) == zmq_batch_full(payload) == (n, events[0].block_hashes[0])
