"""An abort of the only running request is reported although nothing is left to compute: the
engine loop steps once more to deliver its "abort" output (its decode stream waits for it; an
idle loop used to keep it until the next request arrived)."""

from __future__ import annotations

import threading

from engine.request import SamplingParams
from services.engine.native.loop import Delivery, EngineLoop

BS = 8


def test_aborting_the_only_request_delivers_its_abort(tiny_model, make_engine, prompts_of) -> None:
    engine = make_engine(tiny_model("llama_gqa_llama3").path, block_size=BS)
    first, aborted = threading.Event(), threading.Event()
    reasons: list[str | None] = []

    def deliver(deliveries: list[Delivery]) -> None:
        for d in deliveries:
            first.set()
            if d.output.finished:
                reasons.append(d.output.finish_reason)
                aborted.set()

    loop = EngineLoop(engine, deliver=deliver, flush_pending=lambda: False,
                      after_step=lambda *_: None, periodic=lambda _: None)
    (prompt,) = prompts_of([2 * BS + 3], seed=5)
    loop.call(lambda e: e.add_request("a", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True)))
    loop.start()
    try:
        assert first.wait(60)
        assert loop.call(lambda e: e.abort_request("a")).result(10)
        assert aborted.wait(10), "the abort output was never delivered"
    finally:
        loop.stop()
    assert reasons == ["abort"]
    assert engine.load().num_running == 0 and engine.check_leaks() == []
