"""The README's vLLM command exactly as written — `.venv-vllm/bin/pdserve up --engine vllm`, no
dtype, memory or length settings of the tests' own — serves the README's generate commands.
(Its defaults once failed: float32 forced on CPU and vLLM's full context did not fit the
default KV budget.)"""

from __future__ import annotations

import json
from pathlib import Path

from tests.readme_commands import ROOT, Up, readme_commands, run

VLLM = ".venv-vllm/bin/pdserve "


def _generate_commands() -> list[str]:
    """The README's generate commands, from .venv where it exists (make test builds both), else
    from .venv-vllm."""
    commands = [c for c in readme_commands(".venv/bin/pdserve ") if c.startswith(".venv/bin/pdserve generate")]
    if not (ROOT / ".venv/bin/pdserve").exists():
        commands = [c.replace(".venv/bin/pdserve ", VLLM, 1) for c in commands]
    return commands


def test_readme_vllm_up_serves_with_its_defaults(tmp_path: Path) -> None:
    ups = [c for c in readme_commands(VLLM) if c.startswith(f"{VLLM}up") and "..." not in c]
    assert ups == [f"{VLLM}up --engine vllm"]
    generates = _generate_commands()
    assert len(generates) >= 3
    up = Up(ups[0], tmp_path / "up.log")
    up.start(timeout=480)
    try:
        for command in generates:
            result = run(command, timeout=300)
            assert result.returncode == 0, f"{command}: {result.stderr[-2000:]}\n{up.output()[-3000:]}"
            assert result.stdout.strip(), command
            if "--json" in command:
                assert json.loads(result.stdout)["usage"]["generated_tokens"] > 0
    finally:
        status = up.stop()
    assert status == 0, up.output()[-4000:]
