"""`prefill.engine` / `decode.engine` (native | vllm): passed to the engine as `--engine`, vLLM's
arguments through `config.vllm`, the vLLM image by default tag; what the pod runs loads as an
EngineConfig. Renders offline (about 1 s per render)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from chart_render import CHART, config_files, one, render_values

from services.common.config import EngineConfig, add_config_arguments, load_config


def _engine(docs: list[tuple[str, dict[str, Any]]], role: str) -> dict[str, Any]:
    return one(docs, "StatefulSet", role)["spec"]["template"]["spec"]["containers"][0]


def _load_pod_config(docs: list[tuple[str, dict[str, Any]]], role: str, tmp_path: Path) -> EngineConfig:
    """The EngineConfig the role's container builds from its args and its config file."""
    path = tmp_path / f"{role}.yaml"
    path.write_text(yaml.safe_dump(config_files(docs)[role]))
    args = [str(a) for a in _engine(docs, role)["args"]]
    args[args.index("--config") + 1] = str(path)
    args = [a.replace("$(POD_NAME)", f"{role}-0").replace("$(POD_IP)", "10.0.0.1") for a in args]
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    assert args[0] == role
    return load_config(EngineConfig, parser.parse_args(args[1:]), env={},
                       overrides={"role": role, "allow_plaintext": True})


def test_default_engines_are_native(tmp_path: Path) -> None:
    docs = render_values({})
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for role in ("prefill", "decode"):
        container = _engine(docs, role)
        assert container["image"] == f"ghcr.io/pdserve/pdserve:{version}"
        config = _load_pod_config(docs, role, tmp_path)
        assert config.engine == "native" and config.vllm == {}


def test_vllm_engine_per_role_with_its_arguments(tmp_path: Path) -> None:
    docs = render_values({"gpu": {"enabled": False},
                          "decode": {"engine": "vllm", "config": {"vllm": {"enforce_eager": True, "swap_space": 2}}}})
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert _engine(docs, "decode")["image"] == f"ghcr.io/pdserve/pdserve:{version}-cpu-vllm"
    assert _engine(docs, "prefill")["image"] == f"ghcr.io/pdserve/pdserve:{version}-cpu"
    decode = _load_pod_config(docs, "decode", tmp_path)
    assert decode.engine == "vllm" and decode.vllm == {"enforce_eager": True, "swap_space": 2}
    assert _load_pod_config(docs, "prefill", tmp_path).engine == "native"


def test_explicit_image_tag_is_used_as_given() -> None:
    docs = render_values({"image": {"tag": "mine"}, "prefill": {"engine": "vllm"}})
    assert _engine(docs, "prefill")["image"] == "ghcr.io/pdserve/pdserve:mine"


def test_bad_engine_values_fail_the_render() -> None:
    with pytest.raises(helm_python.errors.HelmValuesError, match="/prefill/engine': value must be one of 'native', 'vllm'"):
        render_values({"prefill": {"engine": "sglang"}})
    with pytest.raises(helm_python.HelmRenderError, match="decode.config.vllm .*needs decode.engine: vllm"):
        render_values({"decode": {"config": {"vllm": {"enforce_eager": True}}}})
    with pytest.raises(helm_python.HelmRenderError, match="prefill.config.engine is set by the chart"):
        render_values({"prefill": {"config": {"engine": "vllm"}}})
