"""The engine loop flushes a finished prefill's send command to the ranks with a command-only
plan: the send goes out right after the step that finished the prefill, before that step's
outputs are delivered, and a prompt queued meanwhile is not computed by the flush (it would
delay the finished prefill's first token by a whole forward pass)."""

from __future__ import annotations

import threading
from typing import Any

from connectors.ucx.scheduler import UcxSchedulerConnector
from engine.request import RequestMode, SamplingParams
from services.engine.native.loop import Delivery, EngineLoop

BS = 8


def test_flush_sends_without_computing_the_queued_prefill(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    connector = UcxSchedulerConnector(BS)
    # One request per step: "b" waits while "a" is computed.
    engine = make_engine(model.path, block_size=BS, max_num_seqs=1, scheduler_connector=connector)
    events: list[tuple[str, ...]] = []
    execute = engine.workers.execute

    def recording_execute(plan: Any) -> Any:
        meta = plan.connector_meta
        events.append(("plan", *sorted(c.request_id for c in plan.chunks),
                       *(f"send:{s.request_id}" for s in (meta.sends if meta is not None else []))))
        return execute(plan)

    engine.workers.execute = recording_execute
    done = threading.Event()

    def deliver(deliveries: list[Delivery]) -> None:
        events.append(("deliver", *sorted(d.output.request_id for d in deliveries)))
        if any(d.output.request_id == "b" for d in deliveries):
            done.set()

    loop = EngineLoop(engine, deliver=deliver, flush_pending=connector.has_pending,
                      after_step=lambda *_: None, periodic=lambda _: None)
    a, b = prompts_of([3 * BS + 1, 3 * BS + 2], seed=3)

    def add_both(e: Any) -> None:
        for rid, prompt in (("a", a), ("b", b)):
            e.add_request(rid, prompt, SamplingParams(max_tokens=4), mode=RequestMode.PREFILL_ONLY)

    loop.call(add_both)
    loop.start()
    try:
        assert done.wait(60), events
    finally:
        loop.stop()
        engine.release("a"), engine.release("b")
    assert events == [("plan", "a"), ("plan", "send:a"), ("deliver", "a"),
                      ("plan", "b"), ("plan", "send:b"), ("deliver", "b")], events
