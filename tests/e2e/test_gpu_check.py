"""`make gpu-check --dry-run`: every section of the GPU check (parity with transformers, a 1P1D
cluster, KV transfer bandwidth, vLLM's layouts without vLLM, the CUDA test files collected) runs on the CPU at tiny sizes, so the script cannot rot while
no GPU is lent; without a GPU and without --dry-run it refuses at once, naming the missing CUDA.
Cost: one tiny cluster and one transfer process pair: 140 s to 400 s measured on a 2-core host
shared with seven other test runs (most of it process start-up under that load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_make_gpu_check_dry_run_passes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    result = subprocess.run(["make", "-s", "gpu-check", f"GPU_CHECK_OUT={out}", f"GPU_CHECK_WHEEL_DIR={tmp_path}",
                             f"GPU_CHECK_ARGS=--dry-run --new-tokens 6 --workdir {tmp_path / 'work'}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PDSERVE_CPU_BF16": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["device"], report["dry_run"], report["ok"]) == ("cpu", True, True)
    sections = report["sections"]
    assert list(sections) == ["parity", "cluster", "transfer", "vllm_layouts", "cuda_tests"]
    [row] = sections["parity"]["models"]
    assert row["float32_equal"] and row["float32_token_agreement"] == 1.0 and 0 <= row["bfloat16_token_agreement"] <= 1
    requests = sections["cluster"]["requests"]
    assert len(requests) == 4 and all(r["equal"] and r["transferred_tokens"] == r["prompt_tokens"] for r in requests)
    assert sections["cluster"]["leaks"] == {}
    rows = sections["transfer"]["rows"]
    assert [r["num_blocks"] for r in rows] == [16, 64]
    assert all(r["gbps"]["pdserve"] > 0 and r["gbps"]["copy"] > 0 for r in rows)
    assert sections["transfer"]["unavailable"] == {"nixl": "NIXL VRAM reads need a GPU"}
    vllm = sections["vllm_layouts"]["layouts"]
    assert [r["layout"] for r in vllm] == ["BHLNC", "LBHNC"]
    assert all(r["whole_blocks_exact"] and r["head_ranges_exact"] and r["run_gbps"] > 0 for r in vllm)
    # dry: the CUDA test files are collected (they import and exist), not run
    assert sections["cuda_tests"]["collected"] >= 15 and sections["cuda_tests"]["missing"] == []
    carry = report["environment"]["carry"]  # the tree + GPU_CHECK_WHEEL_DIR (no wheels here)
    assert carry["ok"] and carry["wheel_bytes"] == 0 and carry["tree_bytes"] > 0
    assert "PASSED" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the real check would run")
def test_gpu_check_without_a_gpu_refuses_naming_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "gpu-check", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "--dry-run" in err
    assert not (tmp_path / "r.json").exists()


STALL_LIMIT_S = 10  # the stalled section's wait; the next one (transfer, ~4 s here) must fit in it too


def test_a_stalled_section_is_ended_and_reported(tmp_path: Path) -> None:
    """A section that hangs is ended at its limit with the reason; the next section still runs
    and the report is written."""
    out = tmp_path / "r.json"
    result = subprocess.run(
        [sys.executable, "-m", "services.common.cli", "bench", "gpu-check", "--dry-run", "--sections", "parity,transfer",
         "--sizes", "16", "--iters", "1", "--section-limit-s", str(STALL_LIMIT_S), "--out", str(out),
         "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PDSERVE_GPU_CHECK_STALL": "parity"})
    assert result.returncode == 1, result.stderr[-3000:]
    report = json.loads(out.read_text())
    parity, transfer = report["sections"]["parity"], report["sections"]["transfer"]
    assert not parity["ok"] and parity["error"].startswith(
        f"stalled: no result within the section's limit of {STALL_LIMIT_S} s")
    assert STALL_LIMIT_S <= parity["seconds"] < 60
    assert transfer["ok"], transfer
