"""`bench serve --compare-kv-reuse --workload multi-turn` (bench/kv_reuse.py) at tiny sizes: the
conversations are driven through the real gRPC client against an in-process Generation server
(127.0.0.1:0) that records each prompt and answers as engines would; each follow-up turn is the
previous prompt, its answer and a new message, and `turn_placement` tells turns computed away
from their history's engine. Bad arguments end the run before any cluster starts."""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bench import kv_reuse
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.generation_stub import serving


class AlternatingEngines(pb_grpc.GenerationServicer):
    """Answers two tokens; request k is prefilled on prefill-(k % 2) and decoded on decode-0, so
    every follow-up turn is computed away from the engine that decoded the turn before."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.count = itertools.count()

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        k = next(self.count)
        self.prompts.append(list(request.token_ids.ids))
        yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.Chunk(token_ids=[7, 8], index=0))
        yield pb.GenerateResponse(request_id=request.request_id, complete=pb.Complete(
            finish_reason=pb.FINISH_REASON_LENGTH, prefill_engine_id=f"prefill-{k % 2}", decode_engine_id="decode-0",
            usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), generated_tokens=2)))


def _args(**kw: Any) -> argparse.Namespace:
    base = dict(seed=0, conversations=2, turns=4, prompt_len="20:30", output_len="2:2", workload="multi-turn")
    return argparse.Namespace(**{**base, **kw})


async def _drive(convs: list[Any]) -> tuple[list[Any], list[list[int]]]:
    servicer = AlternatingEngines()
    async with serving(servicer) as target:
        results, _ = await kv_reuse._drive_conversations(target, convs)
    return results, servicer.prompts


def test_each_turn_carries_the_history_and_placement_is_reported() -> None:
    convs = kv_reuse._conversations(_args(), 1000)
    results, prompts = asyncio.run(_drive(convs))
    assert len(results) == 8 and all(r is not None for r in results)
    first, messages, _ = convs[0]
    by_prompt = {tuple(p) for p in prompts}
    history = first
    for message in messages:  # each follow-up = the previous prompt + its answer + a new message
        history = history + [7, 8] + message
        assert tuple(history) in by_prompt
    placement = kv_reuse.turn_placement(results, 4)
    assert placement["turns_away"] == 1.0  # every follow-up was prefilled on a prefill engine
    assert placement["history_tokens"]["max"] == max(r.prompt_tokens for r in results)


def test_turns_on_their_historys_engine_are_not_away() -> None:
    results, _ = asyncio.run(_drive(kv_reuse._conversations(_args(conversations=1), 1000)))
    for r in results:  # decode-local on the engine that decoded the turn before
        r.prefill_engine_id = ""
    assert kv_reuse.turn_placement(results, 4)["turns_away"] == 0.0
    results[2] = None  # a lost turn counts neither way
    assert kv_reuse.turn_placement(results, 4)["turns_away"] == 0.0


@pytest.mark.parametrize("bad", [{"turns": 3}, {"conversations": 0}])
def test_bad_multi_turn_arguments_are_refused_before_a_cluster_starts(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="multi-turn"):
        kv_reuse.compare_kv_reuse(_args(**bad), 1000)
