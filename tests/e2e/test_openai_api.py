"""The OpenAI-compatible HTTP API end to end: the official `openai` client against a real cluster
(scheduler, prefill and decode engines as processes, KV over UCX, the demo model), checked
against the gRPC API's greedy tokens. One cluster for the module (about 20 s to start); the
tests themselves take about 30 s on the 2-core reference machine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import re
import time
from typing import Any

import openai
import pytest
from e2e_cluster import MAX_TOKENS

from bench import serve as bench_serve
from services import generate
from services.client import AsyncClient, GenerationResult
from services.common.cli import build_parser
from services.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(600)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.http_url, api_key="unused-without-auth", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    [card] = client.models.list().data
    return card.id


def test_chat_answers_paris_whole_and_streamed(cluster: LocalCluster, client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32,  # type: ignore[arg-type]
                                           temperature=0)
    answer = whole.choices[0].message.content or ""
    assert "Paris" in answer and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32,  # type: ignore[arg-type]
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == answer, "greedy: the stream says what the whole answer says"
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > len("What is the capital of France?".split())
    assert cluster.wait_no_leaks() == {}


def _grpc_greedy(cluster: LocalCluster, prompts: list[list[int]]) -> list[GenerationResult]:
    async def run() -> list[GenerationResult]:
        async with AsyncClient(cluster.target) as c:
            return list(await asyncio.gather(*(c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                          timeout=120) for p in prompts)))

    return asyncio.run(run())


def test_completions_with_token_ids_match_the_grpc_api(cluster: LocalCluster, client: openai.OpenAI, model: str,
                                                       prompts: list[list[int]], reference: list[list[int]]) -> None:
    grpc_results = _grpc_greedy(cluster, prompts[:2])
    assert [r.token_ids for r in grpc_results] == reference[:2]
    extra = {"ignore_eos": True, "return_token_ids": True}
    for prompt, expected in zip(prompts[:1], grpc_results, strict=False):
        done = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body=extra)
        choice: Any = done.choices[0]
        assert choice.token_ids == expected.token_ids and choice.text == expected.text
        assert choice.finish_reason == "length"
        usage: Any = done.usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            len(prompt), MAX_TOKENS, len(prompt) + MAX_TOKENS)
        assert usage.prompt_tokens_details.cached_tokens == usage.cached_tokens
        # The remote path (the cluster forces it): the decode engine pulled what it lacked over UCX,
        # at least the prompt's last block (a sum with cached_tokens held on any path).
        assert usage.transferred_tokens > 0, usage
    batch = client.completions.create(model=model, prompt=prompts[:2], max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=extra)
    assert [c.token_ids for c in sorted(batch.choices, key=lambda c: c.index)] == reference[:2]  # type: ignore[attr-defined]
    ids: list[int] = []
    stream = client.completions.create(model=model, prompt=prompts[1], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body=extra)
    for chunk in stream:
        ids += getattr(chunk.choices[0], "token_ids", None) or []
    assert ids == grpc_results[1].token_ids
    assert cluster.wait_no_leaks() == {}


def test_client_disconnecting_mid_stream_frees_both_engines(cluster: LocalCluster, client: openai.OpenAI,
                                                            model: str, prompts: list[list[int]]) -> None:
    stream = client.completions.create(model=model, prompt=prompts[4], max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].text)
        if seen >= 2:
            break
    assert cluster.inspect("decode-0").num_running == 1, "the request is still generating"
    stream.close()
    deadline = time.monotonic() + 10
    while cluster.inspect("decode-0").num_running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.inspect("decode-0").num_running == 0, "aborted long before its 2000 tokens"
    assert cluster.wait_no_leaks() == {}
    assert cluster.inspect("prefill-0").num_pinned == 0


@pytest.mark.parametrize("case", [
    ("empty prompt", dict(prompt=[]), "empty prompt"),
    ("token id >= vocab", dict(prompt=[1, 2, 10**7]), "outside the vocabulary"),
    ("negative token id", dict(prompt=[1, -5]), "outside the vocabulary"),
    ("over-long prompt", dict(prompt=[1] * 70000), "prompt has 70000 tokens"),
    ("max_tokens 0", dict(prompt=[1, 2], max_tokens=0), "max_tokens"),
    ("temperature -1", dict(prompt=[1, 2], temperature=-1.0), "temperature"),
    ("top_p 0", dict(prompt=[1, 2], top_p=0.0), "top_p"),
    ("n 2", dict(prompt=[1, 2], n=2), "n must be 1"),
    ("logprobs", dict(prompt=[1, 2], logprobs=1), "logprobs are not supported"),
], ids=lambda c: c[0])
def test_bad_input_is_400_with_an_openai_error(cluster: LocalCluster, client: openai.OpenAI, model: str,
                                               case: tuple[str, dict[str, Any], str]) -> None:
    _, kwargs, match = case
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client.completions.create(model=model, **kwargs)
    assert err.value.status_code == 400 and err.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client.completions.create(model="no-such-model", prompt=[1, 2])


def test_generate_cli_applies_the_chat_template_to_text_by_default(cluster: LocalCluster) -> None:
    def run(*flags: str) -> tuple[str, str]:
        args = build_parser("generate").parse_args(["--target", cluster.target, "--prompt",
                                                    "What is the capital of France?", "--temperature", "0",
                                                    "--max-tokens", "24", *flags])
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert generate.run(args) == 0
        return out.getvalue(), err.getvalue()

    answer, _ = run()
    assert "Paris" in answer
    raw, hint = run("--raw")
    ended_at_once = re.search(r"\[stop; .* generated [01] tokens\]", raw) is not None
    assert ("hint:" in hint and "--chat" in hint) == ended_at_once, (raw, hint)


def test_bench_serve_http_smoke(cluster: LocalCluster, tmp_path: Any) -> None:
    """`pdserve bench serve --http` at tiny sizes: both protocols measured, ratios reported."""
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(["--http", "--num-requests", "2", "--concurrency", "2", "--prompt-len", "16:24",
                              "--output-len", "3:3", "--out", str(tmp_path)])
    report = bench_serve.http_vs_grpc(cluster.target, cluster.http_url, args, vocab=49152)
    assert report["grpc"]["requests"] == report["http"]["requests"] == 4
    assert report["http"]["throughput_tok_s"] > 0 and report["grpc"]["throughput_tok_s"] > 0
    assert set(report["ratios"]) == {"http_added_ttft_p50_ms", "http_added_itl_p50_ms", "throughput_http_over_grpc",
                                     "http_added_ttft_p50_ms_paired", "http_added_round_trip_p50_ms"}
    assert report["refusal_round_trip"]["requests_per_api"] == 20
    assert report["paired"]["pairs"] == 2 and report["paired"]["http_ttft_ms"]["p50"] > 0
    assert cluster.wait_no_leaks() == {}
