"""`bench serve --compare vllm` judges every system's greedy tokens against its engine family's
reference run (the first system of the family measured): identical systems say so, a differing
one is flagged with where it differs and fails the command; repeated runs keep a flag only if it
held in every run."""

from __future__ import annotations

from typing import Any

from bench.repeats import median_report
from bench.vllm_compare import judge_tokens, table, token_difference


def _report() -> dict[str, Any]:
    return {"systems": {n: {"tok_s": 1.0} for n in ("vllm_colocated", "pdserve", "pdserve_vllm",
                                                    "pdserve_vllm_staging")}, "absent": {}, "threads": {}}


def test_token_difference_names_the_first_differing_request_and_token() -> None:
    assert token_difference([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert token_difference([[1, 2], [3, 5], [6]], [[1, 2], [3, 4], [7]]) == \
        "2 of 3 requests differ (first: request 1 at token 1)"


def test_each_family_is_judged_against_its_first_system() -> None:
    report, refs = _report(), {}
    judge_tokens(report, "vllm_colocated", [[1, 2], [3, 4]], refs)
    judge_tokens(report, "pdserve", [[9, 9], [9, 9]], refs)  # another engine: its own reference
    judge_tokens(report, "pdserve_vllm", [[1, 2], [3, 4]], refs)
    judge_tokens(report, "pdserve_vllm_staging", [[1, 2], [3, 5]], refs)
    systems = report["systems"]
    assert [systems[n]["identical"] for n in systems] == [True, True, True, False]
    assert systems["pdserve_vllm"]["reference"] == "vllm_colocated" and systems["pdserve"]["reference"] == "pdserve"
    assert report["failed"] is True
    assert report["not_identical"] == {
        "pdserve_vllm_staging": "1 of 2 requests differ (first: request 1 at token 1) against vllm_colocated"}
    assert "pdserve_vllm_staging NOT IDENTICAL: 1 of 2 requests differ" in table(report)


def test_repeated_runs_are_identical_only_if_every_run_was() -> None:
    runs = [{"s": {"identical": True, "tok_s": 1.0}}, {"s": {"identical": False, "tok_s": 3.0}}]
    assert median_report(runs) == {"s": {"identical": False, "tok_s": 2.0}}
    assert median_report(runs[:1] * 2) == {"s": {"identical": True, "tok_s": 1.0}}
