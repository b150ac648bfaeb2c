"""The engine-loop thread binds rank 0's CUDA device before it runs anything (CUDA's current
device is per thread; the thread that built the engine bound it for itself only).

Without a GPU the binding is observed through a stand-in for `torch.cuda.set_device` and an
engine stand-in that has only what `EngineLoop` touches when idle; with two GPUs the real
current device is read on the loop thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from engine.device import DevicePlan, bind_thread_device
from services.engine.native import loop as loop_module
from services.engine.native.loop import EngineLoop


@dataclass
class _Load:
    num_running: int = 0
    num_waiting: int = 0


@dataclass
class _Workers:
    procs: list[Any] = field(default_factory=list)


@dataclass
class _IdleEngine:
    """What an idle `EngineLoop` reads from its engine: the device plan, the load, the ranks,
    undelivered outputs."""

    device_plan: DevicePlan
    workers: _Workers = field(default_factory=_Workers)

    def load(self) -> _Load:
        return _Load()

    def has_outputs_to_report(self) -> bool:
        return False


def _run_on_loop(engine: Any, fn: Any) -> Any:
    loop = EngineLoop(engine, deliver=lambda _: None, flush_pending=lambda: False,
                      after_step=lambda *_: None, periodic=lambda _: None)
    loop.start()
    try:
        return loop.call(fn).result(timeout=10)
    finally:
        loop.stop()


def test_loop_thread_binds_rank0_device_before_any_call(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(loop_module, "bind_thread_device",
                        lambda device: events.append(("bind", f"{threading.current_thread().name} {device}")))
    engine = _IdleEngine(DevicePlan("cuda", ("cuda:3", "cuda:1"), "bfloat16"))
    _run_on_loop(engine, lambda _: events.append(("call", threading.current_thread().name)))
    assert events == [("bind", "engine-loop cuda:3"), ("call", "engine-loop")]


def test_bind_thread_device_sets_cuda_devices_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    bind_thread_device("cpu")
    assert calls == []
    bind_thread_device("cuda:1")
    assert calls == [torch.device("cuda:1")]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason=f"needs 2 CUDA GPUs (torch sees "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})")
def test_loop_thread_current_cuda_device_is_rank0s() -> None:
    engine = _IdleEngine(DevicePlan("cuda", ("cuda:1",), "bfloat16"))
    assert _run_on_loop(engine, lambda _: torch.cuda.current_device()) == 1
    assert torch.cuda.current_device() == 0  # the test's own thread was left alone
