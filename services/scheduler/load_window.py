"""`LoadWindow`: what the role planner reads about recent traffic.

Pure and synchronous (the Generation servicer calls `arrived` when it admits a request and
`finished` when it completes one; the planner loop reads `stats`). Two views over the last
`window_s` seconds:
- **The load** (rate, prompt and output lengths, prefix hit rate) is read from the requests that
  *arrived* in the window: what is coming now, not what is done. A window of finished requests
  lags by a request's whole duration (a long answer shows up only after it is generated) and,
  when the engines fall behind, reads the rate they finish at rather than the rate that arrives,
  hiding the overload the planner exists to answer (docs/decisions/0051). An arrival's output
  length is its `max_tokens` scaled by the share of their `max_tokens` the window's finished
  requests generated (1 until one has finished); its cached tokens are the router's prediction.
- **What was served** (goodput, attainment) is read from the requests *finished* in the window:
  a request is good when its TTFT and its mean inter-token latency are both within the targets
  (its own, else the window's), as in vLLM's `--goodput ttft:MS tpot:MS`.
A window never told of arrivals (a caller feeding finished requests only) reads the load from
the finished ones, as before.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    at: float
    arrived: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    ttft_s: float | None
    itl_s: float | None
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    max_tokens: int | None = None  # what the request asked for (None: unknown)


@dataclass(frozen=True, slots=True)
class ArrivedRequest:
    at: float
    num_prompt_tokens: int
    num_cached_tokens: int  # the router's prediction (the prefix index's hit where it computes)
    max_tokens: int
    ttft_target_s: float | None = None
    itl_target_s: float | None = None


@dataclass(frozen=True, slots=True)
class WindowStats:
    num_requests: int
    arrival_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    prefix_hit_rate: float
    goodput_rps: float
    attainment: float
    ttft_target_s: float | None  # the tightest target requests set themselves (None: none did)
    itl_target_s: float | None


class LoadWindow:
    def __init__(self, window_s: float = 30.0, *, ttft_target_s: float = 1.0, itl_target_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.ttft_target_s = ttft_target_s
        self.itl_target_s = itl_target_s
        self.clock = clock
        self._done: deque[FinishedRequest] = deque()
        self._arrived: deque[ArrivedRequest] = deque()
        self._told_arrivals = False

    def arrived(self, request: ArrivedRequest) -> None:
        self._told_arrivals = True
        self._arrived.append(request)
        self._trim()

    def finished(self, request: FinishedRequest) -> None:
        self._done.append(request)
        self._trim()

    def _trim(self) -> None:
        horizon = self.clock() - self.window_s
        while self._done and self._done[0].at < horizon:
            self._done.popleft()
        while self._arrived and self._arrived[0].at < horizon:
            self._arrived.popleft()

    def good(self, r: FinishedRequest) -> bool:
        ttft, itl = r.ttft_target_s or self.ttft_target_s, r.itl_target_s or self.itl_target_s
        return r.ttft_s is not None and r.ttft_s <= ttft and (r.itl_s is None or r.itl_s <= itl)

    def stats(self) -> WindowStats:
        self._trim()
        done, arrived = list(self._done), list(self._arrived)
        if not self._told_arrivals:
            return self._finished_stats(done)
        n = len(arrived)
        if not n:
            return WindowStats(0, 0.0, 0.0, 0.0, 0.0, *self._served(done), None, None)
        prompt = sum(r.num_prompt_tokens for r in arrived)
        asked = [r.max_tokens for r in done if r.max_tokens]
        generated = sum(r.num_output_tokens for r in done if r.max_tokens)
        completion = min(1.0, generated / sum(asked)) if asked else 1.0
        ttft_target, itl_target = _tightest(arrived, done)
        return WindowStats(n, n / self._span([r.at for r in arrived]), prompt / n,
                           completion * sum(r.max_tokens for r in arrived) / n,
                           sum(min(r.num_cached_tokens, r.num_prompt_tokens) for r in arrived) / prompt if prompt else 0.0,
                           *self._served(done), ttft_target, itl_target)

    def _finished_stats(self, done: list[FinishedRequest]) -> WindowStats:
        """The load read from finished requests (a window never told of arrivals)."""
        n = len(done)
        if not n:
            return WindowStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, None, None)
        prompt = sum(r.num_prompt_tokens for r in done)
        ttft_target, itl_target = _tightest(done)
        return WindowStats(n, n / self._span([r.arrived for r in done]), prompt / n,
                           sum(r.num_output_tokens for r in done) / n,
                           sum(r.num_cached_tokens for r in done) / prompt if prompt else 0.0,
                           *self._served(done), ttft_target, itl_target)

    def _span(self, arrivals: list[float]) -> float:
        """The window's span, or less while it fills (the first requests after a start or a lull)."""
        return max(1.0, min(self.window_s, self.clock() - min(arrivals)))

    def _served(self, done: list[FinishedRequest]) -> tuple[float, float]:
        """(goodput in requests/s, attainment) of the finished requests."""
        if not done:
            return 0.0, 1.0
        good = sum(1 for r in done if self.good(r))
        return good / self._span([r.arrived for r in done]), good / len(done)


def _tightest(*groups: list[FinishedRequest] | list[ArrivedRequest]) -> tuple[float | None, float | None]:
    """The tightest TTFT and ITL targets requests set themselves (None: none did)."""
    ttfts = [r.ttft_target_s for g in groups for r in g if r.ttft_target_s]
    itls = [r.itl_target_s for g in groups for r in g if r.itl_target_s]
    return min(ttfts) if ttfts else None, min(itls) if itls else None
