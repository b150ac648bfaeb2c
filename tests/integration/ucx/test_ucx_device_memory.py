"""KV in GPU memory over the UCX data plane, and the explicit host bounce (`kv_staging="host"`).

The host-staging tests run everywhere (a CPU tensor stands in for the device: the same bounded
pool, stager thread, copies and ordering; only the side CUDA stream is not exercised). The
staged pair's pools are smaller than the cache and than what the test moves at once (decode:
48 slots for 68 blocks pulled together), so pulls wait for slots and runs are reused. The CUDA
tests need a GPU and are skipped with the reason otherwise; `make gpu-check` runs them on a GPU
machine (bench/gpu_check.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ucx_rank_proc import RankProc

WAIT_S = 20.0
BLOCK_NBYTES = 2 * 2 * 2 * 4 * 8 * 4  # layers x K/V x heads x block_size x head_dim x fp32
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="no CUDA device here: the UCX connector's CUDA branch runs where a GPU is visible "
                                    "(make gpu-check)")


def _descriptor(p: RankProc, request_id: str, block_ids: list[int]) -> dict[str, Any]:
    return {"engine_id": p.spec["engine_id"], "epoch": p.spec["epoch"], "request_id": request_id,
            "block_ids": tuple(block_ids), "num_tokens": 4 * len(block_ids), "tp_size": p.spec["tp_size"],
            "block_size": 4, "num_kv_heads": p.spec["num_kv_heads"]}


def _pull_random_lists(prefill: RankProc, decode: RankProc, seed: int) -> int:
    """Pins and pulls random (partly contiguous) block lists; checks them byte for byte and
    that nothing else changed. Returns the blocks moved."""
    rng = random.Random(seed)
    sizes = [1, 3, 8, 16, 40]
    local_pool = rng.sample(range(256), sum(sizes))
    jobs: dict[str, tuple[list[int], list[int]]] = {}
    for i, n in enumerate(sizes):
        start = rng.randrange(0, 256 - n)
        remote = list(range(start, start + n)) if i % 2 else rng.sample(range(256), n)
        jobs[f"r{seed}-{n}"] = (remote, local_pool[:n])
        local_pool = local_pool[n:]
    untouched = local_pool[:8]
    before = decode.call("digests", untouched)
    for _, local in jobs.values():
        decode.call("zero", local)
    for rid, (remote, _) in jobs.items():
        prefill.call("expect_send", rid, remote)
    for rid, (remote, local) in jobs.items():
        decode.call("start_pull", rid, _descriptor(prefill, rid, remote), local)
    got = decode.call("wait_results", list(jobs), WAIT_S)
    assert got["failed_recving"] == [] and got["finished_recving"] == sorted(jobs), got
    assert prefill.call("wait_results", list(jobs), WAIT_S)["finished_sending"] == sorted(jobs)
    for rid, (remote, local) in jobs.items():
        assert decode.call("digests", local) == prefill.call("digests", remote), rid
    assert decode.call("digests", untouched) == before
    assert prefill.call("pending") == 0 and decode.call("pending") == 0
    return sum(sizes)


PREFILL_POOL, DECODE_POOL = 96, 48  # blocks of the staged pair's pools (the caches hold 256)


def _pair(device: str, kv_staging: str) -> Iterator[tuple[RankProc, RankProc]]:
    pools = (PREFILL_POOL, DECODE_POOL) if kv_staging == "host" else (0, 0)
    prefill = RankProc("prefill-0", 11, seed=5, device=device, kv_staging=kv_staging, kv_staging_blocks=pools[0])
    decode = RankProc("decode-0", 22, device=device, kv_staging=kv_staging, kv_staging_blocks=pools[1])
    try:
        decode.call("add_peer", prefill.call("meta"))
        yield prefill, decode
    finally:
        decode.close()
        prefill.close()


@pytest.fixture(scope="module")
def staged_pair() -> Iterator[tuple[RankProc, RankProc]]:
    yield from _pair("cpu", "host")


def test_host_staging_moves_blocks_byte_exact_and_is_measured(staged_pair: tuple[RankProc, RankProc]) -> None:
    prefill, decode = staged_pair
    prefill.call("staging"), decode.call("staging")  # start from empty series
    num_blocks = _pull_random_lists(prefill, decode, seed=1)
    # Host staging is the host mirror: the region UCX sees is host memory, labelled so.
    assert decode.call("region_memory_type") == "cpu"
    staged_in = decode.call("staging")
    assert staged_in["host_staged_bytes"] == num_blocks * BLOCK_NBYTES
    assert staged_in["host_staging_duration"] > 0
    assert prefill.call("staging")["host_staged_bytes"] == num_blocks * BLOCK_NBYTES  # copied out before pinning
    # Only the pools are registered (and reported as the mirror), and every slot came back;
    # the decode pool was full at some point: the 68 blocks queued for its 48 slots.
    assert tuple(prefill.call("registered_bytes")) == (PREFILL_POOL * BLOCK_NBYTES,) * 2
    assert tuple(decode.call("registered_bytes")) == (DECODE_POOL * BLOCK_NBYTES,) * 2
    assert tuple(prefill.call("staging_slots"))[:2] == (0, PREFILL_POOL)
    used, slots, peak = decode.call("staging_slots")
    assert (used, slots) == (0, DECODE_POOL) and 40 <= peak <= DECODE_POOL


def test_a_full_staging_pool_refuses_to_pin_and_a_pull_larger_than_the_pool_fails_with_the_reason(
        staged_pair: tuple[RankProc, RankProc]) -> None:
    prefill, decode = staged_pair
    prefill.call("expect_send", "big", list(range(90)))  # 90 of the 96 slots
    with pytest.raises(RuntimeError, match="staging pool is full .*90 of 96"):
        prefill.call("expect_send", "more", list(range(100, 110)))
    with pytest.raises(RuntimeError, match="do not fit the KV staging pool of 96"):
        prefill.call("expect_send", "huge", list(range(97)))
    assert prefill.call("staging_slots")[0] == 90  # the refusals took nothing
    prefill.call("cancel", "big")
    assert prefill.call("staging_slots")[0] == 0
    too_big = list(range(DECODE_POOL + 1))
    prefill.call("expect_send", "wide", too_big)
    decode.call("start_pull", "wide", _descriptor(prefill, "wide", too_big), too_big)
    got = decode.call("wait_results", ["wide"], WAIT_S)
    assert got["failed_recving"] == ["wide"] and got["reasons"] == {"wide": "staging_pool_too_small"}
    assert sorted(decode.call("invalid")) == too_big
    prefill.call("cancel", "wide")
    assert decode.call("staging_slots")[0] == 0 == prefill.call("staging_slots")[0]
    assert prefill.call("pending") == 0 and decode.call("pending") == 0


@NO_CUDA
def test_gpu_kv_moves_between_processes_byte_exact() -> None:
    for prefill, decode in _pair("cuda", "none"):
        assert decode.call("region_memory_type") == "cuda" == prefill.call("region_memory_type")
        _pull_random_lists(prefill, decode, seed=2)
        assert decode.call("staging") == {}  # no host bounce on the direct path


@NO_CUDA
def test_gpu_kv_with_explicit_host_staging() -> None:
    for prefill, decode in _pair("cuda", "host"):
        num_blocks = _pull_random_lists(prefill, decode, seed=3)
        assert decode.call("staging")["host_staged_bytes"] == num_blocks * BLOCK_NBYTES
