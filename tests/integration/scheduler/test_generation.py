"""Generation servicer: a real SchedulerService (all three gRPC servers) with scripted engines
that register over real control streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from scheduler_harness import eventually
from scripted_engine import BASE, ScriptedEngine

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from services.common.config import SchedulerConfig, load_config
from services.common.grpc_server import insecure_channel
from services.scheduler.event_sink import RecordingEventSink
from services.scheduler.service import SchedulerService
from services.scheduler.tokenization import ModelFacts

FACTS = ModelFacts("scripted", vocab_size=1000, max_model_len=512)


class Cluster:
    def __init__(self, **overrides: Any) -> None:
        config = load_config(SchedulerConfig, env={}, overrides={
            "port": 0, "control_port": 0, "events_port": 0, "routing_policy": "load", "path_policy": "remote",
            "heartbeat_interval_s": 0.05, "default_max_tokens": 8, **overrides})
        self.prometheus = CollectorRegistry()
        self.service = SchedulerService(config, facts=FACTS, sink=RecordingEventSink(), prometheus=self.prometheus)
        self.engines: list[ScriptedEngine] = []
        self.channel: grpc.aio.Channel | None = None

    async def start(self) -> None:
        await self.service.start()
        self.channel = insecure_channel(f"127.0.0.1:{self.service.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def add(self, engine_id: str, role: str, **kw: Any) -> ScriptedEngine:
        engine = ScriptedEngine(engine_id, role, self.service.control_port, **kw)
        await engine.start()
        self.engines.append(engine)
        return engine

    async def stop(self) -> None:
        for e in self.engines:
            await e.stop()
        if self.channel is not None:
            await self.channel.close()
        await self.service.stop(0)

    async def generate(self, prompt: list[int], timeout: float = 10.0,
                       **sampling: Any) -> tuple[list[pb.Chunk], pb.Complete]:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(**sampling))
        chunks: list[pb.Chunk] = []
        complete = None
        async for resp in self.stub.Generate(req, timeout=timeout):
            if resp.WhichOneof("payload") == "chunk":
                chunks.append(resp.chunk)
            else:
                complete = resp.complete
        assert complete is not None
        return chunks, complete


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


def tokens_and_indices(chunks: list[pb.Chunk]) -> tuple[list[int], list[int]]:
    tokens: list[int] = []
    for c in chunks:
        assert c.index == len(tokens), "chunk index must continue the stream with no gap or repeat"
        tokens.extend(c.token_ids)
    return tokens, [c.index for c in chunks]


async def no_leaks(cluster: Cluster) -> None:
    await eventually(lambda: cluster.service.leaks() == [])


async def test_disaggregated_stream_releases_prefill_blocks(cluster: Cluster) -> None:
    p = await cluster.add("p0", "prefill")
    d = await cluster.add("d0", "decode")
    chunks, done = await cluster.generate(list(range(40)), max_tokens=6)
    tokens, _ = tokens_and_indices(chunks)
    assert tokens == [BASE + i for i in range(6)]
    assert done.finish_reason == pb.FINISH_REASON_LENGTH
    assert (done.prefill_engine_id, done.decode_engine_id, done.num_migrations) == ("p0", "d0", 0)
    assert (done.usage.prompt_tokens, done.usage.generated_tokens, done.usage.transferred_tokens) == (40, 6, 40)
    assert done.scheduler_overhead_ms > 0
    assert list(d.decode_requests[0].output_token_ids) == [BASE]  # the first token came from prefill
    assert d.decode_requests[0].descriptor.engine_id == "p0"
    await eventually(lambda: p.released == [d.decode_requests[0].request_id] and not p.pinned)
    assert [type(m).__name__ for m in d.kv_outcomes] == ["KVReady"]
    await no_leaks(cluster)
    assert cluster.service.table.release_outcomes == {"transferred": 1}
    sample = cluster.prometheus.get_sample_value
    assert sample("pdserve_scheduler_requests_total", {"outcome": "success"}) == 1
    assert sample("pdserve_scheduler_lease_outcomes_total", {"outcome": "released"}) == 1
    assert sample("pdserve_scheduler_routing_decisions_total",
                  {"role": "prefill", "engine": "p0", "policy": "load", "reason": "load"}) == 1
    assert sample("pdserve_scheduler_time_to_first_token_seconds_count", {"path": "disaggregated"}) == 1
    assert sample("pdserve_scheduler_registered_engines", {"role": "decode", "state": "routable"}) == 1


async def test_reused_client_request_id_is_echoed_and_served_twice(cluster: Cluster) -> None:
    await cluster.add("p0", "prefill")
    d = await cluster.add("d0", "decode")
    for _ in range(2):
        req = pb.GenerateRequest(request_id="same", token_ids=pb.TokenIds(ids=list(range(40))),
                                 sampling=pb.SamplingParams(max_tokens=3))
        responses = [r async for r in cluster.stub.Generate(req, timeout=10)]
        assert {r.request_id for r in responses} == {"same"}
        assert responses[-1].complete.usage.generated_tokens == 3
    assert len({r.request_id for r in d.decode_requests}) == 2
    assert [type(m).__name__ for m in d.kv_outcomes] == ["KVReady", "KVReady"]
    await no_leaks(cluster)


async def test_first_token_can_end_the_request_at_prefill(cluster: Cluster) -> None:
    p = await cluster.add("p0", "prefill")
    d = await cluster.add("d0", "decode")
    chunks, done = await cluster.generate(list(range(20)), max_tokens=1)
    assert [list(c.token_ids) for c in chunks] == [[BASE]] and done.usage.generated_tokens == 1
    assert d.decode_requests == []
    await eventually(lambda: not p.pinned)
    await no_leaks(cluster)


async def test_decode_only_below_threshold_and_without_prefill() -> None:
    c = Cluster(decode_only_threshold=32)
    await c.start()
    try:
        d = await c.add("d0", "decode")
        _, done = await c.generate(list(range(40)), max_tokens=3)  # no prefill engine registered
        assert done.prefill_engine_id == "" and not d.decode_requests[0].HasField("descriptor")
        await c.add("p0", "prefill")
        _, done = await c.generate(list(range(10)), max_tokens=3)  # short prompt
        assert done.prefill_engine_id == ""
        _, done = await c.generate(list(range(40)), max_tokens=3)
        assert done.prefill_engine_id == "p0"
        assert c.service.router.decisions == {"decode_local:no_prefill_engine": 1, "decode_local:short_prompt": 1,
                                              "load": 1}
        assert c.service.router.paths == {"decode_local:no_prefill_engine": 1, "decode_local:short_prompt": 1,
                                          "remote:always": 1}
        await no_leaks(c)
    finally:
        await c.stop()


async def test_decode_failure_migrates_without_repeating_a_token(cluster: Cluster) -> None:
    await cluster.add("p0", "prefill")
    bad = await cluster.add("d0", "decode", fail_decode_after=3)
    good = await cluster.add("d1", "decode", token_delay_s=0.001)
    good.decode_requests.clear()
    # Make d0 the least loaded choice: d1 reports load.
    cluster.service.registry.engines["d1"].load = type(cluster.service.registry.engines["d1"].load)(num_running=5)
    chunks, done = await cluster.generate(list(range(40)), max_tokens=10)
    tokens, _ = tokens_and_indices(chunks)
    assert tokens == [BASE + i for i in range(10)]
    assert (done.decode_engine_id, done.num_migrations) == ("d1", 1)
    migrated = good.decode_requests[0]
    assert list(migrated.output_token_ids) == [BASE + i for i in range(4)]
    assert not migrated.HasField("descriptor")  # recomputed on the new engine
    assert bad.decode_requests and bad.decode_requests[0].HasField("descriptor")
    await no_leaks(cluster)


async def test_prefill_failure_recomputes_on_decode(cluster: Cluster) -> None:
    await cluster.add("p0", "prefill", fail_prefill=True)
    d = await cluster.add("d0", "decode")
    chunks, done = await cluster.generate(list(range(40)), max_tokens=4)
    assert tokens_and_indices(chunks)[0] == [BASE + i for i in range(4)]
    assert done.prefill_engine_id == "" and not d.decode_requests[0].HasField("descriptor")
    await no_leaks(cluster)


async def test_prefill_failure_retries_another_engine() -> None:
    c = Cluster(prefill_failure_policy="retry")
    await c.start()
    try:
        await c.add("p0", "prefill", fail_prefill=True)
        await c.add("p1", "prefill")
        await c.add("d0", "decode")
        c.service.registry.engines["p1"].load = type(c.service.registry.engines["p1"].load)(num_running=9)
        _, done = await c.generate(list(range(40)), max_tokens=3)
        assert done.prefill_engine_id == "p1"
        await no_leaks(c)
    finally:
        await c.stop()


async def test_client_cancel_aborts_both_legs_and_releases(cluster: Cluster) -> None:
    p = await cluster.add("p0", "prefill")
    d = await cluster.add("d0", "decode", token_delay_s=0.05)
    req = pb.GenerateRequest(request_id="cancel-me", token_ids=pb.TokenIds(ids=list(range(40))),
                             sampling=pb.SamplingParams(max_tokens=200))
    call = cluster.stub.Generate(req, timeout=10)
    seen = 0
    async for resp in call:
        seen += len(resp.chunk.token_ids)
        if seen >= 3:
            call.cancel()
            break
    engine_id = d.decode_requests[0].request_id
    assert engine_id.startswith("cancel-me.")  # engines see a scheduler-unique id
    await eventually(lambda: engine_id in d.aborted)
    await eventually(lambda: engine_id in p.released and not p.pinned)
    await no_leaks(cluster)
    assert cluster.service.table.outcomes["aborted:cancelled"] == 1


async def test_deadline_exceeded_aborts(cluster: Cluster) -> None:
    await cluster.add("p0", "prefill")
    d = await cluster.add("d0", "decode", token_delay_s=0.05)
    with pytest.raises(grpc.aio.AioRpcError, match="DEADLINE_EXCEEDED") as e:
        await cluster.generate(list(range(40)), timeout=0.5, max_tokens=200)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: len(d.aborted) == 1)
    await no_leaks(cluster)


BAD: list[tuple[Callable[[pb.GenerateRequest], None], str]] = [
    (lambda r: r.ClearField("token_ids"), "prompt missing"),
    (lambda r: r.token_ids.ClearField("ids"), "empty prompt"),
    (lambda r: setattr(r, "text", ""), "empty prompt"),
    (lambda r: r.token_ids.ids.append(1000), "outside the vocabulary"),
    (lambda r: r.token_ids.ids.append(-1), "outside the vocabulary"),
    (lambda r: r.token_ids.ids.extend([1] * 600), "prompt has"),
    (lambda r: setattr(r.sampling, "max_tokens", 0), "max_tokens"),
    (lambda r: setattr(r.sampling, "max_tokens", -5), "max_tokens"),
    (lambda r: setattr(r.sampling, "max_tokens", 510), "exceeds the model's maximum length"),
    (lambda r: setattr(r.sampling, "temperature", -1.0), "temperature"),
    (lambda r: setattr(r.sampling, "temperature", float("nan")), "temperature"),
    (lambda r: setattr(r.sampling, "top_p", 0.0), "top_p"),
    (lambda r: setattr(r.sampling, "top_p", 1.5), "top_p"),
    (lambda r: setattr(r.sampling, "top_k", -1), "top_k"),
    (lambda r: r.sampling.stop_token_ids.append(5000), "stop token id"),
    (lambda r: r.sampling.stop.append(""), "stop"),
    (lambda r: setattr(r, "chat", True), "chat applies to a text prompt"),
    (lambda r: setattr(r, "request_id", "x" * 300), "request_id"),
]


@pytest.mark.parametrize("mutate, match", BAD)
async def test_bad_input_is_invalid_argument_and_changes_nothing(cluster: Cluster, mutate: Callable[..., None],
                                                                 match: str) -> None:
    await cluster.add("d0", "decode")
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]))
    mutate(req)
    with pytest.raises(grpc.aio.AioRpcError, match="INVALID_ARGUMENT") as e:
        async for _ in cluster.stub.Generate(req, timeout=5):
            pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in (e.value.details() or "")
    assert cluster.service.router.decisions == {}
    # The server closes its count of the stream after the client has seen the status.
    await eventually(lambda: cluster.service.leaks() == [])


async def test_unknown_model_no_engine_and_full_engine(cluster: Cluster) -> None:
    with pytest.raises(grpc.aio.AioRpcError, match="UNAVAILABLE") as e:
        await cluster.generate([1, 2, 3])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    await cluster.add("d0", "decode", token_delay_s=0.2)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), model="other")
    with pytest.raises(grpc.aio.AioRpcError, match="NOT_FOUND") as e:
        async for _ in cluster.stub.Generate(req):
            pass
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    cluster.service.admission.max_inflight_per_engine = 1
    first = asyncio.ensure_future(cluster.generate([1, 2, 3], max_tokens=3))
    await eventually(lambda: cluster.service.admission.total() == 1)
    with pytest.raises(grpc.aio.AioRpcError, match="RESOURCE_EXHAUSTED") as e:
        await cluster.generate([1, 2, 3])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await first
    await no_leaks(cluster)


async def test_server_info_and_models(cluster: Cluster) -> None:
    await cluster.add("p0", "prefill")
    await cluster.add("d0", "decode")
    info = await cluster.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert (info.model, info.vocab_size, info.num_prefill_engines, info.num_decode_engines) == ("scripted", 1000, 1, 1)
    models = await cluster.stub.ListModels(pb.ListModelsRequest())
    assert [m.name for m in models.models] == ["scripted"]


async def test_hung_decode_engine_is_declared_dead_and_its_request_migrates() -> None:
    c = Cluster(heartbeat_timeout_s=0.3)
    await c.start()
    try:
        await c.add("p0", "prefill")
        hung = await c.add("d0", "decode", token_delay_s=0.05)
        spare = await c.add("d1", "decode")
        c.service.registry.engines["d1"].load = type(c.service.registry.engines["d1"].load)(num_running=5)
        task = asyncio.ensure_future(c.generate(list(range(40)), max_tokens=40))
        await eventually(lambda: len(hung.decode_requests) == 1)
        assert hung.client is not None
        await asyncio.to_thread(hung.client.close)  # the engine stops heartbeating; its stream still "runs"
        chunks, done = await task
        tokens, _ = tokens_and_indices(chunks)
        assert tokens == [BASE + i for i in range(40)]
        assert (done.decode_engine_id, done.num_migrations) == ("d1", 1)
        assert spare.decode_requests and len(spare.decode_requests[0].output_token_ids) >= 1
        await no_leaks(c)
    finally:
        await c.stop()


async def test_text_and_chat_prompts_use_the_model_tokenizer() -> None:
    from engine.demo_model import demo_model_dir
    from services.scheduler.tokenization import PromptTokenizer

    tokenizer = PromptTokenizer(demo_model_dir())
    config = load_config(SchedulerConfig, env={}, overrides={"port": 0, "control_port": 0, "events_port": 0,
                                                            "routing_policy": "load", "default_max_tokens": 2})
    service = SchedulerService(config, model_dir=demo_model_dir(), sink=RecordingEventSink())
    await service.start()
    engine = ScriptedEngine("d0", "decode", service.control_port)
    await engine.start()
    try:
        async with insecure_channel(f"127.0.0.1:{service.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for chat in (False, True):
                req = pb.GenerateRequest(text="Hello there", chat=chat)
                [r async for r in stub.Generate(req, timeout=10)]
            info = await stub.GetServerInfo(pb.GetServerInfoRequest())
        plain, chat_ids = (list(r.prompt_token_ids) for r in engine.decode_requests)
        assert plain == tokenizer.encode("Hello there")
        assert chat_ids == tokenizer.encode(tokenizer.render_chat("Hello there")) and len(chat_ids) > len(plain)
        assert info.vocab_size == 49152 and info.max_model_len == 8192
    finally:
        await engine.stop()
        await service.stop(0)


async def test_health_serving_and_drain_refuses_new_work() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    c = Cluster()
    await c.start()
    try:
        await c.add("d0", "decode", token_delay_s=0.02)
        async with insecure_channel(f"127.0.0.1:{c.service.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="pdserve.v1.Generation")
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
            running = asyncio.ensure_future(c.generate([1, 2, 3], max_tokens=10))
            await eventually(lambda: len(c.service.generation.table) > 0)
            drained = asyncio.ensure_future(c.service.drain(5.0))
            await eventually(lambda: c.service.generation.draining)
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError, match="UNAVAILABLE") as e:
                await c.generate([1, 2, 3])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            chunks, _ = await running  # the in-flight request finishes
            assert len(tokens_and_indices(chunks)[0]) == 10
            assert await drained
    finally:
        await c.stop()


async def test_engine_events_reach_event_plane_subscribers() -> None:
    from connectors.kv_events import BlockStored, KVEventBatch
    from pdserve.v1 import kv_events_pb2, kv_events_pb2_grpc
    from services.engine.control_client import StepReport

    config = load_config(SchedulerConfig, env={}, overrides={"port": 0, "control_port": 0, "events_port": 0})
    service = SchedulerService(config, facts=FACTS)  # the real event plane and prefix policy
    await service.start()
    engine = ScriptedEngine("p0", "prefill", service.control_port)
    await engine.start()
    try:
        assert engine.client is not None
        stored = BlockStored(block_hashes=(7,), parent_block_hash=None, token_ids=tuple(range(16)), block_size=16,
                             medium="CPU")
        seq = engine.client.report(StepReport(engine_events=KVEventBatch(ts=2.0, events=[stored])))
        assert await asyncio.to_thread(engine.client.wait_acked, seq)
        async with insecure_channel(f"127.0.0.1:{service.events_port}") as channel:
            stream = kv_events_pb2_grpc.KVEventsStub(channel).Subscribe(kv_events_pb2.SubscribeRequest(from_seq=0))
            async for msg in stream:
                if msg.WhichOneof("payload") == "batch" and msg.batch.events:
                    assert (msg.batch.engine_id, msg.batch.epoch) == ("p0", engine.epoch)
                    assert list(msg.batch.events[0].block_stored.block_hashes) == [7]
                    break
            stream.cancel()
        assert service.router.policy.name != "load"
    finally:
        await engine.stop()
        await service.stop(0)


async def test_path_policy_decides_per_request_and_reports_why() -> None:
    """Cost path policy through the servicer: a short prompt is prefilled on the decode engine,
    a long one remotely; the reason reaches Complete and the metrics; the backlog and ITL-target
    books balance after the requests (no_leaks)."""
    c = Cluster(path_policy="cost", path_decode_stall_budget_ms=50.0)  # prior 200 us/token: 250 tokens
    await c.start()
    try:
        await c.add("p0", "prefill")
        d = await c.add("d0", "decode")
        _, short = await c.generate(list(range(10)), max_tokens=3, itl_target_ms=500.0)
        assert (short.prefill_engine_id, short.path_reason) == ("", "decode_local:short_prompt")
        assert not d.decode_requests[0].HasField("descriptor") and short.usage.transferred_tokens == 0
        _, long = await c.generate(list(range(400)), max_tokens=3, ttft_target_ms=10_000.0)
        assert (long.prefill_engine_id, long.path_reason) == ("p0", "remote:long_prompt")
        assert long.usage.transferred_tokens == 400
        sample = c.prometheus.get_sample_value
        for path, reason in (("decode_local", "decode_local:short_prompt"), ("remote", "remote:long_prompt")):
            assert sample("pdserve_scheduler_path_decisions_total", {"path": path, "reason": reason}) == 1
        assert sample("pdserve_scheduler_transferred_tokens_total") == 400
        assert sample("pdserve_scheduler_decode_only_total", {"reason": "short_prompt"}) == 1
        # Each decision's predicted TTFT (both paths) beside the actual one, fed back per engine.
        for done in (short, long):
            assert done.predicted_ttft_ms > 0 and done.HasField("alternative_ttft_ms") and done.ttft_ms > 0, done
        for path in ("decode_local", "remote"):
            assert sample("pdserve_scheduler_path_ttft_prediction_error_ratio_count", {"path": path}) == 1
        costs = c.service.router.path.costs
        assert {k: v.num_samples for k, v in costs.corrections.items()} == {("d0", "decode_local"): 1,
                                                                           ("p0", "remote"): 1}
        await no_leaks(c)
    finally:
        await c.stop()


@pytest.mark.parametrize("field", ["ttft_target_ms", "itl_target_ms"])
async def test_latency_targets_must_be_positive(cluster: Cluster, field: str) -> None:
    await cluster.add("p0", "prefill")
    await cluster.add("d0", "decode")
    with pytest.raises(grpc.aio.AioRpcError, match=f"{field} must be a positive number") as e:
        await cluster.generate(list(range(10)), max_tokens=3, **{field: -5.0})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert cluster.service.router.paths == {} and cluster.service.router.path.costs.leaks() == []


async def test_request_end_drops_transfer_counters_only_on_its_engines(cluster: Cluster) -> None:
    await cluster.add("p0", "prefill")
    d0 = await cluster.add("d0", "decode")
    await cluster.add("d9", "decode")  # idle: the tie goes to d0
    _, done = await cluster.generate(list(range(40)), max_tokens=2)
    assert done.decode_engine_id == "d0"
    await no_leaks(cluster)
    rid = d0.decode_requests[0].request_id
    states = cluster.service.control.aggregator._engines
    assert rid in states["p0"].sending.done and rid in states["d0"].recving.done  # late reports absorbed
    assert all(rid not in c.done for c in (states["d9"].sending, states["d9"].recving))  # O(its engines), not O(all)
