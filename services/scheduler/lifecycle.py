"""Request lifecycle: one record per client request, from admission to its end.

Pure and synchronous, with an injectable clock. States:

    QUEUED -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED
       |          |              |              |
       +----------+--------------+--------------+--> ABORTED (client cancel, deadline) | FAILED

Decode-only requests go QUEUED -> DECODING. A prefill failure moves PREFILLING back to QUEUED
(retry on another prefill engine) or on to DECODING without a descriptor (recompute). A decode
failure keeps the request in DECODING on another engine (`migrate`), remembering how many
tokens the client already has.

Contracts:
- One deadline per request (monotonic seconds), fixed at admission; `expired()` lists the live
  requests past it.
- Prefill blocks are released exactly once: `release_prefill` returns True for the first cause
  (all readers finished, transfer failed, finished at prefill, abort, lease expired, engine gone) and False for every
  later one; both are counted in `release_outcomes` / `release_noops` by cause.
- Terminal states are final; a transition from a terminal state raises `LifecycleError`, as
  does a transition that skips a state.
- `remove` forgets a terminal request; a table with no live requests is empty (`leaks()` lists
  what is left, for the after-test leak check).
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


class RequestState(enum.StrEnum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


TERMINAL = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED})

_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: frozenset({RequestState.PREFILLING, RequestState.DECODING}),
    RequestState.PREFILLING: frozenset({RequestState.TRANSFERRING, RequestState.DECODING, RequestState.QUEUED,
                                        RequestState.FINISHED}),
    RequestState.TRANSFERRING: frozenset({RequestState.DECODING, RequestState.FINISHED}),
    RequestState.DECODING: frozenset({RequestState.DECODING, RequestState.FINISHED}),
}


class ReleaseCause(enum.StrEnum):
    TRANSFERRED = "transferred"          # every reader finished reading
    TRANSFER_FAILED = "transfer_failed"  # readers gave up; blocks no longer needed
    FINISHED = "finished"                # the request ended at prefill (first token was the last)
    ABORT = "abort"                      # client cancel, deadline, or a failure ended the request
    LEASE_EXPIRED = "lease_expired"      # nobody released in time; the engine freed them itself
    ENGINE_GONE = "engine_gone"          # the prefill engine's epoch died or was fenced


class LifecycleError(RuntimeError):
    """An illegal transition: a bug in the caller, never a client error."""


@dataclass(frozen=True, slots=True)
class EngineRef:
    engine_id: str
    epoch: int


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    deadline: float
    num_prompt_tokens: int
    state: RequestState = RequestState.QUEUED
    prefill: EngineRef | None = None
    decode: EngineRef | None = None
    # Prefill blocks pinned for this request and not yet released.
    prefill_pinned: bool = False
    prefill_release: ReleaseCause | None = None
    lease_expires: float | None = None
    # Tokens the client has been sent (its stream index continues from here after a migration).
    num_streamed_tokens: int = 0
    num_migrations: int = 0
    num_prefill_attempts: int = 0
    failed_decode_engines: set[str] = field(default_factory=set)
    failed_prefill_engines: set[str] = field(default_factory=set)
    end_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.state in TERMINAL


class RequestTable:
    """Every live request (see the module docstring for the contracts)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_release: Callable[[ReleaseCause, bool], None] | None = None) -> None:
        """`on_release(cause, first)` is told of every release_prefill call (for metrics)."""
        self.clock = clock
        self.on_release = on_release
        self.requests: dict[str, RequestRecord] = {}
        self.outcomes: Counter[str] = Counter()
        self.release_outcomes: Counter[str] = Counter()
        self.release_noops: Counter[str] = Counter()

    def admit(self, request_id: str, num_prompt_tokens: int, timeout_s: float) -> RequestRecord:
        """Creates a QUEUED record whose deadline is `timeout_s` from now. Raises ValueError for a
        duplicate live request id (nothing changes)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if timeout_s <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout_s}")
        record = RequestRecord(request_id, self.clock() + timeout_s, num_prompt_tokens)
        self.requests[request_id] = record
        return record

    def get(self, request_id: str) -> RequestRecord | None:
        return self.requests.get(request_id)

    def _move(self, record: RequestRecord, to: RequestState) -> None:
        if to not in _ALLOWED.get(record.state, frozenset()):
            raise LifecycleError(f"request {record.request_id}: {record.state} -> {to} is not allowed")
        record.state = to

    # -- prefill leg ---------------------------------------------------------------------------

    def start_prefill(self, record: RequestRecord, engine: EngineRef) -> None:
        self._move(record, RequestState.PREFILLING)
        record.prefill = engine
        record.num_prefill_attempts += 1

    def prefill_done(self, record: RequestRecord, lease_expires: float | None) -> None:
        """The prefill engine pinned the prompt's blocks: they must be released once."""
        if record.state != RequestState.PREFILLING:
            raise LifecycleError(f"request {record.request_id}: prefill_done in state {record.state}")
        record.prefill_pinned = True
        record.lease_expires = lease_expires

    def prefill_failed(self, record: RequestRecord, *, retry: bool) -> None:
        """Back to QUEUED for another prefill engine (`retry`) or on to decode-only recompute."""
        if record.prefill is not None:
            record.failed_prefill_engines.add(record.prefill.engine_id)
        record.prefill = None
        self._move(record, RequestState.QUEUED if retry else RequestState.DECODING)

    # -- decode leg ----------------------------------------------------------------------------

    def start_decode(self, record: RequestRecord, engine: EngineRef) -> None:
        """Opens the decode leg: TRANSFERRING when prefill pinned KV for it, else DECODING."""
        target = RequestState.TRANSFERRING if record.state == RequestState.PREFILLING else RequestState.DECODING
        if record.state == RequestState.DECODING and record.decode is not None:
            raise LifecycleError(f"request {record.request_id}: decode already open; use migrate")
        self._move(record, target)
        record.decode = engine

    def kv_arrived(self, record: RequestRecord) -> None:
        if record.state == RequestState.TRANSFERRING:
            self._move(record, RequestState.DECODING)

    def tokens_streamed(self, record: RequestRecord, n: int) -> int:
        """Records `n` tokens sent to the client; returns the stream index of the first one."""
        if record.state == RequestState.TRANSFERRING:
            self._move(record, RequestState.DECODING)
        index = record.num_streamed_tokens
        record.num_streamed_tokens += n
        return index

    def migrate(self, record: RequestRecord, engine: EngineRef) -> None:
        """The decode engine failed mid-stream: continue on `engine` from the streamed tokens."""
        if record.done:
            raise LifecycleError(f"request {record.request_id}: migrate after {record.state}")
        if record.decode is not None:
            record.failed_decode_engines.add(record.decode.engine_id)
        record.decode = engine
        record.num_migrations += 1
        record.state = RequestState.DECODING

    # -- the end -------------------------------------------------------------------------------

    def finish(self, record: RequestRecord, state: RequestState, reason: str) -> None:
        """Moves a live request to a terminal state (FINISHED, ABORTED or FAILED). A second call
        is a no-op, so whichever of done / abort / failure comes first decides the outcome."""
        if state not in TERMINAL:
            raise LifecycleError(f"finish needs a terminal state, got {state}")
        if record.done:
            return
        if state == RequestState.FINISHED:
            self._move(record, state)
        record.state = state
        record.end_reason = reason
        self.outcomes[f"{state}:{reason}"] += 1

    def release_prefill(self, record: RequestRecord, cause: ReleaseCause) -> bool:
        """True exactly once per pinned request: the caller then frees the prefill blocks."""
        if not record.prefill_pinned or record.prefill_release is not None:
            self.release_noops[cause] += 1
            if self.on_release is not None and record.prefill_pinned:
                self.on_release(cause, False)
            return False
        record.prefill_release = cause
        self.release_outcomes[cause] += 1
        if self.on_release is not None:
            self.on_release(cause, True)
        return True

    def remove(self, record: RequestRecord) -> None:
        """Forgets a terminal request whose prefill blocks (if any) were released."""
        if not record.done:
            raise LifecycleError(f"request {record.request_id}: remove while {record.state}")
        self.requests.pop(record.request_id, None)

    # -- sweeps --------------------------------------------------------------------------------

    def expired(self) -> list[RequestRecord]:
        now = self.clock()
        return [r for r in self.requests.values() if not r.done and now >= r.deadline]

    def lease_expired(self) -> list[RequestRecord]:
        now = self.clock()
        return [r for r in self.requests.values()
                if r.prefill_pinned and r.prefill_release is None and r.lease_expires is not None
                and now >= r.lease_expires]

    def on_engine(self, engine_id: str, epoch: int) -> list[RequestRecord]:
        """Live requests with a leg on (engine_id, epoch)."""
        ref = EngineRef(engine_id, epoch)
        return [r for r in self.requests.values() if not r.done and ref in (r.prefill, r.decode)]

    def leaks(self) -> list[str]:
        return [f"{r.request_id}: {r.state}" for r in self.requests.values()]
