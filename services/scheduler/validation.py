"""Validation of a GenerateRequest into a `ValidRequest`: pure, raises `RequestError` (with the
gRPC status to answer) and changes no state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import generation_pb2 as gen_pb
from services.scheduler.tokenization import ModelFacts, PromptTokenizer

MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_PROMPT_CHARS = 4 * 1024 * 1024


class RequestError(Exception):
    """A request the scheduler refuses; `code` is the gRPC status, the message the reason."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True, slots=True)
class Limits:
    max_prompt_tokens: int  # longest accepted prompt
    max_new_tokens: int     # largest accepted max_tokens
    default_max_tokens: int


@dataclass(slots=True)
class ValidRequest:
    prompt_token_ids: list[int]
    # Sampling parameters for the engines, max_tokens resolved.
    sampling: gen_pb.SamplingParams
    max_tokens: int
    # Tokens already generated on a replica that died (GenerateRequest.output_token_ids).
    output_token_ids: list[int] = field(default_factory=list)


def validate(req: gen_pb.GenerateRequest, facts: ModelFacts, limits: Limits,
             tokenizer: PromptTokenizer | None) -> ValidRequest:
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id longer than {MAX_REQUEST_ID_CHARS} characters")
    if req.model and req.model != facts.name:
        raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown model {req.model!r}; this server serves {facts.name!r}")
    prompt = _prompt_ids(req, facts, tokenizer)
    if len(prompt) > limits.max_prompt_tokens:
        raise invalid(f"prompt has {len(prompt)} tokens; the limit is {limits.max_prompt_tokens}")
    sampling = gen_pb.SamplingParams()
    sampling.CopyFrom(req.sampling)
    max_tokens = _check_sampling(sampling, facts, limits)
    if len(prompt) + max_tokens > facts.max_model_len:
        raise invalid(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's maximum "
                      f"length {facts.max_model_len}")
    sampling.max_tokens = max_tokens
    outputs = list(req.output_token_ids)
    if len(outputs) >= max_tokens:
        raise invalid(f"output_token_ids: {len(outputs)} tokens already generated leave nothing of max_tokens "
                      f"{max_tokens}")
    bad = next((t for t in outputs if t >= facts.vocab_size), None)
    if bad is not None:
        raise invalid(f"output token id {bad} outside the vocabulary [0, {facts.vocab_size})")
    return ValidRequest(prompt, sampling, max_tokens, outputs)


def _prompt_ids(req: gen_pb.GenerateRequest, facts: ModelFacts, tokenizer: PromptTokenizer | None) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise invalid("prompt missing: set text or token_ids")
    if kind == "token_ids":
        if req.HasField("chat") and req.chat:
            raise invalid("chat applies to a text prompt, not to token_ids")
        ids = list(req.token_ids.ids)
        if not ids:
            raise invalid("empty prompt")
        bad = next((t for t in ids if t < 0 or t >= facts.vocab_size), None)
        if bad is not None:
            raise invalid(f"token id {bad} outside the vocabulary [0, {facts.vocab_size})")
        return ids
    if not req.text:
        raise invalid("empty prompt")
    if len(req.text) > MAX_PROMPT_CHARS:
        raise invalid(f"prompt text longer than {MAX_PROMPT_CHARS} characters")
    if tokenizer is None:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "this scheduler has no tokenizer; send token_ids")
    try:
        ids = tokenizer.encode_chat(req.text) if req.HasField("chat") and req.chat else tokenizer.encode(req.text)
    except ValueError as e:
        raise invalid(str(e)) from None
    if not ids:
        raise invalid("prompt text encodes to no tokens")
    return ids


def _check_sampling(s: gen_pb.SamplingParams, facts: ModelFacts, limits: Limits) -> int:
    max_tokens = s.max_tokens if s.HasField("max_tokens") else limits.default_max_tokens
    if not 1 <= max_tokens <= limits.max_new_tokens:
        raise invalid(f"max_tokens must be in [1, {limits.max_new_tokens}], got {max_tokens}")
    if s.HasField("temperature") and not (math.isfinite(s.temperature) and 0 <= s.temperature <= 100):
        raise invalid(f"temperature must be in [0, 100], got {s.temperature}")
    if s.HasField("top_p") and not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        raise invalid(f"top_p must be in (0, 1], got {s.top_p}")
    if s.HasField("top_k") and s.top_k < 0:
        raise invalid(f"top_k must be >= 0 (0 disables it), got {s.top_k}")
    if len(s.stop) > MAX_STOP_STRINGS or any(not x or len(x) > MAX_STOP_CHARS for x in s.stop):
        raise invalid(f"stop: at most {MAX_STOP_STRINGS} non-empty strings of <= {MAX_STOP_CHARS} characters")
    bad = next((t for t in s.stop_token_ids if t < 0 or t >= facts.vocab_size), None)
    if bad is not None:
        raise invalid(f"stop token id {bad} outside the vocabulary [0, {facts.vocab_size})")
    for name in ("ttft_target_ms", "itl_target_ms"):
        if s.HasField(name) and not (math.isfinite(getattr(s, name)) and getattr(s, name) > 0):
            raise invalid(f"{name} must be a positive number of milliseconds, got {getattr(s, name)}")
    return max_tokens
