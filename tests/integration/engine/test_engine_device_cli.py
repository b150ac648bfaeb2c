"""`pdserve offline --device cuda` and `pdserve up --device cuda` on a host without a GPU: a
clear exit naming the missing CUDA, before any engine, process or port is set up."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: CUDA is not missing here")
HANG_GUARD_S = 120  # generous for a loaded CPU: the commands exit after importing torch


def _pdserve(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.common.cli", *argv], capture_output=True, text=True,
                          timeout=HANG_GUARD_S)


@pytest.mark.parametrize("argv", [
    ("offline", "--device", "cuda", "--prompt-ids", "1,2,3"),
    ("up", "--device", "cuda", "--port", "1", "--control-port", "1", "--events-port", "1"),
])
def test_cuda_requested_without_a_gpu_exits_2_naming_cuda(argv: tuple[str, ...]) -> None:
    result = _pdserve(*argv)
    assert result.returncode == 2, result.stderr
    assert "--device cuda: CUDA is not available" in result.stderr and "use --device cpu" in result.stderr
    assert "Traceback" not in result.stderr
    assert "starting scheduler" not in result.stdout  # nothing was started


def test_bad_devices_list_is_refused() -> None:
    result = _pdserve("offline", "--device", "cpu", "--devices", "0", "--prompt-ids", "1")
    assert result.returncode == 2 and "--devices selects GPUs; it needs --device cuda" in result.stderr
    assert "Traceback" not in result.stderr
