"""`pdserve up --plan` as a user runs it (a subprocess): the placement printed, nothing started,
exit 0; a shape that cannot be placed exits 2 with the reason. `--gpus` pretends the count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.demo_model import demo_model_dir

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's config with 8 attention heads and 4 KV heads: splits over 1, 2 and 4 ranks
    (the demo model's own 9 and 3 do not; `--plan` checks that as `up` does)."""
    raw = json.loads((demo_model_dir() / "config.json").read_text())
    raw.update(num_attention_heads=8, num_key_value_heads=4)
    path = tmp_path_factory.mktemp("tp-model")
    (path / "config.json").write_text(json.dumps(raw))
    return path


def pdserve_up(*argv: str, model: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    model_args = ["--model", str(model)] if model is not None else []
    return subprocess.run([sys.executable, "-m", "services.common.cli", "up", "--plan", *model_args, *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def test_plan_prints_every_rank_gpu_and_share_and_exits_0(tp_model: Path) -> None:
    out = pdserve_up("--gpus", "4", "--device", "cuda", "--prefill-tp", "2", "--decode-tp", "1", model=tp_model)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "pdserve up --plan: 1 prefill (tp 2) and 1 decode (tp 1) engine(s)",
        "  cuda, 4 GPU(s) pretended by --gpus, dtype bfloat16",
        "  engine       rank  gpu  kv-share",
        "  prefill-0       0    0  0.5000",
        "  prefill-0       1    1  0.5000",
        "  decode-0        0    2  0.5000",
        "  unused GPU(s): 3"]


def test_plan_with_shared_gpus_and_on_cpu() -> None:
    out = pdserve_up("--gpus", "1", "--device", "cuda", "--dtype", "float16")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[3:] == ["  prefill-0       0    0  0.2500", "  decode-0        0    0  0.2500"]
    cpu = pdserve_up("--gpus", "0", "--dtype", "float32")
    assert (cpu.returncode, cpu.stdout.splitlines()[1]) == (0, "  cpu, dtype float32: every rank on the CPU")


@pytest.mark.parametrize("argv,reason", [
    (("--gpus", "2", "--device", "cuda", "--prefill-tp", "2", "--decode-tp", "1", "--exclusive-gpus"),
     "1 prefill x tp 2 + 1 decode x tp 1 = 3 ranks need 3 GPUs, 2 available: drop --exclusive-gpus"),
    (("--gpus", "2", "--device", "cuda", "--decode-tp", "4"),
     "decode tp 4 needs 4 GPUs (one per rank), 2 available"),
    (("--gpus", "0", "--device", "cuda"), "--device cuda with --gpus 0: no GPU to place engines on"),
    (("--gpus", "-1",), "--gpus must be >= 0, got -1"),
])
def test_a_shape_that_cannot_be_placed_exits_2_with_the_reason(argv: tuple[str, ...], reason: str,
                                                               tp_model: Path) -> None:
    out = pdserve_up(*argv, model=tp_model)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.startswith("pdserve up: ") and reason in out.stderr


@pytest.mark.parametrize("engine", ["native", "vllm"])
def test_plan_refuses_a_tp_the_model_cannot_split(engine: str) -> None:
    """A plan `up` would refuse to start is no plan: the demo model's 9 heads over 2 ranks."""
    out = pdserve_up("--gpus", "2", "--device", "cuda", "--prefill-tp", "2", "--engine", engine)
    assert (out.returncode, out.stdout) == (2, "")
    assert "the demo model cannot run at tensor-parallel size 2" in out.stderr


def test_gpus_without_plan_is_refused() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "services.common.cli", "up", "--gpus", "2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--gpus pretends a GPU count; it needs --plan" in out.stderr


def test_up_refuses_a_tp_the_model_cannot_split_before_starting_anything(tmp_path: Path) -> None:
    """The demo model's 9 attention heads do not split over 2 ranks: `pdserve up --tp 2` exits 2
    with the reason instead of starting engines that fail (and are restarted) forever."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "services.common.cli", "up", "--tp", "2", "--log-dir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "the demo model cannot run at tensor-parallel size 2: tp=2 does not divide num_attention_heads=9" \
        in out.stderr
    assert "starting" not in out.stdout and not list(tmp_path.iterdir())
