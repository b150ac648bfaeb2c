"""A short `bench chaos` run: under a steady streaming load, SIGKILL the prefill engine and then
one decode engine (each restarted at once); no request may be lost, none may carry a repeated,
skipped or wrong token, and no engine may keep a leaked block."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.chaos import ChaosConfig, run_chaos


def test_chaos_kills_lose_no_request_and_no_token(tmp_path: Path, demo_model: Path) -> None:
    lines: list[str] = []
    cfg = ChaosConfig(duration_s=30.0, num_prefill=1, num_decode=2, concurrency=4, num_prompts=8,
                      prompt_len=(16, 64), max_tokens=24, deadline_s=60.0, lease_s=5.0,
                      schedule=[(4.0, "prefill-0"), (12.0, "decode-0")], model=str(demo_model),
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


@pytest.mark.parametrize("bad", [dict(duration_s=0.0), dict(num_decode=0), dict(concurrency=0)])
def test_chaos_config_refuses_bad_values(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ChaosConfig(**bad).validate()  # type: ignore[arg-type]
