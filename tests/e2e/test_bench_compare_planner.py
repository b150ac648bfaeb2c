"""Smoke test of `pdserve bench serve --compare-planner` at tiny sizes, pdserve engines only: the
static cluster (1P1D, then both engines set mixed in place) and one planner cluster, one probe
each, one SLO pair. Checks the issue's keys, that the static 2-mixed probe ran on two mixed
engines, that nothing was lost, and the SVG. Cost: two cluster starts and three 3-request
probes, about 40-60 s here. (vLLM colocated is `vllm serve`, covered by tests/vllm/.)"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from services.common.cli import main

pytestmark = pytest.mark.timeout(300)


def test_compare_planner_reports_goodput_per_system_and_phase(tiny_tp_model: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", "--compare-planner", "--model", str(tiny_tp_model), "--out", str(tmp_path),
            "--num-requests", "3", "--prompt-len", "16:32", "--short-len", "4:8", "--output-len", "2:2",
            "--kv-cache-memory", "32MiB", "--planner-systems", "static_1p1d,static_2mixed,planner",
            "--slo-pair", "loose=ttft:60000,tpot:60000", "--rate-range", "1:16", "--probes", "1", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    phases = {"overall", "prefill_heavy", "decode_heavy", "mixed"}
    goodput = report["goodput_rps"]["loose"]
    assert set(goodput) == {"static_1p1d", "static_2mixed", "planner"}
    assert all(set(by_phase) == phases for by_phase in goodput.values())
    # One probe at the geometric middle of the range; every request meets SLOs this loose.
    assert goodput["planner"]["overall"] == goodput["static_1p1d"]["overall"] == 4.0
    for key in ("planner_vs_best_static", "planner_vs_worst_static"):
        assert report[key]["loose"]["overall"] == 1.0
    assert report["planner_vs_vllm_colocated"]["loose"]["overall"] is None  # not run
    assert report["goodput_is_lower_bound"]["loose"]["planner"] is True  # no probe failed
    assert report["requests_lost"]["total"] == 0 and report["role_changes"]["loose"] >= 0
    curves = report["attainment_curves"]["loose"]
    assert curves["static_2mixed"][0]["start_roles"] == ["mixed", "mixed"]
    assert curves["static_1p1d"][0]["start_roles"] == curves["planner"][0]["start_roles"] == ["decode", "prefill"]
    assert set(report["planner_settings"]) == {"planner_interval_s", "planner_window_s", "planner_min_dwell_s",
                                               "planner_hysteresis"}
    svg = ET.parse(tmp_path / "compare_planner.svg").getroot()
    assert svg.tag.endswith("svg") and len(list(svg.iter("{http://www.w3.org/2000/svg}rect"))) > 3
    assert json.loads((tmp_path / "compare_planner.json").read_text())["goodput_rps"] == report["goodput_rps"]


def test_compare_planner_refuses_bad_settings_before_starting_anything(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    for bad, says in ((["--rate-range", "2:1"], "--rate-range"), (["--slo-pair", "x=ttft:100"], "--slo-pair"),
                      (["--probes", "0"], "--probes"), (["--planner-systems", "static_3p"], "static_3p")):
        assert main(["bench", "serve", "--compare-planner", "--out", str(tmp_path / "out"), *bad]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
