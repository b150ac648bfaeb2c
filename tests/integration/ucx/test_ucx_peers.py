"""UCX data plane with several peers: processes killed in the middle of real transfers, and TP 2."""

from __future__ import annotations

import random
import signal
import time

from ucx_rank_proc import RankProc

from connectors.aggregator import KVOutputAggregator
from connectors.outputs import KVConnectorOutput

WAIT_S = 20.0
# 256 KiB blocks so a pull of a few hundred blocks is still moving when the kill lands.
BIG = {"num_layers": 16, "head_dim": 64, "block_size": 16, "num_blocks": 512}


def descriptor(p: RankProc, request_id: str, block_ids: list[int]) -> dict[str, object]:
    return {"engine_id": p.spec["engine_id"], "epoch": p.spec["epoch"], "request_id": request_id,
            "block_ids": tuple(block_ids), "num_tokens": 16 * len(block_ids), "tp_size": p.spec["tp_size"],
            "block_size": p.spec["block_size"], "num_kv_heads": p.spec["num_kv_heads"]}


def test_prefill_killed_mid_transfer_reports_exactly_the_missing_blocks() -> None:
    decode = RankProc("decode-k", 1, timeout_s=1.5, **BIG)
    doomed = RankProc("prefill-k", 2, seed=3, **BIG)
    twin = RankProc("prefill-twin", 3, seed=3, **BIG)  # same bytes as doomed, stays alive
    try:
        decode.call("add_peer", doomed.call("meta"))
        decode.call("add_peer", twin.call("meta"))
        rng = random.Random(5)
        remote = rng.sample(range(512), 400)
        local = rng.sample(range(512), 400)
        doomed.call("expect_send", "victim", remote)
        decode.call("zero", local)
        decode.call("start_pull", "victim", descriptor(doomed, "victim", remote), local)
        time.sleep(0.003)
        doomed.signal(signal.SIGKILL)
        got = decode.call("wait_results", ["victim"], WAIT_S)
        assert got["finished_recving"] + got["failed_recving"] == ["victim"]
        invalid = set(decode.call("invalid"))
        if got["failed_recving"]:
            assert got["reasons"] == {"victim": "timeout"}
            assert invalid and invalid <= set(local)
        expected = twin.call("digests", remote)
        actual = decode.call("digests", local)
        for block, want, have in zip(local, expected, actual, strict=True):
            assert block in invalid or want == have, f"block {block} reported valid but differs"
        # the decode rank survived the dead peer and serves the next request from a live one
        twin.call("expect_send", "next", remote[:50])
        decode.call("zero", local[:50])
        decode.call("start_pull", "next", descriptor(twin, "next", remote[:50]), local[:50])
        assert decode.call("wait_results", ["next"], WAIT_S)["finished_recving"] == ["next"]
        assert decode.call("digests", local[:50]) == expected[:50]
        assert twin.call("wait_results", ["next"], WAIT_S)["finished_sending"] == ["next"]
    finally:
        for p in (decode, doomed, twin):
            p.close()


def test_decode_killed_mid_transfer_frees_prefill_blocks_and_prefill_keeps_serving() -> None:
    prefill = RankProc("prefill-s", 4, seed=8, lease_s=2.0, **BIG)
    doomed = RankProc("decode-doomed", 5, **BIG)
    other = RankProc("decode-other", 6, **BIG)
    try:
        meta = prefill.call("meta")
        doomed.call("add_peer", meta)
        other.call("add_peer", meta)
        remote = list(range(0, 500))
        prefill.call("expect_send", "orphaned", remote)
        doomed.call("start_pull", "orphaned", descriptor(prefill, "orphaned", remote), list(range(500)))
        time.sleep(0.003)
        doomed.signal(signal.SIGKILL)
        # the reader never says done: the prefill rank releases the request within the lease
        assert prefill.call("wait_results", ["orphaned"], WAIT_S)["finished_sending"] == ["orphaned"]
        assert prefill.call("pending") == 0
        prefill.call("expect_send", "fresh", [7, 9, 11])
        other.call("start_pull", "fresh", descriptor(prefill, "fresh", [7, 9, 11]), [1, 2, 3])
        assert other.call("wait_results", ["fresh"], WAIT_S)["finished_recving"] == ["fresh"]
        assert other.call("digests", [1, 2, 3]) == prefill.call("digests", [7, 9, 11])
    finally:
        for p in (prefill, doomed, other):
            p.close()


def test_tp2_each_decode_rank_pulls_only_its_heads_and_the_request_completes_once() -> None:
    common = {"tp_size": 2, "num_kv_heads": 4}
    prefills = [RankProc("prefill-tp", 7, tp_rank=r, seed=10 + r, **common) for r in range(2)]
    decodes = [RankProc("decode-tp", 8, tp_rank=r, **common) for r in range(2)]
    try:
        metas = [p.call("meta") for p in prefills]
        for d in decodes:
            for meta in metas:  # the scheduler hands every decode rank every prefill rank
                d.call("add_peer", meta)
        remote, local = [3, 4, 5, 90, 17], [100, 101, 102, 7, 8]
        for p in prefills:
            p.call("expect_send", "tp-req", remote)
        for d in decodes:
            d.call("start_pull", "tp-req", descriptor(prefills[0], "tp-req", remote), local)
        aggregator = KVOutputAggregator()
        aggregator.register_engine("decode-tp", 8, [0, 1])
        aggregator.register_engine("prefill-tp", 7, [0, 1])
        released: list[str] = []
        for r, d in enumerate(decodes):
            got = d.call("wait_results", ["tp-req"], WAIT_S)
            assert got["finished_recving"] == ["tp-req"] and got["duplicates"] == []
            out = KVConnectorOutput(finished_recving=frozenset(got["finished_recving"]))
            released += aggregator.add_report("decode-tp", 8, r, out).finished_recving
            released += aggregator.add_report("decode-tp", 8, r, out).finished_recving  # a repeat
            assert released == (["tp-req"] if r == 1 else []), "complete only once every rank reported"
        for r, p in enumerate(prefills):
            got = p.call("wait_results", ["tp-req"], WAIT_S)
            assert got["finished_sending"] == ["tp-req"] and got["duplicates"] == []
            out = KVConnectorOutput(finished_sending=frozenset(got["finished_sending"]))
            released += aggregator.add_report("prefill-tp", 7, r, out).finished_sending
        assert released == ["tp-req", "tp-req"]  # received once, sent once
        rank_bytes = [p.call("digests", remote) for p in prefills]
        assert rank_bytes[0] != rank_bytes[1]  # the ranks hold different heads
        for r, d in enumerate(decodes):
            assert d.call("digests", local) == rank_bytes[r]
            (row,) = d.call("stats")["pairs"]
            assert row["num_blocks"] == len(remote)
            assert row["num_bytes"] == len(remote) * 2 * 2 * 2 * 4 * 8 * 4  # 2 of the 4 heads per rank
        for d in decodes:
            assert d.call("pending") == 0
    finally:
        for p in (*prefills, *decodes):
            p.close()
