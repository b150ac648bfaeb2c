"""bench/repeats.py: the ABBA order of repeated runs and the median / min–max arithmetic,
against hand-built reports."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.repeats import abba_orders, combine, median_report, run_repeated, spread, summarize


def test_runs_alternate_which_side_goes_first() -> None:
    # sides: B A | A B | B A | A B | B A  -> baseline, pdserve, pdserve, baseline, baseline, ...
    assert abba_orders(5) == [True, False, True, False, True]
    assert abba_orders(1) == [True]
    with pytest.raises(ValueError, match="--repeat must be >= 1"):
        abba_orders(0)


def test_spread_is_median_min_max_of_the_measured_runs() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert spread([4.0, 1.0]) == {"median": 2.5, "min": 1.0, "max": 4.0, "runs": [4.0, 1.0]}
    assert spread([None, 5.0, 1.0, 3.0])["median"] == 3.0  # an absent value is not a zero
    assert spread([None])["median"] is None


def test_summary_takes_every_ratio_and_the_named_headlines() -> None:
    runs = [{"ratio": 2.0, "p99_ms": 10, "a": {"throughput_ratio": 1.0, "tok_s": 5}, "name": "x", "duration_s": 5},
            {"ratio": 1.0, "p99_ms": 30, "a": {"throughput_ratio": 3.0, "tok_s": 7}, "name": "x", "duration_s": 5},
            {"ratio": 4.0, "p99_ms": 20, "a": {"throughput_ratio": 2.0, "tok_s": 6}, "name": "x", "duration_s": 5}]
    s = summarize(runs, headline=("p99_ms",))
    assert set(s) == {"ratio", "p99_ms", "a.throughput_ratio"}
    assert (s["ratio"]["median"], s["ratio"]["min"], s["ratio"]["max"]) == (2.0, 1.0, 4.0)
    assert s["a.throughput_ratio"]["runs"] == [1.0, 3.0, 2.0]
    assert median_report(runs) == {"ratio": 2.0, "p99_ms": 20, "a": {"throughput_ratio": 2.0, "tok_s": 6},
                                   "name": "x", "duration_s": 5}


def test_combined_report_names_each_runs_order() -> None:
    runs = [{"ratio": 1.0, "baseline_first": True}, {"ratio": 3.0, "baseline_first": False}]
    out = combine(runs, [True, False])
    assert out["repeat"]["orders"] == ["baseline,pdserve", "pdserve,baseline"]
    assert out["ratio"] == 2.0 and out["runs"] == runs
    assert combine([{"ratio": 1.0}], [True])["repeat"]["orders"] == ["its own interleaving"]


def test_run_repeated_drives_the_benchmark_in_abba_order(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[bool] = []

    def bench(args: argparse.Namespace) -> int:
        seen.append(args.baseline_first)
        print(json.dumps({"ratio": float(len(seen)), "baseline_first": args.baseline_first}))
        return 0

    args = argparse.Namespace(repeat=4, json=True)
    assert run_repeated(bench, args) == 0
    out = json.loads(capsys.readouterr().out)
    assert seen == [True, False, True, False]
    assert out["repeat"]["summary"]["ratio"] == {"median": 2.5, "min": 1.0, "max": 4.0, "runs": [1.0, 2.0, 3.0, 4.0]}
