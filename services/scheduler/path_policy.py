"""`PathPolicy`: per request, remote prefill + KV transfer, or prefill on the decode engine.

Disaggregation pays only when the remote prefill saves more than the transfer and the extra hop
cost. The policy decides per request, together with the decode engine, from:

- the prompt's uncached tokens on every candidate (the prefix index holds the decode engines'
  own blocks too: a decode engine holding part of the prompt pulls only the rest — the engine
  reuses its local prefix and pulls the blocks after it — and computes only the rest when local);
- the engines' load (`EngineView`: queue, KV usage, the scheduler's own backlog of prompt tokens
  there, the tightest ITL target of the requests decoding there);
- the measured prefill and transfer costs (`PathCosts`: prefill time, and transfer time per
  prefill→decode pair).

Modes (`PathConfig.mode`):
- `remote`: always remote prefill (the classic disaggregated path; decode-local only when no
  prefill engine can take the prompt).
- `threshold`: decode-local when the prompt's uncached tokens on the decode engine are below
  `threshold_tokens` (llm-d's prefix-based decider); otherwise remote, to the decode engine
  holding the most of the prompt (fewest blocks to pull), ties to the less loaded. No measured
  cost enters this mode, so its choices are the same on any machine.
- `cost` (default): see docs/architecture.md "What the cost policy optimises". Without
  targets: the option (decode engine x local | remote via the chosen prefill engine) with the
  lowest cost — its predicted TTFT (corrected, see `PathCosts`) plus `decode_load_s` per unit
  of the decode engine's load — among those within the stall budget; costs within `TTFT_TIE`
  of each other (about the model's median error) are a tie, won by local (no hop, no
  transfer). The KV transfer, which delays only the second token, picks the decode engine of a
  remote pull (fewest blocks to pull, fastest pair). Within the stall budget:
  a local prefill may lengthen a step there by at most `decode_stall_steps` measured steps of
  that engine, at least `decode_stall_budget_s`. With targets (the request's, or the
  configured defaults): first the most requests predicted to meet them (the new one its TTFT
  target; each request decoding on the engine its ITL target, lost when the engine's plain
  step meets it and the step holding a local prefill, plain step + stall, exceeds it), then
  the cost; a TTFT target that only a
  local prefill meets lifts the stall budget. The budget in decode steps keeps the short/long
  boundary where it belongs on any machine (per-token cost and step time scale together).

Every decision records the predicted TTFT on the chosen path and on the other one, and what it
was predicted from (`TtftInputs`); `observe_ttft` feeds the outcome back (every mode).

Shared rules: decode engines whose KV usage is at or above `max_decode_kv_usage` are not
candidates while another is below it (a nearly full engine gets no new request, whatever its
prefix); ties go to the less loaded decode engine, then the smaller id.

Every decision has a reason, a low-cardinality label (`REASONS`), `<path>:<why>`:
  decode_local:short_prompt       the prompt is cheap enough to prefill where it decodes
  decode_local:decode_has_prefix  the decode engine's cached prefix makes it cheap (long prompt)
  decode_local:prefill_queue      the prefill engines' backlog makes remote slower
  decode_local:ttft_target        only the local prefill meets the request's TTFT target
  decode_local:no_prefill_engine  no prefill engine can take the prompt
  decode_local:peer_fetch         the decode engine pulls a prefix another engine caches (peer_fetch.py)
  remote:long_prompt              a local prefill would stall the decode engine past the budget
  remote:itl_target               ... past the ITL target of a request decoding there
  remote:ttft_target              only remote meets the request's TTFT target (local costs less)
  remote:lower_cost               local was allowed, remote is predicted faster (beyond `TTFT_TIE`)
  remote:always                   mode remote
  remote:peer_fetch               the prefill engine first pulls a prefix another engine caches (peer_fetch.py)

Pure: plain data in and out, no clock, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from services.scheduler.path_costs import PathCosts

if TYPE_CHECKING:  # routing imports this module
    from services.scheduler.routing import EngineView

logger = logging.getLogger(__name__)

PATH_LOCAL = "decode_local"
PATH_REMOTE = "remote"

LOCAL_SHORT_PROMPT = "decode_local:short_prompt"
LOCAL_DECODE_HAS_PREFIX = "decode_local:decode_has_prefix"
LOCAL_PREFILL_QUEUE = "decode_local:prefill_queue"
LOCAL_TTFT_TARGET = "decode_local:ttft_target"
LOCAL_NO_PREFILL = "decode_local:no_prefill_engine"
LOCAL_PEER_FETCH = "decode_local:peer_fetch"  # services/scheduler/peer_fetch.py
LOCAL_MIXED_ENGINE = "decode_local:mixed_engine"  # the decode engine is mixed: it computes its own prompts
REMOTE_LONG_PROMPT = "remote:long_prompt"
REMOTE_ITL_TARGET = "remote:itl_target"
REMOTE_TTFT_TARGET = "remote:ttft_target"
REMOTE_LOWER_COST = "remote:lower_cost"
REMOTE_ALWAYS = "remote:always"
REMOTE_PEER_FETCH = "remote:peer_fetch"  # the prefill engine pulls a prefix another engine caches (peer_fetch.py)
REASONS = (LOCAL_SHORT_PROMPT, LOCAL_DECODE_HAS_PREFIX, LOCAL_PREFILL_QUEUE, LOCAL_TTFT_TARGET, LOCAL_NO_PREFILL,
           LOCAL_PEER_FETCH,
           LOCAL_MIXED_ENGINE,
           REMOTE_LONG_PROMPT, REMOTE_ITL_TARGET, REMOTE_TTFT_TARGET, REMOTE_LOWER_COST, REMOTE_ALWAYS, REMOTE_PEER_FETCH)
MODES = ("cost", "threshold", "remote")
# Predicted costs within this fraction of each other are a tie (the TTFT model's median error is
# about this size, docs/benchmarks.md), won by the local option: it pays no hop and no transfer.
TTFT_TIE = 0.25


@dataclass(frozen=True, slots=True)
class PathConfig:
    """The policy's knobs (SchedulerConfig's path_* fields)."""

    mode: str = "cost"
    threshold_tokens: int = 256
    max_decode_kv_usage: float = 0.9
    decode_stall_budget_s: float = 0.05
    decode_stall_steps: float = 2.0
    decode_load_s: float = 0.002
    ttft_target_s: float | None = None
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"path_policy: must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.threshold_tokens < 0:
            raise ValueError(f"path_threshold_tokens: must be >= 0, got {self.threshold_tokens}")
        if not 0 < self.max_decode_kv_usage <= 1:
            raise ValueError(f"path_max_decode_kv_usage: must be in (0, 1], got {self.max_decode_kv_usage}")
        for name in ("decode_stall_budget_s", "decode_stall_steps", "decode_load_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"path {name}: must be >= 0, got {getattr(self, name)}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class PathRequest:
    """A prompt as the path policy sees it. Targets are the request's own (None: not set)."""

    num_tokens: int
    ttft_target_s: float | None = None
    itl_target_s: float | None = None


@dataclass(frozen=True, slots=True)
class TtftInputs:
    """What a TTFT prediction is made from: the path, the engine computing the first token (the
    prefill engine for remote, the decode engine for local), the prompt tokens queued there
    ahead of the request, the request's own uncached tokens, and (local) whether requests were
    decoding there."""

    path: str
    engine_id: str
    num_backlog_tokens: int
    num_uncached_tokens: int
    busy: bool = False


@dataclass(frozen=True, slots=True)
class PathDecision:
    """Where the prompt is prefilled (`prefill_id` None: on the decode engine) and why.

    `num_uncached_tokens` is what the prefilling engine is predicted to compute;
    `num_pull_tokens` what the decode engine is predicted to pull (0 when local);
    `predicted_s` the cost the choice minimised (cost mode; else 0): the predicted TTFT plus
    the decode engine's load term.
    `predicted_ttft_s` is the (corrected) predicted time to first token on the chosen path,
    `alternative_ttft_s` on the path not chosen (None: no such path, e.g. no prefill engine),
    `ttft_inputs` what the chosen path's prediction was made from (`PathPolicy.observe_ttft`
    compares the outcome with the fits as they are then); every mode fills them."""

    path: str
    reason: str
    decode_id: str
    prefill_id: str | None
    num_uncached_tokens: int
    num_pull_tokens: int = 0
    predicted_s: float = 0.0
    predicted_ttft_s: float | None = None
    alternative_ttft_s: float | None = None
    ttft_inputs: TtftInputs | None = None

    @property
    def local(self) -> bool:
        return self.prefill_id is None


@dataclass(frozen=True, slots=True)
class _Option:
    cost_s: float
    decode: EngineView
    local: bool
    uncached: int
    pull: int
    ttft_s: float = 0.0  # predicted TTFT, corrected
    inputs: TtftInputs | None = None
    stretched: bool = False  # local beyond the stall budget, allowed by the TTFT target
    # Requests predicted to meet their targets with this option: the new one (its TTFT target)
    # minus those decoding there that a local prefill would push past their ITL target.
    score: int = 1
    harmed: int = 0
    transfer_s: float = 0.0  # remote: the predicted KV transfer (delays the second token)


class PathPolicy:
    """See the module docstring. `matched_blocks` maps engine id -> consecutive prompt blocks it
    holds (live epoch only; the caller filters). Never called with no decode engine."""

    def __init__(self, config: PathConfig | None = None, costs: PathCosts | None = None) -> None:
        self.config = config or PathConfig()
        self.costs = costs or PathCosts()

    def decide(self, request: PathRequest, prefill: EngineView | None, decodes: Sequence[EngineView],
               matched_blocks: Mapping[str, int]) -> PathDecision:
        if not decodes:
            raise ValueError("decide needs at least one decode engine")
        candidates = self._candidates(decodes)
        if prefill is None:
            d = self._best_local_engine(request, candidates, matched_blocks)
            return self._predicted(self._local(LOCAL_NO_PREFILL, request, d, matched_blocks), request, None, d,
                                   matched_blocks)
        if self.config.mode == "cost":
            return self._cost(request, prefill, candidates, matched_blocks)
        if self.config.mode == "remote":
            decision = self._best_remote(REMOTE_ALWAYS, request, prefill, candidates, matched_blocks)
        else:
            decision = self._threshold(request, prefill, candidates, matched_blocks)
        d = next(c for c in candidates if c.engine_id == decision.decode_id)
        return self._predicted(decision, request, prefill, d, matched_blocks)

    def local(self, reason: str, request: PathRequest, decodes: Sequence[EngineView],
              matched_blocks: Mapping[str, int]) -> PathDecision:
        """A decode-local decision forced by the caller (e.g. a legacy short-prompt rule)."""
        d = self._best_local_engine(request, self._candidates(decodes), matched_blocks)
        return self._predicted(self._local(reason, request, d, matched_blocks), request, None, d, matched_blocks)

    def _predicted(self, decision: PathDecision, request: PathRequest, prefill: EngineView | None, d: EngineView,
                   matched_blocks: Mapping[str, int]) -> PathDecision:
        """`decision` with the TTFT predictions on both paths through decode engine `d`."""
        local = self._local_option(request, d, matched_blocks)
        remote = self._remote_option(request, prefill, d, matched_blocks) if prefill is not None else None
        chosen, other = (local, remote) if decision.local else (remote, local)
        assert chosen is not None
        return replace(decision, predicted_ttft_s=chosen.ttft_s, ttft_inputs=chosen.inputs,
                       alternative_ttft_s=other.ttft_s if other is not None else None)

    # -- shared pieces -------------------------------------------------------------------------

    def _candidates(self, decodes: Sequence[EngineView]) -> list[EngineView]:
        roomy = [d for d in decodes if d.kv_usage < self.config.max_decode_kv_usage]
        return roomy or [min(decodes, key=lambda d: (d.kv_usage, d.load_score, d.engine_id))]

    def _uncached(self, request: PathRequest, engine_id: str, matched_blocks: Mapping[str, int]) -> int:
        # The last prompt token is always computed (its logits sample the first token).
        cached = min(matched_blocks.get(engine_id, 0) * self.config.block_size, request.num_tokens - 1)
        return request.num_tokens - max(0, cached)

    def _local(self, reason: str, request: PathRequest, d: EngineView, matched_blocks: Mapping[str, int],
               predicted_s: float = 0.0) -> PathDecision:
        return PathDecision(PATH_LOCAL, reason, d.engine_id, None, self._uncached(request, d.engine_id, matched_blocks),
                            0, predicted_s)

    def _best_local_engine(self, request: PathRequest, candidates: Sequence[EngineView],
                           matched_blocks: Mapping[str, int]) -> EngineView:
        return min(candidates, key=lambda d: (self._uncached(request, d.engine_id, matched_blocks), d.load_score,
                                              d.engine_id))

    def _best_remote(self, reason: str, request: PathRequest, prefill: EngineView, candidates: Sequence[EngineView],
                     matched_blocks: Mapping[str, int]) -> PathDecision:
        best = self._best_remote_option(request, prefill, candidates, matched_blocks)
        return self._remote(reason, request, prefill, best, matched_blocks)

    def _best_remote_option(self, request: PathRequest, prefill: EngineView, candidates: Sequence[EngineView],
                            matched_blocks: Mapping[str, int], *, with_backlog: bool = True) -> _Option:
        """`min(_remote_option(d) for d in candidates, key=_pull_order)`, costing only the candidates
        that can differ: a decode engine holding none of the prompt and without a measured
        transfer fit from this prefill engine pulls the whole prompt at the shared fit, so those
        differ only by `decode_load_s` (>= 0) x load, and the order among them is (load, id): only
        the least loaded of them is costed, beside every engine with a prefix or a fit of its own.
        Exactly the full scan's choice; per request O(candidates) cheap tests instead of a cost
        model evaluation per decode engine."""
        fits = self.costs.transfer
        src = prefill.engine_id
        special: list[EngineView] = []
        plain: EngineView | None = None
        plain_key: tuple[float, str] | None = None
        for d in candidates:
            if d.engine_id in matched_blocks or (src, d.engine_id) in fits:
                special.append(d)
                continue
            key = (d.load_score, d.engine_id)
            if plain_key is None or key < plain_key:
                plain, plain_key = d, key
        costed = special if plain is None else [plain, *special]
        return min((self._remote_option(request, prefill, d, matched_blocks, with_backlog=with_backlog)
                    for d in costed), key=_pull_order)

    def _remote(self, reason: str, request: PathRequest, prefill: EngineView, option: _Option,
                matched_blocks: Mapping[str, int]) -> PathDecision:
        return PathDecision(PATH_REMOTE, reason, option.decode.engine_id, prefill.engine_id,
                            self._uncached(request, prefill.engine_id, matched_blocks), option.pull, option.cost_s)

    # -- threshold mode ------------------------------------------------------------------------

    def _threshold(self, request: PathRequest, prefill: EngineView, candidates: Sequence[EngineView],
                   matched_blocks: Mapping[str, int]) -> PathDecision:
        d = self._best_local_engine(request, candidates, matched_blocks)
        limit = self.config.threshold_tokens
        if self._uncached(request, d.engine_id, matched_blocks) < limit:
            reason = LOCAL_SHORT_PROMPT if request.num_tokens < limit else LOCAL_DECODE_HAS_PREFIX
            return self._local(reason, request, d, matched_blocks)
        # The simple mode uses no measured costs: the pull goes to the engine holding the most of
        # the prompt (the fewest blocks to pull), ties to the less loaded.
        option = self._remote_option(request, prefill, d, matched_blocks)
        return self._remote(REMOTE_LONG_PROMPT, request, prefill, option, matched_blocks)

    # -- cost mode -----------------------------------------------------------------------------

    def _remote_option(self, request: PathRequest, prefill: EngineView, d: EngineView,
                       matched_blocks: Mapping[str, int], *, with_backlog: bool = True) -> _Option:
        """Remote: the first token comes from the prefill engine after its backlog and the
        uncached tokens; the KV transfer then delays the second token (`transfer_s`)."""
        c = self.costs
        uncached = self._uncached(request, prefill.engine_id, matched_blocks)
        inputs = TtftInputs(PATH_REMOTE, prefill.engine_id, prefill.num_backlog_tokens if with_backlog else 0, uncached)
        pull = self._uncached(request, d.engine_id, matched_blocks)
        ttft = self.raw_ttft_s(inputs) * c.correction(prefill.engine_id, PATH_REMOTE)
        return _Option(ttft + self.config.decode_load_s * d.load_score, d, False, uncached, pull, ttft, inputs,
                       transfer_s=c.transfer_s(prefill.engine_id, d.engine_id, pull))

    def _local_option(self, request: PathRequest, d: EngineView, matched_blocks: Mapping[str, int]) -> _Option:
        """Local: on an idle decode engine, a prefill call of the local prefills queued there
        plus the uncached tokens (the prefill fit: same model, same device); on a busy one, at
        least that, and the queued local prefills, half a step of waiting and the step that
        holds the prefill: a measured plain step plus the measured stall of the uncached tokens."""
        uncached = self._uncached(request, d.engine_id, matched_blocks)
        inputs = TtftInputs(PATH_LOCAL, d.engine_id, d.num_backlog_tokens, uncached, self._busy(d))
        ttft = self.raw_ttft_s(inputs) * self.costs.correction(d.engine_id, PATH_LOCAL)
        return _Option(ttft + self.config.decode_load_s * d.load_score, d, True, uncached, 0, ttft, inputs)

    def raw_ttft_s(self, inputs: TtftInputs) -> float:
        """The fits' TTFT prediction, before the correction (see `_remote_option`, `_local_option`)."""
        c = self.costs
        alone = c.queued_prefill_s(inputs.num_backlog_tokens, inputs.num_uncached_tokens)
        if inputs.path == PATH_REMOTE:
            return alone
        # An idle decode engine prefills like a prefill engine (same model and device); a busy
        # one takes no less.
        if not inputs.busy:
            return alone
        return max(alone, c.compute_s(inputs.num_backlog_tokens) + 1.5 * c.step_s(inputs.engine_id)
                   + c.stall_s(inputs.engine_id, inputs.num_uncached_tokens))

    def observe_ttft(self, decision: PathDecision, actual_s: float) -> None:
        """A decision's outcome (the request took the path decided): the correction of its
        engine and path learns log(actual / the fits' prediction for the same inputs *now*), so
        it learns only what the fits, which may have learnt from this very request, still miss.
        A local prefill on an idle decode engine is a prefill call like a remote one: it feeds
        the prefill fit first (one on a busy engine mixes in the decode batch and does not)."""
        inputs = decision.ttft_inputs
        if inputs is None:
            return
        if inputs.path == PATH_LOCAL and not inputs.busy:
            self.costs.observe_queued_prefill(inputs.num_backlog_tokens,
                                              inputs.num_backlog_tokens + inputs.num_uncached_tokens, actual_s)
        raw = self.raw_ttft_s(inputs)
        logger.debug("TTFT outcome %s on %s: backlog %d, uncached %d, busy %s; predicted %.4f s, actual %.4f s "
                     "(raw now %.4f s, correction %.3f)", inputs.path, inputs.engine_id, inputs.num_backlog_tokens,
                     inputs.num_uncached_tokens, inputs.busy, decision.predicted_ttft_s or 0.0, actual_s, raw,
                     self.costs.correction(inputs.engine_id, inputs.path))
        if inputs.path == PATH_LOCAL and inputs.busy and inputs.num_backlog_tokens:
            # Queued behind local prefills on a busy engine: the time left of the step holding
            # them, which the scheduler does not see, decides the outcome; learnt as an error of
            # the engine, it took the correction to 0.55 in one run and the steady predictions
            # after it were 40 % low (decision 0037).
            return
        self.costs.observe_ttft(inputs.engine_id, inputs.path, raw, actual_s)

    @staticmethod
    def _busy(d: EngineView) -> bool:
        """Requests of this scheduler are on `d` (its own count is exact and current; the
        engine's reported `num_running` lags a load report behind)."""
        return d.num_inflight > 0

    def _harmed(self, d: EngineView, plain_s: float, gap_s: float) -> int:
        """Requests decoding on `d` whose ITL target its plain step (`plain_s`) meets and the step
        holding the local prefill (`gap_s`) misses; one that the plain step already misses has
        nothing to lose."""
        if not self._busy(d):
            return 0
        targets = self.costs.itl_targets.get(d.engine_id)
        if not targets:
            return int(d.itl_target_s is not None and plain_s <= d.itl_target_s < gap_s)
        return sum(n for target, n in targets.items() if plain_s <= target < gap_s)

    def stall_budget_s(self, engine_id: str | None = None) -> float:
        """How long a local prefill may stall a decode engine (see the module docstring)."""
        step = self.costs.step_s(engine_id) if engine_id is not None else self.costs.itl_s or 0.0
        return max(self.config.decode_stall_budget_s, self.config.decode_stall_steps * step)

    def _ttft_target(self, request: PathRequest) -> float | None:
        return request.ttft_target_s if request.ttft_target_s is not None else self.config.ttft_target_s

    def _cost(self, request: PathRequest, prefill: EngineView, candidates: Sequence[EngineView],
              matched_blocks: Mapping[str, int]) -> PathDecision:
        target = self._ttft_target(request)
        remote = self._best_remote_option(request, prefill, candidates, matched_blocks)
        remote = replace(remote, score=int(target is None or remote.ttft_s <= target))
        locals_, over_budget = self._local_options(request, candidates, matched_blocks, remote)
        best = min([remote, *locals_], key=_objective)
        if not best.local and locals_:
            local = min(locals_, key=_objective)
            if local.score == best.score and not _remote_wins(best, local):
                best = local
        if not best.local:
            cheapest = min(locals_, key=_order) if locals_ else None
            if cheapest is None:
                reason = REMOTE_LONG_PROMPT if over_budget else REMOTE_ITL_TARGET
            elif not _remote_wins(best, cheapest):
                reason = REMOTE_ITL_TARGET if cheapest.harmed else REMOTE_TTFT_TARGET
            else:
                reason = REMOTE_LOWER_COST
            other = min(locals_, key=_objective) if locals_ else self._local_option(request, best.decode, matched_blocks)
            decision = self._remote(reason, request, prefill, best, matched_blocks)
        else:
            other = remote
            reason = self._local_reason(request, prefill, best, candidates, matched_blocks)
            decision = PathDecision(PATH_LOCAL, reason, best.decode.engine_id, None, best.uncached, 0, best.cost_s)
        return replace(decision, predicted_ttft_s=best.ttft_s, ttft_inputs=best.inputs,
                       alternative_ttft_s=other.ttft_s)

    def _local_options(self, request: PathRequest, candidates: Sequence[EngineView],
                       matched_blocks: Mapping[str, int], remote: _Option) -> tuple[list[_Option], bool]:
        """The local options the stall budget allows (or, beyond it, the TTFT target: only a
        local prefill meets it), scored; and whether the budget ruled one out."""
        target = self._ttft_target(request)
        options, over_budget = [], False
        for d in candidates:
            option = self._local_option(request, d, matched_blocks)
            stall = self.costs.stall_s(d.engine_id, option.uncached)
            budget = self.stall_budget_s(d.engine_id)
            plain = self.costs.step_s(d.engine_id) if self._busy(d) else 0.0
            harmed = self._harmed(d, plain, plain + stall)
            meets = target is None or option.ttft_s <= target
            logger.debug("local on %s: %d uncached, TTFT %.3f s, stall %.3f s (budget %.3f s, %d would miss "
                         "their ITL target); remote TTFT %.3f s, cost %.3f s", d.engine_id, option.uncached,
                         option.ttft_s, stall, budget, harmed, remote.ttft_s, remote.cost_s)
            stretched = stall > budget
            if stretched and not (target is not None and option.ttft_s <= target < remote.ttft_s):
                over_budget = True
                continue
            options.append(replace(option, stretched=stretched, score=int(meets) - harmed, harmed=harmed))
        return options, over_budget

    def _local_reason(self, request: PathRequest, prefill: EngineView, best: _Option,
                      candidates: Sequence[EngineView], matched_blocks: Mapping[str, int]) -> str:
        if best.stretched:
            return LOCAL_TTFT_TARGET
        whole = self.costs.stall_s(best.decode.engine_id, request.num_tokens)
        if best.uncached < request.num_tokens and whole > self.stall_budget_s(best.decode.engine_id):
            return LOCAL_DECODE_HAS_PREFIX
        idle = self._best_remote_option(request, prefill, candidates, matched_blocks, with_backlog=False)
        return LOCAL_PREFILL_QUEUE if _remote_wins(idle, best) else LOCAL_SHORT_PROMPT


def _remote_wins(remote: _Option, local: _Option) -> bool:
    """On cost alone, remote beats local only by more than the tie band."""
    return remote.cost_s * (1 + TTFT_TIE) < local.cost_s


def _pull_order(option: _Option) -> tuple[float, float, str]:
    """Among remote options (one prefill engine, so one TTFT): cost plus transfer, then load, id."""
    return round(option.cost_s + option.transfer_s, 9), option.decode.load_score, option.decode.engine_id


def _objective(option: _Option) -> tuple[int, float, float, str, bool]:
    """Most requests meeting their targets first, then `_order`."""
    return (-option.score, *_order(option))


def _order(option: _Option) -> tuple[float, float, str, bool]:
    """Lowest cost first; ties by decode load, then id, then local before remote."""
    return round(option.cost_s, 9), option.decode.load_score, option.decode.engine_id, not option.local
