"""Smoke test of `pdserve bench serve --workload mixed --compare-paths` at tiny sizes: both
clusters run (1 prefill + 1 decode each), the JSON has the issue's keys, the policy run's
decisions add up. Cost: two cluster starts and 6 short requests each, about 60-90 s here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import serve

pytestmark = pytest.mark.timeout(600)


def test_compare_paths_reports_the_issue_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--compare-paths", "--num-requests", "6", "--concurrency", "2", "--prompt-len",
                              "200:220", "--prefix-len", "160", "--num-prefixes", "1", "--short-len", "4:8",
                              "--output-len", "2:2", "--out", str(tmp_path), "--json"])
    assert serve.run(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["workload"]["workload"] == "mixed"
    for key in ("short_ttft_p50_speedup", "long_ttft_p50_ratio", "throughput_ratio", "decisions", "ttft_p90_ratio",
                "goodput_ratio", "ttft_prediction_error_p50"):
        assert key in report, key
    assert sum(report["decisions"].values()) == 6
    assert set(report["always_remote"]["decisions"]) == {"remote:always"}
    assert report["throughput_ratio"] > 0 and (tmp_path / "serve.json").exists()
    assert report["path_policy"]["ttft_prediction_error"]["decisions"] == 6
    assert 0 <= report["ttft_prediction_error_p50"] < 100
    # The SLOs went out as every request's targets; each kind's TTFT is reported per path taken.
    assert report["targets_ms"] == {"ttft": 2000.0, "itl": 200.0}
    by_path = report["path_policy"]["by_kind_and_path"]
    assert sum(p["requests"] for kind in by_path.values() for p in kind.values()) == 6
    assert set(report["always_remote"]["by_kind_and_path"]["long"]) == {"remote"}
