"""An engine stopped before any scheduler answered it (a pod deleted while its scheduler is
unreachable) exits promptly and cleanly: the start's wait for a Welcome has no deadline, so
SIGTERM must end it rather than leave the process draining forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.local_cluster import free_port

ROOT = Path(__file__).resolve().parents[3]
BUILD_GUARD_S = 120  # the model load on a loaded 2-core host
EXIT_WITHIN_S = 8.0  # under the engine's own 10 s watchdog, so the watchdog cannot mask a hang


def test_sigterm_while_waiting_for_a_scheduler_exits_0(tmp_path: Path) -> None:
    log = tmp_path / "prefill.log"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'protos'}", "PDSERVE_TORCH_THREADS": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.common.cli", "prefill", "--port", "0",
                                 "--scheduler", f"127.0.0.1:{free_port()}"], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + BUILD_GUARD_S
        while "reconnecting" not in log.read_text():  # built, and trying to reach the scheduler
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the engine never got to its scheduler wait"
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, log.read_text()[-2000:]
    assert took < EXIT_WITHIN_S, f"exited {took:.1f} s after SIGTERM"
    assert "stopped before it was ready" in log.read_text()
