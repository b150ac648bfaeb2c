"""`PeerFetchPolicy`: fetch a cached prefix from the engine holding it, or not (decisions 0043, 0046).

After the path policy chose where a prompt is computed, a longer prefix of it may be cached on
another engine (the prefix index knows every engine's blocks, decode engines' included: a
conversation's history lives on the decode engine that generated it). The ways to serve it:

- route to the holder: the routing and path policies already weigh each engine's cached
  prefix (a prefill engine holding it wins the prefix policy; a decode engine holding most of
  it prefills the rest itself), so whatever they chose stands when no fetch beats it;
- fetch into the decode engine: the decode engine of the decision pulls the holder's blocks
  over the KV data plane (the holder pins them under a lease, as a prefill engine pins a
  prompt) and computes only the rest; the request becomes decode-local on that engine, reason
  `decode_local:peer_fetch`;
- fetch into the prefill engine (a remote decision only): the decision's prefill engine pulls
  the holder's blocks into its cache first (decision 0046), then prefills the prompt as routed,
  computing only the rest; reason `remote:peer_fetch`;
- recompute: none of these.

Mode `cost` fetches when the predicted time to first token with the fetch is below the
decision's: the holder's pin (`PeerFetchPolicy.pin_s`: on pdserve's engine the rest of its
current step, decision 0049; on a vLLM engine a one-block prefill behind its backlog, on a busy
engine at least the steps it waits for, plus the holder's load, `decode_load_s` per unit),
the pair's fitted transfer time
of the blocks pulled, then the computing engine's prefill of the rest (`PathPolicy.raw_ttft_s`
with its correction; into a prefill engine, plus the one-token step that ends its pull). When
both fetches beat the decision, the one into the decode engine wins unless the other is faster
beyond the path policy's tie band (it saves the second hop). `always` fetches whenever a holder
has at least `min_blocks` more blocks than the target engine (into the decode engine first);
`off` never.

The holder is the live engine (other than the target, whose KV heads the target can read — the
caller filters) holding the most consecutive blocks of the prompt, ties to the less loaded,
then the smaller id. At least one prompt token is always computed, so at most
`(num_tokens - 1) // block_size` blocks are fetched.

Pure: plain data in and out, no clock, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.scheduler.path_policy import (
    LOCAL_PEER_FETCH,
    PATH_LOCAL,
    PATH_REMOTE,
    REMOTE_PEER_FETCH,
    TTFT_TIE,
    PathDecision,
    PathPolicy,
    PathRequest,
    TtftInputs,
)

if TYPE_CHECKING:  # routing imports this module
    from services.scheduler.routing import EngineView

MODES = ("cost", "always", "off")

# A pin on pdserve's engine besides the step it waits for: the Prefill call's round trip, the
# block lookup and the command-only flush to every rank (a few milliseconds on a loaded host).
PIN_CALL_S = 0.01

# Why a fetch was or was not made (metric label values).
FETCH = "fetch"
NO_HOLDER = "no_holder"
SLOWER = "slower"  # the decision as routed (route to the holder, or recompute) is predicted faster


@dataclass(frozen=True, slots=True)
class PeerFetchConfig:
    mode: str = "cost"
    min_blocks: int = 2
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"peer_fetch: must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.min_blocks < 1:
            raise ValueError(f"peer_fetch_min_blocks: must be >= 1, got {self.min_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class PeerFetch:
    """A decided fetch: `target_id` pulls the first `num_blocks` prompt blocks (of which it
    caches `num_local_blocks` itself) from `holder_id`, then computes the rest. `predicted_s`
    is the predicted TTFT with the fetch, `without_s` the decision's without it. `into_prefill`:
    the target is the decision's prefill engine (it pulls into its cache, then prefills)."""

    holder_id: str
    holder_epoch: int
    target_id: str
    num_blocks: int
    num_local_blocks: int
    block_size: int
    predicted_s: float
    without_s: float | None
    into_prefill: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt tokens whose KV the holder pins (the descriptor's)."""
        return self.num_blocks * self.block_size

    @property
    def num_pull_tokens(self) -> int:
        return (self.num_blocks - self.num_local_blocks) * self.block_size


@dataclass(slots=True)
class PeerFetchPolicy:
    """See the module docstring. `decisions` counts every call by outcome (FETCH, NO_HOLDER, SLOWER)."""

    config: PeerFetchConfig = field(default_factory=PeerFetchConfig)
    decisions: Counter[str] = field(default_factory=Counter)

    def decide(self, request: PathRequest, decision: PathDecision, decode: EngineView,
               holders: Sequence[EngineView], matched_blocks: Mapping[str, int],
               path: PathPolicy, *, prefill: EngineView | None = None,
               prefill_holders: Sequence[EngineView] = ()) -> tuple[PathDecision, PeerFetch | None]:
        """The decision to apply and the fetch, if any. `decode` is the decision's decode engine;
        `holders` the live engines it could read from (itself excluded); `prefill` the
        decision's prefill engine when remote, `prefill_holders` those it could read from."""
        if self.config.mode == "off":
            return decision, None
        into_decode = self._candidate(request, decision, decode, holders, matched_blocks, path)
        into_prefill = None
        if prefill is not None and not decision.local:
            into_prefill = self._candidate(request, decision, prefill, prefill_holders, matched_blocks, path,
                                           into_prefill=True)
        if into_decode is None and into_prefill is None:
            self.decisions[NO_HOLDER] += 1
            return decision, None
        fetch = _choose(into_decode, into_prefill, self.config.mode == "cost")
        if fetch is None:
            self.decisions[SLOWER] += 1
            return decision, None
        self.decisions[FETCH] += 1
        rest = request.num_tokens - fetch.num_tokens
        if fetch.into_prefill:
            fetched = PathDecision(PATH_REMOTE, REMOTE_PEER_FETCH, decision.decode_id, fetch.target_id, rest,
                                   decision.num_pull_tokens,
                                   fetch.predicted_s + path.config.decode_load_s * decode.load_score,
                                   predicted_ttft_s=fetch.predicted_s, alternative_ttft_s=fetch.without_s)
        else:
            fetched = PathDecision(PATH_LOCAL, LOCAL_PEER_FETCH, decode.engine_id, None, rest, fetch.num_pull_tokens,
                                   fetch.predicted_s + path.config.decode_load_s * decode.load_score,
                                   predicted_ttft_s=fetch.predicted_s, alternative_ttft_s=fetch.without_s)
        return fetched, fetch

    def _candidate(self, request: PathRequest, decision: PathDecision, target: EngineView,
                   holders: Sequence[EngineView], matched_blocks: Mapping[str, int],
                   path: PathPolicy, *, into_prefill: bool = False) -> PeerFetch | None:
        bs = self.config.block_size
        most = (request.num_tokens - 1) // bs
        own = min(matched_blocks.get(target.engine_id, 0), most)
        best: EngineView | None = None
        for h in holders:
            n = min(matched_blocks.get(h.engine_id, 0), most)
            if h.engine_id == target.engine_id or n - own < self.config.min_blocks:
                continue
            if best is None or (-n, h.load_score, h.engine_id) < (-min(matched_blocks[best.engine_id], most),
                                                                   best.load_score, best.engine_id):
                best = h
        if best is None:
            return None
        n = min(matched_blocks[best.engine_id], most)
        predict = self.predict_into_prefill_s if into_prefill else self.predict_s
        return PeerFetch(best.engine_id, best.epoch, target.engine_id, n, own, bs,
                         predict(request, target, best, n, own, path), decision.predicted_ttft_s, into_prefill)

    def _pull_s(self, target: EngineView, holder: EngineView, num_blocks: int, num_local_blocks: int,
                path: PathPolicy) -> float:
        """The holder's pin (`pin_s`) and the pair's transfer."""
        bs = self.config.block_size
        transfer_s = path.costs.transfer_s(holder.engine_id, target.engine_id, (num_blocks - num_local_blocks) * bs)
        return self.pin_s(holder, path) + transfer_s

    def pin_s(self, holder: EngineView, path: PathPolicy) -> float:
        """How long the holder takes to pin the blocks. pdserve's engine pins between two steps
        and computes nothing (decision 0049): the rest of the step it is in when the call
        arrives — a whole measured step when requests run there (an arrival lands in a long
        step more often than in a short one, so the mean rest is more than half a step) —
        plus `PIN_CALL_S`. A vLLM engine pins through its scheduler: a one-block prefill
        predicted as a local prefill there (`PathPolicy.raw_ttft_s`), behind its backlog and,
        when requests run there, at least the steps it waits for, plus its load."""
        if holder.native_engine:
            busy = holder.num_inflight > 0 or holder.num_running > 0
            return PIN_CALL_S + (path.costs.step_s(holder.engine_id) if busy else 0.0)
        pin = TtftInputs(PATH_LOCAL, holder.engine_id, holder.num_backlog_tokens, self.config.block_size,
                         holder.num_inflight > 0)
        return path.raw_ttft_s(pin) + path.config.decode_load_s * holder.load_score

    def predict_s(self, request: PathRequest, decode: EngineView, holder: EngineView, num_blocks: int,
                  num_local_blocks: int, path: PathPolicy) -> float:
        """Predicted TTFT with a fetch into the decode engine (see the module docstring)."""
        inputs = TtftInputs(PATH_LOCAL, decode.engine_id, decode.num_backlog_tokens,
                            request.num_tokens - num_blocks * self.config.block_size, decode.num_inflight > 0)
        local_s = path.raw_ttft_s(inputs) * path.costs.correction(decode.engine_id, PATH_LOCAL)
        return self._pull_s(decode, holder, num_blocks, num_local_blocks, path) + local_s

    def predict_into_prefill_s(self, request: PathRequest, prefill: EngineView, holder: EngineView,
                               num_blocks: int, num_local_blocks: int, path: PathPolicy) -> float:
        """Predicted TTFT with a fetch into the prefill engine: the pull, the one-token step that
        ends it, then the prefill of the rest behind the engine's backlog."""
        costs = path.costs
        inputs = TtftInputs(PATH_REMOTE, prefill.engine_id, prefill.num_backlog_tokens,
                            request.num_tokens - num_blocks * self.config.block_size)
        remote_s = path.raw_ttft_s(inputs) * costs.correction(prefill.engine_id, PATH_REMOTE)
        return self._pull_s(prefill, holder, num_blocks, num_local_blocks, path) + costs.queued_prefill_s(0, 1) \
            + remote_s


def _choose(into_decode: PeerFetch | None, into_prefill: PeerFetch | None, cost: bool) -> PeerFetch | None:
    """The fetch to make (None: none beats the decision, cost mode). Into the decode engine first;
    into the prefill engine when only it qualifies or (cost) it is faster beyond the tie band."""
    if not cost:
        return into_decode or into_prefill
    viable = [f for f in (into_decode, into_prefill)
              if f is not None and (f.without_s is None or f.predicted_s < f.without_s)]
    if len(viable) == 2:
        decode_s, prefill_s = viable[0].predicted_s, viable[1].predicted_s
        return viable[1] if prefill_s * (1 + TTFT_TIE) < decode_s else viable[0]
    return viable[0] if viable else None
