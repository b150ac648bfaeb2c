"""Shared pieces of the vLLM cluster tests (test_vllm_serving.py, test_vllm_tp.py): the cluster
starter, the colocated greedy reference and a greedy client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import engine_pb2, engine_pb2_grpc, generation_pb2
from services.client import AsyncClient, GenerationResult
from services.local_cluster import ClusterSpec, LocalCluster

BLOCK = 32  # vLLM's CPU attention takes multiples of 32, on the scheduler as on the engines


@contextmanager
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory, name: str, *, kv_cache_memory: str,
                 scheduler_args: list[str], max_model_len: int, max_num_seqs: int,
                 transfer_timeout_s: float = 5.0, dtype: str = "float32",
                 vllm_args: tuple[str, ...] = ("enforce_eager=true",), **spec: object) -> Iterator[LocalCluster]:
    """A started cluster of vLLM engines (fp32, eager, block size `BLOCK`, one torch thread, a 5 s
    transfer timeout unless given; `vllm_args=()` leaves vLLM's compile setting to pdserve's
    default), stopped at exit; `spec` is the rest of the `ClusterSpec`."""
    cluster_spec = ClusterSpec(
        log_dir=str(tmp_path_factory.mktemp(name)), engine="vllm", kv_cache_memory=kv_cache_memory,
        torch_threads=1, scheduler_args=["--block-size", str(BLOCK), *scheduler_args],
        engine_args=["--block-size", str(BLOCK), "--dtype", dtype, "--max-model-len", str(max_model_len),
                     "--max-num-seqs", str(max_num_seqs), "--transfer-timeout-s", str(transfer_timeout_s)],
        vllm_args=list(vllm_args),
        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"},
        **spec)  # type: ignore[arg-type]
    c = LocalCluster(cluster_spec)
    try:
        c.start(timeout=float(os.environ.get("PDSERVE_VLLM_START_TIMEOUT", "900")))
        yield c
    finally:
        c.stop()


def colocated(c: LocalCluster, prompt: list[int], max_tokens: int, name: str = "decode-0") -> list[int]:
    """vLLM colocated greedy: the decode engine `name` computes the prompt itself (an
    `Engine.Decode` without a descriptor)."""
    address = c.components[name].address
    assert address
    stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(address))
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = engine_pb2.DecodeRequest(request_id=f"ref-{time.monotonic_ns()}", prompt_token_ids=prompt,
                                       sampling=sampling)
    return [t for response in stub.Decode(request, timeout=300) for t in response.token_ids]


def offline_greedy(model: Path, dtype: str, prompts: list[list[int]], tmp_path: Path, *, max_tokens: int,
                   max_model_len: int, tp: int = 1) -> list[list[int]]:
    """vLLM offline (`vllm.LLM`) greedy with pdserve's CPU settings (eager, block size `BLOCK`,
    prefix caching), each prompt alone, in a process of its own (offline_reference.py)."""
    return offline_greedy_dtypes(model, [dtype], prompts, tmp_path, max_tokens=max_tokens,
                                 max_model_len=max_model_len, tp=tp)[dtype]


def offline_greedy_dtypes(model: Path, dtypes: list[str], prompts: list[list[int]], tmp_path: Path, *,
                          max_tokens: int, max_model_len: int, tp: int = 1) -> dict[str, list[list[int]]]:
    """`offline_greedy` in each of `dtypes`, by dtype, from one process (one vLLM import)."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(model), "dtypes": dtypes, "tp": tp, "max_tokens": max_tokens,
                                "max_model_len": max_model_len, "prompts": prompts, "vllm": {"enforce_eager": True}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("offline_reference.py")), str(spec)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    marker = "pdserve-offline-reference: "
    lines = [line for line in done.stdout.splitlines() if line.startswith(marker)]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    answers: dict[str, list[list[int]]] = json.loads(lines[-1][len(marker):])
    return answers


def generate_greedy(target: str, prompts: list[list[int]], max_tokens: int, *, concurrency: int) -> list[GenerationResult]:
    """Every prompt through the scheduler at `target`, greedy to `max_tokens` (`ignore_eos`),
    `concurrency` at a time; results in prompt order."""
    async def run() -> list[GenerationResult]:
        gate = asyncio.Semaphore(concurrency)
        async with AsyncClient(target) as client:
            async def one(prompt: list[int]) -> GenerationResult:
                async with gate:
                    return await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                 timeout=300)

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(run())


# pdserve's own lines (its log format) at WARNING or above, and the bare lines of pdserve loggers in
# vLLM's worker processes (no handler there: Python's last-resort handler prints the message alone).
_PDSERVE_PROBLEM = re.compile(r"^\S+ \S+ (WARNING|ERROR|CRITICAL) \[|^(cannot |request .* failed|rank .* (down|lost))")
_NOISE = ("PLAINTEXT gRPC", "UNAUTHENTICATED", "Triton")


def log_problems(c: LocalCluster, limit: int = 40) -> str:
    """The last `limit` warnings pdserve itself logged in each component's log (the scheduler's
    engine-down reasons, the connectors' failed pulls): what an assertion message should carry
    when a transfer did not happen, since CI keeps no log files."""
    out = []
    for name, comp in c.components.items():
        if comp.log_path is None or not comp.log_path.exists():
            continue
        lines = [line for line in comp.log_path.read_text(errors="replace").splitlines()
                 if _PDSERVE_PROBLEM.search(line) and not any(n in line for n in _NOISE)]
        if lines:
            out.append(f"--- {name} ({len(lines)} lines, the last {min(limit, len(lines))})")
            out.extend(lines[-limit:])
    return "\n".join(out) or "(no pdserve warnings in the component logs)"
