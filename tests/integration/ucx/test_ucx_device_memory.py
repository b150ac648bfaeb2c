"""KV in GPU memory over the UCX data plane, and the explicit host bounce (`kv_staging="host"`).

The host-staging tests run everywhere (a CPU tensor stands in for the device: the same mirror,
copies and ordering). The CUDA tests need a GPU and are skipped with the reason otherwise;
`make gpu-check` runs them on a GPU machine (bench/gpu_check.py).
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


def _pair(device: str, kv_staging: str) -> Iterator[tuple[RankProc, RankProc]]:
    prefill = RankProc("prefill-0", 11, seed=5, device=device, kv_staging=kv_staging)
    decode = RankProc("decode-0", 22, device=device, kv_staging=kv_staging)
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
