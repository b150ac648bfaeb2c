"""KVOutputAggregator: pdserve's per-rank aggregation semantics (ARCHITECTURE §3).

Hand-built cases first (including the two places where vLLM's aggregator is wrong, reference
spec §7 items 1 and 2), then hypothesis runs against a small, obviously-correct reference model
that simulates each rank's holdings with plain sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.aggregator import (
    AggregatedResult,
    KVOutputAggregator,
    PendingCounts,
    StaleEpochError,
    UnknownEngineError,
)
from connectors.kv_events import (
    MEDIUM_CPU,
    MEDIUM_CPU_OFFLOAD,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from connectors.outputs import KVConnectorOutput, KVConnectorStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stored(*hashes: int, medium: str = MEDIUM_CPU) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 0, medium=medium)


def out(sending: set[str] | None = None, recving: set[str] | None = None,
        failed: set[str] | None = None, invalid: set[int] | None = None,
        events: tuple[KVCacheEvent, ...] = (), expected: int = 0) -> KVConnectorOutput:
    return KVConnectorOutput(
        finished_sending=frozenset(sending or ()), finished_recving=frozenset(recving or ()),
        failed_recving=frozenset(failed or ()), invalid_block_ids=frozenset(invalid or ()),
        kv_cache_events=events, expected_finished_count=expected)


def agg2(clock: FakeClock | None = None) -> KVOutputAggregator:
    a = KVOutputAggregator(clock=clock or FakeClock())
    a.register_engine("e", 7, [0, 1])
    return a


# -- vLLM's two aggregation bugs (spec §7.1, §7.2) ----------------------------------------

def test_silent_rank_does_not_complete_an_event() -> None:
    """§7.1: rank 1 sends no events: rank 0's BlockStored must not be published."""
    a = agg2()
    assert a.add_report("e", 7, 0, out(events=(stored(1),))).events == []
    assert a.add_report("e", 7, 1, out()).events == []  # rank 1 reports, but no event
    assert a.pending_reports()["e"].blocks == 1
    assert a.add_report("e", 7, 1, out(events=(stored(1),))).events == [stored(1)]
    assert a.pending_reports()["e"] == PendingCounts(0, 0, 0, 0)


def test_duplicate_from_one_rank_does_not_satisfy_quorum() -> None:
    """§7.2: one rank reporting an event twice (in one report or two) is one rank."""
    a = agg2()
    assert a.add_report("e", 7, 0, out(events=(stored(1), stored(1)))).events == []
    assert a.add_report("e", 7, 0, out(events=(stored(1),))).events == []
    assert a.add_report("e", 7, 0, out(sending={"r"})).finished_sending == []
    assert a.add_report("e", 7, 0, out(sending={"r"})).finished_sending == []
    res = a.add_report("e", 7, 1, out(sending={"r"}, events=(stored(1),)))
    assert res.finished_sending == ["r"] and res.events == [stored(1)]
    # Repeats after release change nothing.
    res = a.add_report("e", 7, 1, out(sending={"r"}, events=(stored(1),)))
    assert res.is_empty()
    assert a.pending_reports()["e"].total == 0


# -- finished ids ---------------------------------------------------------------------------

def test_finished_ids_persist_across_steps_and_release_once() -> None:
    a = KVOutputAggregator(clock=FakeClock())
    a.register_engine("e", 1, range(4))
    for rank in (2, 0, 3):
        assert a.add_report("e", 1, rank, out(recving={"x"})).finished_recving == []
    assert a.pending_reports()["e"].recving == 1
    assert a.add_report("e", 1, 1, out(recving={"x"})).finished_recving == ["x"]
    assert a.add_report("e", 1, 1, out(recving={"x"})).finished_recving == []
    assert a.pending_reports()["e"].recving == 0


def test_expected_count_change_applies_to_new_ids_only() -> None:
    a = agg2()
    a.add_report("e", 7, 0, out(sending={"old"}))
    res = a.add_report("e", 7, 0, out(sending={"new"}, expected=1))
    assert res.finished_sending == ["new"]
    assert a.add_report("e", 7, 0, out(sending={"old"})).finished_sending == []
    assert a.add_report("e", 7, 1, out(sending={"old"})).finished_sending == ["old"]


def test_failed_and_invalid_blocks_are_unions() -> None:
    a = agg2()
    a.add_report("e", 7, 0, out(invalid={3}))  # before the request's report: held for it
    a.add_report("e", 7, 0, out(recving={"x"}, invalid={4}))
    res = a.add_report("e", 7, 1, out(failed={"x"}, invalid={5}))
    assert res.finished_recving == ["x"] and res.failed_recving == {"x"}
    assert res.invalid_block_ids == {"x": frozenset({3, 4, 5})}
    output = res.to_output()
    assert output.failed_recving == {"x"} and output.invalid_block_ids == {3, 4, 5}


def test_abort_drops_pending_and_absorbs_late_reports() -> None:
    a = agg2()
    a.add_report("e", 7, 0, out(sending={"x"}))
    assert a.abort("x") is True
    assert a.abort("x") is False
    assert a.add_report("e", 7, 1, out(sending={"x"})).finished_sending == []
    assert a.pending_reports()["e"].total == 0


def test_epoch_change_clears_and_stale_reports_are_rejected() -> None:
    a = agg2()
    a.add_report("e", 7, 0, out(sending={"x"}, events=(stored(1),)))
    assert a.register_engine("e", 7, [0, 1]) is False
    assert a.pending_reports()["e"].total == 2
    assert a.register_engine("e", 8, [0, 1, 2]) is True
    assert a.pending_reports()["e"].total == 0
    with pytest.raises(StaleEpochError, match='report for epoch 7, current epoch is 8'):
        a.add_report("e", 7, 1, out(sending={"x"}))
    for rank in (0, 1):
        assert a.add_report("e", 8, rank, out(sending={"x"})).finished_sending == []
    assert a.add_report("e", 8, 2, out(sending={"x"})).finished_sending == ["x"]


def test_bad_input_raises_and_changes_nothing() -> None:
    a = agg2()
    a.add_report("e", 7, 0, out(sending={"x"}))
    before = a.pending_reports()
    with pytest.raises(UnknownEngineError, match="engine 'nope' is not registered"):
        a.add_report("nope", 7, 0, out())
    with pytest.raises(ValueError, match="rank 5"):
        a.add_report("e", 7, 5, out(sending={"x"}))
    with pytest.raises(ValueError, match="finished count"):
        a.add_report("e", 7, 1, out(sending={"x"}, expected=3))
    with pytest.raises(ValueError, match="ranks"):
        a.register_engine("e", 7, [0, 1, 2])
    with pytest.raises(ValueError, match="ranks"):
        a.register_engine("f", 1, [])
    with pytest.raises(ValueError, match="finished count"):
        a.register_engine("f", 1, [0], finished_count=2)
    with pytest.raises(ValueError, match="rank 9"):
        a.add_reports("e", 7, {1: out(sending={"x"}), 9: out()})
    assert a.pending_reports() == before
    assert a.add_report("e", 7, 1, out(sending={"x"})).finished_sending == ["x"]


def test_pending_age_uses_the_injected_clock() -> None:
    clock = FakeClock()
    a = agg2(clock)
    assert a.oldest_pending_age() is None
    a.add_report("e", 7, 0, out(recving={"x"}))
    clock.now += 5
    a.add_report("e", 7, 0, out(events=(stored(9),)))
    clock.now += 2
    assert a.oldest_pending_age() == 7.0
    a.add_report("e", 7, 1, out(recving={"x"}))
    assert a.oldest_pending_age("e") == 2.0
    assert a.drop_engine("e") and a.oldest_pending_age() is None
    with pytest.raises(UnknownEngineError, match="engine 'e' is not registered"):
        a.oldest_pending_age("e")


# -- worker-side events --------------------------------------------------------------------

def test_removed_at_first_rank_then_absorbed() -> None:
    a = agg2()
    a.add_reports("e", 7, {0: out(events=(stored(1, 2),)), 1: out(events=(stored(1, 2),))})
    removed = BlockRemoved((1,), MEDIUM_CPU)
    assert a.add_report("e", 7, 1, out(events=(removed,))).events == [removed]
    assert a.add_report("e", 7, 0, out(events=(removed,))).events == []
    # Re-stored by both ranks: published again.
    a.add_report("e", 7, 0, out(events=(stored(1),)))
    assert a.add_report("e", 7, 1, out(events=(stored(1),))).events == [stored(1)]


def test_removal_by_a_rank_that_never_finished_storing_is_absorbed() -> None:
    a = agg2()
    a.add_report("e", 7, 0, out(events=(stored(1),)))
    assert a.add_report("e", 7, 0, out(events=(BlockRemoved((1,), MEDIUM_CPU),))).events == []
    assert a.add_report("e", 7, 1, out(events=(stored(1),))).events == []  # rank 0 no longer holds it
    assert a.pending_reports()["e"].blocks == 1


def test_all_blocks_cleared_once_per_round_and_per_medium() -> None:
    a = agg2()
    both = {r: out(events=(stored(1), stored(2, medium=MEDIUM_CPU_OFFLOAD))) for r in (0, 1)}
    assert len(a.add_reports("e", 7, both).events) == 2
    clear = AllBlocksCleared(MEDIUM_CPU)
    assert a.add_report("e", 7, 0, out(events=(clear,))).events == [clear]
    assert a.add_report("e", 7, 0, out(events=(clear,))).events == []
    assert a.add_report("e", 7, 1, out(events=(clear,))).events == []
    assert a.add_report("e", 7, 1, out(events=(clear,))).events == [clear]  # a new round
    # The other medium is untouched: a repeat store is still a duplicate.
    assert a.add_report("e", 7, 0, out(events=(stored(2, medium=MEDIUM_CPU_OFFLOAD),))).events == []


def test_add_reports_folds_stats() -> None:
    a = agg2()
    s0, s1 = KVConnectorStats({"bytes": [1.0]}), KVConnectorStats({"bytes": [2.0]})
    res = a.add_reports("e", 7, {1: KVConnectorOutput(kv_connector_stats=s1),
                                 0: KVConnectorOutput(kv_connector_stats=s0)})
    assert res.kv_connector_stats is not None and res.kv_connector_stats.data == {"bytes": [1.0, 2.0]}


# -- property tests against a reference model ---------------------------------------------

@dataclass
class RefEngine:
    epoch: int
    ranks: list[int]
    count: int
    sending: dict[str, tuple[set[int], int]] = field(default_factory=dict)
    recving: dict[str, tuple[set[int], int, bool, set[int]]] = field(default_factory=dict)
    done: set[tuple[str, str]] = field(default_factory=set)
    held_invalid: dict[int, set[int]] = field(default_factory=dict)
    holdings: dict[int, set[tuple[str | None, int | None, int]]] = field(default_factory=dict)
    live: set[tuple[str | None, int | None, int]] = field(default_factory=set)
    clears: dict[str | None, set[int]] = field(default_factory=dict)
    # when each partial state began: ("s" | "r", id) for ids, (medium, group, hash) for blocks
    since: dict[object, float] = field(default_factory=dict)

    def _holders(self, key: tuple[str | None, int | None, int]) -> int:
        return sum(key in self.holdings.get(r, set()) for r in self.ranks)

    def _track(self, keys: set[tuple[str | None, int | None, int]], now: float) -> None:
        for key in keys:
            if 0 < self._holders(key) < len(self.ranks):
                self.since.setdefault(key, now)
            else:
                self.since.pop(key, None)

    def report(self, rank: int, o: KVConnectorOutput, now: float) -> AggregatedResult:
        res = AggregatedResult()
        if o.expected_finished_count:
            self.count = o.expected_finished_count
        for rid in sorted(o.finished_sending):
            if ("s", rid) in self.done:
                continue
            ranks, need = self.sending.setdefault(rid, (set(), self.count))
            ranks.add(rank)
            self.since.setdefault(("s", rid), now)
            if len(ranks) >= need:
                del self.sending[rid]
                del self.since[("s", rid)]
                self.done.add(("s", rid))
                res.finished_sending.append(rid)
        recv = o.finished_recving | o.failed_recving
        invalid = set(o.invalid_block_ids)
        if recv:
            invalid |= self.held_invalid.pop(rank, set())
        elif invalid:
            self.held_invalid.setdefault(rank, set()).update(invalid)
        for rid in sorted(recv):
            if ("r", rid) in self.done:
                continue
            ranks, need, failed, inv = self.recving.setdefault(rid, (set(), self.count, False, set()))
            ranks.add(rank)
            self.since.setdefault(("r", rid), now)
            self.recving[rid] = (ranks, need, failed or rid in o.failed_recving, inv | invalid)
            if len(ranks) >= need:
                _, _, failed, inv = self.recving.pop(rid)
                del self.since[("r", rid)]
                self.done.add(("r", rid))
                res.finished_recving.append(rid)
                if failed:
                    res.failed_recving.add(rid)
                if inv:
                    res.invalid_block_ids[rid] = frozenset(inv)
        mine = self.holdings.setdefault(rank, set())
        for ev in o.kv_cache_events:
            if isinstance(ev, BlockStored):
                keys = {(ev.medium, ev.group_idx, int(h)) for h in ev.block_hashes}
                mine |= keys
                self._track(keys, now)
                if all(keys <= self.holdings.get(r, set()) for r in self.ranks) and not keys <= self.live:
                    self.live |= keys
                    res.events.append(ev)
            elif isinstance(ev, BlockRemoved):
                keys = {(ev.medium, ev.group_idx, int(h)) for h in ev.block_hashes} & mine
                mine -= keys
                self._track(keys, now)
                if keys & self.live:
                    self.live -= keys
                    res.events.append(ev)
            else:
                keys = {k for k in mine if ev.medium is None or k[0] == ev.medium}
                mine -= keys
                self._track(keys, now)
                outstanding = self.clears.setdefault(ev.medium, set())
                if keys & self.live or not outstanding:
                    res.events.append(ev)
                self.live -= keys
                outstanding.add(rank)
                if outstanding == set(self.ranks):
                    del self.clears[ev.medium]
        return res

    def abort(self, rid: str) -> None:
        """Aborted ids are absorbed from now on, whether or not a rank reported them yet."""
        for kind, pending in (("s", self.sending), ("r", self.recving)):
            pending.pop(rid, None)
            self.since.pop((kind, rid), None)
            self.done.add((kind, rid))

    def oldest_age(self, now: float) -> float | None:
        return now - min(self.since.values()) if self.since else None

    def pending(self) -> PendingCounts:
        all_keys = set().union(*self.holdings.values()) if self.holdings else set()
        partial = [k for k in all_keys
                   if 0 < sum(k in self.holdings.get(r, set()) for r in self.ranks) < len(self.ranks)]
        return PendingCounts(len(self.sending), len(self.recving), len(partial), len(self.clears))


IDS = ["a", "b", "c", "d"]
HASHES = st.integers(1, 5)
MEDIA = st.sampled_from([MEDIUM_CPU, MEDIUM_CPU_OFFLOAD])
EVENTS = st.one_of(
    st.builds(lambda hs, m: BlockStored(tuple(hs), None, (), 0, medium=m, group_idx=0),
              st.lists(HASHES, min_size=1, max_size=3, unique=True), MEDIA),
    st.builds(lambda hs, m: BlockRemoved(tuple(hs), m, 0),
              st.lists(HASHES, min_size=1, max_size=3, unique=True), MEDIA),
    st.builds(AllBlocksCleared, st.one_of(st.none(), MEDIA)),
)


def _run(medium: str, *hash_lists: tuple[int, ...]) -> tuple[KVCacheEvent, ...]:
    return tuple(BlockStored(hs, None, (), 0, medium=medium, group_idx=0) for hs in hash_lists)


# Whole runs that several ranks report identically (the common case the bulk path serves),
# including overlapping and repeated hashes.
RUNS = st.sampled_from([
    _run(MEDIUM_CPU, (1, 2), (3,), (4, 5)),
    _run(MEDIUM_CPU, (1,), (2,)),
    _run(MEDIUM_CPU, (2, 3), (3, 4)),
    _run(MEDIUM_CPU, (5,), (5,)),
    _run(MEDIUM_CPU_OFFLOAD, (1, 2, 3)),
])


def _report(num_ranks: int) -> st.SearchStrategy[tuple[str, int, KVConnectorOutput]]:
    ids = st.frozensets(st.sampled_from(IDS), max_size=3)
    return st.tuples(
        st.just("report"),
        # rank num_ranks - 1 is silent in about half of the runs (the strategy never picks it)
        st.integers(0, num_ranks - 1),
        st.builds(KVConnectorOutput, finished_sending=ids, finished_recving=ids,
                  failed_recving=st.frozensets(st.sampled_from(IDS), max_size=1),
                  invalid_block_ids=st.frozensets(st.integers(0, 9), max_size=2),
                  kv_cache_events=st.one_of(st.lists(EVENTS, max_size=4).map(tuple), RUNS),
                  expected_finished_count=st.integers(0, num_ranks)))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_matches_reference_model(data: st.DataObject) -> None:
    num_ranks = data.draw(st.integers(1, 4), label="num_ranks")
    talking = data.draw(st.integers(1, num_ranks), label="ranks_that_talk")
    ops = data.draw(st.lists(st.one_of(
        _report(talking),
        st.tuples(st.just("abort"), st.sampled_from(IDS), st.none()),
        st.tuples(st.just("epoch"), st.integers(0, 2), st.none()),
    ), max_size=40), label="ops")
    clock = FakeClock()
    agg = KVOutputAggregator(clock=clock)
    agg.register_engine("e", 0, range(num_ranks))
    ref = RefEngine(0, list(range(num_ranks)), num_ranks)
    released: list[tuple[int, str, str]] = []
    published_stored = 0
    for kind, arg, output in ops:
        clock.now += 1
        if kind == "report":
            assert isinstance(output, KVConnectorOutput) and isinstance(arg, int)
            got = agg.add_report("e", ref.epoch, arg, output)
            want = ref.report(arg, output, clock.now)
            assert sorted(got.finished_sending) == sorted(want.finished_sending)
            assert sorted(got.finished_recving) == sorted(want.finished_recving)
            assert got.failed_recving == want.failed_recving
            assert got.invalid_block_ids == want.invalid_block_ids
            assert got.events == want.events
            released += [(ref.epoch, "s", r) for r in got.finished_sending]
            released += [(ref.epoch, "r", r) for r in got.finished_recving]
            published_stored += sum(isinstance(e, BlockStored) for e in got.events)
        elif kind == "abort":
            assert isinstance(arg, str)
            agg.abort(arg)
            ref.abort(arg)
        else:
            assert isinstance(arg, int)
            new_epoch = ref.epoch + 1 + arg
            assert agg.register_engine("e", new_epoch, range(num_ranks)) is True
            ref = RefEngine(new_epoch, list(range(num_ranks)), num_ranks)
        assert agg.pending_reports()["e"] == ref.pending()
        assert agg.oldest_pending_age() == ref.oldest_age(clock.now)
    # An id is released at most once per epoch; with a silent rank no block is ever whole.
    assert len(released) == len(set(released))
    if talking < num_ranks:
        assert published_stored == 0


def test_one_events_tuple_shared_by_every_rank_equals_separate_copies() -> None:
    # The Control servicer hands every rank of a step the same decoded tuple object; the
    # aggregator's per-tuple memo must give exactly what separate equal copies give.
    step: tuple[KVCacheEvent, ...] = (stored(1, medium=MEDIUM_CPU_OFFLOAD), stored(2, 3, medium=MEDIUM_CPU_OFFLOAD))
    mixed: tuple[KVCacheEvent, ...] = (stored(4), BlockRemoved((1,), MEDIUM_CPU_OFFLOAD))
    shared, copies = agg2(), agg2()
    for ranked in ([(0, step), (1, mixed), (0, mixed), (1, step)], [(1, step), (0, step), (0, mixed)]):
        for rank, events in ranked:
            got = shared.add_report("e", 7, rank, out(events=events))
            want = copies.add_report("e", 7, rank, out(events=tuple(list(events))))
            assert got.events == want.events
            assert shared.pending_reports() == copies.pending_reports()
    with pytest.raises(ValueError, match="not a KV cache event"):
        shared.add_report("e", 7, 0, out(events=(*step, "bogus")))  # type: ignore[arg-type]
    assert shared.add_report("e", 7, 1, out(events=step)).events == []


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_shared_events_equal_each_rank_reporting_them(data: st.DataObject) -> None:
    """`add_shared_events` (one engine step's events for a group of ranks, as a merged report
    carries them) leaves exactly the state that reporting them rank by rank leaves, and
    publishes the same events (as a multiset; in event order), after any history."""
    num_ranks = data.draw(st.integers(1, 4), label="num_ranks")
    history = data.draw(st.lists(_report(num_ranks), max_size=12), label="history")
    steps = data.draw(st.lists(st.tuples(
        st.sets(st.integers(0, num_ranks - 1), min_size=1),
        st.one_of(st.lists(EVENTS, min_size=1, max_size=4).map(tuple), RUNS)), min_size=1, max_size=4),
        label="steps")
    clock = FakeClock()
    shared, one_by_one = KVOutputAggregator(clock=clock), KVOutputAggregator(clock=clock)
    for a in (shared, one_by_one):
        a.register_engine("e", 0, range(num_ranks))
    for _, rank, output in history:
        clock.now += 1
        assert shared.add_report("e", 0, rank, output).events == one_by_one.add_report("e", 0, rank, output).events
    for ranks, events in steps:
        clock.now += 1
        got = shared.add_shared_events("e", 0, ranks, events).events
        want = [e for r in sorted(ranks) for e in one_by_one.add_report("e", 0, r, out(events=events)).events]
        assert sorted(map(repr, got)) == sorted(map(repr, want))
        a, b = shared._engines["e"], one_by_one._engines["e"]
        assert (a.blocks, a.live, a.pending_blocks, a.clears) == (b.blocks, b.live, b.pending_blocks, b.clears)
        assert shared.pending_reports() == one_by_one.pending_reports()
        assert shared.oldest_pending_age() == one_by_one.oldest_pending_age()


def test_shared_stored_step_with_a_repeated_hash_goes_rank_by_rank() -> None:
    """Rank 1 held block 1; then both ranks store (1, 2) and (1) in one step. Rank by rank,
    rank 0's (1, 2) completes... nothing whole yet (2 is rank 0's alone), its (1) completes 1;
    rank 1's (1, 2) completes 2: two events. The joint mask published only the first."""
    step = (stored(1, 2), stored(1))
    by_rank, events, hashes = agg2(), agg2(), agg2()
    for a in (by_rank, events, hashes):
        assert a.add_report("e", 7, 1, out(events=(stored(1),))).events == []
    want = [e for r in (0, 1) for e in by_rank.add_report("e", 7, r, out(events=step)).events]
    assert sorted(map(repr, want)) == sorted(map(repr, step))
    assert sorted(map(repr, events.add_shared_events("e", 7, [0, 1], step).events)) == sorted(map(repr, want))
    got = hashes.add_shared_hashes("e", 7, [0, 1], (MEDIUM_CPU, None), [1, 2, 1], [2, 1])
    assert sorted(got if got is not None else [0, 1]) == [0, 1]
    assert events._engines["e"].blocks == by_rank._engines["e"].blocks == hashes._engines["e"].blocks


def test_shared_events_validate_every_rank_first() -> None:
    a = agg2()
    with pytest.raises(ValueError, match="not one of the expected ranks"):
        a.add_shared_events("e", 7, [0, 5], (stored(1),))
    with pytest.raises(ValueError, match="ranks repeat"):
        a.add_shared_events("e", 7, [0, 0], (stored(1),))
    with pytest.raises(StaleEpochError, match="current epoch is 7"):
        a.add_shared_events("e", 6, [0, 1], (stored(1),))
    assert a.pending_reports()["e"] == PendingCounts(0, 0, 0, 0)
    assert a.add_shared_events("e", 7, [1, 0], (stored(1), stored(2))).events == [stored(1), stored(2)]


def test_block_state_is_not_walked_by_the_garbage_collector() -> None:
    """An engine's per-block state (masks, published hashes, partial blocks) grows with its KV
    cache: millions of entries on a large cluster. None of it may be a container the collector
    tracks (a set always is), or every full collection would walk each entry."""
    import gc

    agg = KVOutputAggregator()
    agg.register_engine("e", 1, range(2))
    stored = [BlockStored((h,), None, (), 16, medium=MEDIUM_CPU_OFFLOAD) for h in range(100)]
    agg.add_shared_events("e", 1, (0, 1), stored)  # published: every rank holds them
    agg.add_report("e", 1, 0, KVConnectorOutput(kv_cache_events=(
        BlockStored((b"\x01" * 32,), None, (), 16, medium=MEDIUM_CPU_OFFLOAD),)))  # partial: rank 0 only
    gc.collect()
    state = agg._engines["e"]
    key = (MEDIUM_CPU_OFFLOAD, None)
    assert len(state.live[key]) == 100 and len(state.pending_blocks[key]) == 1
    for per_key in (state.blocks, state.live, state.pending_blocks):
        assert not gc.is_tracked(per_key[key])
