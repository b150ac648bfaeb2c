"""What a rank's reports cost the rank: `ControlClient` against a real Control server (decision 0045).

One engine of tp 8: 8 real `ControlClient`s (each its own stream and thread, as 8 rank
processes would have) report every step's 64 CPU_OFFLOAD BlockStored (`bench.events_load.
step_events`) to a real `ControlServicer` behind a real gRPC server in this process (its own
thread and loop), paced at STEPS_PER_S. Prints, per report: the CPU the caller's thread spends in
`ControlClient.report()` (what the forward pass pays) and the CPU of the clients' own threads
(encoding is the caller's; these send, read Acks and prune the buffer).

    PYTHONPATH=.:protos .venv/bin/python docs/data/control_client_micro.py 2000

Run it from a detached worktree of another commit (PYTHONPATH pointing there) for the baseline,
alternating runs.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

from bench.events_load import step_events
from pdserve.v1 import control_pb2_grpc
from services.common.grpc_server import ServiceServer
from services.engine.control_client import ControlClient, ControlHello, RankIdentity, StepReport
from services.scheduler.control import ControlServicer
from services.scheduler.registry import EngineRegistry

TP, EVENTS, STEPS_PER_S = 8, 64, 400


def _threads_cpu_s(clients: list[ControlClient]) -> float:
    """utime + stime of the clients' own threads (gRPC core's threads not included)."""
    total = 0
    for client in clients:
        assert client._thread is not None and client._thread.native_id is not None
        fields = Path(f"/proc/self/task/{client._thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _serve(port_box: list[int], ready: threading.Event, stop: threading.Event) -> None:
    async def main() -> None:
        registry = EngineRegistry(block_size=16, hash_seed="0", heartbeat_timeout_s=120.0)
        control = ControlServicer(registry, heartbeat_interval_s=1.0, scheduler_id="micro")
        server = ServiceServer(["pdserve.v1.Control"], options=control.flow_options())
        control_pb2_grpc.add_ControlServicer_to_server(control, server.server)
        port_box.append(server.bind("127.0.0.1", 0))
        await server.start()
        control.start_monitor()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await control.stop()
        await server.stop(0)

    asyncio.run(main())


def main(steps: int) -> None:
    port: list[int] = []
    ready, stop = threading.Event(), threading.Event()
    server = threading.Thread(target=_serve, args=(port, ready, stop), name="scheduler", daemon=True)
    server.start()
    ready.wait(30)
    clients = []
    for r in range(TP):
        hello = ControlHello(RankIdentity("micro-p0", "prefill", 1000, r, TP), "bench", "127.0.0.1:1", b"",
                             hash_seed="0", block_size=16)
        client = ControlClient(f"127.0.0.1:{port[0]}", hello)
        client.start(30.0)
        clients.append(client)
    report_cpu = 0.0
    threads0 = _threads_cpu_s(clients)
    t0 = time.monotonic()
    for s in range(steps):
        events = step_events(time.time(), EVENTS)
        for client in clients:
            c0 = time.thread_time()
            client.report(StepReport(worker_events=events))
            report_cpu += time.thread_time() - c0
        delay = t0 + (s + 1) / STEPS_PER_S - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    for client in clients:
        client.wait_acked(client.last_seq, 30.0)
    threads_cpu = _threads_cpu_s(clients) - threads0
    for client in clients:
        client.close()
    stop.set()
    server.join(10)
    reports = steps * TP
    print(f"{steps} steps x {TP} ranks, {EVENTS} events: report() {report_cpu / reports * 1e6:.1f} us CPU per report "
          f"(caller); client threads {threads_cpu / reports * 1e6:.1f} us CPU per report")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
