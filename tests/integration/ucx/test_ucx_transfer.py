"""The UCX KV data plane between real processes with real KV tensors, over loopback UCX."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from ucx_rank_proc import RankProc

TIMEOUT_S = 1.5  # the decode ranks' transfer timeout
WAIT_S = 20.0  # how long a test waits for a result before calling it a hang
BLOCK_NBYTES = 2 * 2 * 2 * 4 * 8 * 4  # layers x K/V x heads x block_size x head_dim x fp32


def descriptor(p: RankProc, request_id: str, block_ids: list[int], **over: Any) -> dict[str, Any]:
    d = {"engine_id": p.spec["engine_id"], "epoch": p.spec["epoch"], "request_id": request_id,
         "block_ids": tuple(block_ids), "num_tokens": 4 * len(block_ids), "tp_size": p.spec["tp_size"],
         "block_size": 4, "num_kv_heads": p.spec["num_kv_heads"]}
    return {**d, **over}


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[RankProc, RankProc]]:
    prefill = RankProc("prefill-0", 1001, seed=7)
    decode = RankProc("decode-0", 2002, timeout_s=TIMEOUT_S, max_inflight=16)
    try:
        decode.call("add_peer", prefill.call("meta"))
        yield prefill, decode
    finally:
        decode.close()
        prefill.close()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "pair" in request.fixturenames:
        prefill, decode = request.getfixturevalue("pair")
        assert prefill.call("pending") == 0, "prefill rank still pins requests"
        assert decode.call("pending") == 0, "decode rank still has pulls"


def pull_and_check(prefill: RankProc, decode: RankProc, jobs: dict[str, tuple[list[int], list[int]]]) -> None:
    """Pins, pulls and verifies byte for byte: jobs = request id -> (remote ids, local ids)."""
    for _, local in jobs.values():
        decode.call("zero", local)
    for rid, (remote, _) in jobs.items():
        prefill.call("expect_send", rid, remote)
    for rid, (remote, local) in jobs.items():
        decode.call("start_pull", rid, descriptor(prefill, rid, remote), local)
    got = decode.call("wait_results", list(jobs), WAIT_S)
    assert got["failed_recving"] == [] and got["reasons"] == {}
    assert got["finished_recving"] == sorted(jobs)
    assert got["duplicates"] == []
    sent = prefill.call("wait_results", list(jobs), WAIT_S)
    assert sent["finished_sending"] == sorted(jobs)
    for rid, (remote, local) in jobs.items():
        assert decode.call("digests", local) == prefill.call("digests", remote), rid


def test_random_non_contiguous_block_lists_arrive_byte_exact(pair: tuple[RankProc, RankProc]) -> None:
    prefill, decode = pair
    rng = random.Random(1)
    sizes = [1, 2, 3, 5, 8, 13, 32, 64, 100]
    local_pool = rng.sample(range(256), sum(sizes))
    jobs = {}
    for i, n in enumerate(sizes):
        remote = rng.sample(range(256), n)
        if i % 3 == 0:  # some runs contiguous on both sides, to exercise coalescing
            start = rng.randrange(0, 256 - n)
            remote = list(range(start, start + n))
        jobs[f"rand-{n}"] = (remote, local_pool[:n])
        local_pool = local_pool[n:]
    pull_and_check(prefill, decode, jobs)
    stats = decode.call("stats")
    (row,) = stats["pairs"]
    assert (row["src_engine_id"], row["dst_engine_id"]) == ("prefill-0", "decode-0")
    assert row["num_operations"] == len(sizes) and row["num_blocks"] == sum(sizes)
    assert row["num_bytes"] == sum(sizes) * BLOCK_NBYTES and not row["failures_by_reason"]


def test_64_concurrent_requests(pair: tuple[RankProc, RankProc]) -> None:
    prefill, decode = pair
    rng = random.Random(2)
    local_pool = rng.sample(range(256), 256)
    jobs = {}
    for i in range(64):
        remote = rng.sample(range(256), 4)
        jobs[f"conc-{i}"] = (remote, local_pool[4 * i:4 * i + 4])
    pull_and_check(prefill, decode, jobs)


def test_cached_local_prefix_pulls_only_the_rest(pair: tuple[RankProc, RankProc]) -> None:
    prefill, decode = pair
    remote = [40, 41, 42, 43, 90, 91, 92, 93]
    local = [200, 201, 150]  # the first 5 blocks are cached locally
    bystanders = [10, 11, 12]
    decode.call("zero", local)
    before = decode.call("digests", bystanders)
    decode.call("stats")
    prefill.call("expect_send", "prefix", remote)
    decode.call("start_pull", "prefix", descriptor(prefill, "prefix", remote), local)
    assert decode.call("wait_results", ["prefix"], WAIT_S)["finished_recving"] == ["prefix"]
    assert prefill.call("wait_results", ["prefix"], WAIT_S)["finished_sending"] == ["prefix"]
    assert decode.call("digests", local) == prefill.call("digests", remote[-3:])
    assert decode.call("digests", bystanders) == before
    (row,) = decode.call("stats")["pairs"]
    assert row["num_blocks"] == 3 and row["num_bytes"] == 3 * BLOCK_NBYTES


def test_bad_descriptors_are_refused_without_touching_memory(pair: tuple[RankProc, RankProc]) -> None:
    prefill, decode = pair
    local = [60, 61, 62]
    decode.call("zero", local)
    untouched = decode.call("digests", local)
    prefill.call("expect_send", "pinned", [1, 2, 3])
    cases = {
        "stale": (descriptor(prefill, "pinned", [1, 2, 3], epoch=999), "stale_epoch"),
        "range": (descriptor(prefill, "pinned", [1, 2, 100_000]), "out_of_range"),
        "unpinned": (descriptor(prefill, "pinned", [7, 8, 9]), "refused:not_pinned"),
        "unknown": (descriptor(prefill, "never-pinned", [1, 2, 3]), "refused:unknown_request"),
        "engine": (descriptor(prefill, "pinned", [1, 2, 3], engine_id="nobody"), "peer_unknown"),
    }
    for rid, (desc, _) in cases.items():
        decode.call("start_pull", rid, desc, local)
    got = decode.call("wait_results", list(cases), WAIT_S)
    assert got["failed_recving"] == sorted(cases) and got["finished_recving"] == []
    assert got["reasons"] == {rid: reason for rid, (_, reason) in cases.items()}
    assert decode.call("invalid") == local
    assert decode.call("digests", local) == untouched
    refusals = {r: n for row in prefill.call("stats")["pairs"] for r, n in row["failures_by_reason"].items()}
    assert refusals == {"refused:not_pinned": 1, "refused:unknown_request": 1}
    # The refused pulls left the pinned request alone: a correct pull still works.
    decode.call("start_pull", "pinned", descriptor(prefill, "pinned", [1, 2, 3]), local)
    assert decode.call("wait_results", ["pinned"], WAIT_S)["finished_recving"] == ["pinned"]
    assert prefill.call("wait_results", ["pinned"], WAIT_S)["finished_sending"] == ["pinned"]
    assert decode.call("digests", local) == prefill.call("digests", [1, 2, 3])
    decode.call("stats")


def test_caller_errors_raise_and_change_nothing(pair: tuple[RankProc, RankProc]) -> None:
    prefill, decode = pair
    with pytest.raises(RuntimeError, match="ValueError"):
        decode.call("start_pull", "dup-local", descriptor(prefill, "x", [1, 2]), [5, 5])
    with pytest.raises(RuntimeError, match="ValueError"):
        decode.call("start_pull", "too-many", descriptor(prefill, "x", [1]), [5, 6])
    with pytest.raises(RuntimeError, match="ValueError"):
        prefill.call("expect_send", "bad-range", [0, 256])
    assert decode.call("wait_results", ["dup-local", "too-many"], 0.05)["failed_recving"] == []


def test_lease_expires_without_reader(pair: tuple[RankProc, RankProc]) -> None:
    prefill, decode = pair
    prefill.call("stats")
    prefill.call("expect_send", "orphan", [5, 6], 0.2)
    got = prefill.call("wait_results", ["orphan"], WAIT_S)
    assert got["finished_sending"] == ["orphan"]
    assert prefill.call("stats")["lease_expiries"] == 1
    decode.call("start_pull", "orphan", descriptor(prefill, "orphan", [5, 6]), [7, 8])
    assert decode.call("wait_results", ["orphan"], WAIT_S)["reasons"] == {"orphan": "refused:unknown_request"}
    assert decode.call("invalid") == [7, 8]


def test_killed_prefill_fails_within_timeout_and_next_request_succeeds(pair: tuple[RankProc, RankProc]) -> None:
    live, decode = pair
    doomed = RankProc("prefill-doomed", 3003, seed=9)
    try:
        meta = doomed.call("meta")
        decode.call("add_peer", meta)
        doomed.call("expect_send", "gone", [1, 2, 3, 10, 11])
        doomed.call("expect_send", "dead", [4, 5, 6, 20, 21])
        local = [30, 31, 32, 33, 34]
        # a peer killed while a pull is in flight: the pull fails by timeout, all blocks invalid
        doomed.signal(signal.SIGSTOP)
        decode.call("start_pull", "dead", descriptor(doomed, "dead", [4, 5, 6, 20, 21]), local)
        time.sleep(0.1)
        doomed.signal(signal.SIGKILL)
        got = decode.call("wait_results", ["dead"], WAIT_S)
        assert got["failed_recving"] == ["dead"] and got["reasons"] == {"dead": "timeout"}
        assert got["elapsed"] < WAIT_S
        assert decode.call("invalid") == local
        # remove_peer (the scheduler saw the epoch die) fails an in-flight pull at once
        decode.call("start_pull", "gone", descriptor(doomed, "gone", [1, 2, 3, 10, 11]), local)
        decode.call("remove_peer", "prefill-doomed", 3003)
        got = decode.call("wait_results", ["gone"], WAIT_S)
        assert got["reasons"] == {"gone": "peer_gone"} and decode.call("invalid") == local
        decode.call("remove_peer", "prefill-doomed", None)
        rows = {r["src_engine_id"]: r for r in decode.call("stats")["pairs"]}
        assert rows["prefill-doomed"]["failures_by_reason"] == {"peer_gone": 1, "timeout": 1}
    finally:
        doomed.proc.kill()
        doomed.proc.join()
    # the connector stays usable: the next request to a live peer succeeds
    pull_and_check(live, decode, {"after-kill": ([9, 8, 7], [30, 31, 32])})
