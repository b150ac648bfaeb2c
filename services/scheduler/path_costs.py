"""`PathCosts`: what the path policy predicts from, fitted from what the scheduler measured.

Pure and synchronous (the servicer feeds it; the policy reads it). The facts:

- **Prefill time**: one engine step of N prompt tokens, `fixed + per_token * N`. A prompt sent
  to an engine with a backlog waits for the step in progress, then rides the next step with
  whatever else waited: two steps, one more fixed part (`queued_prefill_s`; measured per
  decision, 4 December 2026: one step predicted 35-45 % low whenever a prompt queued). The
  samples: seconds from dispatch until the engine answered, against the prompt tokens it
  computed meanwhile — those ahead of it (the backlog at dispatch), its own, and those sent
  after it that joined its step (`PromptBacklog`; no sample when that is unknown) — less one
  fixed part when some were ahead. The per-token part is also what a decode-local prefill costs a decode engine (same
  model, same kind of device). One fit for all prefill engines, not one per engine: a handful of
  samples per engine gave fixed parts noisy enough to outweigh a whole prefix; what differs
  between engines is their backlog and load, which the policy reads per engine. Decode-local
  prefills are not sampled: their time to the first token mixes in the decode batch they join,
  which a remote prefill's request joins too after its transfer.
- **Transfer time per prefill→decode pair**: seconds from the decode leg's dispatch until the
  decode engine finished receiving (KVReady), against the prompt tokens it pulled (only the
  blocks it lacked). The fixed part is the hop: the second RPC, allocation, the UCX
  handshake and the KVReady round trip.
- **Inter-token latency**: an exponentially weighted mean of the gaps between the tokens the
  scheduler relays (from the third token on: the gap before the second holds the transfer), so
  the policy can size a decode engine's stall budget in decode steps.
- **Decode steps per engine** (`DecodeStalls`): each decode engine's step time without a
  local prefill, and the stall a local prefill of N tokens adds to a step there, measured from
  the same gaps (the step holding a local prefill ends with that request's first token).
- **TTFT corrections per engine and path** (`TtftCorrection`): every decision's raw predicted
  TTFT against the actual one; a clamped moving mean of log(actual / predicted) per (engine,
  path) scales later predictions there, so what the fits miss (queueing, batching, a loaded
  host) is learnt from the recorded errors, and one outlier moves it little.
- **Backlog and ITL targets per engine**: prompt tokens the scheduler sent to an engine that it
  has not finished computing yet, and the ITL targets of the requests decoding on it (a
  decode-local prefill there stalls all of them).

Each fit is `seconds = fixed_s + per_token_s * tokens`, by exponentially decayed least squares
(recent samples count most, so a fit follows a changing machine). Until a fit has samples of
clearly different sizes it keeps the prior's fixed part and charges the rest to the tokens; a
pair without samples uses the fit over all pairs, and a fit without any, the prior.
Predictions are never negative.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from services.scheduler.decode_stalls import DecodeStalls
from services.scheduler.linear_fit import DEFAULT_DECAY, LinearFit
from services.scheduler.prompt_backlog import PromptBacklog

__all__ = ["DEFAULT_DECAY", "CostPriors", "LinearFit", "PathCosts", "TtftCorrection"]

# A TTFT correction follows the recent prediction errors (weight of one sample), moves by at most
# `SAMPLE_CLAMP` (a log ratio) around its current value per sample, so one outlier (a stalled
# host, a GC pause) barely moves it, and stays within `CORRECTION_CLAMP` of the raw model.
CORRECTION_WEIGHT = 0.2
SAMPLE_CLAMP = math.log(4.0)
CORRECTION_CLAMP = math.log(16.0)


def _clamp(x: float, limit: float) -> float:
    return max(-limit, min(limit, x))


@dataclass(slots=True)
class TtftCorrection:
    """A clamped exponentially weighted mean of log(actual TTFT / raw predicted TTFT): the
    factor `exp(log_ratio)` turns the fits' raw prediction into the corrected one. The first
    samples count fully (weight 1/n until `CORRECTION_WEIGHT`), so a fresh engine converges in a
    few requests; after that each sample moves it by at most `CORRECTION_WEIGHT * SAMPLE_CLAMP`."""

    log_ratio: float = 0.0
    num_samples: int = 0

    def observe(self, raw_predicted_s: float, actual_s: float) -> None:
        """One decision's outcome; non-positive or non-finite values are ignored."""
        if not (0 < raw_predicted_s < float("inf") and 0 < actual_s < float("inf")):
            return
        x = math.log(actual_s / raw_predicted_s)
        if self.num_samples:
            x = self.log_ratio + _clamp(x - self.log_ratio, SAMPLE_CLAMP)
        self.num_samples += 1
        w = max(CORRECTION_WEIGHT, 1.0 / self.num_samples)
        self.log_ratio = _clamp((1 - w) * self.log_ratio + w * x, CORRECTION_CLAMP)

    @property
    def factor(self) -> float:
        return math.exp(self.log_ratio)


@dataclass(frozen=True, slots=True)
class CostPriors:
    """What the fits start from before any measurement (seconds)."""

    prefill_fixed_s: float = 0.01
    prefill_per_token_s: float = 0.0002
    transfer_fixed_s: float = 0.01
    transfer_per_token_s: float = 0.00002


@dataclass(slots=True)
class PathCosts:
    """Fits, backlogs and ITL targets (see the module docstring)."""

    priors: CostPriors = field(default_factory=CostPriors)
    decay: float = DEFAULT_DECAY
    transfer: dict[tuple[str, str], LinearFit] = field(default_factory=dict)
    backlog: PromptBacklog = field(default_factory=PromptBacklog)
    itl_targets: dict[str, Counter[float]] = field(default_factory=dict)
    itl_s: float | None = None
    prefill: LinearFit | None = None
    # (engine id, path) -> correction of that engine's TTFT predictions on that path (the
    # prefill engine's for remote, the decode engine's for decode_local).
    corrections: dict[tuple[str, str], TtftCorrection] = field(default_factory=dict)
    decode: DecodeStalls | None = None
    _all_transfer: LinearFit | None = None

    def __post_init__(self) -> None:
        p = self.priors
        self.prefill = LinearFit(p.prefill_fixed_s, p.prefill_per_token_s, self.decay)
        self._all_transfer = LinearFit(p.transfer_fixed_s, p.transfer_per_token_s, self.decay)
        self.decode = DecodeStalls(p.prefill_per_token_s, self.decay)

    # -- measurements ------------------------------------------------------------------------

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A remote prefill; `num_tokens` = backlog at dispatch plus the request's own uncached
        tokens."""
        assert self.prefill is not None
        self.prefill.observe(num_tokens, seconds)

    def observe_transfer(self, prefill_id: str, decode_id: str, num_tokens: int, seconds: float) -> None:
        assert self._all_transfer is not None
        pair = (prefill_id, decode_id)
        fit = self.transfer.get(pair)
        if fit is None:
            fit = self.transfer[pair] = LinearFit(self.priors.transfer_fixed_s, self.priors.transfer_per_token_s,
                                                  self.decay)
        fit.observe(num_tokens, seconds)
        self._all_transfer.observe(num_tokens, seconds)

    def observe_itl(self, seconds: float, engine_id: str | None = None, end_s: float | None = None) -> None:
        """One inter-token gap (per token) of a decoding request; with the decode engine and the
        token's arrival time it also feeds that engine's step and stall measurements."""
        if not 0 <= seconds < float("inf"):
            return
        self.itl_s = seconds if self.itl_s is None else self.decay * self.itl_s + (1 - self.decay) * seconds
        if engine_id is not None and end_s is not None:
            assert self.decode is not None
            self.decode.observe_gap(engine_id, end_s, seconds)

    def observe_local_prefill(self, engine_id: str, end_s: float, num_tokens: int) -> None:
        """A decode-local prefill's first token arrived (see `DecodeStalls`)."""
        assert self.decode is not None
        self.decode.observe_local_prefill(engine_id, end_s, num_tokens)

    def observe_ttft(self, engine_id: str, path: str, raw_predicted_s: float, actual_s: float) -> None:
        """A decision's outcome: the raw (uncorrected) predicted and the actual TTFT."""
        key = (engine_id, path)
        correction = self.corrections.get(key)
        if correction is None:
            correction = self.corrections[key] = TtftCorrection()
        correction.observe(raw_predicted_s, actual_s)

    # -- predictions -------------------------------------------------------------------------

    def prefill_s(self, num_tokens: int) -> float:
        """Seconds until a prefill engine has computed `num_tokens` more tokens (its queue
        included when the caller adds the backlog)."""
        assert self.prefill is not None
        return self.prefill.predict(num_tokens)

    def queued_prefill_s(self, num_ahead: int, num_tokens: int) -> float:
        """Seconds until an engine with `num_ahead` prompt tokens queued has computed
        `num_tokens` more: the step in progress, then the next (one step when idle)."""
        assert self.prefill is not None
        extra = self.prefill.params()[0] if num_ahead > 0 else 0.0
        return extra + self.prefill_s(num_ahead + num_tokens)

    def compute_s(self, num_tokens: int) -> float:
        """The per-token part only: how long computing `num_tokens` stalls an engine's batch."""
        assert self.prefill is not None
        return self.prefill.params()[1] * max(0, num_tokens)

    def correction(self, engine_id: str, path: str) -> float:
        """The factor from raw to corrected TTFT predictions there. An engine without an outcome
        on that path yet borrows the mean (of the log ratios) of the path's other engines; a
        path without any stays at 1.0, so a path never tried looks as fast as its fits say and
        is tried once rather than ruled out by the other path's errors."""
        c = self.corrections.get((engine_id, path))
        if c is not None:
            return c.factor
        same = [c.log_ratio for (_, p), c in self.corrections.items() if p == path]
        return math.exp(sum(same) / len(same)) if same else 1.0

    def step_s(self, engine_id: str) -> float:
        """A decode step there without a local prefill: measured, else the mean inter-token gap
        over all engines, else a prefill step of one token (a forward pass; 0 was a busy
        engine's first local prefills predicted at a third of their time, and the correction
        learnt that error)."""
        assert self.decode is not None
        step = self.decode.step_s(engine_id)
        if step is not None:
            return step
        return self.itl_s if self.itl_s is not None else self.prefill_s(1)

    def stall_s(self, engine_id: str, num_tokens: int) -> float:
        """How much a local prefill of `num_tokens` lengthens a step there: measured (see
        `DecodeStalls`), else the prefill fit's per-token cost once it has one of its own (a fit
        of one prompt size charges the call's fixed part to the tokens), else the prior's."""
        assert self.decode is not None and self.prefill is not None
        per_token = self.prefill.params()[1] if self.prefill.has_slope else self.priors.prefill_per_token_s
        return self.decode.stall_s(engine_id, num_tokens, per_token)

    def transfer_s(self, prefill_id: str, decode_id: str, num_tokens: int) -> float:
        assert self._all_transfer is not None
        return self.transfer.get((prefill_id, decode_id), self._all_transfer).predict(num_tokens)

    # -- backlog and ITL targets ---------------------------------------------------------------

    @property
    def backlog_tokens(self) -> Counter[str]:
        """Engine id -> prompt tokens sent there and not computed yet (read only)."""
        return self.backlog.tokens

    def add_backlog(self, engine_id: str, num_tokens: int) -> int:
        """A prompt sent to `engine_id`; returns the ticket `settle_backlog` takes."""
        return self.backlog.add(engine_id, num_tokens)

    def settle_backlog(self, engine_id: str, ticket: int, seconds: float | None) -> None:
        """The engine computed the ticket's prompt `seconds` after its dispatch (None: gave up,
        or nothing to learn); a sample of the prefill fit when the tokens computed meanwhile
        are known (see `PromptBacklog`)."""
        window = self.backlog.settle(engine_id, ticket, seconds is not None)
        if window is not None and seconds is not None:
            self.observe_queued_prefill(*window, seconds)

    def observe_queued_prefill(self, num_ahead: int, num_tokens: int, seconds: float) -> None:
        """`seconds` for `num_tokens` computed, `num_ahead` of them queued ahead: with a queue,
        two steps (see the module docstring), learnt as one step of all the tokens."""
        assert self.prefill is not None
        self.observe_prefill(num_tokens, seconds - self.prefill.params()[0] if num_ahead > 0 else seconds)

    def add_itl_target(self, engine_id: str, target_s: float) -> None:
        self.itl_targets.setdefault(engine_id, Counter())[target_s] += 1

    def remove_itl_target(self, engine_id: str, target_s: float) -> None:
        targets = self.itl_targets.get(engine_id)
        if targets is None or not targets[target_s]:
            return
        targets[target_s] -= 1
        if not targets[target_s]:
            del targets[target_s]
        if not targets:
            del self.itl_targets[engine_id]

    def tightest_itl_target(self, engine_id: str) -> float | None:
        targets = self.itl_targets.get(engine_id)
        return min(targets) if targets else None

    def forget_engine(self, engine_id: str) -> None:
        """Drops what was measured of an engine: its pairs' transfer fits (a restarted engine may
        sit elsewhere), its TTFT corrections and its decode step measurements."""
        for pair in [p for p in self.transfer if engine_id in p]:
            del self.transfer[pair]
        for key in [k for k in self.corrections if k[0] == engine_id]:
            del self.corrections[key]
        assert self.decode is not None
        self.decode.forget_engine(engine_id)

    def leaks(self) -> list[str]:
        """Backlog or ITL targets left after every request ended (empty when clean)."""
        return self.backlog.leaks() + [f"itl targets {e}: {dict(t)}" for e, t in self.itl_targets.items()]
