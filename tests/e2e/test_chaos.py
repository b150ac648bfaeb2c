"""A short `bench chaos` run: under a steady streaming load, SIGKILL the prefill engine and then
one decode engine (each restarted at once); no request may be lost, none may carry a repeated,
skipped or wrong token, and no engine may keep a leaked block."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.chaos import ChaosConfig, moved_added_ms, run_chaos
from bench.workload import OK, StreamOutcome, percentiles, random_prompts, token_errors


def test_chaos_kills_lose_no_request_and_no_token(tmp_path: Path, demo_model: Path) -> None:
    lines: list[str] = []
    # The second kill waits until the first victim serves again (kills do not overlap), so it
    # is scheduled right after the first: both are back ~11 s in here, and 20 s of load leaves
    # room for slower restarts before the second kill.
    cfg = ChaosConfig(duration_s=20.0, num_prefill=1, num_decode=2, concurrency=4, num_prompts=8,
                      prompt_len=(16, 64), max_tokens=24, deadline_s=60.0, lease_s=5.0,
                      schedule=[(3.0, "prefill-0"), (4.0, "decode-0")], model=str(demo_model),
                      log_dir=str(tmp_path / "logs"))
    report = run_chaos(cfg, progress=lines.append)
    summary = report.to_json()
    if os.environ.get("PDSERVE_E2E_LOGS"):
        print("\n".join(lines))
    assert [k.victim for k in report.kills] == ["prefill-0", "decode-0"], summary
    assert report.sent > 0 and report.completed > 0, summary
    assert report.lost == 0, summary
    assert report.token_errors == 0, summary
    # A request may fail only with a clear status, and only because its deadline passed.
    assert set(report.failed) <= {"DEADLINE_EXCEEDED"}, summary
    assert report.completed + sum(report.failed.values()) == report.sent, summary
    assert report.leaks == {}, summary
    assert all(k.recovery_s is not None and k.restart_s is not None for k in report.kills), summary


def test_chaos_killed_rank_takes_its_engine_down_and_loses_nothing(tmp_path: Path, tiny_tp_model: Path) -> None:
    """SIGKILL rank 1 of a tp-2 decode engine mid-stream: its engine exits by itself (instead of
    lingering registered with a dead rank), its requests migrate, and it is restarted."""
    # The load stops at 8 s; the run still waits for the victim to serve again (~9 s in here).
    cfg = ChaosConfig(duration_s=8.0, num_prefill=0, num_decode=2, tp=2, concurrency=4, num_prompts=8,
                      prompt_len=(16, 48), max_tokens=160, deadline_s=60.0, lease_s=5.0, include_scheduler=False,
                      schedule=[(3.0, "decode-0/1")], model=str(tiny_tp_model), log_dir=str(tmp_path / "logs"))
    report = run_chaos(cfg)
    summary = report.to_json()
    assert [k.victim for k in report.kills] == ["decode-0/1"], summary
    assert report.kills[0].engine_exit_s is not None, summary
    assert report.lost == 0 and report.token_errors == 0, summary
    assert set(report.failed) <= {"DEADLINE_EXCEEDED"}, summary
    assert report.completed > 0 and report.leaks == {}, summary


@pytest.mark.parametrize(("bad", "message"), [(dict(duration_s=0.0), "deadline must be > 0"),
                                              (dict(num_decode=0), "need >= 1 decode"),
                                              (dict(concurrency=0), "max_tokens must be >= 1"),
                                              (dict(tp=0), "tp must be >= 1")])
def test_chaos_config_refuses_bad_values(bad: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChaosConfig(**bad).validate()  # type: ignore[arg-type]


def test_token_check_catches_repeats_gaps_and_wrong_tokens() -> None:
    expected = [5, 6, 7, 8]
    ok = StreamOutcome("r", 0, 4, token_ids=[5, 6, 7, 8], status=OK)
    assert token_errors(ok, expected) == []
    repeated = StreamOutcome("r", 0, 4, token_ids=[5, 6, 6, 7, 8], status=OK)
    assert token_errors(repeated, expected)
    missing = StreamOutcome("r", 0, 4, token_ids=[5, 7, 8], status=OK)
    assert token_errors(missing, expected)
    wrong = StreamOutcome("r", 0, 4, token_ids=[5, 6, 9, 8], status=OK)
    assert token_errors(wrong, expected)
    # A failed request is checked on what it received: a correct prefix is fine, a wrong one not.
    assert token_errors(StreamOutcome("r", 0, 4, token_ids=[5, 6], status="DEADLINE_EXCEEDED"), expected) == []
    assert token_errors(StreamOutcome("r", 0, 4, token_ids=[6], status="DEADLINE_EXCEEDED"), expected)
    gap = StreamOutcome("r", 0, 4, token_ids=[5, 6, 7, 8], status=OK, index_errors=["chunk index 3, expected 2"])
    assert token_errors(gap, expected) == ["chunk index 3, expected 2"]


def test_percentiles_and_prompts() -> None:
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    assert percentiles([float(v) for v in range(1, 101)]) == {"p50": 51.0, "p90": 90.0, "p99": 99.0}
    prompts = random_prompts(3, 10, 4, 9, 1000)
    assert prompts == random_prompts(3, 10, 4, 9, 1000)
    assert all(4 <= len(p) <= 9 and all(100 <= t < 1000 for t in p) for p in prompts)
    with pytest.raises(ValueError, match="prompt lengths must satisfy 1 <= min <= max"):
        random_prompts(0, 1, 5, 4, 1000)


def test_moved_added_ms_is_the_gap_across_a_resume_beyond_the_steady_gap() -> None:
    steady = StreamOutcome("s", 0, 4, token_ids=[1, 2, 3, 4], status=OK, token_times_s=[0.1, 0.2, 0.3, 0.4])
    moved = StreamOutcome("m", 0, 4, token_ids=[1, 2, 3, 4], status=OK, token_times_s=[0.1, 0.2, 1.7, 1.8],
                          num_resumes=2, resumed_at=[2, 2])  # resumed twice at token 2: one gap
    assert moved_added_ms([steady, moved]) == [1400.0]  # a 1.5 s gap where 0.1 s was usual
    assert moved_added_ms([steady]) == []
