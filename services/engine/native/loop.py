"""`EngineLoop`: the one thread that owns an `LLMEngine`.

The engine is synchronous and not thread-safe; gRPC handlers, the control stream and timers
hand it work with `call(fn)` (fn runs on the loop thread between steps) and receive outputs
through the `deliver` callback. On CUDA the loop thread makes rank 0's GPU its current device
before anything else runs on it. The loop steps only while there is schedulable work, so an
idle engine — or one whose requests all wait for remote KV — costs no CPU.

Data-plane commands queued on the scheduler-side connector during a step (a prefill request
pinned for readers, a pull to start) are flushed to every rank by a command-only plan (no model
compute: a prompt queued meanwhile waits for the next step) before that step's outputs are
delivered: a descriptor never leaves before every rank pinned its blocks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.device import bind_thread_device
from engine.llm_engine import LLMEngine
from engine.request import RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_WAIT_S = 0.05


@dataclass(slots=True)
class Delivery:
    """One step output plus what the service needs with it (prefill: the prompt's blocks)."""

    output: RequestOutput
    block_ids: list[int] = field(default_factory=list)
    first: bool = False  # the request's first output from this engine


class EngineLoop:
    def __init__(self, engine: LLMEngine, *, deliver: Callable[[list[Delivery]], None],
                 flush_pending: Callable[[], bool],
                 after_step: Callable[[LLMEngine, float, list[Delivery]], None],
                 periodic: Callable[[LLMEngine], None], period_s: float = 0.25) -> None:
        self.engine = engine
        self._deliver = deliver
        self._flush_pending = flush_pending
        self._after_step = after_step
        self._periodic = periodic
        self._period_s = period_s
        self._calls: list[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future[Any]]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Set when a step raised (e.g. a rank process died mid-collective): the engine is
        # unusable and the loop has ended; the service must exit so its supervisor restarts it.
        self.failed = threading.Event()
        self._thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)
        self.num_steps = 0
        self._started: set[str] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Runs fn(engine) on the loop thread before the next step; its result or exception
        lands in the returned future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._calls.append((fn, future))
        self._wake.set()
        return future

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

    def _has_work(self) -> bool:
        load = self.engine.load()
        # An abort of the last running request leaves nothing to compute, but its "abort" output
        # must still be delivered: its stream waits for it.
        return bool(load.num_running or load.num_waiting) or self.engine.has_outputs_to_report() \
            or self._flush_pending()

    def _main(self) -> None:
        try:
            # The thread that built the engine bound rank 0's GPU for itself only (CUDA's current
            # device is per thread); the step's bare current-stream synchronize runs here.
            bind_thread_device(self.engine.device_plan.device_for(0))
            self._run()
        except BaseException:
            self.failed.set()
            raise

    def _run(self) -> None:
        next_periodic = 0.0
        while not self._stop.is_set():
            self._run_calls()
            if self._has_work():
                self._step()
            else:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
            now = time.monotonic()
            if now >= next_periodic:
                next_periodic = now + self._period_s
                self._check_ranks()
                try:
                    self._periodic(self.engine)
                except Exception:
                    logger.exception("periodic engine task failed")
        self._run_calls()

    def _check_ranks(self) -> None:
        """A dead rank process means no step can ever complete: fail the loop (the service
        exits and the scheduler fails its requests over) even while the engine is idle."""
        dead = [p.name for p in self.engine.workers.procs if not p.is_alive()]
        if dead:
            logger.error("rank process(es) %s died; this engine cannot step any more", ", ".join(dead))
            raise RuntimeError(f"rank process(es) {', '.join(dead)} died")

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
            if self._flush_pending():
                self.engine.flush_commands()
        except Exception:
            logger.exception("engine step failed")
            raise
        self.num_steps += 1
        deliveries = [self._delivery(o) for o in outputs]
        self._after_step(self.engine, time.perf_counter() - start, deliveries)
        if deliveries:
            self._deliver(deliveries)

    def _delivery(self, output: RequestOutput) -> Delivery:
        rid = output.request_id
        first = rid not in self._started
        if output.finished:
            self._started.discard(rid)
        elif first:
            self._started.add(rid)
        return Delivery(output, self._blocks_for(output), first)

    def _blocks_for(self, output: RequestOutput) -> list[int]:
        if output.finished and output.finish_reason != "abort":
            try:
                return self.engine.get_block_ids(output.request_id)
            except (KeyError, ValueError):
                return []
        return []
