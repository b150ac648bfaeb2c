"""A pdserve cluster as containers of one image on a user-defined Docker network.

Each container has its own network namespace: engines advertise their container name, KV moves
between containers over UCX's TCP transport, and the test reaches the scheduler and the metrics
ports only through ports published on the host's loopback. The network gets an explicit
/24 subnet out of 172.31.0.0/16 (the first one free); `close()` removes every container and the
network.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field

SCHEDULER_PORTS = {"port": 50051, "control": 50052, "events": 50053, "http": 8000, "metrics": 9400}
ENGINE_PORT = 50060
METRICS_PORT = 9400


def docker(*args: str, timeout: float = 120.0, check: bool = True) -> str:
    """Runs the docker CLI; raises with its stderr when it fails."""
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} ... failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip()


@dataclass(slots=True)
class DockerCluster:
    image: str
    prefix: str = field(default_factory=lambda: f"pdserve-t{os.getpid()}")
    network: str = ""
    subnet: str = ""
    containers: list[str] = field(default_factory=list)

    def create_network(self) -> None:
        name = f"{self.prefix}-net"
        for third in range(200, 256):
            subnet = f"172.31.{third}.0/24"
            proc = subprocess.run(["docker", "network", "create", "--driver", "bridge", "--subnet", subnet, name],
                                  capture_output=True, text=True, timeout=60)
            if proc.returncode == 0:
                self.network, self.subnet = name, subnet
                return
            if "overlap" not in proc.stderr:
                raise RuntimeError(f"docker network create {subnet}: {proc.stderr.strip()}")
        raise RuntimeError("no free /24 in 172.31.200.0-172.31.255.0 for the test network")

    def run(self, name: str, args: list[str], *, env: dict[str, str], publish: list[int]) -> str:
        """Starts a container `<prefix>-<name>` with `pdserve <args>`; returns its name."""
        full = f"{self.prefix}-{name}"
        cmd = ["run", "-d", "--name", full, "--network", self.network, "--hostname", full]
        for key, value in env.items():
            cmd += ["-e", f"{key}={value}"]
        for port in publish:
            cmd += ["-p", f"127.0.0.1::{port}"]
        docker(*cmd, self.image, *args)
        self.containers.append(full)
        return full

    def scheduler(self) -> str:
        p = SCHEDULER_PORTS
        return self.run("scheduler", [
            "scheduler", "--host", "0.0.0.0", "--allow-plaintext", "--control-port", str(p["control"]),
            "--events-port", str(p["events"]), "--http-port", str(p["http"]), "--metrics-port", str(p["metrics"]),
            "--path-policy", "remote", "--heartbeat-timeout-s", "3"],
            env={"PDSERVE_PORT": str(p["port"])}, publish=[p["port"], p["http"], p["metrics"]])

    def engine(self, role: str, engine_id: str, scheduler: str) -> str:
        name = f"{self.prefix}-{engine_id}"
        return self.run(engine_id, [
            role, "--host", "0.0.0.0", "--advertise-host", name, "--allow-plaintext", "--engine-id", engine_id,
            "--scheduler", f"{scheduler}:{SCHEDULER_PORTS['control']}", "--metrics-port", str(METRICS_PORT),
            "--ucx-tls", "tcp", "--kv-cache-memory", "64MiB", "--torch-threads", "1", "--dtype", "float32"],
            env={"PDSERVE_PORT": str(ENGINE_PORT)}, publish=[METRICS_PORT])

    def host_port(self, container: str, port: int) -> int:
        """The loopback port the container's `port` is published on."""
        out = docker("port", container, f"{port}/tcp")
        return int(out.splitlines()[0].rsplit(":", 1)[1])

    def state(self, container: str) -> dict[str, object]:
        return dict(json.loads(docker("inspect", "-f", "{{json .State}}", container)))

    def wait_healthy(self, containers: list[str], timeout: float = 240.0) -> None:
        """Waits for the image's HEALTHCHECK (`pdserve health`) to pass in every container."""
        deadline = time.monotonic() + timeout
        pending = list(containers)
        while pending:
            for c in list(pending):
                state = self.state(c)
                if not state.get("Running"):
                    raise RuntimeError(f"{c} exited ({state.get('ExitCode')}):\n{self.logs(c)}")
                if dict(state.get("Health") or {}).get("Status") == "healthy":  # type: ignore[call-overload]
                    pending.remove(c)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout:.0f} s: {pending}\n{self.logs(pending[0])}")
            time.sleep(1.0)

    def metrics(self, container: str, port: int = METRICS_PORT) -> str:
        url = f"http://127.0.0.1:{self.host_port(container, port)}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return str(reply.read().decode())

    def logs(self, container: str, tail: int = 60) -> str:
        proc = subprocess.run(["docker", "logs", "--tail", str(tail), container], capture_output=True, text=True,
                              timeout=30)
        return proc.stdout + proc.stderr

    def image_size_mib(self) -> float:
        return int(docker("image", "inspect", "-f", "{{.Size}}", self.image)) / 2**20

    def close(self) -> None:
        for c in self.containers:
            docker("rm", "-f", c, check=False, timeout=60)
        if self.network:
            docker("network", "rm", self.network, check=False, timeout=60)
