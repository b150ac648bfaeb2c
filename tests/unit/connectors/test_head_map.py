"""KV-head partitions and read plans across TP sizes (pure; well under a second)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.head_map import (
    mapping_problem,
    num_local_heads,
    partition_problem,
    rank_heads,
    ranks_read,
    read_plan,
    readers_of,
    source_ranks,
)


def test_split_and_replicated_partitions() -> None:
    assert [rank_heads(r, 2, 4) for r in range(2)] == [(0, 2), (2, 4)]
    assert [rank_heads(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [rank_heads(r, 2, 1) for r in range(2)] == [(0, 1), (0, 1)]  # MQA: replicated
    assert num_local_heads(4, 8) == 2 and num_local_heads(4, 1) == 1


def test_unpartitionable_layouts_are_refused_with_a_reason() -> None:
    assert partition_problem(6, 4) == "tp=4 does not divide num_key_value_heads=6"
    assert "does not divide tp=6" in (partition_problem(4, 6) or "")
    assert (mapping_problem(3, 1, 6) or "").startswith("prefill tp=3") is False  # 6 % 3 == 0: fine
    assert mapping_problem(1, 4, 6) == "decode tp=4 does not divide num_key_value_heads=6"
    with pytest.raises(ValueError, match="does not divide"):
        read_plan(0, 4, 1, 6)
    with pytest.raises(ValueError, match=r"rank 2 not in \[0, 2\)"):
        rank_heads(2, 2, 4)


def test_gather_two_prefill_ranks_into_one_decode_rank() -> None:
    plan = read_plan(0, 1, 2, 2)
    assert [(r.src_rank, r.head_start, r.head_end, r.src_offset, r.dst_offset) for r in plan] == [
        (0, 0, 1, 0, 0), (1, 1, 2, 0, 1)]
    assert readers_of(0, 2, 1, 2) == readers_of(1, 2, 1, 2) == 1


def test_split_one_prefill_rank_over_two_decode_ranks() -> None:
    assert [(r.src_rank, r.src_offset, r.dst_offset, r.num_heads) for r in read_plan(1, 2, 1, 2)] == [(0, 1, 0, 1)]
    assert readers_of(0, 1, 2, 2) == 2


def test_mqa_replicas_spread_reads_and_unread_ranks_have_no_readers() -> None:
    assert source_ranks(0, 1, 2, 1) == {0}
    assert readers_of(1, 2, 1, 1) == 0  # prefill rank 1's copy of the head is never read
    assert [source_ranks(d, 2, 2, 1) for d in range(2)] == [{0}, {1}]  # equal TP: own rank
    assert ranks_read(4, 2, 1) == {0, 1}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_every_decode_head_is_read_exactly_once_from_a_holder(heads: int, p: int, d: int) -> None:
    if mapping_problem(p, d, heads) is not None:
        return
    total_readers = 0
    for rank in range(d):
        start, end = rank_heads(rank, d, heads)
        covered: list[int] = []
        for read in read_plan(rank, d, p, heads):
            src_start, src_end = rank_heads(read.src_rank, p, heads)
            assert src_start <= read.head_start < read.head_end <= src_end
            assert read.src_offset == read.head_start - src_start and read.dst_offset == read.head_start - start
            covered += range(read.head_start, read.head_end)
        assert covered == list(range(start, end))
        total_readers += len(source_ranks(rank, d, p, heads))
    assert sum(readers_of(r, p, d, heads) for r in range(p)) == total_readers


def test_tp_over_the_supported_size_is_a_problem_not_a_long_loop() -> None:
    from connectors.head_map import MAX_TP_SIZE, mapping_problem, partition_problem

    assert partition_problem(3, MAX_TP_SIZE + 1) is not None
    assert "largest supported" in (mapping_problem(1, 2**32 - 1, 3) or "")
    assert partition_problem(1, MAX_TP_SIZE) is None
