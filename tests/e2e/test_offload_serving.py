"""The CPU offload tier in the engine services, end to end: a cluster whose engines have a tiny
device KV cache (8 blocks) and a `--kv-offload-memory` tier. A prompt pushed out of the prefill
engine's device cache is served from the tier on its next request (its prompt blocks count as
cached although the decode engine has none of them, and the greedy output is the same), and the
tier's CPU_OFFLOAD events reach a KVEvents subscriber through the ranks' control streams."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from e2e_cluster import start_cluster

from connectors.hashing import DEFAULT_HASH_SEED, BlockHasher, to_external
from connectors.kv_events import MEDIUM_CPU, MEDIUM_CPU_OFFLOAD, BlockRemoved, BlockStored, event_from_proto
from pdserve.v1 import kv_events_pb2 as ev_pb
from pdserve.v1 import kv_events_pb2_grpc as ev_grpc
from services.client import AsyncClient, GenerationResult

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
PROMPT_LEN = 4 * BLOCK + 6  # 4 full blocks + 6 tokens: 5 device blocks with the generated ones
# SmolLM2-135M in float32: 30 layers x 2 x 3 heads x 16 tokens x 64 x 4 B = 720 KiB per block.
DEVICE_KV = "6MiB"  # 8 blocks
# tests/e2e/conftest.py's tiny_tp_model at tp 2: 2 layers x 2 x 1 head x 16 x 32 x 4 B = 8 KiB per block and rank.
TINY_DEVICE_KV = "64KiB"  # 8 blocks


def _generate(target: str, prompt: list[int], max_tokens: int = 6) -> GenerationResult:
    async def go() -> GenerationResult:
        async with AsyncClient(target) as client:
            return await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                         timeout=60)

    return asyncio.run(go())


def _long_prompt(prompts: list[list[int]], start: int) -> list[int]:
    tokens: list[int] = []
    i = start
    while len(tokens) < PROMPT_LEN:
        tokens += prompts[i % len(prompts)]
        i += 1
    return tokens[:PROMPT_LEN]


class _Subscriber:
    """Collects every (engine_id, event) of the cluster's KVEvents stream on a thread."""

    def __init__(self, target: str) -> None:
        self.events: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(target)
        self._call = ev_grpc.KVEventsStub(self._channel).Subscribe(ev_pb.SubscribeRequest())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for msg in self._call:
                if msg.WhichOneof("payload") == "batch":
                    with self._lock:
                        self.events += [(msg.batch.engine_id, event_from_proto(e)) for e in msg.batch.events]
        except grpc.RpcError:
            pass  # cancelled by close()

    def wait_for(self, what: str, predicate: Any, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if any(predicate(engine, e) for engine, e in self.events):
                    return
            time.sleep(0.05)
        raise AssertionError(f"no KV event {what} within {timeout}s; got {len(self.events)} events")

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)
        self._channel.close()


def test_prompt_evicted_from_device_is_served_from_the_cpu_tier(
        tmp_path_factory: pytest.TempPathFactory, prompts: list[list[int]]) -> None:
    _evict_and_reload(tmp_path_factory, prompts, "offload", device_kv=DEVICE_KV)


def test_tp2_every_rank_offloads_its_shard(tmp_path_factory: pytest.TempPathFactory, prompts: list[list[int]],
                                           tiny_tp_model: Path) -> None:
    """tp 2: each rank stores its heads in its own pool and reports on its own control stream;
    the tier's BlockStored is published once both ranks stored, and loads restore both shards."""
    _evict_and_reload(tmp_path_factory, prompts, "offload-tp2", device_kv=TINY_DEVICE_KV, tp=2,
                      model=str(tiny_tp_model))


def _evict_and_reload(tmp_path_factory: pytest.TempPathFactory, prompts: list[list[int]], name: str, *,
                      device_kv: str, **spec: Any) -> None:
    c = start_cluster(tmp_path_factory, name,
                      engine_args=["--kv-cache-memory", device_kv, "--kv-offload-memory", "64MiB"], **spec)
    sub = _Subscriber(c.events_target)
    try:
        prompt = _long_prompt(prompts, 0)
        hashes = [to_external(h) for h in BlockHasher(BLOCK, DEFAULT_HASH_SEED).hash_blocks(prompt)]
        assert len(hashes) == 4
        first = _generate(c.target, prompt)
        assert first.prefill_engine_id == "prefill-0"

        # Every rank stored the prompt's full blocks in the tier: the event plane publishes them.
        def offloaded(engine: str, e: Any) -> bool:
            return (engine == "prefill-0" and isinstance(e, BlockStored) and e.medium == MEDIUM_CPU_OFFLOAD
                    and set(hashes) <= set(e.block_hashes))

        sub.wait_for("CPU_OFFLOAD BlockStored of the prompt", offloaded)

        # Three other prompts of 5 blocks each push the prompt out of both 8-block device caches.
        for start in (3, 7, 11):
            _generate(c.target, _long_prompt(prompts, start))

        def evicted(engine: str, e: Any) -> bool:
            return (engine == "prefill-0" and isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU
                    and hashes[0] in e.block_hashes)

        sub.wait_for("device BlockRemoved of the prompt's first block", evicted)

        again = _generate(c.target, prompt)
        assert again.token_ids == first.token_ids
        # The decode engine had nothing cached (it pulled every full block), so the cached
        # tokens are the prefill engine's: loaded from the tier, not computed.
        assert again.transferred_tokens >= 4 * BLOCK, again
        assert again.cached_tokens == 4 * BLOCK, again
        assert first.cached_tokens == 0, first
        assert c.wait_no_leaks() == {}
    finally:
        sub.close()
        c.stop()
