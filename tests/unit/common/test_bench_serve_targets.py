"""`bench serve --compare-paths` sends its goodput SLOs as every request's own TTFT / ITL targets:
the workload is driven through the real gRPC client against an in-process Generation server
(127.0.0.1:0) that records what arrived on the wire; goodput counts requests within both."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

from bench import serve
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.generation_stub import serving


class RecordingGeneration(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.Chunk(token_ids=[7, 8], index=0))
        yield pb.GenerateResponse(request_id=request.request_id, complete=pb.Complete(
            finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=3, generated_tokens=2)))


async def _drive_recorded(wl: serve.Workload) -> list[pb.GenerateRequest]:
    servicer = RecordingGeneration()
    async with serving(servicer) as target:
        await serve._drive(target, wl, 2, 0.0)
    return servicer.requests


def test_targets_travel_with_every_request_and_only_when_set() -> None:
    wl = serve.Workload([[101, 102, 103]] * 3, [2] * 3, ttft_target_ms=2000.0, itl_target_ms=200.0)
    got = asyncio.run(_drive_recorded(wl))
    assert len(got) == 3
    for r in got:
        assert r.sampling.HasField("ttft_target_ms") and r.sampling.ttft_target_ms == 2000.0
        assert r.sampling.HasField("itl_target_ms") and r.sampling.itl_target_ms == 200.0
    plain = asyncio.run(_drive_recorded(serve.Workload([[101, 102, 103]], [2])))
    assert not plain[0].sampling.HasField("ttft_target_ms") and not plain[0].sampling.HasField("itl_target_ms")


def test_compare_paths_sends_the_slos_as_targets(monkeypatch: Any) -> None:
    seen: list[serve.Workload] = []

    def fake_mode(name: str, args: argparse.Namespace, wl: serve.Workload, **cluster: Any) -> dict[str, Any]:
        seen.append(wl)
        return {"ttft_ms": {"p90": 1.0}, "throughput_tok_s": 1.0, "goodput_req_s": 1.0, "transferred_tokens": 0,
                "decisions": {}, "ttft_prediction_error": {"p50": 0.1}}

    monkeypatch.setattr(serve, "_run_mode", fake_mode)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--compare-paths", "--slo-ttft-ms", "1500", "--slo-itl-ms", "120"])
    report = serve._compare_paths(args, serve.Workload([[1, 2]], [2]))
    assert [(w.ttft_target_ms, w.itl_target_ms) for w in seen] == [(1500.0, 120.0)] * 2
    assert report["targets_ms"] == {"ttft": 1500.0, "itl": 120.0}
