"""Requests as the batch scheduler sees them: sampling parameters, modes, states, outputs.

Torch-free. `SamplingParams.validate` raises ValueError naming the offending field.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from connectors.hashing import BlockHash


class RequestMode(enum.Enum):
    NORMAL = "normal"
    PREFILL_ONLY = "prefill_only"  # compute the prompt, sample one token, keep blocks pinned
    REMOTE_KV = "remote_kv"  # decode: the prompt's KV arrives from a prefill engine


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    PINNED = "pinned"  # finished prefill-only request whose blocks wait for release()
    FINISHED = "finished"


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True

    def validate(self, vocab_size: int) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request. Tokens are never repeated across steps."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_cached_tokens: int
    num_prompt_tokens: int


@dataclass(slots=True)
class Request:
    """One sequence inside the engine. `all_token_ids` = prompt + output tokens so far.

    num_computed_tokens counts tokens whose KV is in this request's blocks. block_hashes holds
    the chained hash of every full block of all_token_ids (extended as tokens arrive).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    mode: RequestMode = RequestMode.NORMAL
    all_token_ids: list[int] = field(default_factory=list)
    num_initial_output_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    finish_reason: str | None = None
    arrival_order: int = 0
    num_preemptions: int = 0
    remote_kv_target: int | None = None  # tokens computed once WAITING_FOR_REMOTE_KV ends

    @property
    def keeps_blocks_for_readers(self) -> bool:
        """A finished prefill-only request (not aborted): its prompt blocks stay for readers."""
        return self.mode is RequestMode.PREFILL_ONLY and self.finish_reason not in (None, "abort")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.PINNED)
