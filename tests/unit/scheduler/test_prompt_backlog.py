"""PromptBacklog: a prefill's sample counts the tokens its engine computed while it waited —
those ahead, its own, and later ones that joined its step — and none when that is unknown; the
prefill fit learns one batch as one sample of its whole size (measured burst, decision 0037)."""

import pytest

from services.scheduler.path_costs import PathCosts
from services.scheduler.prompt_backlog import PromptBacklog


def test_later_prompts_that_answer_first_joined_the_step() -> None:
    b = PromptBacklog()
    first = b.add("p", 100)
    joined = b.add("p", 30)
    assert b.tokens["p"] == 130
    assert b.settle("p", joined, computed=True) == (100, 130)  # 100 ahead + its own 30
    assert b.settle("p", first, computed=True) == (0, 130)  # its own 100 + 30 that joined its step
    assert b.leaks() == [] and b.tokens == {}


def test_no_sample_while_a_later_prompt_waits_or_for_a_prompt_given_up() -> None:
    b = PromptBacklog()
    first, later, failed = b.add("p", 100), b.add("p", 30), b.add("q", 5)
    assert b.settle("p", first, computed=True) is None  # `later` may have joined its step, or not
    assert b.settle("q", failed, computed=False) is None
    assert b.settle("p", later, computed=True) == (100, 130)
    assert b.settle("p", later, computed=True) is None  # settled twice: no-op
    assert b.leaks() == []


def test_one_batch_of_four_prompts_is_one_sample_of_its_size_not_a_flat_line() -> None:
    """Measured 4 December 2026: a 17-token prompt computing, four long prompts sent meanwhile
    (385, 385, 420, 448 uncached tokens) answered together 3.8 s later. Counted by the backlog
    at dispatch they were 402 / 787 / 1,207 / 1,655 tokens in 3.8 s each: the fit's fixed part
    went to seconds and a 15-token prompt was predicted at 0.6 s (it took 0.08 s)."""
    costs = PathCosts()
    step = lambda n: 0.065 + 0.0022 * n  # noqa: E731 - this host's prefill engine, one thread
    for n in (1, 22, 385, 17, 1, 30):  # steady state: one prompt at a time
        costs.settle_backlog("p", costs.add_backlog("p", n), step(n))
    small = costs.add_backlog("p", 17)
    batch = [costs.add_backlog("p", n) for n in (385, 385, 420, 448)]
    costs.settle_backlog("p", small, step(17))
    for ticket in batch:
        costs.settle_backlog("p", ticket, step(17) + step(1638))
    assert costs.prefill_s(15) == pytest.approx(step(15), rel=0.25)
    assert costs.prefill_s(400) == pytest.approx(step(400), rel=0.25)
    assert costs.leaks() == []


def test_a_prompt_that_finds_the_engine_busy_waits_two_steps() -> None:
    """Measured 4 December 2026: a 9-token prompt sent while 22 tokens computed took 0.19 s, two
    steps; one step of 31 tokens (0.13 s) was the old prediction."""
    costs = PathCosts()
    step = lambda n: 0.065 + 0.0022 * n  # noqa: E731
    for n in (1, 22, 385, 17):
        costs.settle_backlog("p", costs.add_backlog("p", n), step(n))
    busy = costs.add_backlog("p", 22)
    queued = costs.add_backlog("p", 9)
    costs.settle_backlog("p", busy, step(22))
    costs.settle_backlog("p", queued, step(22) + step(9))  # learnt as one step of 31 tokens
    assert costs.prefill.params() == pytest.approx((0.065, 0.0022), rel=0.01)
    assert costs.queued_prefill_s(22, 9) == pytest.approx(step(22) + step(9), rel=0.01)
    assert costs.queued_prefill_s(0, 9) == pytest.approx(step(9), rel=0.01)
