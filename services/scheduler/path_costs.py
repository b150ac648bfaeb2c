"""`PathCosts`: what the path policy predicts from, fitted from what the scheduler measured.

Pure and synchronous (the servicer feeds it; the policy reads it). Three kinds of facts:

- **Prefill time**: seconds from dispatch until a prefill engine answered, against the prompt
  tokens it had to compute *including those queued ahead of it* (the backlog at dispatch). So
  a prediction for `backlog + uncached` tokens is a prediction of the wait plus the compute, in
  one line. The per-token part is also what a decode-local prefill costs a decode engine (same
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
- **Backlog and ITL targets per engine**: prompt tokens the scheduler sent to an engine that it
  has not finished computing yet, and the tightest ITL target among the requests decoding on
  it (a decode-local prefill there stalls all of them).

Each fit is `seconds = fixed_s + per_token_s * tokens`, by exponentially decayed least squares
(recent samples count most, so a fit follows a changing machine). Until a fit has samples of
clearly different sizes it keeps the prior's fixed part and charges the rest to the tokens; a
pair without samples uses the fit over all pairs, and a fit without any, the prior.
Predictions are never negative.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

DEFAULT_DECAY = 0.95
# Samples whose sizes spread less than this many tokens (standard deviation) fix no slope.
MIN_SPREAD_TOKENS = 8.0


@dataclass(slots=True)
class LinearFit:
    """seconds ~ fixed_s + per_token_s * tokens; see the module docstring."""

    prior_fixed_s: float
    prior_per_token_s: float
    decay: float = DEFAULT_DECAY
    num_samples: int = 0
    _w: float = 0.0
    _n: float = 0.0
    _nn: float = 0.0
    _t: float = 0.0
    _nt: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Adds one sample; negative or non-finite seconds are ignored (a clock glitch)."""
        if not 0 <= seconds < float("inf") or num_tokens < 0:
            return
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + num_tokens
        self._nn = d * self._nn + num_tokens * num_tokens
        self._t = d * self._t + seconds
        self._nt = d * self._nt + num_tokens * seconds
        self.num_samples += 1

    @property
    def has_slope(self) -> bool:
        """True once the samples spread enough to fix the per-token cost themselves."""
        return self.num_samples > 1 and self._nn / self._w - (self._n / self._w) ** 2 >= MIN_SPREAD_TOKENS ** 2

    def params(self) -> tuple[float, float]:
        """(fixed_s, per_token_s), both >= 0. Samples of (nearly) one size cannot tell the two
        apart: the fit keeps the prior's fixed part and charges the rest to the tokens."""
        if self.num_samples == 0:
            return self.prior_fixed_s, self.prior_per_token_s
        mean_n, mean_t = self._n / self._w, self._t / self._w
        if self.has_slope:
            var = self._nn / self._w - mean_n * mean_n
            slope = max(0.0, (self._nt / self._w - mean_n * mean_t) / var)
            return max(0.0, mean_t - slope * mean_n), slope
        if mean_n <= 0:
            return mean_t, self.prior_per_token_s
        fixed = min(self.prior_fixed_s, mean_t)
        return fixed, (mean_t - fixed) / mean_n

    def predict(self, num_tokens: int) -> float:
        fixed, slope = self.params()
        return fixed + slope * max(0, num_tokens)


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
    backlog_tokens: Counter[str] = field(default_factory=Counter)
    itl_targets: dict[str, Counter[float]] = field(default_factory=dict)
    itl_s: float | None = None
    prefill: LinearFit | None = None
    _all_transfer: LinearFit | None = None

    def __post_init__(self) -> None:
        p = self.priors
        self.prefill = LinearFit(p.prefill_fixed_s, p.prefill_per_token_s, self.decay)
        self._all_transfer = LinearFit(p.transfer_fixed_s, p.transfer_per_token_s, self.decay)

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

    def observe_itl(self, seconds: float) -> None:
        """One inter-token gap (per token) of a decoding request."""
        if not 0 <= seconds < float("inf"):
            return
        self.itl_s = seconds if self.itl_s is None else self.decay * self.itl_s + (1 - self.decay) * seconds

    # -- predictions -------------------------------------------------------------------------

    def prefill_s(self, num_tokens: int) -> float:
        """Seconds until a prefill engine has computed `num_tokens` more tokens (its queue
        included when the caller adds the backlog)."""
        assert self.prefill is not None
        return self.prefill.predict(num_tokens)

    def compute_s(self, num_tokens: int) -> float:
        """The per-token part only: how long computing `num_tokens` stalls an engine's batch."""
        assert self.prefill is not None
        return self.prefill.params()[1] * max(0, num_tokens)

    def transfer_s(self, prefill_id: str, decode_id: str, num_tokens: int) -> float:
        assert self._all_transfer is not None
        return self.transfer.get((prefill_id, decode_id), self._all_transfer).predict(num_tokens)

    # -- backlog and ITL targets ---------------------------------------------------------------

    def add_backlog(self, engine_id: str, num_tokens: int) -> None:
        self.backlog_tokens[engine_id] += num_tokens

    def remove_backlog(self, engine_id: str, num_tokens: int) -> None:
        left = self.backlog_tokens[engine_id] - num_tokens
        if left > 0:
            self.backlog_tokens[engine_id] = left
        else:
            del self.backlog_tokens[engine_id]

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
        """Drops the transfer fits of an engine's pairs (a restarted engine may sit elsewhere)."""
        for pair in [p for p in self.transfer if engine_id in p]:
            del self.transfer[pair]

    def leaks(self) -> list[str]:
        """Backlog or ITL targets left after every request ended (empty when clean)."""
        return [f"backlog {e}: {n} tokens" for e, n in self.backlog_tokens.items()] + \
            [f"itl targets {e}: {dict(t)}" for e, t in self.itl_targets.items()]
