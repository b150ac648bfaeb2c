"""The README's vLLM command exactly as written — `.venv-vllm/bin/pdserve up --engine vllm`, no
dtype, memory or length settings of the tests' own — serves the README's generate commands.
(Its defaults once failed: float32 forced on CPU and vLLM's full context did not fit the
default KV budget.)

It runs as a user's does, without vLLM's CI switch (`VLLM_CPU_CI_ENV`, which tests/vllm/conftest.py
sets to run vLLM's compiled graph eagerly), and the capital question must be answered right: the
defaults once served vLLM's compiled bfloat16 CPU graph, which answered `L'Étoile, la
Marseillaise, …` (decision 0040). 70 s on the shared 2-core host (eager: no compilation at start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.readme_commands import ROOT, Up, readme_commands, run

VLLM = ".venv-vllm/bin/pdserve "


def _generate_commands() -> list[str]:
    """The README's generate commands, from .venv where it exists (make test builds both), else
    from .venv-vllm."""
    commands = [c for c in readme_commands(".venv/bin/pdserve ") if c.startswith(".venv/bin/pdserve generate")]
    if not (ROOT / ".venv/bin/pdserve").exists():
        commands = [c.replace(".venv/bin/pdserve ", VLLM, 1) for c in commands]
    return commands


def test_readme_vllm_up_serves_with_its_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_CI_ENV", raising=False)  # as a user runs it (module docstring)
    ups = [c for c in readme_commands(VLLM) if c.startswith(f"{VLLM}up") and "..." not in c]
    assert ups == [f"{VLLM}up --engine vllm"]
    generates = _generate_commands()
    assert len(generates) >= 3 and any("What is the capital of France?" in c for c in generates)
    up = Up(ups[0], tmp_path / "up.log")
    up.start(timeout=480)
    try:
        for command in generates:
            result = run(command, timeout=300)
            assert result.returncode == 0, f"{command}: {result.stderr[-2000:]}\n{up.output()[-3000:]}"
            assert result.stdout.strip(), command
            if "What is the capital of France?" in command:
                assert "Paris" in result.stdout, f"{command}: {result.stdout!r}"
            if "--json" in command:
                assert json.loads(result.stdout)["usage"]["generated_tokens"] > 0
    finally:
        status = up.stop()
    assert status == 0, up.output()[-4000:]
