"""OpenAI request bodies into GenerateRequests and Generate streams into OpenAI's JSON (pure;
milliseconds)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from pdserve.v1 import generation_pb2 as pb
from services.scheduler.openai_protocol import (
    ResponseWriter,
    error_json,
    parse_chat,
    parse_completion,
    usage_json,
)
from services.scheduler.validation import RequestError


def _render(messages: list[dict[str, str]]) -> str:
    return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"


def test_completion_fields_map_onto_the_generate_request() -> None:
    api = parse_completion({"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0, "top_p": 0.5,
                            "top_k": 3, "seed": 11, "stop": "x", "stop_token_ids": [2], "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}, "user": "ignored",
                            "n": 1, "logprobs": None}, "rid")
    [req] = api.requests
    assert (api.chat, api.model, api.stream, api.include_usage) == (False, "m", True, True)
    assert list(req.token_ids.ids) == [5, 6, 7] and req.request_id == "rid" and req.model == "m"
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (9, 0.0, 0.5, 3, 11)
    assert s.HasField("temperature"), "an explicit temperature 0 (greedy) must survive"
    assert (list(s.stop), list(s.stop_token_ids), s.ignore_eos) == (["x"], [2], True)
    assert not parse_completion({"prompt": "hi"}, "r").requests[0].sampling.HasField("temperature")


def test_a_list_of_prompts_is_one_request_each() -> None:
    api = parse_completion({"prompt": ["a", [1, 2]], "max_tokens": 2}, "rid")
    assert [r.WhichOneof("prompt") for r in api.requests] == ["text", "token_ids"]
    assert [r.request_id for r in api.requests] == ["rid-0", "rid-1"]
    assert all(r.sampling.max_tokens == 2 for r in api.requests)


def test_output_token_ids_continue_a_broken_stream_like_the_grpc_api() -> None:
    [req] = parse_completion({"prompt": [1, 2], "max_tokens": 8, "output_token_ids": [7, 9]}, "r").requests
    assert list(req.output_token_ids) == [7, 9]
    [chat] = parse_chat({"messages": [{"role": "user", "content": "hi"}], "output_token_ids": [3]}, "r", _render).requests
    assert list(chat.output_token_ids) == [3]
    for body, match in [({"prompt": ["a", "b"], "output_token_ids": [1]}, "single prompt"),
                        ({"prompt": "a", "output_token_ids": [-1]}, "0..4294967295"),
                        ({"prompt": "a", "output_token_ids": "x"}, "list of integers")]:
        with pytest.raises(RequestError, match=match):
            parse_completion(body, "r")


def test_chat_messages_render_through_the_template() -> None:
    api = parse_chat({"messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                   {"role": "assistant", "content": "hello"},
                                   {"role": "developer", "content": "d"}],
                      "max_completion_tokens": 4}, "rid", _render)
    [req] = api.requests
    assert req.text == "system:be brief|user:hi|assistant:hello|system:d|assistant:"
    assert not req.HasField("chat") and req.sampling.max_tokens == 4 and api.chat


@pytest.mark.parametrize("body, match", [
    ([], "JSON object"),
    ({}, "prompt missing"),
    ({"prompt": 5}, "prompt must be"),
    ({"prompt": [[1], 2]}, "prompt must be"),
    ({"prompt": [1, True]}, "prompt must be"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens must be an integer"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"prompt": "x", "temperature": "hot"}, "temperature must be a number"),
    ({"prompt": "x", "stop": [1]}, "stop must be"),
    ({"prompt": "x", "seed": -1}, "seed must be"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos must be true or false"),
    ({"prompt": "x", "stream": "yes"}, "stream must be"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed with stream"),
    ({"prompt": "x", "n": 2}, "n must be 1"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logprobs": 1}, "logprobs are not supported"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": ["x"] * 65}, "at most 64 prompts"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_completion_bodies_are_refused_with_a_reason(body: Any, match: str) -> None:
    with pytest.raises(RequestError, match=match) as e:
        parse_completion(body, "r")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("body, match", [
    ({}, "messages must be a non-empty list"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": ["hi"]}, r"messages\[0\] must be an object"),
    ({"messages": [{"role": "tool", "content": "x"}]}, r"messages\[0\].role must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
    ({"messages": [{"role": "user"}]}, "content must be a string"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs are not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_chat_bodies_are_refused_with_a_reason(body: Any, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        parse_chat(body, "r", _render)


def test_a_model_without_a_chat_template_is_a_bad_request() -> None:
    def no_template(messages: list[dict[str, str]]) -> str:
        raise ValueError("the model has no chat template; send the prompt without chat")

    with pytest.raises(RequestError, match="no chat template"):
        parse_chat({"messages": [{"role": "user", "content": "x"}]}, "r", no_template)


def test_out_of_range_integers_reach_validation_representable() -> None:
    s = parse_completion({"prompt": [1, 2**70], "max_tokens": 10**12, "top_k": -(10**12)}, "r").requests[0]
    assert s.sampling.max_tokens == 2**31 - 1 and s.sampling.top_k == -(2**31 - 1)
    assert s.token_ids.ids[1] == 2**63 - 1


def _stream(ids: list[list[int]], texts: list[str], finish: int = pb.FINISH_REASON_LENGTH,
            cached: int = 1, transferred: int = 2) -> list[pb.GenerateResponse]:
    out, index = [], 0
    for token_ids, text in zip(ids, texts, strict=True):
        out.append(pb.GenerateResponse(chunk=pb.Chunk(token_ids=token_ids, text=text, index=index)))
        index += len(token_ids)
    usage = pb.Usage(prompt_tokens=3, cached_tokens=cached, transferred_tokens=transferred, generated_tokens=index)
    out.append(pb.GenerateResponse(complete=pb.Complete(finish_reason=finish, usage=usage)))  # type: ignore[arg-type]
    return out


def _events(data: bytes) -> list[Any]:
    assert data.endswith(b"\n\n")
    return [json.loads(e[len(b"data: "):]) for e in data.split(b"\n\n") if e]


def test_completion_answer_and_stream_chunks() -> None:
    api = parse_completion({"prompt": [1, 2, 3], "return_token_ids": True}, "abc")
    writer = ResponseWriter(api, "abc", "demo")
    events = []
    for r in _stream([[7], [8, 9]], ["a", "bc"]):
        writer.add(0, r)
        events += _events(writer.chunk(0, r))
    assert [e["choices"][0]["text"] for e in events] == ["a", "bc", ""]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
    assert events[1]["choices"][0]["token_ids"] == [8, 9]
    assert {e["id"] for e in events} == {"cmpl-abc"} and events[0]["object"] == "text_completion"
    whole = writer.whole()
    assert whole["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length",
                                 "token_ids": [7, 8, 9]}]
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                              "prompt_tokens_details": {"cached_tokens": 1}, "cached_tokens": 1,
                              "transferred_tokens": 2, "peer_fetched_tokens": 0}
    [usage_event] = _events(writer.usage_chunk())
    assert usage_event["choices"] == [] and usage_event["usage"] == whole["usage"]


def test_chat_stream_sends_the_role_once_with_the_first_content() -> None:
    api = parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True}, "abc", _render)
    writer = ResponseWriter(api, "abc", "demo")
    deltas = []
    for r in _stream([[7], [8]], ["Par", "is"], finish=pb.FINISH_REASON_STOP):
        writer.add(0, r)
        [event] = _events(writer.chunk(0, r))
        assert event["object"] == "chat.completion.chunk" and event["id"] == "chatcmpl-abc"
        deltas.append((event["choices"][0]["delta"], event["choices"][0]["finish_reason"]))
    assert deltas == [({"role": "assistant", "content": "Par"}, None), ({"content": "is"}, None), ({}, "stop")]
    assert writer.whole()["choices"][0]["message"] == {"role": "assistant", "content": "Paris"}


def test_usage_sums_every_choice() -> None:
    usages = [pb.Usage(prompt_tokens=3, generated_tokens=2, cached_tokens=1, transferred_tokens=2),
              pb.Usage(prompt_tokens=4, generated_tokens=5)]
    u = usage_json(usages)
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"], u["cached_tokens"]) == (7, 7, 14, 1)


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.FAILED_PRECONDITION, 400),
    (grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.PERMISSION_DENIED, 403),
    (grpc.StatusCode.NOT_FOUND, 404), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.UNAVAILABLE, 503), (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (grpc.StatusCode.INTERNAL, 500),
], ids=lambda v: getattr(v, "name", str(v)))
def test_status_codes_map_to_http_with_openai_error_json(code: grpc.StatusCode, status: int) -> None:
    got, body = error_json(code, "why")
    assert got == status
    assert body == {"error": {"message": "why", "type": body["error"]["type"], "param": None,
                              "code": code.name.lower()}}
    assert body["error"]["type"]
