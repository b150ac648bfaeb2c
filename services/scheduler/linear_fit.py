"""`LinearFit`: `seconds = fixed_s + per_token_s * tokens` by exponentially decayed least squares
(recent samples count most, so a fit follows a changing machine). Until a fit has samples of
clearly different sizes it keeps the prior's fixed part and charges the rest to the tokens.
Predictions are never negative. Pure and synchronous.
"""

from __future__ import annotations

from dataclasses import dataclass

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
