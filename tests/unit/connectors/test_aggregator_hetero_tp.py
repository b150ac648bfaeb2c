"""Transfers between a prefill and a decode engine of different TP sizes, counted per side.

The scheduler's aggregator knows each engine's rank set from registration; the transfer
tracker turns engine-level facts into request outcomes. Against a reference model with plain
sets: a request's decode outcome comes exactly when every decode rank reported it (received or
failed, invalid blocks the union), its release exactly once, when that happened or every
prefill rank reported finished_sending (a rank no decode rank reads reports at once,
`head_map.readers_of` == 0). Ranks report twice, and some never report. Hypothesis, about 2 s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.aggregator import KVOutputAggregator
from connectors.head_map import mapping_problem, readers_of
from connectors.outputs import KVConnectorOutput
from services.scheduler.lifecycle import EngineRef
from services.scheduler.transfers import OutcomeKind, TransferTracker

PREFILL, DECODE = EngineRef("p", 1), EngineRef("d", 2)
IDS = ["a", "b", "c"]


@dataclass
class RefTransfer:
    decode_ranks: set[int] = field(default_factory=set)
    prefill_ranks: set[int] = field(default_factory=set)
    failed: bool = False
    invalid: set[int] = field(default_factory=set)
    decided: bool = False
    released: bool = False


def _layouts() -> st.SearchStrategy[tuple[int, int, int]]:
    return st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])).filter(
        lambda t: t[0] != t[1] and mapping_problem(t[0], t[1], t[2]) is None)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_outcomes_follow_per_side_rank_sets(data: st.DataObject) -> None:
    p, d, heads = data.draw(_layouts(), label="prefill tp, decode tp, kv heads")
    silent_decode = data.draw(st.sets(st.integers(0, d - 1), max_size=d - 1), label="silent decode ranks")
    silent_prefill = data.draw(st.sets(st.integers(0, p - 1), max_size=p - 1), label="silent prefill ranks")
    agg = KVOutputAggregator()
    agg.register_engine("p", 1, range(p))
    agg.register_engine("d", 2, range(d))
    tracker = TransferTracker()
    ref = {rid: RefTransfer() for rid in IDS}
    for rid in IDS:
        tracker.start(rid, PREFILL, DECODE)
    # Ranks no decode rank reads report finished_sending as soon as they pin (0 readers).
    unread = {r for r in range(p) if readers_of(r, p, d, heads) == 0}
    ops = [("p", r, rid, False, frozenset[int]()) for r in unread for rid in IDS]
    ops += data.draw(st.lists(st.one_of(
        st.tuples(st.just("d"), st.integers(0, d - 1).filter(lambda r: r not in silent_decode),
                  st.sampled_from(IDS), st.booleans(), st.frozensets(st.integers(0, 7), max_size=2)),
        st.tuples(st.just("p"), st.integers(0, p - 1).filter(lambda r: r not in silent_prefill),
                  st.sampled_from(IDS), st.just(False), st.just(frozenset[int]())),
    ), max_size=30), label="reports (repeats allowed)")
    decisions: list[tuple[str, str]] = []
    for side, rank, rid, failed, invalid in ops:
        t = ref[rid]
        if side == "d":
            output = KVConnectorOutput(finished_recving=frozenset() if failed else frozenset({rid}),
                                       failed_recving=frozenset({rid}) if failed else frozenset(),
                                       invalid_block_ids=invalid)
            result = agg.add_report("d", 2, rank, output)
            outcomes = [o for r in result.finished_recving
                        for o in tracker.on_recving(DECODE, r, r in result.failed_recving,
                                                    result.invalid_block_ids.get(r, ()))]
            if not t.decided:
                t.decode_ranks.add(rank)
                t.failed |= failed
                t.invalid |= invalid
        else:
            result = agg.add_report("p", 1, rank, KVConnectorOutput(finished_sending=frozenset({rid})))
            outcomes = [o for r in result.finished_sending for o in tracker.on_sending(PREFILL, r)]
            if not t.released:
                t.prefill_ranks.add(rank)
        want: list[tuple[str, str]] = []
        if not t.decided and t.decode_ranks == set(range(d)):
            t.decided = True
            want.append(("kv_failed" if t.failed else "kv_ready", rid))
        if not t.released and (t.decided or t.prefill_ranks == set(range(p))):
            t.released = True
            want.append(("release", rid))
        got = [(str(o.kind), o.request_id) for o in outcomes]
        assert got == want, (side, rank, rid)
        for o in outcomes:
            if o.kind is OutcomeKind.KV_FAILED:
                assert set(o.invalid_block_ids) == t.invalid
            assert o.engine == (PREFILL if o.kind is OutcomeKind.RELEASE else DECODE)
        decisions += got
    assert len(decisions) == len(set(decisions)), "an outcome was produced twice"
    for rid, t in ref.items():
        # A silent decode rank means no decode outcome; a silent read prefill rank (and no
        # decode outcome) means no release.
        assert t.decided == (not silent_decode and t.decode_ranks == set(range(d)))
        if silent_decode and silent_prefill - unread:
            assert not t.released, rid
