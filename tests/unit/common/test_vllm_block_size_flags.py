"""A vLLM cluster runs with block size 32 on the scheduler and every engine (vLLM's CPU attention
takes multiples of 32), from `pdserve up --engine vllm` and `pdserve bench serve --engine vllm`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import serve
from services import up
from services.local_cluster import LocalCluster


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def parse_up(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, expected", [
    (("--engine", "vllm"), "32"),
    (("--engine", "vllm", "--block-size", "64"), "64"),
    ((), None),  # native: the components' own default (16)
    (("--block-size", "32"), "32"),
])
def test_up_sets_one_block_size_on_scheduler_and_engines(monkeypatch: pytest.MonkeyPatch,
                                                          argv: tuple[str, ...], expected: str | None) -> None:
    monkeypatch.setattr(up, "_check_engine", lambda engine, vllm_args: None)  # vLLM need not be installed
    cluster = LocalCluster(up.spec_from_args(parse_up(*argv)))
    assert _flag(cluster._scheduler_component().argv, "--block-size") == expected
    assert _flag(cluster._engine_component("decode", 0).argv, "--block-size") == expected


def test_bench_serve_engine_vllm_sets_the_backend_block_size_and_dtype() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--engine", "vllm", "--vllm-arg", "enforce_eager=true", "--dtype", "bfloat16"])
    cluster = serve._engine_cluster_args(args, {"num_prefill": 1, "scheduler_args": ["--routing-policy", "prefix"]})
    assert cluster["engine"] == "vllm" and cluster["vllm_args"] == ["enforce_eager=true"]
    assert _flag(cluster["engine_args"], "--block-size") == "32" and _flag(cluster["engine_args"], "--dtype") == "bfloat16"
    assert cluster["scheduler_args"] == ["--routing-policy", "prefix", "--block-size", "32"]
    native = serve._engine_cluster_args(parser.parse_args([]), {"num_prefill": 0})
    assert "engine" not in native and native["engine_args"] == [] and native["scheduler_args"] == []


def test_compare_vllm_passes_vllm_args_to_every_vllm_server_as_flags() -> None:
    from bench.vllm_compare import server_flags

    assert server_flags(["enforce_eager=true", "enable_prefix_caching=false", "swap-space=0.5",
                         'compilation_config={"mode": 0}']) == [
        "--enforce-eager", "--no-enable-prefix-caching", "--swap-space", "0.5", "--compilation-config", '{"mode": 0}']
    assert server_flags([]) == []
    with pytest.raises(ValueError, match="max_model_len is set by pdserve"):
        server_flags(["max_model_len=64"])
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        server_flags(["enforce_eager"])


def test_compare_vllm_refuses_a_bad_vllm_arg_before_starting_anything(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from services.common.cli import main

    assert main(["bench", "serve", "--compare", "vllm", "--out", str(tmp_path), "--vllm-arg", "dtype=float16"]) == 2
    assert "dtype is set by pdserve: use --dtype" in capsys.readouterr().err
    assert not (tmp_path / "serve_compare.json").exists()


def test_compare_vllm_refuses_an_unknown_system_before_starting_anything(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from services.common.cli import main

    assert main(["bench", "serve", "--compare", "vllm", "--out", str(tmp_path),
                 "--systems", "pdserve,pdserve_vllm_stagin"]) == 2
    assert "--systems: unknown pdserve_vllm_stagin (known: vllm_colocated," in capsys.readouterr().err
    assert not (tmp_path / "serve_compare.json").exists()


def test_compare_vllm_ratios_put_zero_copy_beside_the_staging_copy() -> None:
    from bench.vllm_compare import ratios

    def system(tok_s: float, ttft: float, itl: float) -> dict[str, float]:
        return {"tok_s": tok_s, "ttft_p50_ms": ttft, "itl_p99_ms": itl}

    out = ratios({"pdserve_vllm": system(30.0, 500.0, 200.0), "pdserve_vllm_staging": system(20.0, 1000.0, 400.0),
                  "vllm_colocated": system(40.0, 400.0, 800.0)})
    assert out["pdserve_vllm_over_pdserve_vllm_staging_tok_s_ratio"] == 1.5
    assert out["pdserve_vllm_over_pdserve_vllm_staging_ttft_p50_ratio"] == 0.5
    assert out["pdserve_vllm_over_vllm_colocated_itl_p99_ratio"] == 0.25
    assert not any(key.startswith("pdserve_over") for key in out)  # native pdserve not measured
