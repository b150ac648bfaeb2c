"""Prefix-aware prefill routing: send a prompt where most of its prefix is already cached.

score(engine) = sum over its matched prefix blocks of the medium weight
                - load_weight * engine.load_score * num_prompt_blocks

The first term is what the engine saves (blocks it need not compute, discounted for slower
media); the second is what its queue costs, in the same unit: each unit of load (roughly one
queued request, see `EngineView.load_score`) is charged `load_weight` of this prompt's blocks.
The default 0.25 says a prefix hit of the whole prompt is worth waiting behind ~4 requests.

Medium weights (defaults, configurable as "GPU=1.0,CPU=0.8,..."):
- GPU 1.0: the working cache on CUDA builds.
- CPU 0.8: vLLM's name for the host-memory offload tier on GPU builds. On the CPU build the
  working cache itself is called CPU; every engine's working cache then weighs the same, so
  only the ordering against the tiers below matters.
- CPU_OFFLOAD 0.7: the offload tier where the working cache already lives in host memory; a
  hit still needs a copy into the working cache, hence below CPU.
- STORAGE (and vLLM's older FS / OBJ) 0.5: disk or object storage.
- any other medium: `unknown_weight` (0.5).
A block held in several media counts once, at its best weight. Matches are only counted for the
engine's live epoch: the index entries of a restarted engine are gone at once.

Ties (scores within `tie_epsilon`) and cold starts (no engine holds block 0) go to the least
loaded engine; equally loaded engines are taken in turn, so sequential cold prompts spread.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from connectors.kv_events import MEDIUM_CPU, MEDIUM_CPU_OFFLOAD, MEDIUM_DISK, MEDIUM_GPU
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.routing import (
    REASON_LOAD,
    REASON_PREFIX,
    EngineView,
    RoutingDecision,
    RoutingRequest,
)

DEFAULT_MEDIUM_WEIGHTS: dict[str, float] = {
    MEDIUM_GPU: 1.0,
    MEDIUM_CPU: 0.8,
    MEDIUM_CPU_OFFLOAD: 0.7,
    MEDIUM_DISK: 0.5,
    "FS": 0.5,
    "OBJ": 0.5,
}
DEFAULT_MEDIUM_WEIGHTS_SPEC = ",".join(f"{k}={v}" for k, v in DEFAULT_MEDIUM_WEIGHTS.items())


def parse_medium_weights(spec: str) -> dict[str, float]:
    """Parses "GPU=1.0,CPU=0.8" (names are case-sensitive, weights >= 0) on top of the defaults."""
    weights = dict(DEFAULT_MEDIUM_WEIGHTS)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"medium_weights: expected NAME=WEIGHT, got {part!r}")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"medium_weights: weight of {name.strip()!r} is not a number: {value!r}") from None
        if not weight >= 0:
            raise ValueError(f"medium_weights: weight of {name.strip()!r} must be >= 0, got {value!r}")
        weights[name.strip()] = weight
    return weights


class PrefixAwarePolicy:
    """`RoutingPolicy` scoring engines by cached prefix (from a `PrefixIndex`) minus load."""

    name = "prefix"

    def __init__(self, index: PrefixIndex, *, medium_weights: Mapping[str, float] | None = None,
                 load_weight: float = 0.25, unknown_weight: float = 0.5, tie_epsilon: float = 1e-6) -> None:
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        self.index = index
        self.medium_weights = dict(DEFAULT_MEDIUM_WEIGHTS if medium_weights is None else medium_weights)
        self.load_weight = load_weight
        self.unknown_weight = unknown_weight
        self.tie_epsilon = tie_epsilon
        self._turn = itertools.count()

    def choose_prefill(self, request: RoutingRequest, engines: Sequence[EngineView]) -> RoutingDecision:
        matches = request.prefix_matches
        if matches is None:
            matches = self.index.match(request.block_hashes) if request.block_hashes else {}
        num_blocks = max(len(request.block_hashes), 1)
        scored: list[tuple[float, int, EngineView]] = []
        for engine in engines:
            m = matches.get(engine.engine_id)
            matched, prefix = 0, 0.0
            if m is not None and m.epoch == engine.epoch:
                matched = m.num_blocks
                prefix = m.weighted_blocks(self.medium_weights, self.unknown_weight)
            scored.append((prefix - self.load_weight * engine.load_score * num_blocks, matched, engine))
        best = max(s for s, _, _ in scored)
        tied = [(matched, e) for s, matched, e in scored if best - s <= self.tie_epsilon]
        lowest = min(e.load_score for _, e in tied)
        tied = sorted((t for t in tied if t[1].load_score - lowest <= self.tie_epsilon),
                      key=lambda t: t[1].engine_id)
        matched, chosen = tied[next(self._turn) % len(tied)]
        return RoutingDecision(chosen.engine_id, REASON_PREFIX if matched else REASON_LOAD, matched)
