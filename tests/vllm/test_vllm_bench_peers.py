"""The benchmarks whose baseline is vLLM's own code, run from .venv-vllm at tiny sizes:
`bench aggregator` against vLLM's KVOutputAggregator (seconds), and `bench serve --compare vllm`
with its three vLLM systems: vLLM colocated, vLLM's 1P1D NixlConnector and pdserve with vLLM
engines (five vLLM engine starts in three rounds, every one `--vllm-arg enforce_eager=true`).
The compare's native `pdserve` system is left out here: the main suite's
tests/e2e/test_bench_smoke.py runs it through the same harness (`run_pdserve`, which the
`pdserve_vllm` system here also runs). Run under the heavy lock like every vLLM test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.common.cli import main

VLLM_SYSTEMS = ("vllm_colocated", "vllm_pd_nixl", "pdserve_vllm")
PDSERVE_KEYS = ("kv_bytes_registered", "kv_mirror_bytes", "kv_staging")


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    return dict(json.loads(out[out.index("{"):]))  # one object, on one line or indented


def test_bench_aggregator_baseline_is_vllms_own_code(capsys: pytest.CaptureFixture[str]) -> None:
    import vllm

    result = run_json(capsys, ["bench", "aggregator", "--tp", "2", "--ids", "4", "--events", "3", "--steps", "2",
                               "--repeat", "1"])
    assert result["vllm_version"] == vllm.__version__
    assert result["vllm_rank_reports_per_s"] == result["baseline_rank_reports_per_s"] > 0
    assert result["ratio_vs_vllm"] == result["ratio"] > 0
    assert result["baseline"].startswith(f"vLLM {vllm.__version__}: KVOutputAggregator.aggregate")


def test_bench_serve_compare_vllm_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.demo_model import demo_model_dir

    report = run_json(capsys, ["bench", "serve", "--compare", "vllm", "--model", str(demo_model_dir()), "--out", str(tmp_path),
                               "--num-requests", "1", "--concurrency", "1", "--prompt-len", "16:32",
                               "--output-len", "3:4", "--kv-cache-memory", "64MiB",
                               "--systems", ",".join(VLLM_SYSTEMS), "--vllm-arg", "enforce_eager=true"])
    keys = {"wall_s", "tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p99_ms", "threads",
            "itl_first_p50_ms", "itl_first_p99_ms", "itl_rest_p99_ms", "cpu", "identical", "reference"}
    assert report["absent"] == {} and set(report["systems"]) == set(VLLM_SYSTEMS), report["absent"]
    for name in VLLM_SYSTEMS:
        assert set(report["systems"][name]) - {"proxy", *PDSERVE_KEYS} == keys, name
        assert report["systems"][name]["tok_s"] > 0, name
        assert report["systems"][name]["identical"] is True, (name, report.get("not_identical"))
    # pdserve with vLLM engines: vLLM's own KV registered in place (both engines' /metrics), no mirror
    pdserve_vllm = report["systems"]["pdserve_vllm"]
    assert set(PDSERVE_KEYS) <= set(pdserve_vllm)
    assert pdserve_vllm["kv_bytes_registered"] > 0 and pdserve_vllm["kv_mirror_bytes"] == 0
    assert pdserve_vllm["kv_staging"] == "none"
    # vLLM's 1P1D went through the proxy (one client for every system): both legs of each request
    legs = report["systems"]["vllm_pd_nixl"]["proxy"]
    assert legs["prefill_ms"]["p50"] > 0 and legs["decode_first_byte_ms"]["p50"] >= legs["prefill_ms"]["p50"]
    assert report["ratios"]["pdserve_vllm_over_vllm_pd_nixl_tok_s_ratio"] > 0
    assert len({report["systems"][n]["threads"] for n in report["systems"]}) == 1, "every system gets the same CPU"
