"""LoadWindow: the load is read from arrivals (rate, lengths, predicted prefix hits; outputs
scaled by what finished requests generated of their max_tokens), what was served from finished
requests; a window never told of arrivals reads both from finished requests."""

from __future__ import annotations

import pytest

from services.scheduler.load_window import ArrivedRequest, FinishedRequest, LoadWindow


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_arrivals_are_the_load_before_anything_finishes() -> None:
    clock = Clock()
    window = LoadWindow(10.0, clock=clock)
    for k in range(8):  # 2 per second over the last 4 s
        window.arrived(ArrivedRequest(clock.t - 4 + k / 2, 400, 100, 64))
    stats = window.stats()
    assert stats.num_requests == 8
    assert stats.arrival_rps == pytest.approx(8 / 4)
    assert (stats.mean_prompt_tokens, stats.mean_output_tokens) == (400, 64)
    assert stats.prefix_hit_rate == pytest.approx(0.25)
    assert (stats.goodput_rps, stats.attainment) == (0.0, 1.0)  # nothing served yet


def test_outputs_are_scaled_by_what_finished_requests_generated_of_their_ask() -> None:
    clock = Clock()
    window = LoadWindow(10.0, ttft_target_s=1.0, itl_target_s=0.1, clock=clock)
    window.arrived(ArrivedRequest(clock.t - 2, 100, 0, 200))
    # Stopped at EOS after a quarter of what they asked for; one of the two too slow.
    window.finished(FinishedRequest(clock.t - 1, clock.t - 3, 100, 0, 25, 0.5, 0.05, max_tokens=100))
    window.finished(FinishedRequest(clock.t - 1, clock.t - 3, 100, 0, 25, 0.5, 0.5, max_tokens=100))
    stats = window.stats()
    assert stats.num_requests == 1
    assert stats.mean_output_tokens == pytest.approx(50)
    assert stats.attainment == pytest.approx(0.5)
    assert stats.goodput_rps == pytest.approx(1 / 3)


def test_a_lull_reads_no_load_though_finished_requests_remain() -> None:
    clock = Clock()
    window = LoadWindow(10.0, clock=clock)
    window.arrived(ArrivedRequest(clock.t, 100, 0, 16))
    clock.t += 8
    window.finished(FinishedRequest(clock.t, clock.t - 8, 100, 0, 16, 0.5, 0.05, max_tokens=16))
    clock.t += 3  # the arrival has left the window, the finished request has not
    stats = window.stats()
    assert stats.num_requests == 0 and stats.arrival_rps == 0.0
    assert stats.attainment == 1.0 and stats.goodput_rps > 0


def test_a_window_told_only_of_finished_requests_reads_the_load_from_them() -> None:
    clock = Clock()
    window = LoadWindow(10.0, clock=clock)
    for k in range(4):
        window.finished(FinishedRequest(clock.t, clock.t - 4 + k, 300, 150, 20, 0.5, 0.05))
    stats = window.stats()
    assert (stats.num_requests, stats.mean_prompt_tokens, stats.mean_output_tokens) == (4, 300, 20)
    assert stats.arrival_rps == pytest.approx(1.0) and stats.prefix_hit_rate == pytest.approx(0.5)


def test_the_tightest_own_targets_of_arrivals_and_finished_requests_are_read() -> None:
    clock = Clock()
    window = LoadWindow(10.0, clock=clock)
    window.arrived(ArrivedRequest(clock.t, 100, 0, 16, ttft_target_s=0.8))
    window.finished(FinishedRequest(clock.t, clock.t - 1, 100, 0, 16, 0.5, 0.05, itl_target_s=0.04))
    stats = window.stats()
    assert (stats.ttft_target_s, stats.itl_target_s) == (0.8, 0.04)
