"""`RolePlanner`: which role each engine should serve, judged by predicted goodput under SLOs.

Pure and synchronous: plain data in (`PlannerInputs`: load, fits, targets, the engines and their
roles), a `PlanDecision` out, an injectable clock. The scheduler service feeds it on a timer
and acts on (or only exports) what it decides (docs/decisions/0044).

The model, per candidate split (prefill, decode, mixed engines; every split of the engines with
at least one engine that decodes):
- Requests arrive at `arrival_rps`; a request's prompt costs `prefill_s(uncached tokens)` (the
  live prefill fit; uncached = prompt x (1 - prefix hit rate)); its tokens cost one decode step
  each, `step_s + step_per_seq_s x batch` (the live ITL fit, batch = sequences decoding there).
- Decode and mixed engines share the requests evenly. Requests on a decode engine prefill on a
  prefill engine (if there is none, locally, like a mixed engine's).
- A prefill engine is a queue: utilisation rho = rate x prefill time / engines; the wait
  before a prompt's prefill is M/M/1's, P(wait > t) = rho exp(-(1 - rho) t / prefill), so
  P(TTFT <= target) = 1 - rho exp(-(target - prefill) (1 - rho) / prefill) above the bare
  prefill time, else 0.
- A decoding engine runs `batch` sequences by Little's law; ITL meets its target while the
  step time does. A local prefill stalls that engine's decode: its ITL target is met only when
  the prefill share of its time leaves the step time within target (a prefill longer than the
  ITL target makes the tokens around it late: the share of requests that see such a stall is
  charged to attainment).
- Attainment is the product of the TTFT and ITL terms. A split's predicted goodput is the
  highest arrival rate at which attainment stays >= 90 % (DistServe's measure), for the
  observed mix of prompt and output lengths: the split with the most headroom wins, whether or
  not the current rate already saturates it.

Decisions: the best split by predicted goodput, ties to the current split, then to fewer role
changes. A change is made only when the best beats the current split's prediction by
`hysteresis` (relative) and `min_gain_rps`, and no change was made within `min_dwell_s`; one
engine changes per decision (the least loaded engine of a role in surplus), so the next
decision sees the effect of the last. Every decision carries its reason and both predictions;
`observe` records the observed goodput against the prediction once the dwell has passed.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

ROLES = ("prefill", "decode", "mixed")
# The share of requests that must meet both targets (DistServe's and vLLM's goodput: 90 %).
ATTAINMENT = 0.9


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """Targets and damping. `ttft_target_s` / `itl_target_s`: the SLO pair (requests' own
    targets, when set, replace them in `PlannerInputs`)."""

    ttft_target_s: float = 1.0
    itl_target_s: float = 0.1
    hysteresis: float = 0.1
    min_gain_rps: float = 0.05
    min_dwell_s: float = 20.0

    def __post_init__(self) -> None:
        if self.ttft_target_s <= 0 or self.itl_target_s <= 0:
            raise ValueError("planner targets must be > 0")
        if self.hysteresis < 0 or self.min_gain_rps < 0 or self.min_dwell_s < 0:
            raise ValueError("planner hysteresis, min_gain_rps and min_dwell_s must be >= 0")


@dataclass(frozen=True, slots=True)
class EngineRoleView:
    engine_id: str
    role: str
    load: float = 0.0  # lower is less loaded (the routing load score)


@dataclass(frozen=True, slots=True)
class PlannerInputs:
    """What the planner reads, measured over a recent window."""

    engines: Sequence[EngineRoleView]
    arrival_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    prefix_hit_rate: float = 0.0
    prefill_fixed_s: float = 0.01
    prefill_per_token_s: float = 1e-4
    step_s: float = 0.02  # a decode step with one sequence
    step_per_seq_s: float = 0.0  # what each further sequence in the batch adds to a step
    ttft_target_s: float | None = None  # None: the config's
    itl_target_s: float | None = None


@dataclass(frozen=True, slots=True)
class Split:
    prefill: int
    decode: int
    mixed: int

    def count(self, role: str) -> int:
        return {"prefill": self.prefill, "decode": self.decode, "mixed": self.mixed}[role]

    def __str__(self) -> str:
        return f"{self.prefill}P+{self.decode}D+{self.mixed}M"


@dataclass(frozen=True, slots=True)
class RoleMove:
    engine_id: str
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class PlanDecision:
    current: Split
    desired: Split
    predicted_current_rps: float
    predicted_desired_rps: float
    reason: str
    move: RoleMove | None = None  # the one engine to change now (None: hold)


@dataclass(slots=True)
class PlanRecord:
    """A change made, with the goodput predicted before and after and, later, observed."""

    at: float
    move: RoleMove
    predicted_old_rps: float
    predicted_new_rps: float
    reason: str
    observed_rps: float | None = None


def attainment(split: Split, x: PlannerInputs, ttft_target: float, itl_target: float) -> float:
    """Predicted share of requests meeting both targets under `split` (see the module model)."""
    decoding = split.decode + split.mixed
    if decoding == 0 or x.arrival_rps <= 0:
        return 0.0 if decoding == 0 else 1.0
    uncached = max(0.0, x.mean_prompt_tokens * (1.0 - x.prefix_hit_rate))
    prefill = x.prefill_fixed_s + x.prefill_per_token_s * uncached
    rate_each = x.arrival_rps / decoding
    local = split.mixed + (split.decode if split.prefill == 0 else 0)
    remote = decoding - local
    total = 0.0
    if remote:
        total += remote * _remote_share(split.prefill, remote * rate_each, rate_each, prefill, x, ttft_target,
                                        itl_target)
    if local:
        total += local * _local_share(rate_each, prefill, x, ttft_target, itl_target)
    return total / decoding


def _ttft_term(rho: float, prefill: float, target: float) -> float:
    """P(wait + prefill <= target) in an M/M/1 queue: P(wait > t) = rho exp(-(1 - rho) t / prefill)."""
    if rho >= 1.0 or target <= prefill:
        return 0.0
    return 1.0 - rho * math.exp(-(target - prefill) * (1.0 - rho) / prefill)


def _decode_step(rate: float, x: PlannerInputs, busy_share: float) -> float | None:
    """Mean step time on an engine decoding `rate` requests/s (None: saturated). Little's law:
    batch = rate x outputs x step, step = (step_s + k x batch) / (1 - busy_share)."""
    free = 1.0 - busy_share
    if free <= 0:
        return None
    demand = rate * x.mean_output_tokens
    denominator = free - demand * x.step_per_seq_s
    if denominator <= 0:
        return None
    return x.step_s / denominator


def _remote_share(num_prefill: int, rate_total: float, rate_each: float, prefill: float, x: PlannerInputs,
                  ttft_target: float, itl_target: float) -> float:
    rho = rate_total * prefill / num_prefill
    step = _decode_step(rate_each, x, 0.0)
    if step is None or step > itl_target:
        return 0.0
    return _ttft_term(rho, prefill + step, ttft_target)


def _local_share(rate: float, prefill: float, x: PlannerInputs, ttft_target: float, itl_target: float) -> float:
    busy = rate * prefill  # share of the engine's time computing prompts
    step = _decode_step(rate, x, busy)
    if step is None or step > itl_target:
        return 0.0
    ttft = _ttft_term(busy, prefill + step, ttft_target)
    if prefill <= itl_target:
        return ttft
    # A prompt computed here stalls every sequence decoding beside it past the ITL target; the
    # requests decoding meanwhile (batch x prefills per output) miss it.
    stalled = min(1.0, rate * prefill * (1.0 + x.mean_output_tokens * step * rate))
    return ttft * (1.0 - stalled)


def splits(num_engines: int) -> list[Split]:
    """Every split of `num_engines` engines with at least one decoding engine."""
    out = []
    for p in range(num_engines):
        for d in range(num_engines - p + 1):
            m = num_engines - p - d
            if d + m >= 1:
                out.append(Split(p, d, m))
    return out


def current_split(engines: Sequence[EngineRoleView]) -> Split:
    roles = [e.role for e in engines]
    return Split(roles.count("prefill"), roles.count("decode"), roles.count("mixed"))


@dataclass(slots=True)
class RolePlanner:
    config: PlannerConfig = field(default_factory=PlannerConfig)
    clock: Callable[[], float] = time.monotonic
    last_change_at: float = float("-inf")
    history: list[PlanRecord] = field(default_factory=list)
    last: PlanDecision | None = None

    def predict(self, split: Split, x: PlannerInputs) -> float:
        """Predicted goodput of `split` for `x`'s mix of prompts and outputs, DistServe's way: the
        highest arrival rate (requests/s) at which `ATTAINMENT` of requests meet both targets."""
        ttft = x.ttft_target_s or self.config.ttft_target_s
        itl = x.itl_target_s or self.config.itl_target_s
        if attainment(split, replace(x, arrival_rps=1e-9), ttft, itl) < ATTAINMENT:
            return 0.0
        low, high = 0.0, 1.0
        while attainment(split, replace(x, arrival_rps=high), ttft, itl) >= ATTAINMENT and high < 1e6:
            low, high = high, high * 2
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if attainment(split, replace(x, arrival_rps=mid), ttft, itl) >= ATTAINMENT \
                else (low, mid)
        return low

    def plan(self, x: PlannerInputs) -> PlanDecision:
        """The split to aim for and the one engine to change now, if any (see the module doc)."""
        now = current_split(x.engines)
        predicted_now = self.predict(now, x)
        scored = [(self.predict(s, x), -_distance(s, now), s) for s in splits(len(x.engines))]
        best_rps, _, best = max(scored, key=lambda t: (round(t[0], 9), t[1], t[2] == now))
        decision = self._decide(now, predicted_now, best, best_rps, x)
        self.last = decision
        return decision

    def _decide(self, now: Split, now_rps: float, best: Split, best_rps: float, x: PlannerInputs) -> PlanDecision:
        gain = best_rps - now_rps
        if best == now or gain <= 0:
            return PlanDecision(now, now, now_rps, now_rps, "current split is the best predicted")
        if gain < self.config.min_gain_rps or best_rps < now_rps * (1.0 + self.config.hysteresis):
            return PlanDecision(now, best, now_rps, best_rps,
                                f"{best} predicts {best_rps:.2f} rps vs {now_rps:.2f}: within hysteresis, holding")
        since = self.clock() - self.last_change_at
        if since < self.config.min_dwell_s:
            return PlanDecision(now, best, now_rps, best_rps,
                                f"last change {since:.0f} s ago (< dwell {self.config.min_dwell_s:.0f} s), holding")
        move = _one_move(now, best, x.engines)
        step = _apply(now, move)
        reason = (f"{now} -> {best} predicts goodput {best_rps:.2f} rps vs {now_rps:.2f} (now {x.arrival_rps:.2f} rps, "
                  f"prompt {x.mean_prompt_tokens:.0f}, output {x.mean_output_tokens:.0f} tokens); "
                  f"moving {move.engine_id} {move.old} -> {move.new} (to {step})")
        return PlanDecision(now, best, now_rps, best_rps, reason, move)

    def record(self, decision: PlanDecision, x: PlannerInputs) -> PlanRecord | None:
        """Marks `decision`'s move as made (starts the dwell); the record keeps both predictions."""
        if decision.move is None:
            return None
        self.last_change_at = self.clock()
        step = _apply(decision.current, decision.move)
        rec = PlanRecord(self.last_change_at, decision.move, decision.predicted_current_rps,
                         self.predict(step, x), decision.reason)
        self.history.append(rec)
        return rec

    def observe(self, goodput_rps: float) -> PlanRecord | None:
        """Records the goodput observed after the last change, once its dwell has passed."""
        if not self.history or self.history[-1].observed_rps is not None:
            return None
        rec = self.history[-1]
        if self.clock() - rec.at < self.config.min_dwell_s:
            return None
        rec.observed_rps = goodput_rps
        return rec


def _distance(a: Split, b: Split) -> int:
    return (abs(a.prefill - b.prefill) + abs(a.decode - b.decode) + abs(a.mixed - b.mixed)) // 2


def _one_move(now: Split, best: Split, engines: Sequence[EngineRoleView]) -> RoleMove:
    surplus = [r for r in ROLES if now.count(r) > best.count(r)]
    deficit = [r for r in ROLES if now.count(r) < best.count(r)]
    # Prefer moves between neighbouring roles (prefill <-> mixed <-> decode share the most work).
    old, new = min(itertools.product(surplus, deficit), key=lambda p: (abs(ROLES.index(p[0]) - ROLES.index(p[1])), p))
    engine = min((e for e in engines if e.role == old), key=lambda e: (e.load, e.engine_id))
    return RoleMove(engine.engine_id, old, new)


def _apply(split: Split, move: RoleMove) -> Split:
    counts = {r: split.count(r) for r in ROLES}
    counts[move.old] -= 1
    counts[move.new] += 1
    return Split(counts["prefill"], counts["decode"], counts["mixed"])
