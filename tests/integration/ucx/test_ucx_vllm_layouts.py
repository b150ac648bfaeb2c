"""vLLM's own KV tensors registered in place and moved between rank processes over real UCX.

Each rank builds its KV the way vLLM 0.32 allocates it (`allocate_like_vllm`: one buffer,
per-layer views at the layout's strides), registers it as the vLLM connector does
(`describe_kv_caches` -> `KVRegion`, zero copy) and moves random block lists byte for byte:
whole blocks between equal TP, and head ranges from a TP-1 prefill rank into two TP-2 decode
ranks. LBHNC is vLLM's CPU layout (one range per layer and run of blocks); BHLNC a
block-outermost one (a run of blocks is one range). Per layout: four rank processes, started
together; the writer is killed mid-pull at the end. The CUDA cases (vLLM's GPU layouts, pins
behind a CUDA event on the stream) run where a GPU is visible and are skipped otherwise.
"""

from __future__ import annotations

import random
import signal
from typing import Any

import pytest
import torch
from ucx_rank_proc import RankProc

from connectors.head_map import read_plan

WAIT_S = 20.0
HEADS = 2


def _descriptor(p: RankProc, rid: str, block_ids: list[int]) -> dict[str, Any]:
    return {"engine_id": p.spec["engine_id"], "epoch": p.spec["epoch"], "request_id": rid,
            "block_ids": tuple(block_ids), "num_tokens": 4 * len(block_ids), "tp_size": p.spec["tp_size"],
            "block_size": 4, "num_kv_heads": HEADS}


NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: vLLM's GPU layouts in GPU "
                             "memory run where a GPU is visible")


@pytest.fixture(params=["LBHNC-cpu", "BHLNC-cpu", pytest.param("BHLNC-cuda", marks=NO_CUDA),
                        pytest.param("BLHNC-cuda", marks=NO_CUDA), pytest.param("LBHNC-cuda", marks=NO_CUDA)])
def ranks(request: pytest.FixtureRequest) -> Any:
    layout, device = request.param.split("-")
    common = {"vllm_layout": layout, "num_kv_heads": HEADS, "num_layers": 3, "num_blocks": 64, "timeout_s": 1.5,
              "device": device}
    prefill = RankProc(f"prefill-{layout}", 5, seed=7, **common)
    decode = RankProc(f"decode-{layout}", 6, **common)
    halves = [RankProc(f"decode2-{layout}", 8, tp_rank=r, tp_size=2, **common) for r in range(2)]
    try:
        meta = prefill.call("meta")
        for rank in (decode, *halves):
            rank.call("add_peer", meta)
        yield layout, prefill, decode, halves
    finally:
        for rank in (*halves, decode, prefill):
            rank.close()


def _jobs(seed: int, prefix: str) -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    local_pool = rng.sample(range(64), 24)
    jobs = {}
    for i, n in enumerate([1, 3, 8]):
        start = rng.randrange(0, 64 - n)
        remote = list(range(start, start + n)) if i % 2 == 0 else rng.sample(range(64), n)
        jobs[f"{prefix}-{n}"] = (remote, local_pool[:n])
        local_pool = local_pool[n:]
    return jobs


def _pull_all(prefill: RankProc, readers: list[RankProc], jobs: dict[str, tuple[list[int], list[int]]]) -> None:
    for rid, (remote, _) in jobs.items():
        prefill.call("expect_send_fenced", rid, remote, len(readers))
    for rank in readers:
        for rid, (remote, local) in jobs.items():
            rank.call("start_pull", rid, _descriptor(prefill, rid, remote), local)
    for rank in readers:
        got = rank.call("wait_results", list(jobs), WAIT_S)
        assert got["failed_recving"] == [] and got["finished_recving"] == sorted(jobs), got
    assert prefill.call("wait_results", list(jobs), WAIT_S)["finished_sending"] == sorted(jobs)


def test_vllm_kv_moves_byte_exact_in_place(ranks: Any) -> None:
    layout, prefill, decode, halves = ranks
    assert prefill.call("region_layout") == decode.call("region_layout") == f"vllm:{layout}"
    jobs = _jobs(1, "whole")
    untouched = [b for b in range(64) if b not in {x for _, local in jobs.values() for x in local}][:6]
    before = decode.call("digests", untouched)
    _pull_all(prefill, [decode], jobs)
    for rid, (remote, local) in jobs.items():
        assert decode.call("digests", local) == prefill.call("digests", remote), rid
    assert decode.call("digests", untouched) == before

    jobs = _jobs(2, "heads")
    _pull_all(prefill, halves, jobs)
    for r, rank in enumerate(halves):
        (read,) = read_plan(r, 2, 1, HEADS)
        for rid, (remote, local) in jobs.items():
            want = prefill.call("head_digests", remote)[read.src_offset]
            assert rank.call("head_digests", local) == {r: want}, rid
    for rank in (prefill, decode, *halves):
        assert rank.call("pending") == 0

    # a writer that stops mid-pull and dies: the pull fails by timeout with exactly its blocks
    prefill.call("expect_send", "dead", list(range(8)))
    prefill.signal(signal.SIGSTOP)
    decode.call("start_pull", "dead", _descriptor(prefill, "dead", list(range(8))), list(range(20, 28)))
    got = decode.call("wait_results", ["dead"], WAIT_S)
    prefill.signal(signal.SIGKILL)
    assert got["failed_recving"] == ["dead"] and got["reasons"]["dead"] == "timeout", got
    assert decode.call("invalid") == list(range(20, 28))
