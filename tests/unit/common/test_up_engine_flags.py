"""`pdserve up --engine / --vllm-arg`: checked before anything starts, passed to every engine."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from services import up
from services.local_cluster import LocalCluster


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_engine_gets_the_backend_and_its_vllm_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "_check_engine", lambda engine, vllm_args: None)  # vLLM need not be installed
    spec = up.spec_from_args(parse("--engine", "vllm", "--vllm-arg", "enforce_eager=true",
                                   "--vllm-arg", "swap_space=2", "--prefill", "2"))
    cluster = LocalCluster(spec)
    for role, index in [("prefill", 0), ("prefill", 1), ("decode", 0)]:
        argv = cluster._engine_component(role, index).argv
        i = argv.index("--engine")
        assert argv[i + 1] == "vllm"
        assert [argv[j + 1] for j, a in enumerate(argv) if a == "--vllm-arg"] == ["enforce_eager=true", "swap_space=2"]


def test_native_is_the_default() -> None:
    argv = LocalCluster(up.spec_from_args(parse()))._engine_component("decode", 0).argv
    assert argv[argv.index("--engine") + 1] == "native" and "--vllm-arg" not in argv


def test_bad_engine_flags_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="--vllm-arg applies only with --engine vllm"):
        up.spec_from_args(parse("--vllm-arg", "enforce_eager=true"))
    with pytest.raises(ValueError, match="vllm: tensor_parallel_size is set by pdserve: use --tp"):
        up.spec_from_args(parse("--engine", "vllm", "--vllm-arg", "tensor_parallel_size=2"))
    with pytest.raises(SystemExit, match="^2$"):
        parse("--engine", "sglang")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_vllm_without_vllm_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="vLLM is not installed in this environment: run `make install-vllm`"):
        up.spec_from_args(parse("--engine", "vllm"))
