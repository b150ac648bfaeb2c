"""Goodput under SLOs, the DistServe way with vLLM's syntax (`--goodput ttft:MS tpot:MS`).

Pure: results in, numbers out (the serve benchmark drives the clusters). A request is good when
every listed metric is within its SLO: TTFT (arrival to first token), TPOT ((end-to-end - TTFT)
/ (output tokens - 1); 0 for one output token, as in vLLM's benchmarks/serve), e2el (end to
end). Attainment = good / all; a system's goodput is the highest swept arrival rate at which
attainment stays >= 90 %.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.client import GenerationResult

ATTAINMENT = 0.9
METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True)
class GoodputSlo:
    """SLOs in milliseconds; None: not part of the goal."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None


@dataclass(frozen=True, slots=True)
class RatePoint:
    rate_rps: float
    attainment: float
    num_requests: int
    good_rps: float  # good requests / wall time at this rate


def parse_goodput(specs: Sequence[str]) -> GoodputSlo:
    """`["ttft:500", "tpot:50"]` -> GoodputSlo(500, 50). Raises ValueError naming the bad item."""
    values: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in METRICS:
            raise ValueError(f"--goodput: {spec!r} is not METRIC:MS with METRIC one of {', '.join(METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {spec!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"--goodput: {spec!r}: the SLO must be > 0 ms")
        values[name] = ms
    if not values:
        raise ValueError("--goodput needs at least one METRIC:MS")
    return GoodputSlo(values.get("ttft"), values.get("tpot"), values.get("e2el"))


def tpot_ms(r: GenerationResult) -> float:
    if r.ttft_s is None or r.generated_tokens <= 1:
        return 0.0
    return 1000.0 * (r.e2e_s - r.ttft_s) / (r.generated_tokens - 1)


def is_good(r: GenerationResult, slo: GoodputSlo) -> bool:
    if r.ttft_s is None or r.generated_tokens == 0:
        return False
    return ((slo.ttft_ms is None or 1000.0 * r.ttft_s <= slo.ttft_ms)
            and (slo.tpot_ms is None or tpot_ms(r) <= slo.tpot_ms)
            and (slo.e2el_ms is None or 1000.0 * r.e2e_s <= slo.e2el_ms))


def attainment(results: Sequence[GenerationResult], slo: GoodputSlo) -> float:
    return sum(1 for r in results if is_good(r, slo)) / len(results) if results else 0.0


def sweep(run_at: Callable[[float], tuple[list[GenerationResult], float]], rates: Sequence[float],
          slo: GoodputSlo, *, stop_after_misses: int = 2) -> list[RatePoint]:
    """Runs `run_at(rate)` -> (results, wall seconds) at each rate in increasing order; stops
    after `stop_after_misses` rates in a row below the attainment goal (higher ones only fall)."""
    curve: list[RatePoint] = []
    misses = 0
    for rate in sorted(rates):
        results, wall = run_at(rate)
        share = attainment(results, slo)
        good = sum(1 for r in results if is_good(r, slo))
        curve.append(RatePoint(rate, round(share, 4), len(results), round(good / wall, 3) if wall > 0 else 0.0))
        misses = misses + 1 if share < ATTAINMENT else 0
        if misses >= stop_after_misses:
            break
    return curve


def goodput_rps(curve: Sequence[RatePoint]) -> float:
    """The highest swept rate whose attainment is >= 90 % (0.0 when none is)."""
    return max((p.rate_rps for p in curve if p.attainment >= ATTAINMENT), default=0.0)
