"""DecodeStalls on hand-built gap streams: plain steps give the step time, the steps that end
with a local prefill's first token (before or after it reaches the scheduler) give the stall."""

import pytest

from services.scheduler.decode_stalls import DecodeStalls


def _decode(stalls: DecodeStalls, engine: str, start: float, steps: int, step_s: float) -> float:
    t = start
    for _ in range(steps):
        t += step_s
        stalls.observe_gap(engine, t, step_s)
    return t


def test_plain_gaps_give_the_step_time_and_prefill_steps_the_stall() -> None:
    stalls = DecodeStalls(prior_per_token_s=0.001)
    assert stalls.step_s("d0") is None
    assert stalls.stall_s("d0", 100, 0.001) == pytest.approx(0.1)  # the fallback until measured
    t = _decode(stalls, "d0", 0.0, 40, 0.05)
    for i, n in enumerate((20, 200, 60, 400, 100, 300) * 3):
        gap = 0.05 + 0.0002 * n  # a 50 ms step plus 200 us per prefilled token
        t += gap
        if i % 2:  # the prefill's first token reaches the scheduler after the other request's token
            stalls.observe_gap("d0", t, gap)
            stalls.observe_local_prefill("d0", t + 0.002, n)
        else:
            stalls.observe_local_prefill("d0", t, n)
            stalls.observe_gap("d0", t + 0.002, gap)
        t = _decode(stalls, "d0", t, 5, 0.05)
    t = _decode(stalls, "d0", t, 5, 0.05)  # ages the last gaps out
    assert stalls.step_s("d0") == pytest.approx(0.05)
    assert stalls.num_stall_samples("d0") == 18
    assert stalls.stall_s("d0", 1000, 0.001) == pytest.approx(0.2, rel=0.02)
    assert stalls.stall_s("d1", 1000, 0.001) == pytest.approx(1.0)  # another engine: not measured
    stalls.forget_engine("d0")
    assert stalls.step_s("d0") is None


def test_gaps_far_from_a_local_prefill_are_plain_steps() -> None:
    stalls = DecodeStalls(prior_per_token_s=0.001)
    t = _decode(stalls, "d0", 0.0, 20, 0.05)
    stalls.observe_local_prefill("d0", t + 0.03, 500)  # 30 ms away from any gap: no match
    _decode(stalls, "d0", t, 20, 0.05)
    assert stalls.num_stall_samples("d0") == 0
    assert stalls.step_s("d0") == pytest.approx(0.05)
    stalls.observe_gap("d0", 10.0, float("nan"))  # ignored
    assert stalls.step_s("d0") == pytest.approx(0.05)
