import argparse

import pytest

from services.common.config import (
    EngineConfig,
    SchedulerConfig,
    add_config_arguments,
    load_config,
    parse_size,
)


def _parse(cls: type, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls)
    return parser.parse_args(argv)


def test_precedence_defaults_yaml_env_flags(tmp_path) -> None:
    cfg_file = tmp_path / "engine.yaml"
    cfg_file.write_text("tp: 2\nblock_size: 32\nmax-num-seqs: 8\n")
    args = _parse(EngineConfig, ["--config", str(cfg_file), "--block-size", "64"])
    cfg = load_config(EngineConfig, args, env={"PDSERVE_MAX_NUM_SEQS": "4", "PDSERVE_TP": "3"})
    assert cfg.block_size == 64  # flag beats YAML
    assert cfg.max_num_seqs == 4  # env beats YAML
    assert cfg.tp == 3
    assert cfg.lease_s == 30.0  # default


def test_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="^tp: must be >= 1"):
        load_config(EngineConfig, _parse(EngineConfig, ["--tp", "0"]), env={})
    with pytest.raises(ValueError, match="routing_policy"):
        load_config(SchedulerConfig, _parse(SchedulerConfig, ["--routing-policy", "magic"]), env={})
    with pytest.raises(ValueError, match="block_size: expected int"):
        load_config(EngineConfig, _parse(EngineConfig, ["--block-size", "sixteen"]), env={})
    with pytest.raises(ValueError, match="kv_cache_memory"):
        load_config(EngineConfig, _parse(EngineConfig, ["--kv-cache-memory", "lots"]), env={})


def test_unknown_yaml_key_is_refused(tmp_path) -> None:
    cfg_file = tmp_path / "s.yaml"
    cfg_file.write_text("port: 1\nbogus: 2\n")
    with pytest.raises(ValueError, match="unknown setting 'bogus'"):
        load_config(SchedulerConfig, _parse(SchedulerConfig, ["--config", str(cfg_file)]), env={})


def test_parse_size() -> None:
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2G") == 2 << 30
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError, match="not a byte size: '12 parsecs'"):
        parse_size("12 parsecs")
