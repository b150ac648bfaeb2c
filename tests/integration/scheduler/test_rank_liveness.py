"""A rank's liveness as the scheduler judges it (docs/architecture.md, liveness): a real Control
server (the scheduler service's keepalive options) and real ControlClients in rank processes.

- A rank whose step (main) thread is blocked, or computes in Python, for several heartbeat
  timeouts is not declared down: its control thread beats on its own.
- A killed rank (SIGKILL) is down within the heartbeat timeout: its stream closes.
- A frozen rank (SIGSTOP: no thread of it runs) of a multi-rank CPU engine, whose heartbeat
  timeout is long, is down within the base heartbeat timeout: the transport's PINGs go
  unanswered and the connection closes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from pdserve.v1 import control_pb2_grpc
from services.common.grpc_server import ServiceServer
from services.scheduler.control import ControlServicer
from services.scheduler.lifecycle import EngineRef
from services.scheduler.registry import EngineRegistry

INTERVAL_S = 0.1
TIMEOUT_S = 0.5  # the base heartbeat timeout
MULTIRANK_CPU_TIMEOUT_S = 30.0  # long: a frozen multi-rank CPU rank must be found by the transport

# A rank process: registers, says "ready", then its main thread does what stdin says.
RANK = """
import sys, time
from services.engine.control_client import ControlClient, ControlHello, RankIdentity
port, engine_id, tp_size = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
hello = ControlHello(RankIdentity(engine_id, "prefill", 5, 0, tp_size), "compat-1", "127.0.0.1:7000", b"m",
                     hash_seed="0", block_size=16, device_kind="cpu")
client = ControlClient(f"127.0.0.1:{port}", hello)
client.start(10)
print("ready", flush=True)
for line in sys.stdin:
    what, seconds = line.split()
    end = time.monotonic() + float(seconds)
    if what == "block":  # a step stuck in a call that releases the interpreter (a collective, a kernel)
        time.sleep(float(seconds))
    else:  # a step computing in Python: holds the interpreter, handing it over every switch interval
        while time.monotonic() < end:
            sum(range(1000))
    print("done", flush=True)
"""


class Scheduler:
    def __init__(self) -> None:
        self.registry = EngineRegistry(block_size=16, hash_seed="0", heartbeat_timeout_s=TIMEOUT_S,
                                       multirank_cpu_heartbeat_timeout_s=MULTIRANK_CPU_TIMEOUT_S)
        self.control = ControlServicer(self.registry, heartbeat_interval_s=INTERVAL_S, scheduler_id="liveness")
        self.server = ServiceServer(["pdserve.v1.Control"], options=self.control.keepalive_options())
        control_pb2_grpc.add_ControlServicer_to_server(self.control, self.server.server)
        self.port = self.server.bind("127.0.0.1", 0)
        self.down: dict[str, tuple[float, str]] = {}
        self.control.on_engine_down.append(self._on_down)
        self.procs: list[subprocess.Popen[str]] = []

    def _on_down(self, ref: EngineRef, reason: str) -> None:
        self.down.setdefault(ref.engine_id, (time.monotonic(), reason))

    async def rank(self, engine_id: str, tp_size: int = 1) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", RANK, str(self.port), engine_id, str(tp_size)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        self.procs.append(proc)
        assert await asyncio.to_thread(proc.stdout.readline) == "ready\n"
        return proc


@pytest.fixture
async def scheduler() -> AsyncIterator[Scheduler]:
    s = Scheduler()
    await s.server.start()
    s.control.start_monitor()
    try:
        yield s
    finally:
        for p in s.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        await s.control.stop()
        await s.server.stop(0)


async def _step(proc: subprocess.Popen[str], what: str, seconds: float) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{what} {seconds}\n")
    proc.stdin.flush()
    assert await asyncio.to_thread(proc.stdout.readline) == "done\n"


async def _until_down(s: Scheduler, engine_id: str, limit_s: float) -> tuple[float, str]:
    start = time.monotonic()
    while engine_id not in s.down:
        assert time.monotonic() - start < limit_s, f"{engine_id} not declared down within {limit_s} s"
        await asyncio.sleep(0.02)
    return s.down[engine_id][0] - start, s.down[engine_id][1]


async def test_a_busy_rank_stays_up_and_a_killed_one_goes_down_within_the_timeout(scheduler: Scheduler) -> None:
    s = scheduler
    proc = await s.rank("p-busy")
    await _step(proc, "block", 3 * TIMEOUT_S)
    await _step(proc, "compute", 3 * TIMEOUT_S)
    assert s.down == {} and s.registry.engines["p-busy"].routable
    proc.send_signal(signal.SIGKILL)
    took, reason = await _until_down(s, "p-busy", TIMEOUT_S + 1.0)
    print(f"killed rank down after {took:.2f} s: {reason}")
    assert took <= TIMEOUT_S and "lost its control stream" in reason, (took, reason)


async def test_a_frozen_rank_of_a_multirank_cpu_engine_goes_down_within_the_base_timeout(
        scheduler: Scheduler) -> None:
    s = scheduler
    proc = await s.rank("p-cpu2", tp_size=2)
    engine = s.registry.engines["p-cpu2"]
    assert s.registry.heartbeat_timeout(engine) == MULTIRANK_CPU_TIMEOUT_S
    await _step(proc, "block", 2 * TIMEOUT_S)
    assert s.down == {}
    proc.send_signal(signal.SIGSTOP)  # no thread of the process runs: no beat, no PING answered
    try:
        # PING every interval, unanswered for the timeout, then the reconnect grace (<= interval).
        took, reason = await _until_down(s, "p-cpu2", MULTIRANK_CPU_TIMEOUT_S / 2)
        print(f"frozen rank down after {took:.2f} s: {reason}")
        assert took <= INTERVAL_S + TIMEOUT_S + INTERVAL_S + 0.5, (took, reason)
        assert EngineRef("p-cpu2", 5) in s.control.down
    finally:
        proc.send_signal(signal.SIGCONT)
