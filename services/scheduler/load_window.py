"""`LoadWindow`: what the role planner reads about recent traffic, from finished requests.

Pure and synchronous (the Generation servicer calls `finished`; the planner loop reads `stats`).
Requests finished within the last `window_s` seconds count; a request is good when its TTFT and
its mean inter-token latency are both within the targets (its own, else the window's), as in
vLLM's `--goodput ttft:MS tpot:MS`.
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

    def finished(self, request: FinishedRequest) -> None:
        self._done.append(request)
        self._trim()

    def _trim(self) -> None:
        horizon = self.clock() - self.window_s
        while self._done and self._done[0].at < horizon:
            self._done.popleft()

    def good(self, r: FinishedRequest) -> bool:
        ttft, itl = r.ttft_target_s or self.ttft_target_s, r.itl_target_s or self.itl_target_s
        return r.ttft_s is not None and r.ttft_s <= ttft and (r.itl_s is None or r.itl_s <= itl)

    def stats(self) -> WindowStats:
        self._trim()
        done = list(self._done)
        n = len(done)
        if not n:
            return WindowStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, None, None)
        # The window's span, or less while it fills (the first requests after a start or a lull).
        span = max(1.0, min(self.window_s, self.clock() - min(r.arrived for r in done)))
        prompt = sum(r.num_prompt_tokens for r in done)
        good = sum(1 for r in done if self.good(r))
        ttfts = [r.ttft_target_s for r in done if r.ttft_target_s]
        itls = [r.itl_target_s for r in done if r.itl_target_s]
        return WindowStats(n, n / span, prompt / n, sum(r.num_output_tokens for r in done) / n,
                           sum(r.num_cached_tokens for r in done) / prompt if prompt else 0.0,
                           good / span, good / n, min(ttfts) if ttfts else None, min(itls) if itls else None)
