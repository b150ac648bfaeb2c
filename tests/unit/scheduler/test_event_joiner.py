"""EventJoiner: ranks' identical compact copies applied once equal every rank applying its own.

The oracle is a second aggregator fed each copy as it arrives (`add_shared_hashes` for the
sending rank: the per-rank protocol applied literally); the joiner must leave the same block
state and publish the same events, in the same order for each block.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from connectors import compact_events
from connectors.aggregator import KVOutputAggregator
from connectors.compact_events import CompactEvents
from connectors.kv_events import MEDIUM_CPU_OFFLOAD, BlockRemoved, BlockStored, KVCacheEvent
from services.scheduler.event_joiner import EventJoiner


def _compact(events: list[KVCacheEvent]) -> CompactEvents:
    c = compact_events.encode(events, mixed=True)
    assert c is not None
    return c


def _contents() -> list[CompactEvents]:
    """A few steps' copies: distinct stores, a repeat, stores mixed with removals."""
    def st_(*hs: int) -> BlockStored:
        return BlockStored(hs, None, (), 0, medium=MEDIUM_CPU_OFFLOAD)

    def rm(*hs: int) -> BlockRemoved:
        return BlockRemoved(hs, MEDIUM_CPU_OFFLOAD)

    return [_compact([st_(1), st_(2), st_(3, 4)]), _compact([st_(5), st_(1)]),
            _compact([st_(6), rm(1), st_(7)]), _compact([rm(2), rm(5)]), _compact([st_(8), st_(8)])]


def _published(log: list[tuple[str, list[KVCacheEvent]]], engine_id: str, compact: CompactEvents,
               indices: list[int] | None) -> None:
    events = compact.events()
    log.append((engine_id, events if indices is None else [events[i] for i in indices]))


def _state(agg: KVOutputAggregator) -> dict[str, tuple[object, object]]:
    return {e: (s.blocks, s.live) for e, s in agg._engines.items()}


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_joined_copies_equal_every_rank_applying_its_own(data: st.DataObject) -> None:
    contents = _contents()
    engines = {"a": data.draw(st.integers(1, 4)), "b": data.draw(st.integers(1, 3))}
    oracle, joined = KVOutputAggregator(clock=lambda: 0.0), KVOutputAggregator(clock=lambda: 0.0)
    for agg in (oracle, joined):
        for engine_id, tp in engines.items():
            agg.register_engine(engine_id, 1, range(tp))
    want: list[tuple[str, list[KVCacheEvent]]] = []
    got: list[tuple[str, list[KVCacheEvent]]] = []
    joiner = EventJoiner(joined, lambda e, _epoch, c, idx: _published(got, e, c, idx))
    # Mostly whole steps (every rank sends the step's copy, in some order), sometimes a late,
    # missing or repeated rank, sometimes a sweep.
    for _ in range(data.draw(st.integers(1, 12))):
        engine_id = data.draw(st.sampled_from(sorted(engines)))
        tp = engines[engine_id]
        content = data.draw(st.integers(0, len(contents) - 1))
        ranks = data.draw(st.permutations(range(tp)))
        ranks = ranks[:data.draw(st.integers(1, tp))] + data.draw(st.lists(st.integers(0, tp - 1), max_size=2))
        for rank in ranks:
            c = contents[content]
            published = oracle.add_shared_hashes(engine_id, 1, (rank,), c.key, c.hashes, c.sizes, c.kinds)
            if published is None or published:
                _published(want, engine_id, c, published)
            _, own = joiner.add(engine_id, 1, (rank,), tp, content, lambda c=c: c)
            if own is None or own:
                _published(got, engine_id, c, own)
        if data.draw(st.booleans()):
            joiner.flush_all()
    joiner.flush_all()
    assert _state(joined) == _state(oracle)
    for engine_id in engines:
        assert _per_block(got, engine_id) == _per_block(want, engine_id)


def _per_block(log: list[tuple[str, list[KVCacheEvent]]], engine_id: str) -> dict[object, list[str]]:
    """Each block's published events, in order (events of different blocks that one step's
    copies release together may come out in event order rather than rank by rank)."""
    blocks: dict[object, list[str]] = {}
    for e, events in log:
        for event in events if e == engine_id else ():
            for h in event.block_hashes:  # type: ignore[union-attr]
                blocks.setdefault(h, []).append(type(event).__name__)
    return blocks


def test_a_whole_step_decodes_once_and_publishes_at_the_last_rank() -> None:
    agg = KVOutputAggregator()
    agg.register_engine("e", 1, range(4))
    published: list[list[int] | None] = []
    joiner = EventJoiner(agg, lambda *a: published.append(a[3]))
    c = _contents()[0]
    decodes = []

    def decode() -> CompactEvents:
        decodes.append(1)
        return c

    results = [joiner.add("e", 1, (r,), 4, b"step", decode)[1] for r in (2, 0, 3, 1)]
    assert results == [[], [], [], None]  # the last rank's copy releases every event
    assert len(decodes) == 1 and joiner.num_joined == 3 and not published and len(joiner) == 0


def test_a_refused_copy_changes_nothing_and_a_new_epoch_drops_noted_copies() -> None:
    agg = KVOutputAggregator()
    agg.register_engine("e", 1, range(2))
    joiner = EventJoiner(agg, lambda *a: None)
    c = _contents()[0]

    def bad() -> CompactEvents:
        raise ValueError("malformed")

    try:
        joiner.add("e", 1, (0,), 2, b"x", bad)
    except ValueError:
        pass
    assert len(joiner) == 0 and agg.pending_reports()["e"].blocks == 0
    joiner.add("e", 1, (0,), 2, b"step", lambda: c)
    agg.register_engine("e", 2, range(2))  # a new epoch: the old one's state is gone
    assert joiner.add("e", 2, (1,), 2, b"step", lambda: c)[1] == []
    assert agg.pending_reports()["e"].blocks == 4  # only the new epoch's copy counted


def test_steps_batched_per_rank_are_decoded_once_each() -> None:
    """A scheduler that fell behind reads each rank's ReportBatch of several steps in turn: the
    copies of one step no longer meet, but each step is decoded once, and the result is the
    oracle's."""
    contents = _contents()[:3]
    oracle, joined = KVOutputAggregator(clock=lambda: 0.0), KVOutputAggregator(clock=lambda: 0.0)
    for agg in (oracle, joined):
        agg.register_engine("e", 1, range(3))
    decodes: list[int] = []
    joiner = EventJoiner(joined, lambda *a: None)
    for rank in range(3):
        for i, c in enumerate(contents):
            oracle.add_shared_hashes("e", 1, (rank,), c.key, c.hashes, c.sizes, c.kinds)
            joiner.add("e", 1, (rank,), 3, bytes([i]), lambda i=i, c=c: decodes.append(i) or c)
    joiner.flush_all()
    assert sorted(decodes) == [0, 1, 2]
    assert _state(joined) == _state(oracle)


def test_steps_of_stores_batched_per_rank_still_meet() -> None:
    """The same with BlockStored steps alone: each step's copies still join (one aggregator call
    for the first copy, one for the rest), and the step is published once, whole."""
    contents = [c for c in _contents() if not c.kinds][:3]
    agg = KVOutputAggregator(clock=lambda: 0.0)
    agg.register_engine("e", 1, range(3))
    published: list[list[int] | None] = []
    joiner = EventJoiner(agg, lambda *a: published.append(a[3]))
    for rank in range(3):
        for i, c in enumerate(contents):
            own = joiner.add("e", 1, (rank,), 3, bytes([i]), lambda c=c: c)[1]
            if own is None or own:
                published.append(own)
    joiner.flush_all()
    assert joiner.num_decoded == 3 and joiner.num_joined == 6 and len(joiner) == 0
    assert agg.pending_reports()["e"].blocks == 0 and len(published) == 3


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_ranks_sending_several_steps_each_equal_every_rank_applying_its_own(data: st.DataObject) -> None:
    """Each rank sends a run of steps in order (a ReportBatch each); the runs arrive interleaved
    in any way that keeps each rank's order: state and each block's events are the oracle's."""
    contents = _contents()
    tp = data.draw(st.integers(1, 4))
    steps = data.draw(st.lists(st.integers(0, len(contents) - 1), min_size=1, max_size=6))
    oracle, joined = KVOutputAggregator(clock=lambda: 0.0), KVOutputAggregator(clock=lambda: 0.0)
    for agg in (oracle, joined):
        agg.register_engine("e", 1, range(tp))
    want: list[tuple[str, list[KVCacheEvent]]] = []
    got: list[tuple[str, list[KVCacheEvent]]] = []
    joiner = EventJoiner(joined, lambda e, _epoch, c, idx: _published(got, e, c, idx))
    left = {r: list(steps) for r in range(tp)}
    while left:
        rank = data.draw(st.sampled_from(sorted(left)))
        for _ in range(data.draw(st.integers(1, len(left[rank])))):
            content = left[rank].pop(0)
            c = contents[content]
            published = oracle.add_shared_hashes("e", 1, (rank,), c.key, c.hashes, c.sizes, c.kinds)
            if published is None or published:
                _published(want, "e", c, published)
            _, own = joiner.add("e", 1, (rank,), tp, content, lambda c=c: c)
            if own is None or own:
                _published(got, "e", c, own)
        if not left[rank]:
            del left[rank]
    joiner.flush_all()
    assert _state(joined) == _state(oracle)
    assert _per_block(got, "e") == _per_block(want, "e")
