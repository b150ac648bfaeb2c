"""Shared pieces of the end-to-end tests: prompts and a cluster starter."""

from __future__ import annotations

import os

import pytest

from services.local_cluster import ClusterSpec, LocalCluster

MAX_TOKENS = 12
PROMPT_TEXTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "List three primary colors:",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Water boils at",
    "In 1492, Columbus",
    "A haiku about the sea:",
    "Translate to French: good morning",
    "The meaning of life is",
    "KV caches store the keys and values of attention so that",
    "Question: what is 2 + 2? Answer:",
    "import numpy as np\nx = np.",
    "The largest planet in the solar system",
    "Roses are red, violets are blue,",
    "Explain disaggregated serving in one sentence:",
    "1, 2, 3, 4, 5,",
    "The first law of thermodynamics states",
    "My favourite programming language is",
    "Dear team, I am writing to let you know that " * 2,
]


def start_cluster(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs: object) -> LocalCluster:
    """A started cluster. The scheduler prefills every prompt remotely (`--path-policy remote`:
    these tests exercise the disaggregated path) unless `scheduler_args` names a path policy."""
    log_dir = tmp_path_factory.mktemp(name)
    kwargs.setdefault("dtype", "float32")  # outputs are compared with the in-process engine's, in float32
    scheduler_args = list(kwargs.pop("scheduler_args", []))  # type: ignore[call-overload]
    if "--path-policy" not in scheduler_args:
        scheduler_args += ["--path-policy", "remote"]
    kwargs["scheduler_args"] = scheduler_args
    spec = ClusterSpec(log_dir=str(log_dir), torch_threads=1, kv_cache_memory="64MiB",
                       env={"PDSERVE_TRANSFER_TIMEOUT_S": "3"}, **kwargs)  # type: ignore[arg-type]
    cluster = LocalCluster(spec)
    cluster.start(timeout=float(os.environ.get("PDSERVE_E2E_START_TIMEOUT", "240")))
    return cluster


def wait_for_block(c: LocalCluster, engine: str, block_hash: int, timeout: float = 60.0) -> None:
    """Waits until the event plane republished `engine` storing `block_hash` (the prefix index
    then knows the holder)."""
    import grpc

    from pdserve.v1 import kv_events_pb2 as pb
    from pdserve.v1 import kv_events_pb2_grpc as pb_grpc

    request = pb.SubscribeRequest(from_seq=0, engine_ids=[engine])
    with grpc.insecure_channel(c.events_target) as channel:
        for msg in pb_grpc.KVEventsStub(channel).Subscribe(request, timeout=timeout):
            if msg.WhichOneof("payload") == "batch" and any(
                    block_hash in e.block_stored.block_hashes for e in msg.batch.events):
                return
    raise AssertionError(f"{engine} never reported block {block_hash:#x}")
