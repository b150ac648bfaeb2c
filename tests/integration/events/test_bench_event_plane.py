"""Quick runs of `pdserve bench events` and `pdserve bench scale` (tiny sizes), so neither can
rot: real scheduler parts, control streams and subscribers in subprocesses. About 12 s for
events (three sections), 5 s for events sent as engine events (a quarter of them BlockRemoved)
and 9 s for scale (one scheduler process, 8 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.cli import main


def test_bench_events_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "events", "--engines", "2", "--tp", "2", "--batch-events", "8", "--rate", "400",
                 "--duration", "1", "--subscribers", "2", "--sections", "pdserve,vllm,overload",
                 "--overload-seconds", "0.5", "--verify-compact", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    pdserve, baseline = result["pdserve"], result["vllm"]
    assert pdserve["lost"] == 0 and pdserve["published_events"] > 0
    assert pdserve["report_per"] == "rank"  # the default: the protocol the engines speak
    # the ranks' compact reports were taken whole (their three forms checked event by event)
    assert pdserve["report_encoding"] == "compact" and pdserve["reports_malformed"] == 0
    assert pdserve["subscribers"][0]["events"] == pdserve["published_events"] == pdserve["offered_events"]
    # like for like: the same ZMQ subscribers on both sides, one stop rule, one loss count
    assert result["symmetric"] and result["config"]["drain_s"] == 2.0
    assert [s["transport"] for s in pdserve["subscribers"]] == [s["transport"] for s in baseline["subscribers"]] \
        == ["zmq", "zmq"]
    for side in (pdserve, baseline):
        assert side["lost"] == sum(side["offered_events"] - s["events"] for s in side["subscribers"])
        assert side["drain_used_s"] < 2.0  # everything arrived: the drain window ended early
    # the baseline ran at the same offered rate, and says which code it is
    assert baseline["offered_rate"] == 400 and baseline["lost"] == 0
    assert result["baseline"].startswith(("vllm ", "re-implementation"))
    assert result["p99_ratio_vs_vllm"] == pytest.approx(pdserve["p99_ms"] / baseline["p99_ms"])
    overload = result["overload"]
    assert overload["stalled_max_buffered_batches"] <= overload["subscriber_buffer"]
    assert overload["rss_after_mib"] > 0


def test_bench_events_quick_with_engine_events(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "events", "--engines", "2", "--tp", "2", "--batch-events", "8", "--rate", "400",
                 "--duration", "1", "--subscribers", "2", "--sections", "pdserve", "--event-source", "engine",
                 "--removed-share", "0.25", "--verify-compact", "--scheduler-loop", "uvloop", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    pdserve = result["pdserve"]
    assert result["config"]["scheduler_loop"] == pdserve["scheduler_loop"] == "uvloop"  # the loop it ran on
    assert pdserve["event_source"] == "engine" and pdserve["lost"] == 0 and pdserve["reports_malformed"] == 0
    # every step one compact report from rank 0 (mixed: 6 BlockStored, then 2 BlockRemoved of the
    # engine's previous step, which its first step has none of), its three forms checked event by event
    steps = pdserve["engine_steps"]
    assert pdserve["reports_compact_engine_events"] == steps > 2
    assert pdserve["published_removed"] == 2 * (steps - 2)
    assert pdserve["published_events"] == steps * 8 - 2 * 2 == pdserve["subscribers"][0]["events"]


def test_bench_events_rejects_unknown_sections(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "events", "--sections", "pdserve,vllm_style"]) == 2
    assert "unknown ['vllm_style']" in capsys.readouterr().err
    assert main(["bench", "events", "--event-source", "engine", "--report-encoding", "packed"]) == 2
    assert "engine events have no packed form" in capsys.readouterr().err
    assert main(["bench", "events", "--removed-share", "0.6"]) == 2
    assert "--removed-share must be in [0, 0.5]" in capsys.readouterr().err


def test_bench_events_plots_saved_results(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`--from-json ... --plot` draws saved runs (the docs' own, one per rate and variant) without
    running anything (~1 s, matplotlib); bad input is refused with a reason."""
    data = Path(__file__).resolve().parents[3] / "docs" / "data"
    saved = [str(data / f"bench_events_{rate}_per_rank_repeat3.json") for rate in ("48k", "100k")]
    png = tmp_path / "events.png"
    assert main(["bench", "events", "--from-json", *saved, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["bench", "events", "--from-json", *saved]) == 2
    assert "give --plot PATH" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"pdserve": None, "config": {"rate": 1000}}))
    assert main(["bench", "events", "--from-json", str(empty), "--plot", str(tmp_path / "x.png")]) == 2
    assert "no result holds a pdserve section" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_bench_scale_quick(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # the non-default protocols and loop: merged reports (rank 0 carries every rank's events), one report
    # per engine for a transfer, compact events, uvloop
    assert main(["bench", "scale", "--ranks", "8", "--tp", "2", "--duration", "2", "--sim-procs", "1",
                 "--request-rate", "2", "--step-hz", "4", "--report-per", "engine", "--transfer-per", "engine",
                 "--scheduler-loop", "uvloop", "--worker-events", "compact", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out)
    saved = tmp_path / "run.json"
    saved.write_text(out)
    assert main(["bench", "scale", "--from-json", str(saved)]) == 0
    table = capsys.readouterr().out
    assert "tp 2" in table and f"{result['overhead_p50_ms']:.2f}" in table
    for key in ("ranks", "overhead_p50_ms", "overhead_p99_ms", "events_per_s", "rss_mib", "false_down"):
        assert key in result
    point = result["points"][0]
    assert result["ranks"] == 8 and point["engines"] == 4 and point["event_loop"] == "uvloop"
    assert result["config"]["transfer_per"] == point["transfer_per"] == "engine"
    assert result["config"]["worker_events"] == "compact" and result["config"]["report_per"] == "engine"
    assert result["false_down"] == 0 and point["request_errors"] == {}
    assert point["requests_ok"] == point["requests_sent"] > 0
    assert result["events_per_s"] > 0 and point["rank_reports_per_s"] > 0
    assert 0 < result["overhead_p50_ms"] <= result["overhead_p99_ms"]
    assert point["kv_ready_p50_ms"] > 0  # every request's transfer went through the control plane
    # timed from the last rank's report for every request; the ranks' spread is reported apart
    assert point["kv_ready_from_first_report"] == 0
    assert 0 <= point["sim_rank_spread_p50_ms"] <= point["sim_rank_spread_p99_ms"]
    assert 0 < result["rss_mib"] < 1024


def test_bench_scale_two_replicas_quick(capsys: pytest.CaptureFixture[str]) -> None:
    """`--schedulers 1,2`: every rank registered with both replicas (requests round-robin over
    them all complete), then the closed loop's requests routed per second, side by side."""
    assert main(["bench", "scale", "--ranks", "4", "--tp", "2", "--schedulers", "1,2", "--duration", "1.5",
                 "--saturate-s", "1.5", "--concurrency", "4", "--sim-procs", "1", "--request-rate", "2",
                 "--step-hz", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    one, two = result["points"]
    assert (one["schedulers"], two["schedulers"], result["schedulers"]) == (1, 2, 2)
    for p in (one, two):
        assert p["false_down"] == 0 and p["request_errors"] == {} and p["saturated_errors"] == 0
        assert p["requests_ok"] == p["requests_sent"] > 0 and p["saturated_requests"] > 0
        assert p["kv_ready_p50_ms"] > 0 and p["kv_ready_from_first_report"] == 0
        assert p["routed_per_s"] > 0 and p["routed_per_scheduler_cpu_s"] > 0
        # every rank reports each step: rank 0's beats ride on its reports (2 engines would send
        # 2 heartbeat messages per s otherwise), the others' reports prove them alive
        assert p["rank_beats_per_s"] < 1.0
    assert result["replica_speedup"] == pytest.approx(two["routed_per_s"] / one["routed_per_s"])
    assert two["cpu_ms_per_rank_s"] == pytest.approx(2 * two["cpu_ms_per_rank_s_per_replica"])
    assert "replica_speedup" in result and result["routed_per_s"] == two["routed_per_s"]


def test_bench_scale_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scale", "--ranks", "1"]) == 2
    assert "every value must be >= 2" in capsys.readouterr().err
    assert main(["bench", "scale", "--scheduler-loop", "asyncio,trio"]) == 2
    assert "--scheduler-loop: expected a comma-separated list of uvloop, asyncio" in capsys.readouterr().err
    assert main(["bench", "scale", "--transfer-per", "rank,node"]) == 2
    assert "--transfer-per: expected a comma-separated list of rank, engine" in capsys.readouterr().err
    assert main(["bench", "scale", "--schedulers", "1,0"]) == 2
    assert "--schedulers: every value must be >= 1" in capsys.readouterr().err
    assert main(["bench", "scale", "--schedulers", "two"]) == 2
    assert "--schedulers: expected comma-separated integers" in capsys.readouterr().err
