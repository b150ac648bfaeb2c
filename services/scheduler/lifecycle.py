"""A request's lifecycle: its states, the moves between them, and why prefill blocks are
released. The vocabulary only; the request that walks it is `services.scheduler.request.Request`.

    QUEUED -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED
       |          |              |              |
       +----------+--------------+--------------+--> ABORTED (client cancel, deadline) | FAILED

Decode-only requests go QUEUED -> DECODING. A prefill failure moves PREFILLING back to QUEUED
(retry on another prefill engine) or on to DECODING without a descriptor (recompute). A decode
failure keeps the request in DECODING on another engine (a migration).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestState(enum.StrEnum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


TERMINAL = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED})

# States a live request runs on an engine in (a "done" from elsewhere is a failure).
RUNNING = frozenset({RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.DECODING})

ALLOWED: dict[RequestState, frozenset[RequestState]] = {
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
