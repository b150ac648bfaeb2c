"""The args and config files the chart gives `pdserve scheduler|prefill|decode|generate` are
accepted by the real CLI parser and config loader, so the chart cannot drift from the code."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from chart_render import CHART, config_files, of_kind, one, rendered
from google.protobuf import json_format

from pdserve.v1 import generation_pb2
from services.common.cli import build_parser
from services.common.config import EngineConfig, SchedulerConfig, load_config

POD_ENV = {"$(POD_NAME)": "demo-pdserve-prefill-0", "$(POD_IP)": "10.1.2.3"}
COMPONENTS = (("scheduler", "Deployment", SchedulerConfig), ("prefill", "StatefulSet", EngineConfig),
              ("decode", "StatefulSet", EngineConfig))


def _args_with_local_config(args: list[str], config_dir: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """The container args, with pod fields expanded and the mounted config path made local."""
    out = []
    for arg in args:
        arg = POD_ENV.get(arg, arg)
        if arg.startswith("/etc/pdserve/config/"):
            name = Path(arg).name
            local = config_dir / name
            local.write_text(yaml.safe_dump(files[name.removesuffix(".yaml")]))
            arg = str(local)
        out.append(arg)
    return out


def test_every_chart_config_key_is_a_config_field(values_name: str) -> None:
    configs = config_files(rendered(values_name))
    for component, _, cls in COMPONENTS:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(configs[component]) - fields
        assert not unknown, f"{component}: chart passes settings the code does not have: {unknown}"


def test_component_args_parse_and_load_with_the_real_cli(values_name: str, tmp_path: Path) -> None:
    docs = rendered(values_name)
    files = config_files(docs)
    for component, kind, cls in COMPONENTS:
        (container,) = one(docs, kind, component)["spec"]["template"]["spec"]["containers"]
        argv = _args_with_local_config(container["args"], tmp_path, files)
        assert argv[0] == component
        args = build_parser(component).parse_args(argv[1:])
        config: Any = load_config(cls, args, env={})
        assert config.block_size == files[component]["block_size"]
        if cls is EngineConfig:
            assert isinstance(config, EngineConfig)
            assert config.role == component
            assert config.engine_id == POD_ENV["$(POD_NAME)"]
            assert config.advertise_host == POD_ENV["$(POD_IP)"]
            assert config.tp == files[component]["tp"]


def test_helm_test_pod_runs_a_real_generate_command() -> None:
    docs = rendered("default")
    pods = of_kind(docs, "Pod")
    (pod,) = pods
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    argv = container["args"]
    assert argv[0] == "generate"
    args = build_parser("generate").parse_args(argv[1:])
    scheduler_port = config_files(docs)["scheduler"]["port"]
    assert args.target == f"demo-pdserve-scheduler:{scheduler_port}"
    assert args.prompt and args.max_tokens == 8
    (health,) = pod["spec"]["initContainers"]
    assert health["command"][:2] == ["python", "-c"] and health["command"][-1] == args.target
    compile(health["command"][2], "<helm-test health check>", "exec")


def test_a_bad_component_setting_is_refused_by_the_loader(tmp_path: Path) -> None:
    """The loader the chart relies on refuses what the chart could get wrong."""
    bad = tmp_path / "prefill.yaml"
    bad.write_text(yaml.safe_dump({"role": "prefill", "tp": 1, "blok_size": 16}))
    with pytest.raises(ValueError, match="unknown setting"):
        load_config(EngineConfig, build_parser("prefill").parse_args(["--config", str(bad)]), env={})


def test_notes_show_a_working_generate_command() -> None:
    chart = helm_python.Chart.load(str(CHART))
    try:
        notes = chart.render({"prefill": {"hpa": {"enabled": True}}}, name="demo", namespace="ns")[
            "pdserve/templates/NOTES.txt"]
    finally:
        chart.close()
    (line,) = [x.strip() for x in notes.splitlines() if x.strip().startswith("pdserve generate")]
    args = build_parser("generate").parse_args(shlex.split(line)[2:])
    assert args.target == "127.0.0.1:50051" and args.prompt == ["Hello"]
    (grpcurl,) = [shlex.split(x) for x in notes.splitlines() if "Generation/Generate" in x]
    request = json_format.Parse(grpcurl[grpcurl.index("-d") + 1], generation_pb2.GenerateRequest())
    assert request.text == "Hello" and request.sampling.max_tokens == 16
    assert grpcurl[-1] == f"{generation_pb2.DESCRIPTOR.package}.Generation/Generate"
    assert "HPA 1..4 x tp 1" in notes and "helm test demo" in notes
