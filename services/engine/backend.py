"""`EngineBackend`: what the Engine gRPC servicer needs from an engine, whichever it is.

pdserve's own engine (`services.engine.native`) and vLLM's async engine (`services.engine.vllm`)
sit behind this one protocol. The servicer (`services.engine.servicer`) owns everything that is
the same for both — readiness and drain answers, role and epoch checks, request-id checks,
spans, status codes — and converts protobuf at the edge (`services.engine.convert`); a backend
sees only the plain dataclasses below and answers with them or with a `BackendError`.

Contracts every backend keeps:
- `start` returns once the engine serves; the backend registers with the pdserve scheduler
  only after it can take requests (`ready` is True before the scheduler can route to it).
- `prefill` computes the prompt, samples the first token and keeps the prompt's blocks pinned
  for readers until `release`, the scheduler's ReleaseBlocks, an abort or the lease's end.
- `decode` yields `TokenDelta`s until one has `finish_reason` set; the first carries the
  cached / transferred token counts. With a descriptor the prompt's KV is pulled from the
  prefill engine (recomputed locally if the scheduler reports a failure or no verdict comes).
- Cancelling the task awaiting `prefill` or iterating `decode` aborts the request in the
  engine (its blocks are freed); nothing is left behind (`inspect().leaks` is empty when idle).
- `failed` turns True when the engine can no longer step (e.g. a rank died); the process then
  exits non-zero so its supervisor restarts it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from connectors.head_map import mapping_problem
from connectors.ucx.handshake import KVTransferDescriptor
from engine.request import SamplingParams
from services.engine.role_state import EngineRole


class BackendError(Exception):
    """A request the backend refuses; the servicer maps each subclass to one status code."""


class InvalidRequest(BackendError):
    """Bad input (sampling out of range, prompt too long, ...): INVALID_ARGUMENT."""


class DuplicateRequest(BackendError):
    """The request id is already running on this engine: ALREADY_EXISTS."""


class OutOfBlocks(BackendError):
    """The KV cache cannot hold the request now: RESOURCE_EXHAUSTED."""


class RequestAborted(BackendError):
    """The request was aborted while the caller waited for it: ABORTED."""


class NotReady(BackendError):
    """The engine is starting or stopping: UNAVAILABLE."""


class NotCached(BackendError):
    """A peer-fetch pin finds none of the prefix cached here any more: FAILED_PRECONDITION."""


@dataclass(slots=True)
class PrefillInput:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # TP size of the decode engine that will read the KV (0: this engine's); each rank pins its
    # blocks for the decode ranks that read its KV heads (connectors.head_map.readers_of).
    decode_tp_size: int = 0
    # A peer fetch: an engine of either role pins a prefix it holds for another engine's pull.
    peer_fetch: bool = False


@dataclass(slots=True)
class PrefillResult:
    # A peer-fetch pin computes no token (decision 0049): 0, "" and None there, unused.
    first_token_id: int
    first_token_text: str
    finish_reason: str | None  # "stop" / "length" when the first token ends the request
    num_cached_tokens: int  # prompt tokens found cached (device cache and offload tier)
    descriptor: KVTransferDescriptor  # where readers pull the prompt's KV from


@dataclass(slots=True)
class DecodeInput:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)  # already generated (migration)
    descriptor: KVTransferDescriptor | None = None  # pull the prompt's KV from a prefill engine
    trace_carrier: dict[str, str] | None = None  # W3C context for the ranks' transfer spans


@dataclass(slots=True)
class TokenDelta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last delta
    num_cached_tokens: int | None = None  # first delta only
    num_transferred_tokens: int | None = None  # first delta only


@dataclass(slots=True)
class BackendLoad:
    num_running: int
    num_waiting: int
    num_pinned: int
    num_waiting_for_remote_kv: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float = 0.0  # fraction of the KV cache in use

    @property
    def num_busy(self) -> int:
        return self.num_running + self.num_waiting + self.num_pinned + self.num_waiting_for_remote_kv


@dataclass(frozen=True, slots=True)
class PeerTransport:
    """A prefill rank this engine pulls KV from, and the UCX transport of its last pull ("" before one)."""

    engine_id: str
    epoch: int
    tp_rank: int
    transport: str


@dataclass(slots=True)
class Inspection:
    load: BackendLoad
    leaks: list[str]  # empty when nothing is held that should not be
    peer_transports: list[PeerTransport] = field(default_factory=list)  # rank 0's KV sources


def check_reader_tp(tp_size: int, decode_tp_size: int, num_kv_heads: int) -> None:
    """Raises InvalidRequest, before any state, for a reader TP (`PrefillInput.decode_tp_size`;
    0: this engine's) whose KV heads this engine's ranks cannot serve."""
    if decode_tp_size == 0:
        return
    problem = mapping_problem(tp_size, decode_tp_size, num_kv_heads)
    if problem is not None:
        raise InvalidRequest(f"decode_tp_size {decode_tp_size}: {problem}")


class EngineBackend(Protocol):
    """One engine behind the Engine API (see the module docstring for the contracts)."""

    @property
    def epoch(self) -> int:
        """This incarnation's epoch (random, odd): Release with another epoch is refused."""
        ...

    @property
    def ready(self) -> bool: ...

    # The role the Engine API admits calls for (services.engine.role_state); it changes in place
    # on the scheduler's SetRole.
    role_state: EngineRole

    async def sync_role(self) -> None:
        """Brings `role_state` up to date where the SetRole reaches another process (a vLLM
        engine's rank-0 worker); the servicer asks before it refuses a call for its role."""
        ...

    @property
    def failed(self) -> bool: ...

    async def start(self) -> None:
        """Loads the model, starts every rank and registers with the scheduler."""
        ...

    async def prefill(self, request: PrefillInput) -> PrefillResult: ...

    def decode(self, request: DecodeInput) -> AsyncGenerator[TokenDelta, None]: ...

    async def abort(self, request_id: str) -> bool:
        """Aborts a running request or ends a pinned one; True if the engine knew it."""
        ...

    async def release(self, request_id: str) -> bool:
        """Frees a finished prefill's pinned blocks; True if they were pinned."""
        ...

    async def load(self) -> BackendLoad: ...

    async def inspect(self) -> Inspection: ...

    def set_draining(self, draining: bool) -> None:
        """Reported to the scheduler with the load, which then routes nothing new here."""
        ...

    def shutdown(self) -> None: ...
