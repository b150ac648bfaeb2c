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
import signal
import time
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


def test_a_pull_of_three_pools_completes_byte_exact_through_both_pools_in_rounds(
        staged_pair: tuple[RankProc, RankProc]) -> None:
    """3x the decode pool (and 1.5x the prefill's), pinned and pulled while the prefill pool is
    nearly full: the prefill stages it per pull (its pulls wait in line for a run), the decode
    reads it in chunk pulls; every slot returns."""
    prefill, decode = staged_pair
    prefill.call("expect_send", "big", list(range(150, 240)))  # 90 of the 96 prefill slots, pinned
    assert prefill.call("staging_slots")[0] == 90
    remote = list(range(3 * DECODE_POOL))  # 144 blocks
    local = random.Random(7).sample(range(256), len(remote))
    decode.call("zero", local)
    prefill.call("expect_send", "wide", remote)  # larger than the pool: staged per pull
    assert prefill.call("staging_slots")[0] == 90
    decode.call("start_pull", "wide", _descriptor(prefill, "wide", remote), local)
    prefill.call("cancel", "big")  # frees the run the chunk pulls wait for at the prefill
    got = decode.call("wait_results", ["wide"], WAIT_S)
    assert got["finished_recving"] == ["wide"] and got["failed_recving"] == [], got
    assert prefill.call("wait_results", ["wide"], WAIT_S)["finished_sending"] == ["wide"]
    assert decode.call("digests", local) == prefill.call("digests", remote)
    assert decode.call("staging_slots")[0] == 0 == prefill.call("staging_slots")[0]
    assert decode.call("staging_slots")[2] <= DECODE_POOL
    assert prefill.call("pending") == 0 and decode.call("pending") == 0


def test_a_writer_killed_mid_chunked_pull_fails_it_with_exact_invalid_blocks_and_returns_every_slot(
        staged_pair: tuple[RankProc, RankProc]) -> None:
    """A writer with a 16-slot pool, each copy out of its KV slowed to 0.25 s, serves a 48-block
    pull in chunk pulls of 8; it is killed once the first chunk landed. The pull fails once:
    the blocks that landed are byte-exact, exactly the others are invalid (untouched), and every
    decode slot is back."""
    _, decode = staged_pair
    writer = RankProc("prefill-slow", 33, seed=9, kv_staging="host", kv_staging_blocks=16, copy_delay_s=0.25)
    try:
        decode.call("add_peer", writer.call("meta"))
        remote, local = list(range(48)), list(range(200, 248))
        source = writer.call("digests", remote)
        decode.call("zero", local)
        zero = decode.call("digests", local[:1])[0]
        writer.call("expect_send", "slow", remote)
        decode.call("start_pull", "slow", _descriptor(writer, "slow", remote), local)
        deadline = time.monotonic() + WAIT_S
        while decode.call("digests", local[:8]) != source[:8]:
            assert time.monotonic() < deadline, "the first chunk never landed"
            time.sleep(0.02)
        writer.signal(signal.SIGKILL)
        decode.call("remove_peer", "prefill-slow")  # as the scheduler does when the engine's epoch dies
        got = decode.call("wait_results", ["slow"], WAIT_S)
        assert got["failed_recving"] == ["slow"] and got["reasons"] == {"slow": "peer_gone"}, got
        invalid = set(decode.call("invalid"))
        assert invalid and invalid < set(local) and not invalid & set(local[:8])
        now = decode.call("digests", local)
        for b, digest, want in zip(local, now, source, strict=True):
            assert digest == (zero if b in invalid else want), b
        assert decode.call("staging_slots")[0] == 0 and decode.call("pending") == 0
    finally:
        writer.close()


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
