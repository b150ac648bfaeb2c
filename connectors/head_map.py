"""KV-head partitions under tensor parallelism, and how a decode rank reads its heads.

Pure functions, no torch, no I/O. The partition of `num_kv_heads` (H) KV heads over `tp` ranks
(T) is the one the model shards with:

- H >= T (T divides H): rank r holds heads [r*H/T, (r+1)*H/T);
- H < T (H divides T, e.g. MQA): each head is replicated on T/H consecutive ranks; rank r holds
  the single head r // (T/H).

A decode engine of tp D reads a prompt's KV from a prefill engine of tp P when both partitions
exist for H (`mapping_problem` is None). Decode rank d then reads, for each piece of its own
head range, from exactly one prefill rank holding it (`read_plan`); among replicas it picks the
one whose replica index matches d's, spreading the reads. `readers_of` is the inverse: how many
decode ranks read from a prefill rank (the prefill rank pins its blocks for that many readers;
zero means it is not read at all).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeadRead:
    """Decode rank reads heads [head_start, head_end) from prefill rank `src_rank`.

    `src_offset` is the first head's index within the source rank's local heads and
    `dst_offset` within the decode rank's local heads."""

    src_rank: int
    head_start: int
    head_end: int
    src_offset: int
    dst_offset: int

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


MAX_TP_SIZE = 1024  # ranks of one engine; the plans here are linear in tp


def partition_problem(num_kv_heads: int, tp: int) -> str | None:
    """Why `num_kv_heads` heads cannot be partitioned over `tp` ranks (None when they can)."""
    if num_kv_heads < 1 or tp < 1:
        return f"num_kv_heads ({num_kv_heads}) and tp ({tp}) must be >= 1"
    if tp > MAX_TP_SIZE:
        return f"tp={tp} is over the largest supported tensor-parallel size ({MAX_TP_SIZE})"
    if num_kv_heads >= tp and num_kv_heads % tp:
        return f"tp={tp} does not divide num_key_value_heads={num_kv_heads}"
    if num_kv_heads < tp and tp % num_kv_heads:
        return f"num_key_value_heads={num_kv_heads} does not divide tp={tp} (heads cannot be replicated evenly)"
    return None


def rank_heads(rank: int, tp: int, num_kv_heads: int) -> tuple[int, int]:
    """The KV heads [start, end) rank `rank` of a `tp`-rank engine holds. Raises ValueError
    for a rank outside [0, tp) or an impossible partition."""
    problem = partition_problem(num_kv_heads, tp)
    if problem is not None:
        raise ValueError(problem)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} not in [0, {tp})")
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // num_kv_heads)
    return head, head + 1


def num_local_heads(tp: int, num_kv_heads: int) -> int:
    """KV heads each rank holds (1 when heads are replicated)."""
    start, end = rank_heads(0, tp, num_kv_heads)
    return end - start


def mapping_problem(prefill_tp: int, decode_tp: int, num_kv_heads: int) -> str | None:
    """Why a decode engine of `decode_tp` cannot read KV from a prefill engine of `prefill_tp`
    (None when it can: both partitions exist, so every decode head is held by some prefill rank)."""
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        problem = partition_problem(num_kv_heads, tp)
        if problem is not None:
            return f"{role} {problem}"
    return None


def holders(head: int, tp: int, num_kv_heads: int) -> range:
    """The ranks of a `tp`-rank engine that hold `head`."""
    if num_kv_heads >= tp:
        rank = head // (num_kv_heads // tp)
        return range(rank, rank + 1)
    copies = tp // num_kv_heads
    return range(head * copies, (head + 1) * copies)


def read_plan(decode_rank: int, decode_tp: int, prefill_tp: int, num_kv_heads: int) -> tuple[HeadRead, ...]:
    """What decode rank `decode_rank` reads: one `HeadRead` per maximal head run held by one
    chosen prefill rank, in head order, covering the rank's heads exactly once. Raises
    ValueError when the layouts do not map."""
    problem = mapping_problem(prefill_tp, decode_tp, num_kv_heads)
    if problem is not None:
        raise ValueError(problem)
    start, end = rank_heads(decode_rank, decode_tp, num_kv_heads)
    reads: list[HeadRead] = []
    for head in range(start, end):
        candidates = holders(head, prefill_tp, num_kv_heads)
        # Among replicas, the one with decode_rank's replica index (spreads MQA reads).
        src = candidates[decode_rank % len(candidates)]
        src_start = rank_heads(src, prefill_tp, num_kv_heads)[0]
        last = reads[-1] if reads else None
        if last is not None and last.src_rank == src and last.head_end == head:
            reads[-1] = HeadRead(src, last.head_start, head + 1, last.src_offset, last.dst_offset)
        else:
            reads.append(HeadRead(src, head, head + 1, head - src_start, head - start))
    return tuple(reads)


def source_ranks(decode_rank: int, decode_tp: int, prefill_tp: int, num_kv_heads: int) -> frozenset[int]:
    """The prefill ranks decode rank `decode_rank` reads from."""
    return frozenset(r.src_rank for r in read_plan(decode_rank, decode_tp, prefill_tp, num_kv_heads))


def readers_of(prefill_rank: int, prefill_tp: int, decode_tp: int, num_kv_heads: int) -> int:
    """How many decode ranks read from prefill rank `prefill_rank` (0: it is not read)."""
    return sum(prefill_rank in source_ranks(d, decode_tp, prefill_tp, num_kv_heads) for d in range(decode_tp))


def ranks_read(prefill_tp: int, decode_tp: int, num_kv_heads: int) -> frozenset[int]:
    """The prefill ranks some decode rank reads from."""
    out: set[int] = set()
    for d in range(decode_tp):
        out |= source_ranks(d, decode_tp, prefill_tp, num_kv_heads)
    return frozenset(out)
