"""`bound_ports`: what a component reports of the ports it bound, read back by its launcher."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common.bound_ports import PortInUse, PortsFile, listen_port, parse_ephemeral, read_ports


def test_reports_are_read_back_per_setting_and_rank_the_last_one_winning(tmp_path: Path) -> None:
    path = tmp_path / "ports.jsonl"
    assert read_ports(path) == {}
    ports = PortsFile(str(path))
    ports.report("port", 41000)
    ports.report("metrics_port", 42000, rank=0)
    ports.report("metrics_port", 42007, rank=1)
    ports.report("http_port", 0)  # a listener that is off reports nothing
    ports.report("port", 41001)
    with path.open("a") as f:
        f.write('{"setting": "events_port", "po')  # torn: being written as it is read
    assert read_ports(path) == {("port", None): 41001, ("metrics_port", 0): 42000, ("metrics_port", 1): 42007}
    assert f'"pid": {os.getpid()}' in path.read_text()


def test_no_file_no_report(tmp_path: Path) -> None:
    PortsFile("").report("port", 41000)
    assert list(tmp_path.iterdir()) == []


def test_an_optional_listener_is_off_at_0_unless_ephemeral() -> None:
    assert listen_port("metrics_port", 9400, "") == 9400
    assert listen_port("metrics_port", 0, "") is None
    assert listen_port("metrics_port", 0, "http_port, metrics_port") == 0
    assert listen_port("http_port", 8000, "http_port") == 8000


def test_only_optional_listeners_can_be_ephemeral() -> None:
    assert parse_ephemeral("") == frozenset()
    with pytest.raises(ValueError, match="ephemeral_ports: port is not one of"):
        parse_ephemeral("port")
    with pytest.raises(ValueError, match="http_port is not one of health_port, metrics_port"):
        parse_ephemeral("http_port", frozenset({"metrics_port", "health_port"}))


def test_port_in_use_names_the_setting_and_port() -> None:
    error = PortInUse("control_port", "127.0.0.1", 50052)
    assert error.strerror == "cannot bind control_port 50052 on 127.0.0.1: address already in use"
