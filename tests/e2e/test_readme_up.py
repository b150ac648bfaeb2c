"""The README's "Use it" commands exactly as written: `pdserve up` with its defaults, the three
`pdserve generate` forms and `pdserve events`; then one engine is killed and `pdserve up`
restarts it (backoff) instead of stopping the cluster, and it serves again."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.readme_commands import ROOT, Up, engine_pid, readme_commands, run

PREFIX = ".venv/bin/pdserve "


@pytest.fixture(scope="module")
def commands() -> list[str]:
    if not (ROOT / ".venv/bin/pdserve").exists():
        pytest.skip("no .venv/bin/pdserve (make install)")
    return readme_commands(PREFIX)


def test_readme_up_serves_then_survives_an_engine_death(commands: list[str], tmp_path: Path) -> None:
    assert f"{PREFIX}up" in commands
    generates = [c for c in commands if c.startswith(f"{PREFIX}generate")]
    assert len(generates) >= 3
    up = Up(f"{PREFIX}up", tmp_path / "up.log")
    up.start(timeout=180)
    try:
        events = subprocess.Popen(shlex.split(f"{PREFIX}events"), cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            for command in generates:
                result = run(command)
                assert result.returncode == 0, f"{command}: {result.stderr[-2000:]}"
                assert result.stdout.strip(), command
            as_json = [c for c in generates if "--json" in c]
            for command in as_json:
                assert json.loads(run(command).stdout)["usage"]["generated_tokens"] > 0
        finally:
            events.send_signal(signal.SIGINT)
            printed = events.communicate(timeout=30)[0]
        lines = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
        assert {line["engine_id"] for line in lines} & {"prefill-0", "decode-0"}, printed[-2000:]

        assert up.proc is not None
        os.killpg(engine_pid("decode-0", up.proc.pid), signal.SIGKILL)
        deadline = time.monotonic() + 120
        while "restarted decode-0" not in up.output():
            assert time.monotonic() < deadline, up.output()[-4000:]
            assert up.proc is not None and up.proc.poll() is None, up.output()[-4000:]
            time.sleep(0.5)
        while True:  # serves again once the new decode engine has registered
            result = run(generates[0])
            if result.returncode == 0:
                break
            assert time.monotonic() < deadline, result.stderr[-2000:]
            time.sleep(1)
    finally:
        status = up.stop()
    assert status == 0, up.output()[-4000:]
