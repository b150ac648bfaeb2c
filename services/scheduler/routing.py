"""Routing: which prefill engine computes a prompt and which decode engine generates.

The prefill choice is pluggable (`RoutingPolicy`); whether the prompt is prefilled there at all
(remote prefill + KV transfer) or on the decode engine, and which decode engine, is the path
policy's joint decision (`services.scheduler.path_policy`). The `Router` wraps both with the
rules every policy shares: prompts shorter than the decode-only threshold, or arriving when no
prefill engine can take them, skip prefill. Every decision carries a reason (a short constant
below, or a path reason) and is counted by reason.

Contract for policies: `choose_prefill` receives only engines that are healthy and below their
admission limit (never an empty list), must not mutate them, and returns a decision naming one
of them (or None to fall back to decode-only with its own reason).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from connectors.head_map import mapping_problem
from services.scheduler.path_policy import (
    LOCAL_MIXED_ENGINE,
    LOCAL_NO_PREFILL,
    LOCAL_SHORT_PROMPT,
    PathConfig,
    PathDecision,
    PathPolicy,
    PathRequest,
)
from services.scheduler.peer_fetch import PeerFetch, PeerFetchPolicy
from services.scheduler.prefix_index import EngineMatch, PrefixIndex

# Decision reasons (metric label values; keep them low-cardinality).
REASON_LOAD = "load"
REASON_ROUND_ROBIN = "round_robin"
REASON_PREFIX = "prefix"
REASON_SHORT_PROMPT = LOCAL_SHORT_PROMPT
REASON_NO_PREFILL = LOCAL_NO_PREFILL
REASON_NO_DECODE = "no_decode_engine"
REASON_UNMAPPABLE_TP = "decode_only_unmappable_tp"
# The chosen decode engine is mixed: it computes its own prompts (docs/decisions/0044).
REASON_MIXED = LOCAL_MIXED_ENGINE


# A block held in several media counts once, under the fastest (default medium_weights' order).
MEDIUM_ORDER = ("GPU", "CPU", "CPU_OFFLOAD")

@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a policy may look at: the prompt's 64-bit block hashes and its length, the
    request's own latency targets (None: not set), and the prefix index's answer for
    `block_hashes` when the caller already asked it (`Router.route` does, once per request;
    None: a policy that needs it asks its index itself)."""

    block_hashes: list[int]
    num_tokens: int
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    prefix_matches: Mapping[str, EngineMatch] | None = None


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
    # Prompt tokens the scheduler sent there that are not computed yet (path policy).
    num_backlog_tokens: int = 0
    # The tightest ITL target among the requests decoding there (None: no request set one).
    itl_target_s: float | None = None
    # pdserve's own engine: a peer fetch's pin there waits for no more than its current step
    # (decision 0049); False: a vLLM engine (its pin is a scheduled prefill), or unknown.
    native_engine: bool = False
    # Lower is better: requests the scheduler has in flight there, what the engine says is
    # running or queued, and its KV usage (0..1) as a tie-breaker worth one request. Derived,
    # computed once per view: the policies read it several times per engine per request.
    load_score: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "load_score",
                           self.num_inflight + self.num_waiting + 0.5 * self.num_running + self.kv_usage)


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    engine_id: str | None
    reason: str
    matched_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    """A complete decision: prefill (engine_id None = decode-only) and decode, and the path
    decision behind them (None only when no decode engine was left)."""

    prefill: RoutingDecision
    decode: RoutingDecision
    path: PathDecision | None = None
    fetch: PeerFetch | None = None  # the decode engine pulls a prefix cached on another engine
    # The prompt's blocks already cached on the engine that computes it, per medium (the best
    # medium holding each block): what pdserve_scheduler_prefix_hit_tokens_total counts.
    prefix_hit_blocks: tuple[tuple[str, int], ...] = ()

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
    """Applies the shared rules around a prefill policy and the path policy, and counts
    decisions: `decisions` by the prefill reason (a path reason when decode-local), `paths` by
    path reason. Without an explicit `path` policy every prompt is prefilled remotely (the
    scheduler service builds one from its configuration, cost mode by default). `index`, when
    set, tells the path policy which prompt blocks each engine (decode engines too) holds; it
    must be the index a prefix-aware policy reads, as the Router looks each prompt up once and
    hands the answer to the policy (`RoutingRequest.prefix_matches`)."""

    policy: RoutingPolicy
    decode_only_threshold: int = 0
    path: PathPolicy = field(default_factory=lambda: PathPolicy(PathConfig(mode="remote")))
    index: PrefixIndex | None = None
    # KV reuse across engines (None: off): after the path decision, whether the decode engine
    # pulls a longer cached prefix from another engine (services/scheduler/peer_fetch.py).
    fetch: PeerFetchPolicy | None = None
    decisions: Counter[str] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)

    def route(self, request: RoutingRequest, prefill_engines: Sequence[EngineView],
              decode_engines: Sequence[EngineView], *, exclude_decode: frozenset[str] = frozenset(),
              busy: Sequence[EngineView] = ()) -> Route:
        """Chooses both legs among the given (healthy, admissible) engines.

        `exclude_decode` removes decode engines a migrating request already failed on. When no
        decode engine is left the decode decision has engine_id None and reason
        `no_decode_engine` (nothing is counted); the caller answers UNAVAILABLE or
        RESOURCE_EXHAUSTED. Only prefill engines whose KV-head layout some decode engine can
        read are offered to the policy (`pair_problem`); when none is, or the path's decode
        engine cannot read the chosen one, the request is decode-only with reason
        `decode_only_unmappable_tp`. `busy` engines (at their admission bound) are never chosen,
        but may be the holder a peer fetch pulls from.
        """
        decodes = [e for e in decode_engines if e.engine_id not in exclude_decode]
        if not decodes:
            none = RoutingDecision(None, REASON_NO_DECODE)
            return Route(none, none)
        if self.index is not None and request.block_hashes and request.prefix_matches is None:
            request = replace(request, prefix_matches=self.index.match(request.block_hashes))
        matched = self._matched_blocks(request, [*prefill_engines, *decodes])
        want = PathRequest(request.num_tokens, request.ttft_target_s, request.itl_target_s)
        chosen: RoutingDecision | None = None
        if request.num_tokens < self.decode_only_threshold:
            path = self.path.local(REASON_SHORT_PROMPT, want, decodes, matched)
        else:
            mappable = _readable_prefills(prefill_engines, decodes)
            if mappable:
                chosen = self.policy.choose_prefill(request, mappable)
            view = next((e for e in mappable if chosen is not None and e.engine_id == chosen.engine_id), None)
            if prefill_engines and not mappable:
                path = self.path.local(REASON_UNMAPPABLE_TP, want, decodes, matched)
            else:
                path = self.path.decide(want, view, decodes, matched)
        target = next((e for e in decodes if e.engine_id == path.decode_id), None)
        if target is not None and target.role == "mixed" and not path.local:
            path = self.path.local(REASON_MIXED, want, [target], matched)
        fetch = None
        if self.fetch is not None:
            held = {**self._matched_blocks(request, busy), **matched} if busy else matched
            if held:
                remote = view if chosen is not None and not path.local else None
                path, fetch = self._peer_fetch(want, path, [*prefill_engines, *decodes, *busy], decodes, held, remote)
                target = next((e for e in decodes if e.engine_id == path.decode_id), None)
        prefill = chosen if chosen is not None and not path.local else RoutingDecision(None, path.reason)
        if prefill.engine_id is not None and view is not None and target is not None \
                and pair_problem(view, target) is not None:
            prefill = RoutingDecision(None, REASON_UNMAPPABLE_TP)
            if fetch is not None and fetch.into_prefill:  # nothing is prefilled there now
                fetch = None
        decode = RoutingDecision(path.decode_id, REASON_PREFIX if matched.get(path.decode_id) else REASON_LOAD,
                                 matched.get(path.decode_id, 0))
        self.decisions[prefill.reason] += 1
        self.paths[path.reason] += 1
        computing = prefill.engine_id or decode.engine_id
        hit = (request.prefix_matches or {}).get(computing) if computing is not None else None
        return Route(prefill, decode, path, fetch, _blocks_by_medium(hit, MEDIUM_ORDER))

    def _peer_fetch(self, want: PathRequest, path: PathDecision, engines: Sequence[EngineView],
                    decodes: Sequence[EngineView], matched: Mapping[str, int],
                    prefill: EngineView | None) -> tuple[PathDecision, PeerFetch | None]:
        """The peer-fetch policy's verdict on `path`: holders are the engines holding part of the
        prompt whose KV heads the target — the decision's decode engine, or its prefill engine
        (`prefill`, remote decisions) — can read."""
        assert self.fetch is not None
        d = next((e for e in decodes if e.engine_id == path.decode_id), None)
        if d is None:
            return path, None

        def holders(target: EngineView) -> list[EngineView]:
            return [e for e in engines if e.engine_id != target.engine_id and matched.get(e.engine_id)
                    and pair_problem(e, target) is None]

        return self.fetch.decide(want, path, d, holders(d), matched, self.path, prefill=prefill,
                                 prefill_holders=holders(prefill) if prefill is not None else ())

    def _matched_blocks(self, request: RoutingRequest, engines: Sequence[EngineView]) -> dict[str, int]:
        """Engine id -> consecutive prompt blocks it holds, for the engines' live epochs."""
        matches = request.prefix_matches
        if not matches:
            return {}
        return {e.engine_id: m.num_blocks for e in engines
                if (m := matches.get(e.engine_id)) is not None and m.epoch == e.epoch}

    def choose_decode(self, engines: Sequence[EngineView]) -> RoutingDecision:
        if not engines:
            return RoutingDecision(None, REASON_NO_DECODE)
        return RoutingDecision(least_loaded(engines).engine_id, REASON_LOAD)


def _readable_prefills(prefills: Sequence[EngineView], decodes: Sequence[EngineView]) -> list[EngineView]:
    """The prefill engines some decode engine can read (`pair_problem` None), in order.
    `pair_problem` depends only on the two engines' (tp_size, num_kv_heads), so each distinct
    prefill shape is tested once against one decode engine per distinct shape."""
    decode_shapes = list({(d.tp_size, d.num_kv_heads): d for d in decodes}.values())
    readable: dict[tuple[int, int], bool] = {}
    out = []
    for e in prefills:
        shape = (e.tp_size, e.num_kv_heads)
        ok = readable.get(shape)
        if ok is None:
            ok = readable[shape] = any(pair_problem(e, d) is None for d in decode_shapes)
        if ok:
            out.append(e)
    return out


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


def _blocks_by_medium(match: EngineMatch | None, order: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """Each matched block counted once, under the first medium of `order` holding it (others
    after, by name)."""
    if match is None:
        return ()
    rank = {medium: i for i, medium in enumerate(order)}
    counts: Counter[str] = Counter(min(held, key=lambda m: (rank.get(m, len(rank)), m))
                                   for held in match.media if held)
    return tuple(sorted(counts.items()))
