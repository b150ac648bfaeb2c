"""Smoke test of docs/data/control_client_micro.py (decision 0045): a few steps end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_control_client_micro_reports_its_figures() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'protos'}"}
    out = subprocess.run([sys.executable, str(ROOT / "docs/data/control_client_micro.py"), "10"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    m = re.search(r"10 steps x 8 ranks, 64 events: report\(\) ([\d.]+) us CPU per report \(caller\); "
                  r"client threads ([\d.]+) us CPU per report", out)
    assert m is not None, out
    assert float(m.group(1)) > 0
