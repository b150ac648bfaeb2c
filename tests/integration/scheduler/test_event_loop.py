"""The scheduler process on uvloop (`--event-loop uvloop`): every server and client it runs
works there — the three gRPC servers, a rank's control stream, the HTTP API, the ZMQ publisher —
and SIGTERM still drains and exits 0. One real `pdserve scheduler` process; about 4 s."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import msgpack
import pytest
import zmq
from scheduler_harness import hello

from connectors.kv_events import BlockStored, KVEventBatch
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc
from services.common.config import SchedulerConfig
from services.common.event_loop import run_on_loop
from services.engine.control_client import ControlClient, StepReport
from services.local_cluster import free_port

ROOT = Path(__file__).resolve().parents[3]


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the scheduler exited with {proc.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port} after {timeout} s")


def _loaded_uvloop(pid: int) -> bool:
    """Whether the process mapped uvloop's compiled loop (it is imported only to run on it)."""
    return "uvloop/loop." in Path(f"/proc/{pid}/maps").read_text()


def _ints(obj: object) -> set[int]:
    if isinstance(obj, int):
        return {obj}
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else ()
    return set().union(*(_ints(x) for x in items))


def test_run_on_loop_runs_on_the_named_loop() -> None:
    async def loop_class() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_on_loop(loop_class(), "uvloop").startswith("uvloop")
    assert run_on_loop(loop_class(), "asyncio").startswith("asyncio")
    coro = loop_class()
    with pytest.raises(ValueError, match="event_loop: must be one of uvloop, asyncio, got 'trio'"):
        run_on_loop(coro, "trio")
    assert coro.cr_frame is None  # closed, never run: no "never awaited" warning


def test_uvloop_missing_runs_on_asyncio_s_loop(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    async def loop_class() -> str:
        return type(asyncio.get_running_loop()).__module__

    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert run_on_loop(loop_class(), "uvloop").startswith("asyncio")
    assert "event loop uvloop is not available" in caplog.text


def test_config_refuses_an_unknown_event_loop() -> None:
    with pytest.raises(ValueError, match="event_loop: must be uvloop or asyncio, got 'gevent'"):
        SchedulerConfig(event_loop="gevent").validate()


def test_scheduler_process_serves_everything_on_uvloop() -> None:
    port, control, events, http, pub = (free_port() for _ in range(5))
    argv = [sys.executable, "-m", "services.common.cli", "scheduler", "--port", str(port), "--control-port",
            str(control), "--events-port", str(events), "--metrics-port", "0", "--http-port", str(http),
            "--zmq-endpoint", f"tcp://127.0.0.1:{pub}", "--zmq-topic", "", "--log-level", "WARNING",
            "--event-loop", "uvloop"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "protos"),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    rank: ControlClient | None = None
    try:
        for p in (port, control, events, http):
            _wait_listening(p, proc)
        assert _loaded_uvloop(proc.pid)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 10_000)
        sub.connect(f"tcp://127.0.0.1:{pub}")
        # a rank's control stream: registration, a report, its Ack; the event goes out over ZMQ
        rank = ControlClient(f"127.0.0.1:{control}", hello("p0", "prefill", seed=SchedulerConfig().hash_seed))
        rank.start(10.0)
        time.sleep(0.2)  # the SUB's subscription reaches the PUB
        seq = rank.report(StepReport(engine_events=KVEventBatch(ts=1.0, events=[BlockStored((7,), None, (), 16)])))
        assert rank.wait_acked(seq, 10.0)
        _topic, _seq, payload = sub.recv_multipart()
        assert 7 in _ints(msgpack.unpackb(payload))  # the block hash, in vLLM's KVEventBatch encoding

        async def clients() -> tuple[int, httpx.Response]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                info = await generation_pb2_grpc.GenerationStub(channel).GetServerInfo(gen_pb.GetServerInfoRequest())
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http}", timeout=10) as client:
                return info.num_prefill_engines, await client.get("/v1/models")

        num_prefill, models = asyncio.run(clients())
        assert num_prefill == 1
        assert models.status_code == 200 and models.json()["data"][0]["object"] == "model"
        rank.close()
        rank = None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read().decode() if proc.stderr else ""
    finally:
        if rank is not None:
            rank.close()
        sub.close(0)
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
