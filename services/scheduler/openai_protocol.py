"""OpenAI's HTTP API in the scheduler's terms: request bodies of `/v1/completions` and
`/v1/chat/completions` into `GenerateRequest`s, the Generate stream back into OpenAI's JSON
(whole responses and SSE chunks), and gRPC status codes into OpenAI's error JSON. Pure: no
asyncio, no HTTP; the HTTP edge is services/scheduler/http_api.py.

Contracts:
- A body refused here raises `RequestError` (INVALID_ARGUMENT) naming the field; values in the
  right JSON type but out of range travel on unchanged, so `validation.validate` refuses them
  with exactly the gRPC API's messages.
- Supported: `prompt` (text, token ids, or a list of either: one choice per prompt), `messages`
  (system / developer / user / assistant, text content), `max_tokens` (chat also
  `max_completion_tokens`), `temperature`, `top_p`, `top_k`, `seed`, `stop`, `stop_token_ids`
  and `ignore_eos` (vLLM's extensions), `stream`, `stream_options.include_usage`, and
  `return_token_ids` (vLLM's extension: each choice carries its token ids), and
  `output_token_ids` (pdserve's extension, one prompt only: the token ids a stream already
  produced before its replica died; the answer continues after them, as
  `GenerateRequest.output_token_ids` does on the gRPC API: no token twice, none missing).
- Refused with a reason when set to anything but their neutral value: `n`, `best_of`,
  `logprobs`, `top_logprobs`, `echo`, `suffix`, penalties, `logit_bias`, `tools`, `min_tokens`,
  a non-text `response_format`. Other unknown fields are ignored, as OpenAI's own server does
  for fields newer than the client.
- `usage` is OpenAI's (prompt, completion, total tokens, `prompt_tokens_details.cached_tokens`)
  plus pdserve's `cached_tokens`, `transferred_tokens` and `peer_fetched_tokens`, summed over the choices.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.v1 import generation_pb2 as gen_pb
from services.scheduler.validation import invalid

MAX_PROMPTS = 64  # prompts in one /v1/completions batch
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH_REASONS = {gen_pb.FINISH_REASON_STOP: "stop", gen_pb.FINISH_REASON_LENGTH: "length",
                  gen_pb.FINISH_REASON_ABORT: "abort"}

# gRPC status -> (HTTP status, OpenAI error type).
_HTTP_ERRORS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}

# Fields refused unless they hold one of these neutral values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "logit_bias": (None, {}), "tools": (None, []),
    "functions": (None, []), "min_tokens": (None, 0), "top_logprobs": (None, 0),
    "prompt_logprobs": (None, 0), "logprobs": (None, False),
}
_UNSUPPORTED_WHY = {
    "n": "n must be 1 (one choice per prompt)", "best_of": "best_of must be 1",
    "logprobs": "logprobs are not supported", "top_logprobs": "logprobs are not supported",
    "prompt_logprobs": "logprobs are not supported", "echo": "echo is not supported",
    "suffix": "suffix is not supported", "tools": "tools are not supported",
    "functions": "functions are not supported", "logit_bias": "logit_bias is not supported",
    "min_tokens": "min_tokens is not supported",
}


@dataclass(slots=True)
class ApiRequest:
    """A parsed body: one GenerateRequest per prompt (chat: exactly one) and how to answer."""

    chat: bool
    model: str
    requests: list[gen_pb.GenerateRequest]
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


@dataclass(slots=True)
class Choice:
    """One prompt's answer as it accumulates."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: gen_pb.Usage | None = None


def _expect(body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    """The field's value (None when absent or null); RequestError when of the wrong JSON type."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise invalid(f"{name} must be {what}, got {json.dumps(value)}")
    if not isinstance(value, kinds):
        raise invalid(f"{name} must be {what}, got {json.dumps(value)[:64]}")
    return value


def _clamp(value: int, low: int, high: int) -> int:
    """Keeps an out-of-range integer representable in the proto field; validation then refuses
    it with the gRPC API's message (which states the accepted range)."""
    return max(low, min(high, value))


def _check_neutral(body: Mapping[str, Any]) -> None:
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            why = _UNSUPPORTED_WHY.get(name, f"{name} is not supported")
            raise invalid(f"{why}; got {name}={json.dumps(body[name])[:64]}")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
        raise invalid("response_format: only text is supported")


def sampling_params(body: Mapping[str, Any], *, chat: bool) -> gen_pb.SamplingParams:
    """The sampling fields of a body; JSON-type errors raise RequestError, ranges are
    validation's job."""
    s = gen_pb.SamplingParams()
    max_tokens = _expect(body, "max_tokens", int, "an integer")
    if chat and max_tokens is None:
        max_tokens = _expect(body, "max_completion_tokens", int, "an integer")
    if max_tokens is not None:
        s.max_tokens = _clamp(max_tokens, -INT32_MAX, INT32_MAX)
    for name in ("temperature", "top_p"):
        value = _expect(body, name, (int, float), "a number")
        if value is not None:
            setattr(s, name, float(value))
    top_k = _expect(body, "top_k", int, "an integer")
    if top_k is not None:
        s.top_k = _clamp(top_k, -INT32_MAX, INT32_MAX)
    seed = _expect(body, "seed", int, "an integer")
    if seed is not None:
        if not 0 <= seed < 2**64:
            raise invalid(f"seed must be in [0, 2^64), got {seed}")
        s.seed = seed
    stop = _expect(body, "stop", (str, list), "a string or a list of strings")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not all(isinstance(x, str) for x in stops):
        raise invalid("stop must be a string or a list of strings")
    s.stop.extend(stops)
    s.stop_token_ids.extend(_ids(body.get("stop_token_ids") or [], "stop_token_ids"))
    ignore_eos = _expect(body, "ignore_eos", bool, "true or false")
    if ignore_eos is not None:
        s.ignore_eos = ignore_eos
    return s


def _ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise invalid(f"{name} must be a list of integers")
    return [_clamp(t, -INT64_MAX, INT64_MAX) for t in value]


def _continued(body: Mapping[str, Any]) -> list[int]:
    """`output_token_ids`: the tokens a broken stream already produced (range-checked later,
    with the gRPC API's messages; a negative id is refused here: the field is unsigned)."""
    ids = _ids(body.get("output_token_ids") or [], "output_token_ids")
    if any(t < 0 or t > 2**32 - 1 for t in ids):
        raise invalid("output_token_ids: token ids must be in 0..4294967295")
    return ids


def _prompts(value: Any) -> list[str | list[int]]:
    """`prompt` as OpenAI allows it: a string, token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid("prompt must be a string, a list of token ids, or a list of those")
    if not value or all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [_ids(value, "prompt")]
    if len(value) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
    prompts: list[str | list[int]] = []
    for item in value:
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list):
            prompts.append(_ids(item, "prompt"))
        else:
            raise invalid("prompt must be a string, a list of token ids, or a list of those")
    return prompts


def message_text(message: Any, i: int) -> dict[str, str]:
    """One chat message as {role, content}: text content, or a list of text parts."""
    if not isinstance(message, dict):
        raise invalid(f"messages[{i}] must be an object with role and content")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:32]}")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise invalid(f"messages[{i}].content: only text parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise invalid(f"messages[{i}].content must be a string or a list of text parts")
    return {"role": CHAT_ROLES[role], "content": content}


def parse_completion(body: Any, request_id: str) -> ApiRequest:
    """A /v1/completions body; each prompt becomes its own GenerateRequest (`<id>-<index>`)."""
    body = _object(body)
    _check_neutral(body)
    if "prompt" not in body:
        raise invalid("prompt missing: set prompt to text or token ids")
    sampling = sampling_params(body, chat=False)
    prompts = _prompts(body["prompt"])
    api = _api(body, chat=False)
    outputs = _continued(body)
    if outputs and len(prompts) > 1:
        raise invalid("output_token_ids: only with a single prompt")
    for i, prompt in enumerate(prompts):
        req = gen_pb.GenerateRequest(request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
                                     sampling=sampling, model=api.model, output_token_ids=outputs)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.SetInParent()
            req.token_ids.ids.extend(prompt)
        api.requests.append(req)
    return api


def parse_chat(body: Any, request_id: str, render: Callable[[list[dict[str, str]]], str]) -> ApiRequest:
    """A /v1/chat/completions body; `render` applies the model's chat template to the messages
    (ValueError when the model has none) and the rendered text is the prompt."""
    body = _object(body)
    _check_neutral(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list")
    sampling = sampling_params(body, chat=True)
    try:
        text = render([message_text(m, i) for i, m in enumerate(messages)])
    except ValueError as e:
        raise invalid(str(e)) from None
    api = _api(body, chat=True)
    api.requests.append(gen_pb.GenerateRequest(request_id=request_id, text=text, sampling=sampling, model=api.model,
                                               output_token_ids=_continued(body)))
    return api


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _api(body: Mapping[str, Any], *, chat: bool) -> ApiRequest:
    model = _expect(body, "model", str, "a string") or ""
    stream = bool(_expect(body, "stream", bool, "true or false"))
    options = _expect(body, "stream_options", dict, "an object") or {}
    if options and not stream:
        raise invalid("stream_options is only allowed with stream: true")
    include_usage = options.get("include_usage") is True
    return_ids = bool(_expect(body, "return_token_ids", bool, "true or false"))
    return ApiRequest(chat, model, [], stream, include_usage, return_ids)


# -- answers ----------------------------------------------------------------------------------

def usage_json(usages: Sequence[gen_pb.Usage]) -> dict[str, Any]:
    """OpenAI's usage object (summed over choices) with pdserve's cached / transferred tokens."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.generated_tokens for u in usages)
    cached = sum(u.cached_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, "cached_tokens": cached,
            "transferred_tokens": sum(u.transferred_tokens for u in usages),
            "peer_fetched_tokens": sum(u.peer_fetched_tokens for u in usages)}


class ResponseWriter:
    """Builds the JSON of one API call: SSE chunks as responses arrive, or the whole answer."""

    def __init__(self, api: ApiRequest, response_id: str, model: str) -> None:
        self.api = api
        self.id = ("chatcmpl-" if api.chat else "cmpl-") + response_id
        self.model = model
        self.created = int(time.time())
        self.choices = [Choice(i) for i in range(len(api.requests))]
        self._role_sent = False

    def add(self, index: int, response: gen_pb.GenerateResponse) -> Choice:
        """Accumulates one Generate response into choice `index`."""
        choice = self.choices[index]
        if response.WhichOneof("payload") == "chunk":
            choice.text += response.chunk.text
            choice.token_ids.extend(response.chunk.token_ids)
        else:
            choice.finish_reason = FINISH_REASONS.get(response.complete.finish_reason, "stop")
            choice.usage = response.complete.usage
        return choice

    def chunk(self, index: int, response: gen_pb.GenerateResponse) -> bytes:
        """The SSE event for one Generate response (after `add`)."""
        is_chunk = response.WhichOneof("payload") == "chunk"
        text = response.chunk.text if is_chunk else ""
        finish = None if is_chunk else self.choices[index].finish_reason
        if self.api.chat:
            delta: dict[str, Any] = {"content": text} if is_chunk else {}
            if not self._role_sent and is_chunk:
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if self.api.return_token_ids and is_chunk:
            choice["token_ids"] = list(response.chunk.token_ids)
        return sse(self._envelope([choice]))

    def usage_chunk(self) -> bytes:
        return sse({**self._envelope([]), "usage": self._usage()})

    def whole(self) -> dict[str, Any]:
        """The non-streamed answer, once every choice finished."""
        choices = []
        for c in self.choices:
            if self.api.chat:
                entry: dict[str, Any] = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                                         "logprobs": None, "finish_reason": c.finish_reason}
            else:
                entry = {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            if self.api.return_token_ids:
                entry["token_ids"] = c.token_ids
            choices.append(entry)
        body = self._envelope(choices, streamed=False)
        body["usage"] = self._usage()
        return body

    def _usage(self) -> dict[str, Any]:
        return usage_json([c.usage for c in self.choices if c.usage is not None])

    def _envelope(self, choices: list[dict[str, Any]], streamed: bool = True) -> dict[str, Any]:
        kind = "chat.completion" if self.api.chat else "text_completion"
        if streamed and self.api.chat:
            kind = "chat.completion.chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


def sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_json(code: grpc.StatusCode, message: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body) for a gRPC status and its message."""
    status, kind = _HTTP_ERRORS.get(code, (500, "internal_error"))
    return status, {"error": {"message": message, "type": kind, "param": None, "code": code.name.lower()}}
