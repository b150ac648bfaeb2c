"""InMemoryPrefixIndex: longest consecutive match, epochs, AllBlocksCleared, eviction bound."""

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.hashing import BlockHasher
from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.scheduler.prefix_index import InMemoryPrefixIndex, PrefixIndex, block_key


def stored(hashes: list[int], medium: str | None = "GPU", parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, (), 16, medium=medium)


def test_is_a_prefix_index() -> None:
    assert isinstance(InMemoryPrefixIndex(), PrefixIndex)


def test_longest_consecutive_match_from_block_zero() -> None:
    idx = InMemoryPrefixIndex()
    idx.apply("a", 1, [stored([1, 2, 3])])
    idx.apply("b", 2, [stored([1, 2]), stored([4], parent=2)])
    m = idx.match([1, 2, 3, 4])
    assert m["a"].num_blocks == 3 and m["a"].epoch == 1
    assert m["b"].num_blocks == 2  # holds block 4 too, but not block 3: the chain ends at 2
    assert idx.match([9, 1, 2]) == {}  # no block 0, no match at all
    assert idx.match([]) == {}


def test_match_with_real_hashes_and_media() -> None:
    hasher = BlockHasher(block_size=4)
    tokens = list(range(20))
    h = hasher.external_hashes(tokens)
    idx = InMemoryPrefixIndex()
    idx.apply("e", 7, [stored(h[:2], "GPU"), stored(h[2:4], "CPU_OFFLOAD", parent=h[1])])
    idx.apply("e", 7, [stored(h[:1], "CPU_OFFLOAD")])
    m = idx.match(hasher.external_hashes(tokens + [99, 98]))["e"]
    assert m.num_blocks == 4
    assert m.media == (frozenset({"GPU", "CPU_OFFLOAD"}), frozenset({"GPU"}),
                       frozenset({"CPU_OFFLOAD"}), frozenset({"CPU_OFFLOAD"}))
    assert m.weighted_blocks({"GPU": 1.0, "CPU_OFFLOAD": 0.5}, 0.1) == pytest.approx(3.0)


def test_removed_is_per_medium_and_missing_medium_means_gpu() -> None:
    idx = InMemoryPrefixIndex()
    idx.apply("a", 1, [stored([1, 2], None), stored([1], "CPU")])
    idx.apply("a", 1, [BlockRemoved((1,), None)])
    assert idx.match([1, 2])["a"].media == (frozenset({"CPU"}), frozenset({"GPU"}))
    idx.apply("a", 1, [BlockRemoved((1, 5), "CPU")])  # an unknown hash is ignored
    assert idx.match([1, 2]) == {}
    assert len(idx) == 1


def test_bytes_hashes_use_low_64_bits() -> None:
    digest = bytes(range(32))
    idx = InMemoryPrefixIndex()
    idx.apply("a", 1, [stored([digest])])  # type: ignore[list-item]
    assert idx.match([block_key(digest)])["a"].num_blocks == 1
    assert block_key(digest) == int.from_bytes(digest[-8:], "big")


def test_new_epoch_drops_old_entries_and_dead_epoch_is_ignored() -> None:
    idx = InMemoryPrefixIndex()
    idx.apply("a", 1, [stored([1, 2])])
    idx.apply("b", 5, [stored([1])])
    assert idx.apply("a", 2, [stored([7])])
    assert "a" not in idx.match([1, 2]) and idx.match([1])["b"].num_blocks == 1
    assert idx.epoch_of("a") == 2
    assert not idx.apply("a", 1, [stored([1, 2])])  # late report of the dead incarnation
    assert "a" not in idx.match([1, 2])
    assert idx.stats().num_stale_events == 1
    with pytest.raises(ValueError, match="already replaced"):
        idx.begin_epoch("a", 1)


def test_all_blocks_cleared_whole_engine_or_one_medium() -> None:
    idx = InMemoryPrefixIndex()
    idx.apply("a", 1, [stored([1], "GPU"), stored([1], "CPU_OFFLOAD")])
    idx.apply("b", 1, [stored([1], "GPU")])
    idx.apply("a", 1, [AllBlocksCleared("GPU")])
    assert idx.match([1])["a"].media == (frozenset({"CPU_OFFLOAD"}),)
    idx.apply("a", 1, [AllBlocksCleared()])
    assert set(idx.match([1])) == {"b"}
    idx.remove_engine("b")
    assert idx.match([1]) == {} and len(idx) == 0 and idx.epoch_of("b") is None


def test_eviction_bound_is_lru_with_match_touching() -> None:
    idx = InMemoryPrefixIndex(max_entries=4)
    idx.apply("a", 1, [stored([1, 2, 3])])
    idx.match([1])  # block 1 is now the most recently used
    idx.apply("a", 1, [stored([4, 5])])
    assert len(idx) == 4
    assert [h for h, _, _ in idx.entries()] == [3, 1, 4, 5]  # 2 (oldest unused) evicted
    assert idx.stats().num_evicted == 1
    for i in range(100, 200):
        idx.apply("b", 1, [stored([i])])
    assert len(idx) == 4
    assert idx.match([1]) == {}
    with pytest.raises(ValueError, match='max_entries must be >= 1, got 0'):
        InMemoryPrefixIndex(max_entries=0)


def test_snapshot_groups_by_engine_and_medium() -> None:
    idx = InMemoryPrefixIndex()
    idx.apply("a", 3, [stored([1, 2], "GPU"), stored([9], "CPU")])
    idx.apply("b", 4, [stored([1], "GPU")])
    parts = {(p.engine_id, p.epoch, p.medium): p.block_hashes for p in idx.snapshot()}
    assert parts == {("a", 3, "GPU"): (1, 2), ("a", 3, "CPU"): (9,), ("b", 4, "GPU"): (1,)}


def test_match_touches_block_by_block_each_block_in_slot_order() -> None:
    """Within a block, entries are touched in the order their (engine, medium) pairs first
    stored (slot order), across engines and media alike; then the next block."""
    idx = InMemoryPrefixIndex()
    idx.apply("a", 1, [stored([1, 2], "GPU")])
    idx.apply("b", 1, [stored([1, 2], "GPU")])
    idx.apply("a", 1, [stored([1], "CPU")])
    idx.apply("c", 1, [stored([9], "GPU")])
    assert set(idx.match([1, 2])) == {"a", "b"}
    assert list(idx.entries()) == [(9, "c", "GPU"), (1, "a", "GPU"), (1, "b", "GPU"), (1, "a", "CPU"),
                                   (2, "a", "GPU"), (2, "b", "GPU")]


def test_match_after_its_holders_change() -> None:
    """A block 0 asked about before is matched afresh after its holders drop out (a dropped
    engine's entries may still sit in the LRU), store it or store it again."""
    idx = InMemoryPrefixIndex()
    idx.apply("a", 1, [stored([1])])
    idx.apply("b", 1, [stored([2, 3, 4])])
    assert set(idx.match([1])) == {"a"} and idx.match([5]) == {}
    idx.remove_engine("a")
    assert idx.match([1]) == {}
    idx.apply("b", 1, [stored([1])])
    idx.apply_compact("c", 1, "GPU", [5, 6], [1, 1])
    assert set(idx.match([1])) == {"b"} and idx.match([5, 6])["c"].num_blocks == 2
    idx.apply("a", 1, [stored([1]), stored([7], "CPU")])
    assert set(idx.match([1])) == {"a", "b"}


# -- IntLru: the index's LRU order, against OrderedDict as the reference ---------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["touch", "discard", "pop"]), st.integers(0, 40)), max_size=400),
       st.sampled_from([0, 4, 1024]))
def test_int_lru_matches_ordered_dict(ops: list[tuple[str, int]], slack: int) -> None:
    """Cost: about 1 s."""
    from services.scheduler.prefix_index import IntLru

    lru, ref = IntLru(slack), OrderedDict[int, None]()
    for op, key in ops:
        if op == "touch":
            lru.touch(key)
            ref[key] = None
            ref.move_to_end(key)
        elif op == "discard":
            lru.discard(key)
            ref.pop(key, None)
        elif ref:
            assert lru.pop_oldest() == ref.popitem(last=False)[0]
        else:
            with pytest.raises(KeyError, match="empty"):
                lru.pop_oldest()
        assert len(lru) == len(ref) and list(lru) == list(ref)
        assert all(k in lru for k in ref)


@given(st.lists(st.lists(st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=3),
                                   st.sampled_from([None, "CPU"])), min_size=1, max_size=8), max_size=30),
       st.integers(1, 12))
@settings(max_examples=200, deadline=None)
def test_a_batch_of_stored_runs_equals_its_events_one_by_one(batches: list[list[tuple[list[int], str | None]]],
                                                             bound: int) -> None:
    """Runs of BlockStored go into the index in bulk when new to it; the entries and their LRU
    order (so every later eviction) equal applying the same events one batch each."""
    bulk, single = InMemoryPrefixIndex(max_entries=bound), InMemoryPrefixIndex(max_entries=bound)
    for batch in batches:
        events = [BlockStored(tuple(hs), None, (), 16, medium=m) for hs, m in batch]
        bulk.apply("e", 1, events)
        for event in events:
            single.apply("e", 1, [event])
        assert list(bulk.entries()) == list(single.entries())
        assert bulk.stats().num_evicted == single.stats().num_evicted


# -- the whole index against a reference model (entries in LRU order, sizes per medium) -------------

_ops = st.lists(st.tuples(st.sampled_from(["stored", "compact", "removed", "cleared", "epoch", "gone"]),
                          st.sampled_from(["a", "b"]), st.sampled_from(["GPU", "CPU"]),
                          st.lists(st.integers(0, 12), min_size=1, max_size=6)), max_size=40)


def _apply_to_both(idx: InMemoryPrefixIndex, ref: OrderedDict[tuple[int, str, str], None], op: str, engine: str,
                   medium: str, hashes: list[int], epochs: dict[str, int], bound: int) -> int:
    """Applies one history step (stored, compact, removed, cleared, epoch, gone) to the index
    and to the reference OrderedDict of (hash, engine, medium), which evicts after each event;
    returns how many entries the reference evicted."""
    evicted = 0
    if op in ("stored", "compact"):
        if op == "stored":
            idx.apply(engine, epochs[engine], [stored([h], medium) for h in hashes])
        else:
            idx.apply_compact(engine, epochs[engine], medium, list(hashes), [1] * len(hashes))
        for h in hashes:  # one event per hash: evict after each
            ref[(h, engine, medium)] = None
            ref.move_to_end((h, engine, medium))
            while len(ref) > bound:
                ref.popitem(last=False)
                evicted += 1
    elif op == "removed":
        idx.apply_compact(engine, epochs[engine], medium, list(hashes), [1] * len(hashes), b"\x02" * len(hashes))
        for h in hashes:
            ref.pop((h, engine, medium), None)
    else:
        if op == "cleared":
            idx.apply(engine, epochs[engine], [AllBlocksCleared(medium=medium)])
        elif op == "epoch":
            epochs[engine] += 1
            idx.apply(engine, epochs[engine], [])
        else:
            idx.remove_engine(engine)
        for key in [k for k in ref if k[1] == engine and (op != "cleared" or k[2] == medium)]:
            del ref[key]
    return evicted


@given(_ops, st.integers(1, 10))
@settings(max_examples=150, deadline=None)
def test_index_equals_a_reference_lru_of_entries(ops: list[tuple[str, str, str, list[int]]], bound: int) -> None:
    """Stores (object and compact paths, runs new or not), removals, clears, new epochs and
    dropped engines leave the entries, their LRU order, the evictions and the per-medium sizes
    of an OrderedDict of (hash, engine, medium) that evicts after each event. Cost: about 1 s."""
    from collections import Counter

    idx, ref = InMemoryPrefixIndex(max_entries=bound), OrderedDict[tuple[int, str, str], None]()
    epochs, evicted = {"a": 1, "b": 1}, 0
    for op, engine, medium, hashes in ops:
        evicted += _apply_to_both(idx, ref, op, engine, medium, hashes, epochs, bound)
        assert list(idx.entries()) == list(ref)
        assert idx.stats().num_evicted == evicted
        assert idx.blocks_by_medium() == dict(Counter(m for _, _, m in ref))


# -- match against a naive reference after random histories -----------------------------------------

_match_ops = st.lists(st.tuples(st.sampled_from(["compact", "stored", "removed", "cleared", "epoch", "gone", "match"]),
                                st.sampled_from(["a", "b", "c"]), st.sampled_from(["GPU", "CPU"]),
                                st.lists(st.integers(0, 4), min_size=1, max_size=5)), max_size=50)


def _reference_match(ref: dict[tuple[int, str, str], None], prompt: list[int]) -> dict[str, tuple[frozenset[str], ...]]:
    """Per engine, the media of each block of its longest run of held blocks from block 0."""
    out = {}
    for engine in sorted({e for _, e, _ in ref}):
        media = []
        for h in prompt:
            held = frozenset(m for hh, e, m in ref if hh == h and e == engine)
            if not held:
                break
            media.append(held)
        if media:
            out[engine] = tuple(media)
    return out


def _match_and_touch(idx: InMemoryPrefixIndex, ref: dict[tuple[int, str, str], None], prompt: list[int],
                     epochs: dict[str, int]) -> None:
    """Checks one `match` against the reference and touches the reference's matched entries
    block by block, in the index's slot order within a block."""
    expected = _reference_match(ref, prompt)
    got = idx.match(prompt)
    assert {e: m.media for e, m in got.items()} == expected
    assert all(m.num_blocks == len(m.media) and m.epoch == epochs[e] for e, m in got.items())
    slot = idx._slots  # the order of touches within a block
    for i, h in enumerate(prompt):
        for key in sorted((k for k in ref if k[0] == h and k[1] in expected and i < len(expected[k[1]])),
                          key=lambda k: slot[(k[1], k[2])]):
            ref.move_to_end(key)  # type: ignore[attr-defined]


@given(_match_ops, st.integers(1, 12))
@settings(max_examples=200, deadline=None)
def test_match_equals_a_reference_after_random_histories(ops: list[tuple[str, str, str, list[int]]],
                                                         bound: int) -> None:
    """After any history of stores, removals, clears, new epochs and dropped engines, `match`
    gives each engine's longest run of held blocks with their media and live epoch, and touches
    the matched entries block by block, in slot order within a block (the reference reads the
    slots from the index), so the LRU order and every later eviction stay those of the
    reference. Cost: about 2 s."""
    idx, ref = InMemoryPrefixIndex(max_entries=bound), OrderedDict[tuple[int, str, str], None]()
    epochs = {"a": 1, "b": 1, "c": 1}
    for op, engine, medium, hashes in ops:
        if op == "match":  # the prompt and each of its suffixes in turn
            for prompt in [hashes[i:] for i in range(len(hashes))]:
                _match_and_touch(idx, ref, prompt, epochs)
        else:
            _apply_to_both(idx, ref, op, engine, medium, hashes, epochs, bound)
        assert list(idx.entries()) == list(ref)
