"""The GPU check's `vllm_layouts` section (bench/gpu_check_vllm.py) on CPU tensors: vLLM's six
KV layouts, allocated as vLLM 0.32 allocates them, registered in place and moved between two
real processes over UCX — whole blocks into a TP-1 rank, head ranges into a TP-2 engine — with
one received byte flipped in one layout, which the section must report (and only there).
The same code runs on CUDA tensors in `make gpu-check`; no vLLM is imported."""

from __future__ import annotations

import sys

from bench.gpu_check_vllm import ALL_LAYOUTS, VLLM_VERSION, check_vllm_layouts


def test_every_vllm_layout_moves_byte_exact_and_a_flipped_byte_is_caught() -> None:
    report = check_vllm_layouts("cpu", corrupt="LBNHC")
    assert "vllm" not in sys.modules  # the GPU machine has none
    assert report["vllm_version"] == VLLM_VERSION and report["device"] == "cpu"
    rows = {row["layout"]: row for row in report["layouts"]}
    assert list(rows) == list(ALL_LAYOUTS)
    assert not report["ok"]
    for name, row in rows.items():
        assert row["registered_layout"] == f"vllm:{name}" and row["memory_type"] == "cpu", row
        assert row["head_ranges_exact"] and row["head_range_mismatches"] == [], row
        assert row["whole_blocks_exact"] == (name != "LBNHC"), row
        assert row["blocks_checked"] == 16 and row["run_gbps"] > 0 and row["copy_gbps"] > 0, row
        assert row["transport"], row
    assert len(rows["LBNHC"]["whole_block_mismatches"]) == 1
    # a run of 8 blocks: one range where blocks are outermost, one per layer (3) otherwise, one
    # per layer and head (3 x 2) where heads are outside blocks
    assert {n: r["ranges_per_8_block_run"] for n, r in rows.items()} == {
        "BHLNC": 1, "BLHNC": 1, "BLNHC": 1, "LBHNC": 3, "LBNHC": 3, "LHBNC": 6}
