"""The OpenAI-compatible HTTP API on a real SchedulerService (uvicorn on 127.0.0.1:0) with scripted
engines over real control streams, driven by a real HTTP client (httpx). Every case ends with the
scheduler's leak check. About 10 s in all."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from scheduler_harness import eventually
from scripted_engine import BASE, ScriptedEngine
from test_generation import BAD, Cluster, no_leaks

from pdserve.v1 import generation_pb2 as pb
from services.scheduler.http_api import HttpApi
from services.scheduler.registry import Role

TOKEN = "http-test-token-0123456789"


class HttpCluster(Cluster):
    """The Generation test cluster plus its HTTP API and an httpx client."""

    async def start(self) -> None:
        await super().start()
        service = self.service
        self.http = HttpApi(service.generation, service.guard, service.telemetry.prometheus)
        port = await self.http.start("127.0.0.1", 0)
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)

    async def stop(self) -> None:
        await self.client.aclose()
        await self.http.stop(0)
        await super().stop()

    async def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        return await self.client.post(path, content=body if isinstance(body, (str, bytes)) else json.dumps(body),
                                      **kw)


@pytest.fixture
async def http() -> AsyncIterator[HttpCluster]:
    c = HttpCluster()
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


def _sse(text: str) -> list[Any]:
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_completion_whole_and_streamed(http: HttpCluster) -> None:
    await http.add("p0", "prefill")
    await http.add("d0", "decode")
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "return_token_ids": True}
    r = await http.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["token_ids"] == [BASE + i for i in range(4)]
    assert answer["choices"][0]["text"] == "t0t1t2t3" and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] == 3 and answer["usage"]["completion_tokens"] == 4
    r = await http.post("/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "t0t1t2t3"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    await no_leaks(http)


async def test_a_list_of_prompts_answers_one_choice_each(http: HttpCluster) -> None:
    await http.add("d0", "decode")
    r = await http.post("/v1/completions", {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and all(c["text"] == "t0t1" for c in choices)
    assert r.json()["usage"]["prompt_tokens"] == 5
    await no_leaks(http)


def _json_body(mutate: Callable[[pb.GenerateRequest], None]) -> tuple[str, dict[str, str]]:
    """A gRPC bad-input case as a /v1/completions body (and its X-Request-Id header)."""
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]))
    mutate(req)
    body: dict[str, Any] = {}
    if req.WhichOneof("prompt") == "text":
        body["prompt"] = req.text
    elif req.WhichOneof("prompt") == "token_ids":
        body["prompt"] = list(req.token_ids.ids)
    s = req.sampling
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        if s.HasField(name):
            body[name] = getattr(s, name)
    body.update({k: list(getattr(s, k)) for k in ("stop", "stop_token_ids") if getattr(s, k)})
    return json.dumps(body), {"x-request-id": req.request_id} if req.request_id else {}


async def test_every_bad_input_of_the_grpc_list_is_400_with_its_message(http: HttpCluster) -> None:
    """The gRPC API's bad-input list (tests/integration/scheduler/test_generation.py), as JSON
    bodies: 400, OpenAI's error JSON, the same message, nothing changed. (`chat` on token ids
    has no HTTP form: chat is its own endpoint.)"""
    await http.add("d0", "decode")
    cases = [(mutate, match) for mutate, match in BAD if "chat applies" not in match]
    assert len(cases) == len(BAD) - 1
    for mutate, match in cases:
        body, headers = _json_body(mutate)
        r = await http.post("/v1/completions", body, headers=headers)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert match in error["message"] and error["type"] == "invalid_request_error", (body, error)
        assert http.service.leaks() == [] and http.service.router.decisions == {}


@pytest.mark.parametrize("body, match", [
    (b"{not json", "not valid JSON"),
    ({"prompt": [1], "n": 2}, "n must be 1"),
    ({"prompt": [1], "logprobs": 2}, "logprobs are not supported"),
    ({"prompt": [1], "max_tokens": "4"}, "max_tokens must be an integer"),
], ids=["json", "n", "logprobs", "type"])
async def test_http_specific_bad_input_is_400(http: HttpCluster, body: Any, match: str) -> None:
    await http.add("d0", "decode")
    r = await http.post("/v1/completions", body)
    assert r.status_code == 400 and match in r.json()["error"]["message"]
    assert http.service.leaks() == []


async def test_statuses_for_no_engine_unknown_model_full_engine_and_deadline() -> None:
    c = HttpCluster(default_deadline_s=1.0)
    await c.start()
    try:
        r = await c.post("/v1/completions", {"prompt": [1, 2, 3]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        await c.add("d0", "decode", token_delay_s=0.3)
        r = await c.post("/v1/completions", {"prompt": [1], "model": "other"})
        assert r.status_code == 404 and "unknown model" in r.json()["error"]["message"]
        c.service.admission.max_inflight_per_engine = 1
        first = asyncio.ensure_future(c.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}))
        await eventually(lambda: c.service.admission.total() == 1)
        r = await c.post("/v1/completions", {"prompt": [1, 2], "stream": True})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert (await first).status_code == 200
        c.service.admission.max_inflight_per_engine = 8
        r = await c.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 20})
        assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
        await no_leaks(c)
    finally:
        await c.stop()


async def test_deadline_mid_stream_is_an_in_band_error_event() -> None:
    c = HttpCluster(default_deadline_s=1.0)
    await c.start()
    try:
        await c.add("d0", "decode", token_delay_s=0.25)
        r = await c.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 20, "stream": True})
        assert r.status_code == 200
        events = _sse(r.text)
        assert events[0]["choices"][0]["text"] == "t0"
        assert events[-1]["error"]["code"] == "deadline_exceeded"
        await no_leaks(c)
    finally:
        await c.stop()


async def test_client_disconnect_mid_stream_aborts_the_request(http: HttpCluster) -> None:
    await http.add("p0", "prefill")
    decode = await http.add("d0", "decode", token_delay_s=0.05)
    async with http.client.stream("POST", "/v1/completions",
                                  json={"prompt": [1, 2, 3], "max_tokens": 400, "stream": True}) as r:
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= 2:
                break
    await eventually(lambda: len(decode.aborted) == 1, timeout=5)
    await no_leaks(http)
    assert http.prometheus.get_sample_value("pdserve_scheduler_requests_total", {"outcome": "cancelled"}) == 1
    assert http.prometheus.get_sample_value("pdserve_scheduler_http_requests_total",
                                            {"endpoint": "/v1/completions", "code": "499"}) == 1


async def test_client_disconnect_before_the_first_token_aborts_the_request(http: HttpCluster) -> None:
    decode = await http.add("d0", "decode", token_delay_s=5.0)
    task = asyncio.ensure_future(http.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 3}))
    await eventually(lambda: len(decode.decode_requests) == 1)
    task.cancel()
    await eventually(lambda: len(decode.aborted) == 1, timeout=5)
    await no_leaks(http)


async def test_bearer_tokens_limits_models_health_and_metrics() -> None:
    c = HttpCluster(auth_tokens=TOKEN, max_streams_per_client=1)
    await c.start()
    try:
        await c.add("d0", "decode", token_delay_s=0.2)
        for headers, reason in (({}, "missing_token"), ({"authorization": "Bearer wrong-token-0123456789"},
                                                        "bad_token")):
            r = await c.post("/v1/completions", {"prompt": [1]}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
            assert c.service.guard.refused[reason] == 1
            assert (await c.client.get("/v1/models", headers=headers)).status_code == 401
        auth = {"authorization": f"Bearer {TOKEN}"}
        models = (await c.client.get("/v1/models", headers=auth)).json()
        assert [m["id"] for m in models["data"]] == ["scripted"]
        first = asyncio.ensure_future(c.post("/v1/completions", {"prompt": [1], "max_tokens": 2}, headers=auth))
        await eventually(lambda: c.service.guard.streams.total() == 1)
        r = await c.post("/v1/completions", {"prompt": [1]}, headers=auth)
        assert r.status_code == 429 and "concurrent streams" in r.json()["error"]["message"]
        assert (await first).status_code == 200
        assert (await c.client.get("/health")).status_code == 200
        metrics = (await c.client.get("/metrics")).text
        assert 'pdserve_scheduler_http_requests_total{code="401",endpoint="/v1/completions"} 2.0' in metrics
        assert (await c.client.get("/nope")).status_code == 404
        assert (await c.client.get("/v1/completions")).status_code == 405
        await c.service.drain(0.1)
        assert (await c.client.get("/health")).status_code == 503
        r = await c.post("/v1/completions", {"prompt": [1]}, headers=auth)
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        await no_leaks(c)
    finally:
        await c.stop()


async def test_chat_renders_the_models_template() -> None:
    from engine.demo_model import demo_model_dir
    from services.common.config import SchedulerConfig, load_config
    from services.scheduler.event_sink import RecordingEventSink
    from services.scheduler.service import SchedulerService
    from services.scheduler.tokenization import PromptTokenizer

    config = load_config(SchedulerConfig, env={}, overrides={"port": 0, "control_port": 0, "events_port": 0,
                                                            "routing_policy": "load"})
    service = SchedulerService(config, model_dir=demo_model_dir(), sink=RecordingEventSink())
    await service.start()
    api = HttpApi(service.generation, service.guard)
    port = await api.start("127.0.0.1", 0)
    engine = ScriptedEngine("d0", "decode", service.control_port)
    await engine.start()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "t0t1"}
        tokenizer = PromptTokenizer(demo_model_dir())
        [sent] = engine.decode_requests
        assert list(sent.prompt_token_ids) == tokenizer.encode(tokenizer.render_messages(messages))
    finally:
        await engine.stop()
        await api.stop(0)
        await service.stop(0)


async def test_a_taken_port_is_an_error_not_an_exit(http: HttpCluster) -> None:
    other = HttpApi(http.service.generation, http.service.guard)
    with pytest.raises(RuntimeError, match="could not bind"):
        await other.start("127.0.0.1", http.http.port)
    await other.stop(0)


async def test_admin_roles_needs_the_admin_scope_and_asks_the_engine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    admin_token, user_token = "admin-token-0123456789", "user-token-01234567890"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{admin_token} admin\n{user_token}\n")
    c = HttpCluster(auth_tokens_file=str(tokens))
    await c.start()
    c.http.roles = c.service.roles
    try:
        await c.add("p0", "prefill")
        await c.add("d0", "decode")
        await eventually(lambda: len(c.service.registry.routable(Role.DECODE)) == 1)
        user = {"authorization": f"Bearer {user_token}"}
        admin = {"authorization": f"Bearer {admin_token}"}
        assert (await c.client.get("/admin/roles", headers=user)).status_code == 403
        assert (await c.client.get("/admin/roles")).status_code == 401
        listed = (await c.client.get("/admin/roles", headers=admin)).json()
        assert [(e["engine_id"], e["role"], e["role_epoch"]) for e in listed["engines"]] == [
            ("d0", "decode", 0), ("p0", "prefill", 0)]
        bad = await c.post("/admin/roles", {"engine_id": "p0", "role": "both"}, headers=admin)
        assert bad.status_code == 400 and "role must be one of" in bad.json()["error"]["message"]
        missing = await c.post("/admin/roles", {"engine_id": "x9", "role": "decode"}, headers=admin)
        assert missing.status_code == 404
        same = await c.post("/admin/roles", {"engine_id": "d0", "role": "decode"}, headers=admin)
        assert same.status_code == 400 and "already serves" in same.json()["error"]["message"]
        ok = await c.post("/admin/roles", {"engine_id": "p0", "role": "mixed", "reason": "test"}, headers=admin)
        assert ok.status_code == 202 and ok.json() == {"engine_id": "p0", "role": "mixed", "role_epoch": 1}
        assert (await c.post("/v1/completions", {"prompt": [1]}, headers=admin)).status_code == 403
    finally:
        await c.stop()
