"""`DecodeStalls`: each decode engine's step time, and the stall a decode-local prefill adds to a
step there, both measured from the token gaps the scheduler relays (not assumed).

A token of a decoding request reaches the scheduler when the engine step that produced it ends,
so the gap before it is one step of that engine. The step that holds a decode-local prefill also
yields that request's first token, and a step's outputs reach the scheduler together: a gap
ending within the match tolerance (`MATCH_FRACTION` of a step, at least `MATCH_FLOOR_S`) of a
local prefill's first token on the same engine is a step *with* that prefill, one sample of the
stall fit (`stall = gap - plain step` against the prefill's tokens). Every other gap, once older
than the tolerance, is a step *without* one and feeds the plain step time (an exponentially
weighted mean). A prefill split over several steps (chunked prefill) is matched by its last
step only; what that under-counts, the path policy's TTFT correction absorbs.

Contract: pure and synchronous; the caller passes the clock (`end_s`, monotonic seconds, never
decreasing by more than the tolerance between calls). Until an engine has a stall sample,
`stall_s` charges the caller's per-token fallback (the prefill fit's per-token cost).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.scheduler.linear_fit import DEFAULT_DECAY, LinearFit

MATCH_FLOOR_S = 0.005
MATCH_FRACTION = 0.25
MATCH_UNKNOWN_S = 0.01  # the tolerance before any plain step was measured
STEP_WEIGHT = 0.1  # weight of one plain gap in the step time's moving mean
MAX_PENDING = 64  # unclassified gaps kept per engine (a bound, not a tuning knob)


@dataclass(slots=True)
class _EngineSteps:
    stall: LinearFit
    step_s: float | None = None
    gaps: deque[tuple[float, float]] = field(default_factory=deque)  # (end, gap) not yet classified
    prefills: deque[tuple[float, int]] = field(default_factory=deque)  # (first token at, tokens)

    def tolerance(self) -> float:
        return MATCH_UNKNOWN_S if self.step_s is None else max(MATCH_FLOOR_S, MATCH_FRACTION * self.step_s)

    def plain(self, gap_s: float) -> None:
        self.step_s = gap_s if self.step_s is None else (1 - STEP_WEIGHT) * self.step_s + STEP_WEIGHT * gap_s

    def with_prefill(self, num_tokens: int, gap_s: float) -> None:
        if self.step_s is not None:
            self.stall.observe(num_tokens, max(0.0, gap_s - self.step_s))

    def age(self, now_s: float) -> None:
        """Classifies gaps older than the tolerance as plain steps; forgets old prefills."""
        tol = self.tolerance()
        while self.gaps and (self.gaps[0][0] < now_s - tol or len(self.gaps) > MAX_PENDING):
            self.plain(self.gaps.popleft()[1])
        while self.prefills and self.prefills[0][0] < now_s - tol:
            self.prefills.popleft()


class DecodeStalls:
    """See the module docstring."""

    def __init__(self, prior_per_token_s: float, decay: float = DEFAULT_DECAY) -> None:
        self.prior_per_token_s = prior_per_token_s
        self.decay = decay
        self.engines: dict[str, _EngineSteps] = {}

    def _engine(self, engine_id: str) -> _EngineSteps:
        e = self.engines.get(engine_id)
        if e is None:
            e = self.engines[engine_id] = _EngineSteps(LinearFit(0.0, self.prior_per_token_s, self.decay))
        return e

    def observe_gap(self, engine_id: str, end_s: float, gap_s: float) -> None:
        """A decoding request's token on `engine_id` arrived at `end_s`, `gap_s` after its last."""
        if not 0 <= gap_s < float("inf"):
            return
        e = self._engine(engine_id)
        e.age(end_s)
        tol = e.tolerance()
        match = next((n for t, n in e.prefills if abs(t - end_s) <= tol), None)
        if match is not None:
            e.with_prefill(match, gap_s)
        else:
            e.gaps.append((end_s, gap_s))

    def observe_local_prefill(self, engine_id: str, end_s: float, num_tokens: int) -> None:
        """A decode-local prefill of `num_tokens` on `engine_id` yielded its first token at `end_s`."""
        e = self._engine(engine_id)
        e.age(end_s)
        tol = e.tolerance()
        kept: deque[tuple[float, float]] = deque()
        for t, gap in e.gaps:
            if abs(t - end_s) <= tol:
                e.with_prefill(num_tokens, gap)
            else:
                kept.append((t, gap))
        e.gaps = kept
        e.prefills.append((end_s, num_tokens))

    def step_s(self, engine_id: str) -> float | None:
        """The engine's measured step time without a local prefill (None: not measured yet)."""
        e = self.engines.get(engine_id)
        return e.step_s if e is not None else None

    def stall_s(self, engine_id: str, num_tokens: int, fallback_per_token_s: float) -> float:
        """How much longer a step there takes with a local prefill of `num_tokens` in it."""
        e = self.engines.get(engine_id)
        if e is None or e.stall.num_samples == 0:
            return fallback_per_token_s * max(0, num_tokens)
        return e.stall.predict(num_tokens)

    def num_stall_samples(self, engine_id: str) -> int:
        e = self.engines.get(engine_id)
        return e.stall.num_samples if e is not None else 0

    def forget_engine(self, engine_id: str) -> None:
        self.engines.pop(engine_id, None)
