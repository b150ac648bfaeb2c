"""Compact worker events: the three forms agree with the events they were encoded from, framing
errors are refused by name, and the array paths of the aggregator and the prefix index leave the
same state as the event paths (hypothesis, after any history). About 6 s."""

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
