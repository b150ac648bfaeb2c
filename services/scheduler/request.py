"""`Request`: everything the scheduler knows of one client request, in one object with one
owner (the `RequestTable` that admitted it), from admission to its end.

Pure and synchronous: no protobuf beyond the validated input, no asyncio, no clock of its own
(times are the caller's). The Generation servicer runs the engine legs and calls the methods
here as they happen; nothing else holds a request's state.

Contracts:
- Transitions follow `lifecycle.ALLOWED`; a move from a terminal state, or one that skips a
  state, raises `LifecycleError` (a caller bug).
- One deadline (monotonic seconds on the table's clock), fixed at admission.
- The stream's tokens are `output_token_ids`, starting with those a resumed request brought:
  `stream()` returns each chunk's index, so indices never gap or repeat, across migrations too.
- Prefill blocks are released exactly once: `release_prefill` returns True for the first cause
  (all readers finished, transfer failed, finished at prefill, abort, lease expired, engine
  gone) and False for every later one; both are counted in the table's `RequestOutcomes`.
- `finish` is final: the first of done / abort / failure decides the outcome, later calls are
  no-ops.
- `cancel_leg` cancels the engine call in progress (its engine died); the leg then fails over.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.scheduler.lifecycle import (
    ALLOWED,
    TERMINAL,
    EngineRef,
    LifecycleError,
    ReleaseCause,
    RequestState,
)
from services.scheduler.validation import ValidRequest

if TYPE_CHECKING:
    from services.scheduler.path_policy import PathDecision
    from services.scheduler.peer_fetch import PeerFetch


@dataclass(slots=True)
class RequestOutcomes:
    """How requests ended and why prefill blocks were released, over every request of a table.
    `on_release(cause, first)` is told of every release of pinned blocks (for metrics)."""

    on_release: Callable[[ReleaseCause, bool], None] | None = None
    outcomes: Counter[str] = field(default_factory=Counter)
    release_outcomes: Counter[str] = field(default_factory=Counter)
    release_noops: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True, eq=False)
class Request:
    """One client request (see the module docstring). `request_id` is what engines see,
    `client_id` what the client sent (or was given)."""

    request_id: str
    client_id: str
    valid: ValidRequest
    deadline: float
    arrived: float  # time.monotonic() at arrival
    counters: RequestOutcomes = field(default_factory=RequestOutcomes)

    # -- lifecycle --
    state: RequestState = RequestState.QUEUED
    prefill: EngineRef | None = None
    decode: EngineRef | None = None
    num_prefill_attempts: int = 0
    num_migrations: int = 0
    failed_prefill_engines: set[str] = field(default_factory=set)
    failed_decode_engines: set[str] = field(default_factory=set)
    end_reason: str | None = None

    # -- release-once of the prefill blocks --
    prefill_pinned: bool = False
    prefill_release: ReleaseCause | None = None
    lease_expires: float | None = None

    # -- the stream --
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_transferred_tokens: int = 0
    prefill_engine_id: str = ""  # the prefill engine whose KV the decode leg uses ("" : none)
    # -- a peer fetch (decision 0043): `prefill` is then the holder, pinning a prefix for the pull --
    peer_fetch: PeerFetch | None = None
    peer_fetch_engine_id: str = ""  # the holder that pinned the prefix ("": no fetch under way)
    peer_fetch_failed: bool = False
    num_peer_fetched_tokens: int = 0
    # A prefill engine's pull of a peer's prefix (prefill_fetch.py, decision 0046): the
    # scheduler's own request, not a client's (not counted as one).
    internal: bool = False
    fetch_started_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    ttft_s: float | None = None  # arrival to the first token sent (scheduler-side)

    # -- the engine call in progress, and cancelling it --
    call: Any = None
    engine_failed: str | None = None
    dispatched: bool = False
    leg_started_at: float = 0.0
    kv_ready_at: float | None = None
    # Time spent waiting on engines and on the client (not the scheduler's own work).
    outside_s: float = 0.0

    # -- routing: the path decision, admission slots, path-cost bookkeeping --
    path: PathDecision | None = None
    path_reason: str = ""
    decode_tp_size: int = 0  # of the routed decode engine (prefill ranks pin for its readers)
    slots: list[str] = field(default_factory=list)
    # Prompt tokens counted in an engine's backlog until its prefill is done:
    # (engine id, ticket) — see PromptBacklog.
    backlog: tuple[str, int] | None = None
    # The decode engine this request's ITL target is registered on, and the target.
    itl_engine: str | None = None
    itl_target_s: float | None = None

    def __post_init__(self) -> None:
        if not self.output_token_ids:  # resumed: streamed before, by a replica that died
            self.output_token_ids = list(self.valid.output_token_ids)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.valid.prompt_token_ids)

    @property
    def num_streamed_tokens(self) -> int:
        """Tokens the client has (its stream index continues from here after a migration)."""
        return len(self.output_token_ids)

    @property
    def path_name(self) -> str:
        return "disaggregated" if self.prefill_engine_id else "decode_only"

    def _move(self, to: RequestState) -> None:
        if to not in ALLOWED.get(self.state, frozenset()):
            raise LifecycleError(f"request {self.request_id}: {self.state} -> {to} is not allowed")
        self.state = to

    # -- prefill leg ---------------------------------------------------------------------------

    def start_prefill(self, engine: EngineRef) -> None:
        self._move(RequestState.PREFILLING)
        self.prefill = engine
        self.num_prefill_attempts += 1

    def prefill_done(self, lease_expires: float | None, num_cached_tokens: int) -> None:
        """The prefill engine pinned the prompt's blocks: they must be released once."""
        if self.state != RequestState.PREFILLING or self.prefill is None:
            raise LifecycleError(f"request {self.request_id}: prefill_done in state {self.state}")
        self.prefill_pinned = True
        self.lease_expires = lease_expires
        self.num_cached_tokens = num_cached_tokens
        self.prefill_engine_id = self.prefill.engine_id

    def peer_fetch_pinned(self, lease_expires: float | None) -> None:
        """The holder pinned the prefix for the decode engine's pull: released once, as prefill
        blocks are; the decode engine computes the rest and samples the first token."""
        if self.state != RequestState.PREFILLING or self.prefill is None:
            raise LifecycleError(f"request {self.request_id}: peer_fetch_pinned in state {self.state}")
        self.prefill_pinned = True
        self.lease_expires = lease_expires
        self.peer_fetch_engine_id = self.prefill.engine_id

    def prefill_failed(self, engine_id: str, *, retry: bool) -> None:
        """Prefill on `engine_id` failed: back to QUEUED for another prefill engine (`retry`) or
        on to decode-only recompute (a failure before the leg opened only remembers the engine)."""
        self.failed_prefill_engines.add(engine_id)
        if self.state != RequestState.PREFILLING:
            return
        self.prefill = None
        self._move(RequestState.QUEUED if retry else RequestState.DECODING)

    # -- decode leg ----------------------------------------------------------------------------

    def start_decode(self, engine: EngineRef) -> None:
        """Opens the decode leg: TRANSFERRING when prefill pinned KV for it, else DECODING."""
        if self.decode is not None:
            raise LifecycleError(f"request {self.request_id}: decode already open; use migrate")
        target = RequestState.TRANSFERRING if self.state == RequestState.PREFILLING else RequestState.DECODING
        self._move(target)
        self.decode = engine

    def migrate(self, engine: EngineRef) -> None:
        """The decode engine failed mid-stream: continue on `engine` from the streamed tokens."""
        if self.done:
            raise LifecycleError(f"request {self.request_id}: migrate after {self.state}")
        if self.decode is not None:
            self.failed_decode_engines.add(self.decode.engine_id)
        self.decode = engine
        self.num_migrations += 1
        self.state = RequestState.DECODING

    def kv_arrived(self, now: float) -> None:
        self.kv_ready_at = now
        if self.state == RequestState.TRANSFERRING:
            self._move(RequestState.DECODING)

    def stream(self, token_ids: list[int], now: float) -> int:
        """Records tokens sent to the client; returns the stream index of the first one."""
        if self.state == RequestState.TRANSFERRING:
            self._move(RequestState.DECODING)
        index = len(self.output_token_ids)
        self.output_token_ids.extend(token_ids)
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        return index

    def on_leg(self, engine: EngineRef) -> bool:
        """Whether an engine call of this request runs on `engine` now."""
        on_prefill = self.state == RequestState.PREFILLING and self.prefill == engine
        on_decode = self.decode == engine and self.state in (RequestState.TRANSFERRING, RequestState.DECODING)
        return on_prefill or on_decode

    def cancel_leg(self, reason: str) -> None:
        """Cancels the engine call in progress (none: nothing to do); the leg fails with `reason`."""
        if self.call is not None:
            self.engine_failed = reason
            self.call.cancel()

    # -- the end -------------------------------------------------------------------------------

    def finish(self, state: RequestState, reason: str) -> None:
        """Moves a live request to a terminal state (FINISHED, ABORTED or FAILED). A second call
        is a no-op, so whichever of done / abort / failure comes first decides the outcome."""
        if state not in TERMINAL:
            raise LifecycleError(f"finish needs a terminal state, got {state}")
        if self.done:
            return
        if state == RequestState.FINISHED:
            self._move(state)
        self.state = state
        self.end_reason = reason
        self.counters.outcomes[f"{state}:{reason}"] += 1

    def release_prefill(self, cause: ReleaseCause) -> bool:
        """True exactly once per pinned request: the caller then frees the prefill blocks."""
        counters = self.counters
        if not self.prefill_pinned or self.prefill_release is not None:
            counters.release_noops[cause] += 1
            if counters.on_release is not None and self.prefill_pinned:
                counters.on_release(cause, False)
            return False
        self.prefill_release = cause
        counters.release_outcomes[cause] += 1
        if counters.on_release is not None:
            counters.on_release(cause, True)
        return True

    def lease_expired(self, now: float) -> bool:
        return (self.prefill_pinned and self.prefill_release is None and self.lease_expires is not None
                and now >= self.lease_expires)

    def engines_sent_to(self) -> set[str]:
        """Every engine this request was sent to: its prefill and decode engines and those it left."""
        engines = self.failed_prefill_engines | self.failed_decode_engines
        for ref in (self.prefill, self.decode):
            if ref is not None:
                engines.add(ref.engine_id)
        return engines
