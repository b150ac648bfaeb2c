"""KV pulls between engines of different TP sizes: real rank processes, real UCX, real tensors.

Every rank's KV tensor is random with its own seed, so a decode head that arrived from the wrong
prefill rank, the wrong head or the wrong layer slab shows up in the per-head digests. About
15 s for the module (six rank processes at most at once).
"""

from __future__ import annotations

import random
import signal
from typing import Any

import pytest
from ucx_rank_proc import RankProc

from connectors.head_map import read_plan, readers_of
from connectors.ucx.nixl_transport import nixl_importable

TIMEOUT_S = 1.5
WAIT_S = 20.0


class Engines:
    """A prefill engine of P rank processes and a decode engine of D, connected as the
    services connect them (each decode rank to the prefill ranks it reads)."""

    def __init__(self, p: int, d: int, heads: int, tag: str, transport: str = "ucx-tag", pool: int = 0) -> None:
        self.p, self.d, self.heads = p, d, heads
        staging = {"kv_staging": "host", "kv_staging_blocks": pool} if pool else {}
        self.prefill = [RankProc(f"prefill-{tag}", 11, tp_rank=r, tp_size=p, num_kv_heads=heads, seed=100 + r,
                                 kv_transport=transport, **staging) for r in range(p)]
        self.decode = [RankProc(f"decode-{tag}", 22, tp_rank=r, tp_size=d, num_kv_heads=heads,
                                timeout_s=TIMEOUT_S, kv_transport=transport, **staging) for r in range(d)]
        metas = [rank.call("meta") for rank in self.prefill]
        for r, rank in enumerate(self.decode):
            for read in read_plan(r, d, p, heads):
                rank.call("add_peer", metas[read.src_rank])

    def descriptor(self, rid: str, block_ids: list[int]) -> dict[str, Any]:
        spec = self.prefill[0].spec
        return {"engine_id": spec["engine_id"], "epoch": spec["epoch"], "request_id": rid,
                "block_ids": tuple(block_ids), "num_tokens": 4 * len(block_ids), "tp_size": self.p,
                "block_size": 4, "num_kv_heads": self.heads}

    def pin(self, rid: str, remote: list[int]) -> None:
        for r, rank in enumerate(self.prefill):
            rank.call("expect_send", rid, remote, None, readers_of(r, self.p, self.d, self.heads))

    def close(self) -> None:
        for rank in self.decode + self.prefill:
            rank.close()


def check_heads(engines: Engines, jobs: dict[str, tuple[list[int], list[int]]]) -> None:
    """Every decode head of every job's local blocks equals the head of the prefill rank the
    read plan names, block for block."""
    for r, rank in enumerate(engines.decode):
        for rid, (remote, local) in jobs.items():
            got = rank.call("head_digests", local)
            for read in read_plan(r, engines.d, engines.p, engines.heads):
                want = engines.prefill[read.src_rank].call("head_digests", remote)
                for head in range(read.head_start, read.head_end):
                    assert got[head] == want[head], (rid, r, head)


NEEDS_NIXL = pytest.mark.skipif(not nixl_importable(), reason="nixl-cu12 not installed")
NIXL = pytest.param("nixl", marks=NEEDS_NIXL)


@pytest.mark.parametrize(("p", "d", "heads", "transport", "pool"), [
    (2, 1, 2, "ucx-tag", 0), (1, 2, 2, "ucx-tag", 0), (2, 1, 1, "ucx-tag", 0), (1, 2, 1, "ucx-tag", 0),
    (4, 2, 2, "ucx-tag", 0),
    # Host staging through 4-slot pools: the 7- and 13-block reads are chunk pulls of 2 blocks
    # (head ranges), both decode ranks read the one prefill rank, which stages them per pull.
    (1, 2, 2, "ucx-tag", 4),
    pytest.param(2, 1, 2, "nixl", 0, marks=NEEDS_NIXL), pytest.param(1, 2, 1, "nixl", 0, marks=NEEDS_NIXL)])
def test_heads_split_or_gathered_arrive_byte_exact(p: int, d: int, heads: int, transport: str, pool: int) -> None:
    engines = Engines(p, d, heads, f"{p}{d}{heads}{transport}{pool}", transport, pool)
    try:
        rng = random.Random(p * 10 + d)
        jobs = {}
        pool = rng.sample(range(256), 40)
        for i, n in enumerate([1, 3, 7, 13]):
            remote = list(range(50, 50 + n)) if i % 2 else rng.sample(range(256), n)
            jobs[f"r{i}"] = (remote, pool[:n])
            pool = pool[n:]
        for rid, (remote, _) in jobs.items():
            engines.pin(rid, remote)
        for rank in engines.decode:
            for rid, (remote, local) in jobs.items():
                rank.call("start_pull", rid, engines.descriptor(rid, remote), local)
        for rank in engines.decode:
            got = rank.call("wait_results", list(jobs), WAIT_S)
            assert got["finished_recving"] == sorted(jobs) and got["failed_recving"] == []
            assert got["duplicates"] == []
        for r, rank in enumerate(engines.prefill):
            sent = rank.call("wait_results", list(jobs), WAIT_S)
            assert sent["finished_sending"] == sorted(jobs), f"prefill rank {r} did not release"
            assert rank.call("pending") == 0
        check_heads(engines, jobs)
        stats = [rank.call("stats") for rank in engines.decode]
        blocks = sum(len(local) for _, local in jobs.values())
        for s in stats:
            (row,) = s["pairs"]
            assert row["num_blocks"] == blocks and row["failures_by_reason"] == {}
    finally:
        engines.close()


@pytest.mark.parametrize("transport", ["ucx-tag", NIXL])
def test_a_dead_prefill_rank_fails_exactly_the_blocks_it_owed(transport: str) -> None:
    engines = Engines(2, 1, 2, f"kill-{transport}", transport)
    try:
        (decode,) = engines.decode
        whole, broken = ([1, 2, 3], [10, 11, 12]), ([20, 21, 22, 23], [30, 31, 32, 33])
        engines.pin("whole", whole[0])
        decode.call("start_pull", "whole", engines.descriptor("whole", whole[0]), whole[1])
        assert decode.call("wait_results", ["whole"], WAIT_S)["finished_recving"] == ["whole"]
        check_heads(engines, {"whole": whole})
        head1 = engines.prefill[1].call("head_digests", whole[0])[1]
        engines.pin("broken", broken[0])
        engines.prefill[1].signal(signal.SIGKILL)
        decode.call("start_pull", "broken", engines.descriptor("broken", broken[0]), broken[1])
        got = decode.call("wait_results", ["broken"], WAIT_S)
        # The tag transport waits out its timeout; NIXL refuses the READ to a dead agent at once.
        assert got["failed_recving"] == ["broken"]
        assert got["reasons"]["broken"] == {"ucx-tag": "timeout", "nixl": "peer_gone"}[transport]
        # Head 1 of every block of "broken" never arrived: exactly those blocks are invalid.
        assert decode.call("invalid") == broken[1]
        # The live rank's reader finished (with a failure): it released its pin.
        assert engines.prefill[0].call("wait_results", ["broken"], WAIT_S)["finished_sending"] == ["broken"]
        assert decode.call("head_digests", whole[1])[1] == head1  # earlier blocks untouched
        assert decode.call("pending") == 0
    finally:
        engines.close()


@NEEDS_NIXL
def test_ranks_on_different_kv_transports_refuse_to_pair_with_the_reason() -> None:
    nixl = RankProc("decode-mixed", 22, kv_transport="nixl")
    tag = RankProc("prefill-mixed", 11, seed=5)
    try:
        with pytest.raises(RuntimeError, match="peer moves KV with --kv-transport ucx-tag, this engine with nixl"):
            nixl.call("add_peer", tag.call("meta"))
        with pytest.raises(RuntimeError, match="peer moves KV with --kv-transport nixl, this engine with ucx-tag"):
            tag.call("add_peer", nixl.call("meta"))
    finally:
        nixl.close()
        tag.close()
