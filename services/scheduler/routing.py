"""Routing: which prefill engine computes a prompt and which decode engine generates.

The prefill choice is pluggable (`RoutingPolicy`); the decode choice is always by load. The
`Router` wraps a policy with the rules every policy shares: prompts shorter than the
decode-only threshold, or arriving when no prefill engine can take them, skip prefill. Every
decision carries a reason (a short constant below) and is counted by reason.

Contract for policies: `choose_prefill` receives only engines that are healthy and below their
admission limit (never an empty list), must not mutate them, and returns a decision naming one
of them (or None to fall back to decode-only with its own reason).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from connectors.head_map import mapping_problem

# Decision reasons (metric label values; keep them low-cardinality).
REASON_LOAD = "load"
REASON_ROUND_ROBIN = "round_robin"
REASON_PREFIX = "prefix"
REASON_SHORT_PROMPT = "decode_only_short_prompt"
REASON_NO_PREFILL = "decode_only_no_prefill"
REASON_NO_DECODE = "no_decode_engine"
REASON_UNMAPPABLE_TP = "decode_only_unmappable_tp"


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a policy may look at: the prompt's 64-bit block hashes and its length."""

    block_hashes: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class EngineView:
    """A routable engine as the registry sees it right now (a snapshot, not live state)."""

    engine_id: str
    epoch: int
    role: str
    num_inflight: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    max_inflight: int | None = None
    tp_size: int = 1
    num_kv_heads: int = 0  # 0: unknown (treated as mappable with any engine)

    @property
    def load_score(self) -> float:
        """Lower is better: requests the scheduler has in flight there, what the engine says is
        running or queued, and its KV usage (0..1) as a tie-breaker worth one request."""
        return self.num_inflight + self.num_waiting + 0.5 * self.num_running + self.kv_usage


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    engine_id: str | None
    reason: str
    matched_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    """A complete decision: prefill (engine_id None = decode-only) and decode."""

    prefill: RoutingDecision
    decode: RoutingDecision

    @property
    def decode_only(self) -> bool:
        return self.prefill.engine_id is None


@runtime_checkable
class RoutingPolicy(Protocol):
    """Chooses the prefill engine for a prompt. Implementations: `LoadBasedPolicy`,
    `RoundRobinPolicy`, and the prefix-aware policy of the KV-event plane."""

    name: str

    def choose_prefill(self, request: RoutingRequest, engines: Sequence[EngineView]) -> RoutingDecision: ...


def least_loaded(engines: Sequence[EngineView]) -> EngineView:
    """The engine with the lowest load score; ties go to the smallest engine id (stable)."""
    return min(engines, key=lambda e: (e.load_score, e.engine_id))


class LoadBasedPolicy:
    """Least-loaded prefill engine."""

    name = "load"

    def choose_prefill(self, request: RoutingRequest, engines: Sequence[EngineView]) -> RoutingDecision:
        return RoutingDecision(least_loaded(engines).engine_id, REASON_LOAD)


class RoundRobinPolicy:
    """Cycles through the engines in id order, whatever their load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose_prefill(self, request: RoutingRequest, engines: Sequence[EngineView]) -> RoutingDecision:
        ordered = sorted(engines, key=lambda e: e.engine_id)
        return RoutingDecision(ordered[next(self._counter) % len(ordered)].engine_id, REASON_ROUND_ROBIN)


@dataclass(slots=True)
class Router:
    """Applies the shared rules around a policy and counts decisions by reason."""

    policy: RoutingPolicy
    decode_only_threshold: int = 0
    decisions: Counter[str] = field(default_factory=Counter)

    def route(self, request: RoutingRequest, prefill_engines: Sequence[EngineView],
              decode_engines: Sequence[EngineView], *, exclude_decode: frozenset[str] = frozenset()) -> Route:
        """Chooses both legs among the given (healthy, admissible) engines.

        `exclude_decode` removes decode engines a migrating request already failed on. When no
        decode engine is left the decode decision has engine_id None and reason
        `no_decode_engine`; the caller answers UNAVAILABLE or RESOURCE_EXHAUSTED. Only prefill
        engines whose KV-head layout the chosen decode engine can read are offered to the
        policy (`pair_problem`); when none is, the request is decode-only with reason
        `decode_only_unmappable_tp`.
        """
        decode_views = [e for e in decode_engines if e.engine_id not in exclude_decode]
        decode = self.choose_decode(decode_views)
        chosen = next((e for e in decode_views if e.engine_id == decode.engine_id), None)
        mappable = [e for e in prefill_engines if chosen is None or pair_problem(e, chosen) is None]
        if request.num_tokens < self.decode_only_threshold:
            prefill = RoutingDecision(None, REASON_SHORT_PROMPT)
        elif not prefill_engines:
            prefill = RoutingDecision(None, REASON_NO_PREFILL)
        elif not mappable:
            prefill = RoutingDecision(None, REASON_UNMAPPABLE_TP)
        else:
            prefill = self.policy.choose_prefill(request, mappable)
        self.decisions[prefill.reason] += 1
        return Route(prefill, decode)

    def choose_decode(self, engines: Sequence[EngineView]) -> RoutingDecision:
        if not engines:
            return RoutingDecision(None, REASON_NO_DECODE)
        return RoutingDecision(least_loaded(engines).engine_id, REASON_LOAD)


def pair_problem(prefill: EngineView, decode: EngineView) -> str | None:
    """Why `decode` cannot read KV computed by `prefill` (their TP sizes do not map onto the
    model's KV heads), or None. Engines whose KV heads are unknown are assumed to map."""
    heads = decode.num_kv_heads or prefill.num_kv_heads
    if not heads:
        return None
    if prefill.num_kv_heads and decode.num_kv_heads and prefill.num_kv_heads != decode.num_kv_heads:
        return f"KV heads differ ({prefill.num_kv_heads} vs {decode.num_kv_heads})"
    return mapping_problem(prefill.tp_size, decode.tp_size, heads)


def make_policy(name: str) -> RoutingPolicy:
    """The policy named by `SchedulerConfig.routing_policy`. "prefix" needs the KV-event plane's
    policy (`services.scheduler.prefix_routing`); without it, "prefix" falls back to load."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "load":
        return LoadBasedPolicy()
    if name == "prefix":
        return LoadBasedPolicy()
    raise ValueError(f"routing_policy: unknown policy {name!r} (prefix, load or round_robin)")
