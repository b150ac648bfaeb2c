"""Goodput found by a search, per SLO pair and per phase (`bench serve --compare-planner`).

Pure: probe records in, numbers out (bench/compare_planner.py drives the systems). A probe is
one pass of the workload at one open-loop Poisson rate; every request of it is a `ProbeRequest`
(its phase, arrival offset, TTFT, mean time per output token, whether it was lost). A request
is good for a pair when it was answered in full within both of the pair's SLOs (vLLM's TPOT:
(end to end - TTFT) / (tokens - 1)).

Goodput (DistServe's, as bench/goodput.py): the highest rate at which >= 90 % of requests are
good. `search` finds it without a scan: geometric bisection inside `[low, high]`, one bracket
per SLO pair, every probe narrowing every bracket it falls in; each next probe bisects the
widest bracket, so the pairs of one system share probes. A phase's goodput is the highest
probed rate at which that phase's own requests (those that arrived during it) reached 90 %;
its probes are the overall search's, so its resolution is theirs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.goodput import ATTAINMENT, GoodputSlo, parse_goodput


@dataclass(frozen=True, slots=True)
class SloPair:
    name: str
    slo: GoodputSlo

    def deadline_s(self, output_tokens: int) -> float:
        """When a request answered within both SLOs has ended at the latest (from its arrival)."""
        assert self.slo.ttft_ms is not None and self.slo.tpot_ms is not None
        return (self.slo.ttft_ms + max(0, output_tokens - 1) * self.slo.tpot_ms) / 1000.0


def parse_slo_pair(text: str) -> SloPair:
    """`NAME=ttft:MS,tpot:MS` -> SloPair. Raises ValueError naming the bad part."""
    name, sep, spec = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--slo-pair: {text!r} is not NAME=ttft:MS,tpot:MS")
    slo = parse_goodput([s.strip() for s in spec.split(",") if s.strip()])
    if slo.ttft_ms is None or slo.tpot_ms is None or slo.e2el_ms is not None:
        raise ValueError(f"--slo-pair: {text!r} must set exactly ttft and tpot")
    return SloPair(name.strip(), slo)


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    phase: str
    arrival_s: float  # from the probe's start
    output_tokens: int  # asked for
    ttft_s: float | None = None
    tpot_ms: float = 0.0
    tokens: int = 0  # received
    lost: bool = False  # failed or ended early, not cut off by the client

    def good(self, pair: SloPair) -> bool:
        slo = pair.slo
        return (not self.lost and self.ttft_s is not None and self.tokens == self.output_tokens
                and 1000.0 * self.ttft_s <= (slo.ttft_ms or math.inf) and self.tpot_ms <= (slo.tpot_ms or math.inf))


@dataclass(slots=True)
class Probe:
    rate_rps: float
    requests: list[ProbeRequest]
    wall_s: float
    role_changes: int = 0  # made by the planner during the probe
    # System-specific extras (the planner's role timeline); not read here.
    extra: dict[str, object] = field(default_factory=dict)

    def attainment(self, pair: SloPair, phase: str | None = None) -> float:
        rs = [r for r in self.requests if phase is None or r.phase == phase]
        return sum(r.good(pair) for r in rs) / len(rs) if rs else 0.0

    @property
    def lost(self) -> int:
        return sum(r.lost for r in self.requests)


def search(run_probe: Callable[[float], Probe], pairs: Sequence[SloPair], low: float, high: float,
           probes: int) -> list[Probe]:
    """Up to `probes` probes, each bisecting (geometrically) the widest of the pairs' brackets;
    a bracket is (highest rate passed, lowest rate failed), starting at (`low`, `high`).
    Stops early once every bracket is within 5 % (or when a rate would repeat)."""
    if not 0 < low < high:
        raise ValueError(f"rate range must satisfy 0 < low < high, got {low}:{high}")
    brackets = {p.name: [low, high] for p in pairs}
    done: list[Probe] = []
    for _ in range(probes):
        name = max(brackets, key=lambda n: brackets[n][1] / brackets[n][0])
        lo, hi = brackets[name]
        if hi / lo < 1.05:
            break
        rate = round(math.sqrt(lo * hi), 4)
        if any(p.rate_rps == rate for p in done):
            break
        probe = run_probe(rate)
        done.append(probe)
        for p in pairs:
            b = brackets[p.name]
            if b[0] < rate < b[1]:
                b[0 if probe.attainment(p) >= ATTAINMENT else 1] = rate
    return done


def goodput(probes: Sequence[Probe], pair: SloPair, phase: str | None = None) -> float:
    """The highest probed rate with >= 90 % attainment (of `phase`'s requests if given); 0.0
    when none reached it."""
    return max((p.rate_rps for p in probes if p.attainment(pair, phase) >= ATTAINMENT), default=0.0)


def curve(probes: Sequence[Probe], pair: SloPair, phases: Sequence[str]) -> list[dict[str, object]]:
    """Every probe of a search, by rate: overall and per-phase attainment, requests, lost."""
    return [{"rate_rps": p.rate_rps, "attainment": round(p.attainment(pair), 3),
             "by_phase": {ph: round(p.attainment(pair, ph), 3) for ph in phases},
             "requests": len(p.requests), "lost": p.lost, "wall_s": round(p.wall_s, 2),
             "ttft_ms_p50": _p50([1000.0 * r.ttft_s for r in p.requests if r.ttft_s is not None]),
             "tpot_ms_p50": _p50([r.tpot_ms for r in p.requests if r.tokens > 1]),
             "cut_off": sum(r.ttft_s is None and not r.lost for r in p.requests),
             "start_roles": p.extra.get("start_roles"), "role_changes": p.role_changes}
            for p in sorted(probes, key=lambda p: p.rate_rps)]


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded; None when either is missing or b is 0 (nothing to compare against)."""
    return round(a / b, 3) if a is not None and b else None
