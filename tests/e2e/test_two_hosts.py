"""Prefill and decode on two "hosts" (bench/two_hosts.py): host a runs the scheduler and the
prefill engine, host b two decode engines; every process in its own network, IPC, PID, mount and
UTS namespace, so KV crosses the veth link over UCX's TCP transport and the decode engine
reaches the scheduler across the link. Outputs are token-identical to the in-process engine,
and the transport each pull used is reported as tcp (Engine.Inspect and the decode rank's
`pdserve_transfer_bytes_total{transport}`), a fallback below the expected `shm` counted; a
decode engine killed (SIGKILL, its whole process tree) while requests pull and decode on it
loses none of them: they finish on the other decode engine, token-identical."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from e2e_cluster import MAX_TOKENS

from bench.two_hosts import TwoHosts, unavailable
from pdserve.v1 import engine_pb2, engine_pb2_grpc
from services.client import AsyncClient
from services.local_cluster import free_port

pytestmark = pytest.mark.timeout(300)

_SKIP = unavailable()


class TwoHostCluster:
    """Scheduler and prefill-0 in host a, decode-0 and decode-1 in host b, plaintext gRPC on the link."""

    def __init__(self, hosts: TwoHosts, log_dir: Path) -> None:
        self.hosts = hosts
        self.log_dir = log_dir
        self.port, self.control_port, self.events_port, self.http_port = (free_port() for _ in range(4))
        self.engine_ports = {"prefill-0": free_port(), "decode-0": free_port(), "decode-1": free_port()}
        self.metrics_ports = {"decode-0": free_port(), "decode-1": free_port()}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, **hosts.ucx_env, "PYTHONUNBUFFERED": "1", "PDSERVE_TRANSFER_TIMEOUT_S": "3"}

    @property
    def target(self) -> str:
        return f"{self.hosts.a.address}:{self.port}"

    def engine_target(self, name: str) -> str:
        host = self.hosts.a if name.startswith("prefill") else self.hosts.b
        return f"{host.address}:{self.engine_ports[name]}"

    def _start(self, host_name: str, name: str, argv: list[str]) -> None:
        host = self.hosts.a if host_name == "a" else self.hosts.b
        with (self.log_dir / f"{name}.log").open("ab") as out:
            self.procs[name] = host.popen([sys.executable, "-m", "services.common.cli", *argv], env=self.env,
                                          stdout=out, stderr=out)

    def start(self) -> None:
        a = self.hosts.a.address
        self._start("a", "scheduler", [
            "scheduler", "--host", "0.0.0.0", "--port", str(self.port), "--control-port", str(self.control_port),
            "--events-port", str(self.events_port), "--http-port", str(self.http_port), "--allow-plaintext",
            "--path-policy", "remote"])
        common = ["--scheduler", f"{a}:{self.control_port}", "--allow-plaintext", "--torch-threads", "1",
                  "--kv-cache-memory", "64MiB", "--dtype", "float32", "--expected-transports", "shm"]
        self._start("a", "prefill-0", ["prefill", "--engine-id", "prefill-0", "--host", a,
                                        "--port", str(self.engine_ports["prefill-0"]), *common])
        for name in ("decode-0", "decode-1"):
            self._start("b", name, ["decode", "--engine-id", name, "--host", "0.0.0.0",
                                    "--advertise-host", self.hosts.b.address, "--port", str(self.engine_ports[name]),
                                    "--metrics-port", str(self.metrics_ports[name]), *common])

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._inspect(name, 2.0) is not None for name in self.engine_ports):
                if asyncio.run(self._generate_once()):
                    return
            time.sleep(0.5)
        logs = {p.name: p.read_text()[-1500:] for p in self.log_dir.glob("*.log")}
        raise TimeoutError(f"two-host cluster not ready in {timeout}s; logs: {logs}")

    async def _generate_once(self) -> bool:
        try:
            async with AsyncClient(self.target) as client:
                await client.generate([1, 2, 3], max_tokens=1, temperature=0.0, timeout=10)
            return True
        except Exception:
            return False

    def _inspect(self, name: str, timeout: float) -> engine_pb2.InspectResponse | None:
        try:
            with grpc.insecure_channel(self.engine_target(name)) as channel:
                return engine_pb2_grpc.EngineStub(channel).Inspect(engine_pb2.InspectRequest(), timeout=timeout)
        except grpc.RpcError:
            return None

    def inspect(self, name: str) -> engine_pb2.InspectResponse:
        found = self._inspect(name, 5.0)
        assert found is not None, f"{name} does not answer Inspect"
        return found

    def kill(self, name: str) -> None:
        """SIGKILL to the engine's whole process tree (its namespace's init included)."""
        self.hosts.b.kill(self.procs[name])
        self.procs[name].wait(10)

    def metrics(self, name: str) -> str:
        url = f"http://{self.hosts.b.address}:{self.metrics_ports[name]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHostCluster]:
    if _SKIP is not None:
        pytest.skip(f"two namespaced hosts cannot be made here: {_SKIP}")
    with TwoHosts() as hosts:
        cluster = TwoHostCluster(hosts, tmp_path_factory.mktemp("two-hosts"))
        cluster.start()
        cluster.wait_ready(float(os.environ.get("PDSERVE_E2E_START_TIMEOUT", "180")))
        yield cluster


async def _generate_all(target: str, prompts: list[list[int]]) -> list[object]:
    async with AsyncClient(target) as client:
        return list(await asyncio.gather(*(
            client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=120)
            for p in prompts)))


def test_kv_crosses_the_link_over_tcp_and_outputs_match_the_in_process_engine(
        two_hosts: TwoHostCluster, prompts: list[list[int]], reference: list[list[int]]) -> None:
    batch = prompts[:8]
    results = asyncio.run(_generate_all(two_hosts.target, batch))
    for i, (result, expected) in enumerate(zip(results, reference[:8], strict=True)):
        assert result.token_ids == expected, f"prompt {i}"  # type: ignore[attr-defined]
        assert result.prefill_engine_id == "prefill-0"  # type: ignore[attr-defined]
    assert sum(r.transferred_tokens for r in results) > 0  # type: ignore[attr-defined]
    used = {r.decode_engine_id for r in results if r.transferred_tokens}  # type: ignore[attr-defined]

    # A decode engine on host b names the transport its pulls from host a's prefill used.
    name = sorted(used)[0]
    peers = two_hosts.inspect(name).peer_transports
    assert [(p.engine_id, p.tp_rank, p.transport) for p in peers] == [("prefill-0", 0, "tcp")]
    text = two_hosts.metrics(name)
    tcp_bytes = [line for line in text.splitlines()
                 if line.startswith("pdserve_transfer_bytes_total{") and 'transport="tcp"' in line]
    assert tcp_bytes and float(tcp_bytes[0].rsplit(" ", 1)[1]) > 0, text
    for shared in ("sysv", "posix", "cma"):
        assert f'transport="{shared}"' not in text
    # `--expected-transports shm`: every pull over tcp is a fallback, counted.
    fallbacks = [line for line in text.splitlines()
                 if line.startswith("pdserve_transfer_transport_fallbacks_total{") and 'actual="tcp"' in line]
    assert fallbacks and 'expected="shm"' in fallbacks[0] and float(fallbacks[0].rsplit(" ", 1)[1]) >= 1
    assert _leaks_clear(two_hosts, list(two_hosts.engine_ports))


def test_a_decode_engine_killed_mid_pull_loses_nothing(
        two_hosts: TwoHostCluster, prompts: list[list[int]], reference: list[list[int]]) -> None:
    """Runs last in the module: the engine killed stays dead."""
    decodes = ["decode-0", "decode-1"]

    async def run() -> tuple[list[object], str, str]:
        task = asyncio.ensure_future(_generate_all(two_hosts.target, prompts * 2))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # kill a decode engine while it pulls (else while it decodes)
            for name in decodes:
                load = await asyncio.to_thread(two_hosts.inspect, name)
                state = ("pulling" if load.num_waiting_for_remote_kv else
                         "decoding" if load.num_running and time.monotonic() > deadline - 7 else "")
                if state:
                    two_hosts.kill(name)
                    return await task, name, state
        return await task, "", "nothing"

    results, victim, state = asyncio.run(run())
    assert victim, "no decode engine ever held a request"
    for i, (result, expected) in enumerate(zip(results, reference * 2, strict=True)):
        assert result.token_ids == expected, f"prompt {i} ({victim} killed while {state})"  # type: ignore[attr-defined]
    assert sum(r.num_migrations for r in results) >= 1  # type: ignore[attr-defined]
    assert _leaks_clear(two_hosts, ["prefill-0", *(d for d in decodes if d != victim)])


def _leaks_clear(cluster: TwoHostCluster, names: list[str], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not cluster.inspect(name).leaks for name in names):
            return True
        time.sleep(0.2)
    return False
