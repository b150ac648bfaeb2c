"""LoopStalls and the stall-aware heartbeat expiry (issue 18: no rank declared down because the
scheduler's own loop was late)."""

import pytest

from services.scheduler.loop_stalls import LoopStalls
from services.scheduler.registry import EngineRegistry, RankHello, RankId, Role


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _registry(clock: Clock) -> EngineRegistry:
    reg = EngineRegistry(block_size=16, hash_seed="0", heartbeat_timeout_s=5.0, clock=clock)
    for r in range(2):
        reg.register(RankHello("p0", Role.PREFILL, 7, r, 2, "abc", "127.0.0.1:9000"))
    return reg


def test_a_late_tick_records_its_interval_and_an_on_time_one_nothing() -> None:
    stalls = LoopStalls(horizon_s=20.0, tolerance_s=0.05)
    assert stalls.observe(10.0, 10.01) == pytest.approx(0.01)
    assert len(stalls) == 0 and stalls.stalled_since(0.0) == 0.0
    assert stalls.observe(11.0, 14.0) == pytest.approx(3.0)
    assert stalls.stalled_since(0.0) == pytest.approx(3.0)
    assert stalls.stalled_since(12.5) == pytest.approx(1.5)  # clipped at t
    assert stalls.stalled_since(14.0) == 0.0
    stalls.observe(20.0, 21.0)
    assert stalls.stalled_since(0.0) == pytest.approx(4.0)
    assert stalls.total_s == pytest.approx(4.0) and stalls.max_lag_s == pytest.approx(3.0)


def test_stalls_older_than_the_horizon_are_forgotten_and_entries_are_bounded() -> None:
    stalls = LoopStalls(horizon_s=5.0, tolerance_s=0.0, max_entries=3)
    stalls.observe(0.0, 1.0)
    stalls.observe(10.0, 11.0)
    assert stalls.stalled_since(0.0) == pytest.approx(1.0)  # the first ended before 11 - 5
    for k in range(5):
        stalls.observe(20.0 + k, 20.5 + k)
    assert len(stalls) == 3 and stalls.stalled_since(0.0) == pytest.approx(1.5)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="horizon_s must be > 0"):
        LoopStalls(horizon_s=0.0)


def test_expiry_does_not_count_the_schedulers_stall_as_silence() -> None:
    clock = Clock()
    old_rule, new_rule = _registry(clock), _registry(clock)  # both ranks last heard now
    stalls = LoopStalls(horizon_s=20.0)
    # the loop stalls for 6 s (past the 5 s timeout) while the ranks' beats wait unread
    stalls.observe(clock.now + 0.25, clock.now + 6.25)
    clock.now += 6.25
    assert old_rule.expire() == [RankId("p0", 0), RankId("p0", 1)]  # wall time alone: "dead"
    assert new_rule.expire(stalls.stalled_since) == []
    # silence the loop could have heard still counts: 5 s more without a word is death
    clock.now += 5.0
    assert new_rule.expire(stalls.stalled_since) == [RankId("p0", 0), RankId("p0", 1)]
