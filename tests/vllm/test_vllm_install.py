"""Smoke test of the vLLM environment (`.venv-vllm`): vLLM imports beside pdserve, the
`pdserve` entry point there takes `--engine vllm`, and the registry finds the vLLM backend.
About 15 s (one vLLM import in a subprocess, two CLI starts)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PDSERVE = Path(sys.executable).parent / "pdserve"


def test_vllm_imports_beside_pdserve_torch() -> None:
    probe = ("import torch, vllm, services.engine.registry as r; "
             "print(vllm.__version__, torch.__version__, r.BACKENDS['vllm'].module)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    vllm_version, torch_version, module = proc.stdout.split()[-3:]
    assert tuple(int(x) for x in vllm_version.split(".")[:2]) >= (0, 32)
    assert torch_version.startswith("2.")
    assert module == "services.engine.vllm"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pdserve_entry_point_takes_engine_vllm(role: str) -> None:
    proc = subprocess.run([str(PDSERVE), role, "--engine", "vllm", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--engine ENGINE" in proc.stdout and "--vllm-arg KEY=VALUE" in proc.stdout


def test_registry_finds_the_vllm_backend() -> None:
    from services.engine.registry import BackendUnavailable, check_backend

    if importlib.util.find_spec("services.engine.vllm") is None:
        with pytest.raises(BackendUnavailable, match="the vllm engine backend is not part of this pdserve build"):
            check_backend("vllm")
        pytest.skip("services/engine/vllm/ (the vLLM backend, issue 13) is not in this tree yet")
    entry = check_backend("vllm")
    assert entry.module == "services.engine.vllm"
    module = importlib.import_module(entry.module)
    assert callable(module.create_backend)
