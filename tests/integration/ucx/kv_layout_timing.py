"""Timing of block pulls out of vLLM-allocated KV, registered in place, per layout, beside a copy
of the same bytes in one process (the device-to-device copy on a GPU, a memcpy on the CPU).

    PYTHONPATH=.:protos:tests/integration/ucx python tests/integration/ucx/kv_layout_timing.py --device cuda

Two rank processes per layout (prefill, decode; real UCX, `cuda_ipc` on one GPU); each pull is
timed by the decode rank's connector (`transfer_duration`); median of `--repeat` pulls of one
contiguous run of `--blocks` blocks and of the same blocks scattered (every other block). Prints
one JSON line per layout. Not a test (no `test_` prefix): a measurement for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from ucx_rank_proc import RankProc


def _pull_seconds(prefill: RankProc, decode: RankProc, remote: list[int], local: list[int], tag: str) -> float:
    prefill.call("expect_send_fenced", tag, remote, 1)
    spec = prefill.spec
    decode.call("start_pull", tag, {"engine_id": spec["engine_id"], "epoch": spec["epoch"], "request_id": tag,
                                    "block_ids": tuple(remote), "num_tokens": len(remote) * spec["block_size"],
                                    "tp_size": 1, "block_size": spec["block_size"],
                                    "num_kv_heads": spec["num_kv_heads"]}, local)
    got = decode.call("wait_results", [tag], 60.0)
    assert got["finished_recving"] == [tag], got
    prefill.call("wait_results", [tag], 60.0)
    pairs = decode.call("stats")["pairs"]
    return float(pairs[0]["durations"][-1])


def _copy_seconds(nbytes: int, device: str, repeat: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layouts", default="BHLNC,LBHNC")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    spec = {"num_kv_heads": a.heads, "num_layers": a.layers, "block_size": a.block_size, "head_dim": a.head_dim,
            "num_blocks": a.num_blocks, "device": a.device, "timeout_s": 30.0}
    block_nbytes = a.layers * a.heads * a.block_size * 2 * a.head_dim * 2  # fp16
    for layout in a.layouts.split(","):
        prefill = RankProc(f"p-{layout}", 1, seed=3, vllm_layout=layout, **spec)
        decode = RankProc(f"d-{layout}", 2, vllm_layout=layout, **spec)
        try:
            decode.call("add_peer", prefill.call("meta"))
            runs, scattered = [], []
            for i in range(a.repeat + 1):
                run = list(range(a.blocks))
                runs.append(_pull_seconds(prefill, decode, run, [a.num_blocks - a.blocks + b for b in run], f"r{i}"))
                spread = list(range(0, 2 * a.blocks, 2))
                scattered.append(_pull_seconds(prefill, decode, spread, spread, f"s{i}"))
            assert decode.call("digests", spread) == prefill.call("digests", spread)
            nbytes = a.blocks * block_nbytes
            run_s, spread_s = statistics.median(runs[1:]), statistics.median(scattered[1:])
            copy_s = _copy_seconds(nbytes, a.device, a.repeat)
            print(json.dumps({"layout": layout, "device": a.device, "blocks": a.blocks, "bytes": nbytes,
                              "run_s": run_s, "run_gbps": nbytes / run_s / 1e9,
                              "scattered_s": spread_s, "scattered_gbps": nbytes / spread_s / 1e9,
                              "copy_s": copy_s, "copy_gbps": nbytes / copy_s / 1e9}), flush=True)
        finally:
            decode.close()
            prefill.close()



if __name__ == "__main__":
    main()
