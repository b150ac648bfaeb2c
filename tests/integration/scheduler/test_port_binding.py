"""A scheduler process binds its own ports and reports them (the launcher guesses none); a port
it was given that is taken ends it at once with EXIT_PORT_IN_USE naming the setting and port."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.bound_ports import EXIT_PORT_IN_USE, read_ports

ROOT = Path(__file__).resolve().parents[3]


def _scheduler(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "services.common.cli", "scheduler", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_ports(path: Path, settings: set[str], proc: subprocess.Popen[str]) -> dict[str, int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ports = {setting: port for (setting, _), port in read_ports(path).items()}
        if settings <= set(ports):
            return ports
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    raise AssertionError(f"no ports reported in {path}")


def test_ports_the_os_picks_are_reported_and_served(tmp_path: Path) -> None:
    path = tmp_path / "ports.jsonl"
    proc = _scheduler("--port", "0", "--control-port", "0", "--events-port", "0", "--http-port", "0",
                      "--metrics-port", "0", "--ephemeral-ports", "http_port,metrics_port", "--ports-file", str(path))
    try:
        ports = _wait_ports(path, {"port", "control_port", "events_port", "http_port", "metrics_port"}, proc)
        assert len(set(ports.values())) == 5 and all(ports.values())
        for setting in ("port", "control_port", "events_port"):
            with grpc.insecure_channel(f"127.0.0.1:{ports[setting]}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics_port']}/metrics", timeout=10).read()
        assert b"pdserve_" in metrics
        health = urllib.request.urlopen(f"http://127.0.0.1:{ports['http_port']}/health", timeout=10)
        assert health.status == 200
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_taken_port_ends_the_process_at_once_naming_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = _scheduler("--port", "0", "--control-port", str(port), "--events-port", "0", "--metrics-port", "0",
                          "--ports-file", str(tmp_path / "ports.jsonl"))
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PORT_IN_USE, out
    assert f"cannot bind control_port {port} on 127.0.0.1" in out
    assert time.monotonic() - started < 30


def test_an_ephemeral_port_setting_that_is_not_optional_is_refused() -> None:
    proc = _scheduler("--ephemeral-ports", "control_port")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "ephemeral_ports: control_port is not one of" in out


def test_pdserve_up_stops_with_the_reason_when_a_port_it_was_given_is_taken() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "services.common.cli", "up", "--control-port", str(port),
                               "--port", "0", "--events-port", "0", "--http-port", "0"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_PORT_IN_USE, done.stderr[-2000:]
    assert f"cannot bind control_port {port}" in done.stderr
    assert "pdserve up: scheduler exited with status 69 while starting (a port it was given is in use)" in done.stderr
    assert "Traceback" not in done.stderr
