"""`pdserve bench aggregator` runs both aggregators on the same workload and agrees on counts."""

from __future__ import annotations

import json

import pytest

from services.common.cli import main


def test_bench_aggregator_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "aggregator", "--json", "--tp", "2", "--ids", "4", "--events", "3",
                 "--steps", "2", "--repeat", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rank_reports_per_s"] > 0 and result["baseline_rank_reports_per_s"] > 0
    assert result["tp"] == 2 and result["events_per_rank_per_step"] == 3


def test_bench_aggregator_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "aggregator", "--tp", "0"]) == 2
    assert "--tp must be >= 1" in capsys.readouterr().err


def test_bench_aggregator_repeat_reports_median_and_range(capsys: pytest.CaptureFixture[str]) -> None:
    """--repeat 2: two runs, sides swapped between them, every ratio's median, min-max and runs."""
    assert main(["bench", "aggregator", "--json", "--tp", "2", "--ids", "4", "--events", "3",
                 "--steps", "2", "--repeat", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    repeat = result["repeat"]
    assert repeat["n"] == 2 and repeat["orders"] == ["baseline,pdserve", "pdserve,baseline"]
    ratio = repeat["summary"]["ratio"]
    assert len(ratio["runs"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    assert result["ratio"] == pytest.approx(ratio["median"])
    assert [r["baseline_first"] for r in result["runs"]] == [True, False]
