"""The disaggregated serving path end to end: real scheduler, prefill and decode services as
processes, KV over UCX, the demo model; outputs checked token for token against the engine run
in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from e2e_cluster import MAX_TOKENS, start_cluster

from pdserve.v1 import control_pb2, control_pb2_grpc
from services.client import AsyncClient, GenerationResult, _ResultBuilder, build_request
from services.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(600)


async def _run_all(target: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS,
                   timeout: float = 120) -> list[GenerationResult]:
    async with AsyncClient(target) as client:
        return list(await asyncio.gather(*(
            client.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=timeout)
            for p in prompts)))


def _check_against_reference(results: list[GenerationResult], reference: list[list[int]]) -> None:
    for i, (result, expected) in enumerate(zip(results, reference, strict=True)):
        assert result.token_ids == expected, f"prompt {i}: {result.token_ids} != {expected}"
        assert result.finish_reason == "length"
        assert result.generated_tokens == len(expected)


def test_disaggregated_output_matches_offline_with_32_concurrent_clients(
        cluster: LocalCluster, prompts: list[list[int]], reference: list[list[int]]) -> None:
    batch = prompts + prompts[:12]  # 32 concurrent streams
    results = asyncio.run(_run_all(cluster.target, batch))
    _check_against_reference(results, reference + reference[:12])
    first = results[: len(prompts)]
    assert all(r.prefill_engine_id == "prefill-0" and r.decode_engine_id == "decode-0" for r in first)
    # Every prompt's KV came over the data plane (or from the decode engine's own prefix cache).
    assert all(r.transferred_tokens + r.cached_tokens >= r.prompt_tokens - 1 for r in results)
    assert sum(r.transferred_tokens for r in results) > 0
    assert cluster.wait_no_leaks() == {}


def test_client_cancel_mid_stream_frees_both_engines(cluster: LocalCluster, prompts: list[list[int]]) -> None:
    async def cancel_after_two_chunks() -> int:
        async with AsyncClient(cluster.target) as client:
            call = client._stub.Generate(build_request(prompts[4], max_tokens=400, ignore_eos=True, temperature=0.0))
            seen = 0
            async for resp in call:
                if resp.WhichOneof("payload") == "chunk":
                    seen += len(resp.chunk.token_ids)
                if seen >= 2:
                    call.cancel()
                    break
            return seen

    assert asyncio.run(cancel_after_two_chunks()) >= 2
    assert cluster.wait_no_leaks() == {}


@pytest.mark.parametrize("case", [
    ("empty prompt", dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT),
    ("token id >= vocab", dict(prompt=[1, 2, 10**7]), grpc.StatusCode.INVALID_ARGUMENT),
    ("negative token id", dict(prompt=[1, -5]), grpc.StatusCode.INVALID_ARGUMENT),
    ("over-long prompt", dict(prompt=[1] * 70000), grpc.StatusCode.INVALID_ARGUMENT),
    ("max_tokens 0", dict(prompt=[1, 2], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
    ("temperature -1", dict(prompt=[1, 2], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
    ("top_p 0", dict(prompt=[1, 2], top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT),
], ids=lambda c: c[0])
def test_bad_input_gets_a_status_and_the_cluster_keeps_serving(
        cluster: LocalCluster, case: tuple[str, dict[str, object], grpc.StatusCode],
        prompts: list[list[int]], reference: list[list[int]]) -> None:
    _, kwargs, code = case

    async def call() -> None:
        async with AsyncClient(cluster.target) as client:
            prompt = kwargs.pop("prompt")
            await client.generate(prompt, **kwargs)  # type: ignore[arg-type]

    with pytest.raises(grpc.aio.AioRpcError, match=code.name) as err:
        asyncio.run(call())
    assert err.value.code() == code, err.value.details()
    assert err.value.details()
    _check_against_reference(asyncio.run(_run_all(cluster.target, prompts[:1])), reference[:1])


def test_bad_control_stream_input_is_refused(cluster: LocalCluster) -> None:
    """A Hello with a wrong compatibility hash or a malformed handshake, and a report before any
    Hello, are refused with a status; the cluster keeps serving."""

    def connect(first: control_pb2.RankMessage) -> grpc.StatusCode:
        with grpc.insecure_channel(f"127.0.0.1:{cluster.control_port}") as channel:
            stub = control_pb2_grpc.ControlStub(channel)
            try:
                for _ in stub.Connect(iter([first]), timeout=10):
                    pass
            except grpc.RpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    rank = control_pb2.RankIdentity(engine_id="decode-0", role=control_pb2.ROLE_DECODE, epoch=7, tp_rank=0, tp_size=1,
                                    pp_size=1)
    wrong_hash = control_pb2.Hello(rank=rank, compatibility_hash="0" * 32, protocol_version=1,
                                   engine_address="127.0.0.1:1", handshake_metadata=b"x", hash_seed="0", block_size=16)
    assert connect(control_pb2.RankMessage(hello=wrong_hash)) == grpc.StatusCode.FAILED_PRECONDITION  # incompatible
    assert connect(control_pb2.RankMessage(report=control_pb2.StepReport(seq=1, finished_recving=["nope"]))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert cluster.server_info().num_decode_engines == 1


def test_scheduler_restart_ranks_reregister_and_serve(
        cluster: LocalCluster, prompts: list[list[int]], reference: list[list[int]]) -> None:
    cluster.restart("scheduler")
    cluster.wait_ready(1, 1, timeout=60)
    results = asyncio.run(_run_all(cluster.target, prompts[:4]))
    _check_against_reference(results, reference[:4])
    # The re-registered prefill rank prefilled each prompt and the decode rank pulled its KV.
    assert [(r.prefill_engine_id, r.transferred_tokens > 0) for r in results] == [("prefill-0", True)] * len(results)
    assert cluster.wait_no_leaks() == {}


def test_tp2_on_both_sides_matches_offline(tmp_path_factory: pytest.TempPathFactory, tiny_tp_model: Path,
                                           prompts: list[list[int]]) -> None:
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    with LLMEngine(tiny_tp_model, torch_threads=1, dtype="float32") as engine:
        reference = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    c = start_cluster(tmp_path_factory, "tp2", tp=2, model=str(tiny_tp_model))
    try:
        results = asyncio.run(_run_all(c.target, prompts))
        _check_against_reference(results, reference)
        assert sum(r.transferred_tokens for r in results) > 0
        assert c.wait_no_leaks() == {}
    finally:
        c.stop()


def test_decode_only_matches_offline(tmp_path_factory: pytest.TempPathFactory,
                                     prompts: list[list[int]], reference: list[list[int]]) -> None:
    c = start_cluster(tmp_path_factory, "decode-only", num_prefill=0)
    try:
        results = asyncio.run(_run_all(c.target, prompts))
        _check_against_reference(results, reference)
        assert all(r.transferred_tokens == 0 and r.prefill_engine_id == "" for r in results)
        assert c.wait_no_leaks() == {}
    finally:
        c.stop()


def _stream_with_indexes(client: AsyncClient, prompt: list[int], max_tokens: int) -> Any:
    async def run() -> tuple[GenerationResult, list[tuple[int, int]]]:
        req = build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        builder = _ResultBuilder(req.request_id)
        chunks: list[tuple[int, int]] = []
        async for resp in client.stream_raw(req, timeout=120):
            chunk = builder.add(resp)
            if chunk is not None:
                chunks.append((chunk.index, len(chunk.token_ids)))
        return builder.result, chunks

    return run()


def test_killed_engines_lose_no_request_and_no_token(tmp_path_factory: pytest.TempPathFactory, demo_model: Path,
                                                     prompts: list[list[int]]) -> None:
    """SIGKILL a decode engine mid-burst (its requests migrate to the other one), then the only
    prefill engine (requests fall back to local recompute): every request completes with exactly
    the greedy reference tokens, streamed without a repeated or skipped index."""
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    long = 40
    batch = prompts[:8]
    with LLMEngine(demo_model, torch_threads=1, dtype="float32") as engine:
        expected = engine.generate(batch, SamplingParams(max_tokens=long, ignore_eos=True))
    c = start_cluster(tmp_path_factory, "chaos", num_decode=2)
    try:
        async def burst(victim: str, kill_after_s: float) -> list[tuple[GenerationResult, list[tuple[int, int]]]]:
            async with AsyncClient(c.target) as client:
                tasks = [asyncio.create_task(_stream_with_indexes(client, p, long)) for p in batch]
                await asyncio.sleep(kill_after_s)
                c.kill(victim)
                return list(await asyncio.gather(*tasks))

        for victim, kill_after_s in (("decode-0", 2.0), ("prefill-0", 0.3)):
            outcomes = asyncio.run(burst(victim, kill_after_s))
            for i, (result, chunks) in enumerate(outcomes):
                assert result.token_ids == expected[i], f"{victim} killed: prompt {i} differs"
                position = 0
                for index, n in chunks:
                    assert index == position, f"{victim} killed: prompt {i} chunk at {index}, expected {position}"
                    position += n
            if victim == "decode-0":
                assert any(r.num_migrations > 0 for r, _ in outcomes), "no request migrated off decode-0"
        assert c.wait_no_leaks() == {}
    finally:
        c.stop()
