"""Every `pdserve bench …` command run end to end at tiny sizes, through the CLI, so that a
benchmark cannot break unnoticed (the figures themselves are not asserted: benchmarks report,
tests check). Clusters use a 2-layer random Llama; total cost about 2–3 minutes on two cores
(serve ~50 s, compare ~25 s, chaos ~25 s, load ~25 s, engine ~20 s, transfer ~15 s, events ~15 s).
`bench aggregator` has its own smoke test (tests/unit/connectors/test_bench_aggregator.py), and
the vLLM systems of `serve --compare vllm` run in tests/vllm/ (in .venv-vllm)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.common.cli import main

SERVE_TINY = ["--num-requests", "3", "--concurrency", "2", "--prompt-len", "8:24", "--output-len", "2:4",
              "--kv-cache-memory", "32MiB"]


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 0) -> dict[str, Any]:
    capsys.readouterr()
    assert main([*argv, "--json"]) == code
    out = capsys.readouterr().out
    return dict(json.loads(out[out.index("{"):]))  # one object, on one line or indented


def test_bench_serve_gives_both_modes_the_same_cpu(tiny_tp_model: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, ["bench", "serve", "--model", str(tiny_tp_model), "--out", str(tmp_path), *SERVE_TINY,
                               "--threads", "2"])
    for mode in ("disaggregated", "colocated"):
        assert report[mode]["requests"] == 3 and report[mode]["throughput_tok_s"] > 0
    cpu = report["cpu"]
    assert cpu["disaggregated"]["total_torch_threads"] == cpu["colocated"]["total_torch_threads"] == 2
    assert (cpu["disaggregated"]["torch_threads_per_engine"], cpu["colocated"]["torch_threads_per_engine"]) == (1, 2)
    assert cpu["disaggregated"]["cpus"] == cpu["colocated"]["cpus"]
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_bench_serve_refuses_an_uneven_thread_split(tiny_tp_model: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--model", str(tiny_tp_model), "--out", str(tmp_path), "--threads", "3"]) == 2
    assert "--threads 3 does not split evenly over 2 engines" in capsys.readouterr().err


def test_bench_serve_compare_vllm_runs_pdserve_and_reports_absent_systems(
        tiny_tp_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without vLLM (the main suite's venv) its systems are reported absent with the reason;
    pdserve is measured with the issue's keys."""
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here: tests/vllm/ runs the compare with it")
    except ImportError:
        pass
    report = run_json(capsys, ["bench", "serve", "--compare", "vllm", "--model", str(tiny_tp_model), "--out", str(tmp_path),
                               "--dtype", "float32", *SERVE_TINY])
    assert set(report["systems"]) == {"pdserve"}
    assert set(report["systems"]["pdserve"]) == {"wall_s", "tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms",
                                                 "itl_p99_ms", "threads", "itl_first_p50_ms", "itl_first_p99_ms",
                                                 "itl_rest_p99_ms", "cpu", "kv_bytes_registered", "kv_mirror_bytes",
                                                 "kv_staging", "identical", "reference"}
    # greedy tokens judged per engine family: pdserve alone is its own reference
    assert report["systems"]["pdserve"]["identical"] is True and report["systems"]["pdserve"]["reference"] == "pdserve"
    # read from both engines' /metrics: each registered its whole KV cache in place, no mirror
    assert report["systems"]["pdserve"]["kv_bytes_registered"] > 0
    assert report["systems"]["pdserve"]["kv_mirror_bytes"] == 0 and report["systems"]["pdserve"]["kv_staging"] == "none"
    assert report["systems"]["pdserve"]["cpu"]["cores_used"] > 0  # every process of the cluster, the client too
    pdserve = report["systems"]["pdserve"]
    assert pdserve["itl_first_p50_ms"] <= pdserve["itl_first_p99_ms"], pdserve
    assert report["systems"]["pdserve"]["tok_s"] > 0 and report["systems"]["pdserve"]["threads"] >= 1
    assert set(report["absent"]) == {"vllm_colocated", "vllm_pd_nixl", "pdserve_vllm", "pdserve_vllm_staging"}
    assert "vLLM not importable" in report["absent"]["vllm_colocated"] and \
        "vLLM not importable" in report["absent"]["vllm_pd_nixl"]
    assert report["absent"]["pdserve_vllm"].startswith("pdserve with vLLM engines unavailable")
    assert report["absent"]["pdserve_vllm_staging"] == report["absent"]["pdserve_vllm"]
    assert (tmp_path / "serve_compare.png").stat().st_size > 0


def test_bench_chaos_smoke(tiny_tp_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, ["bench", "chaos", "--model", str(tiny_tp_model), "--out", str(tmp_path), "--duration", "3",
                               "--prefill", "1", "--decode", "1", "--kill-interval", "1000", "--baseline", "0",
                               "--concurrency", "2", "--max-tokens", "3", "--no-scheduler-kills"])
    assert report["lost"] == 0 and report["token_errors"] == 0 and report["sent"] > 0


def test_bench_load_smoke(tiny_tp_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, ["bench", "load", "--model", str(tiny_tp_model), "--out", str(tmp_path), "--clients", "6",
                               "--channels", "2", "--decode", "1", "--max-tokens", "2", "--prompt-len", "8:12",
                               "--no-unbounded"])
    assert report["completed"] == 6 and report["failures"] == 0


def test_bench_engine_smoke(tiny_tp_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, ["bench", "engine", "--model", str(tiny_tp_model), "--threads", "1", "--batch1-tokens", "3",
                               "--mixed-requests", "2", "--mixed-max-tokens", "3", "--kv-cache-memory", "32MiB"])
    assert report["batch1_ratio"] > 0 and report["mixed16_ratio"] > 0


def test_bench_transfer_smoke_reports_both_like_for_like_pairs(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, ["bench", "transfer", "--out", str(tmp_path), "--iters", "1", "--sizes", "2",
                               "--concurrent", "0", "--num-layers", "2",
                               "--methods", "pdserve,pdserve-cma,ucxx,ucxx-cma,memcpy"])
    (row,) = report["rows"]
    assert all(row["gbps"][m] > 0 for m in ("pdserve", "pdserve-cma", "ucxx", "ucxx-cma", "memcpy"))
    assert report["compared_with"]["ucxx-cma"] == "pdserve-cma" and report["compared_with"]["ucxx"] == "pdserve"
    assert "UCX_TLS=^cma" in report["transports"]["ucxx"] and "UCX_TLS=all" in report["transports"]["ucxx-cma"]
    assert row["ratio_vs"]["ucxx-cma"] == pytest.approx(row["gbps"]["pdserve-cma"] / row["gbps"]["ucxx-cma"])


def test_bench_transfer_kv_staging_smoke_compares_a_small_pool_with_a_full_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, ["bench", "transfer", "--out", str(tmp_path), "--iters", "1", "--sizes", "6",
                               "--concurrent", "0", "--num-layers", "2", "--kv-staging", "host",
                               "--kv-staging-blocks", "2"])
    (row,) = report["rows"]
    assert report["staging_pools"] == {"pdserve": 6, "pdserve-pool": 2}  # 6 blocks through 2 slots: 6 chunks
    assert row["gbps"]["pdserve"] > 0 and row["gbps"]["pdserve-pool"] > 0
    assert row["ratio_vs"]["pdserve-pool"] == pytest.approx(row["gbps"]["pdserve-pool"] / row["gbps"]["pdserve"])


def test_bench_transfer_two_hosts_smoke_names_the_transport(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from bench.two_hosts import unavailable

    problem = unavailable()
    if problem is not None:
        pytest.skip(f"two namespaced hosts cannot be made here: {problem}")
    from connectors.ucx.nixl_transport import nixl_importable

    methods = ["pdserve", "ucxx"] + (["pdserve-nixl"] if nixl_importable() else [])
    report = run_json(capsys, ["bench", "transfer", "--hosts", "2", "--out", str(tmp_path), "--iters", "1",
                               "--sizes", "2", "--concurrent", "0", "--num-layers", "2", "--methods", ",".join(methods)])
    (row,) = report["rows"]
    assert report["hosts"] == 2 and all(row["gbps"][m] > 0 for m in methods)
    # Across the namespaces neither shared memory nor CMA is reachable: all went over TCP
    # (pdserve-nixl: its writer progresses its NIXL agent while it serves, or READs stall).
    assert report["transports_used"] == {m: "tcp" for m in methods}


def test_bench_events_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, ["bench", "events", "--engines", "1", "--tp", "2", "--batch-events", "4", "--rate", "200",
                               "--direct-rate", "400", "--duration", "1", "--subscribers", "2",
                               "--overload-seconds", "0.3"])
    assert report["lost"] == 0 and report["events_per_s"] > 0
