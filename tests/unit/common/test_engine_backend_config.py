"""`--engine` and the vLLM pass-through arguments (`--vllm-arg`, the YAML `vllm:` section)."""

import argparse

import pytest

from services.common.config import EngineConfig, add_config_arguments, load_config


def _load(argv: list[str], env: dict[str, str] | None = None) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    return load_config(EngineConfig, parser.parse_args(argv), env=env or {})


def test_native_is_the_default_and_takes_no_vllm_args() -> None:
    cfg = _load([])
    assert cfg.engine == "native" and cfg.vllm == {}
    with pytest.raises(ValueError, match="only with --engine vllm"):
        _load(["--vllm-arg", "enforce_eager=true"])


def test_vllm_args_are_typed_yaml_values_with_underscored_names() -> None:
    cfg = _load(["--engine", "vllm", "--vllm-arg", "enforce-eager=true", "--vllm-arg", "gpu_memory_utilization=0.5",
                 "--vllm-arg", "swap_space=4", "--vllm-arg", "tokenizer_mode=slow",
                 "--vllm-arg", 'compilation_config={"level": 0}'])
    assert cfg.vllm == {"enforce_eager": True, "gpu_memory_utilization": 0.5, "swap_space": 4,
                        "tokenizer_mode": "slow", "compilation_config": {"level": 0}}


def test_yaml_section_env_and_flags_merge_key_by_key(tmp_path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("engine: vllm\nvllm:\n  enforce_eager: true\n  swap_space: 2\n  seed: 7\n")
    cfg = _load(["--config", str(path), "--vllm-arg", "swap_space=8"], env={"PDSERVE_VLLM": "{seed: 9}"})
    assert cfg.engine == "vllm"
    assert cfg.vllm == {"enforce_eager": True, "swap_space": 8, "seed": 9}  # flag > env > YAML, per key


@pytest.mark.parametrize(("argv", "message"), [
    (["--vllm-arg", "enforce_eager"], "expected KEY=VALUE, got 'enforce_eager'"),
    (["--vllm-arg", "=1"], "expected KEY=VALUE"),
    (["--vllm-arg", "swap_space="], "swap_space has no value"),
    (["--vllm-arg", "bad key=1"], "'bad_key' is not|'bad key' is not"),
    (["--vllm-arg", "tensor_parallel_size=2"], "tensor_parallel_size is set by pdserve: use --tp"),
    (["--vllm-arg", "block-size=32"], "block_size is set by pdserve: use --block-size"),
    (["--vllm-arg", "kv_transfer_config={}"], "kv_transfer_config is set by pdserve"),
    (["--vllm-arg", "x=[1"], "x: cannot read"),
])
def test_bad_vllm_args_are_refused_with_the_reason(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=f"^vllm: ({message})"):
        _load(["--engine", "vllm", *argv])


def test_yaml_vllm_section_must_be_a_mapping(tmp_path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("engine: vllm\nvllm: [enforce_eager]\n")
    with pytest.raises(ValueError, match="expected KEY=VALUE, got 'enforce_eager'"):
        _load(["--config", str(path)])
    path.write_text("engine: vllm\nvllm: 3\n")
    with pytest.raises(ValueError, match="vllm: expected a mapping of vLLM engine arguments, got 3"):
        _load(["--config", str(path)])


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="^engine: must be one of native, vllm, got 'sglang'"):
        _load(["--engine", "sglang"])
