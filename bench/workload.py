"""Shared pieces of the serving benchmarks (`bench serve`, `bench chaos`, `bench load`): random
token prompts, greedy reference outputs from the in-process engine, one checked streaming
request, percentiles, and the peak memory of a component's processes.

`stream_checked` is the client every chaos and load run uses. Contract:
- Every chunk's `index` must equal the number of tokens received so far (across resumes too);
  a repeat or a gap is recorded in `StreamOutcome.index_errors`, never silently repaired.
- The call carries no gRPC deadline: the scheduler's own deadline must answer. A stream that
  sends neither Complete nor a status within `answer_timeout_s` is LOST (the server hung).
- A status in `retry_codes` (UNAVAILABLE: the scheduler restarted, no engine yet) is retried
  while the client's budget lasts, resuming where the stream stopped: the new request's prompt
  is the original prompt plus every token received, for the tokens still missing. The pause
  before retry k is `retry_backoff_s` · 2^k, capped at `retry_backoff_max_s` (default: no
  growth), jittered ±50 %.
- Given a target address instead of a client, every attempt opens its own channel, so a retry
  right after a scheduler restart is not held back by a shared channel's reconnect backoff.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.v1 import generation_pb2 as gen_pb
from services.client import FINISH_REASONS, AsyncClient, build_request

LOST = "LOST"  # StreamOutcome.status of a request that was never answered
OK = "OK"


@dataclass(slots=True)
class StreamOutcome:
    """What one client request saw. `status` is OK, a gRPC status code name, or LOST."""

    request_id: str
    prompt_index: int
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    status: str = LOST
    detail: str = ""
    finish_reason: str | None = None
    index_errors: list[str] = field(default_factory=list)
    num_resumes: int = 0
    num_retried_statuses: dict[str, int] = field(default_factory=dict)
    num_migrations: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    # How many tokens the stream had at each resume (a retry after tokens arrived).
    resumed_at: list[int] = field(default_factory=list)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 (nearest rank), rounded to 2 decimals; zeros for no values."""
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(values)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

    return {"p50": round(q(0.5), 2), "p90": round(q(0.9), 2), "p99": round(q(0.99), 2)}


def random_prompts(seed: int, count: int, min_len: int, max_len: int, vocab_size: int) -> list[list[int]]:
    """`count` prompts of uniform random length and tokens (ids >= 100: no special tokens)."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"prompt lengths must satisfy 1 <= min <= max, got {min_len}..{max_len}")
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def model_vocab_size(model: str) -> int:
    import json

    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


# Streams are checked token for token against the in-process engine: both run in float32, where
# batching cannot flip a greedy choice (bf16 rounding can).
REFERENCE_DTYPE = "float32"


def greedy_reference(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs (ignore_eos) of the in-process engine: what every served stream must equal."""
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLMEngine(model, torch_threads=1, dtype=REFERENCE_DTYPE) as engine:
        return [list(out) for out in engine.generate(prompts, params)]


async def stream_checked(client: AsyncClient | str, prompt: list[int], max_tokens: int, *, prompt_index: int = 0,
                         request_id: str = "", answer_timeout_s: float = 120.0, budget_s: float = 120.0,
                         retry_codes: Collection[grpc.StatusCode] = (grpc.StatusCode.UNAVAILABLE,),
                         retry_backoff_s: float = 0.25, retry_backoff_max_s: float | None = None) -> StreamOutcome:
    """Streams one greedy request to its end (see the module docstring); never raises for a
    server-side outcome."""
    out = StreamOutcome(request_id, prompt_index, max_tokens)
    start = time.perf_counter()
    attempt = 0
    while True:
        remaining = max_tokens - len(out.token_ids)
        if remaining <= 0:  # every token arrived, only the Complete was cut off: nothing to resume
            out.status, out.finish_reason = OK, "length"
            break
        req = build_request(prompt + out.token_ids, max_tokens=remaining, temperature=0.0, ignore_eos=True,
                            request_id=f"{request_id}.{attempt}" if request_id else "")
        try:
            done = await asyncio.wait_for(_attempt(client, req, out, start), answer_timeout_s)
        except TimeoutError:
            out.status, out.detail = LOST, f"no answer within {answer_timeout_s:.0f} s"
            break
        except grpc.aio.AioRpcError as e:
            code = e.code()
            backoff = min(retry_backoff_s * 2 ** attempt, retry_backoff_max_s or retry_backoff_s)
            if code in retry_codes and time.perf_counter() - start + backoff < budget_s:
                out.num_retried_statuses[code.name] = out.num_retried_statuses.get(code.name, 0) + 1
                if out.token_ids:
                    out.num_resumes += 1
                    out.resumed_at.append(len(out.token_ids))
                attempt += 1
                await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
                continue
            out.status, out.detail = code.name, e.details() or ""
            break
        out.status = OK if done else LOST
        if not done:
            out.detail = "the stream ended without a Complete message"
        break
    out.e2e_s = time.perf_counter() - start
    return out


async def _attempt(client: AsyncClient | str, req: gen_pb.GenerateRequest, out: StreamOutcome,
                   start: float) -> bool:
    if isinstance(client, AsyncClient):
        return await _one_stream(client, req, out, start)
    async with AsyncClient(client) as fresh:
        return await _one_stream(fresh, req, out, start)


async def _one_stream(client: AsyncClient, req: gen_pb.GenerateRequest, out: StreamOutcome, start: float) -> bool:
    """One attempt; True when it ended with a Complete message."""
    base = len(out.token_ids)
    async for resp in client.stream_raw(req):
        now = time.perf_counter() - start
        if resp.WhichOneof("payload") == "chunk":
            c = resp.chunk
            expected = len(out.token_ids) - base
            if c.index != expected:
                out.index_errors.append(f"chunk index {base + c.index}, expected {base + expected}")
            if out.ttft_s is None and c.token_ids:
                out.ttft_s = now
            out.token_ids.extend(c.token_ids)
            out.token_times_s.extend([now] * len(c.token_ids))
        else:
            out.finish_reason = FINISH_REASONS.get(resp.complete.finish_reason)
            out.num_migrations += resp.complete.num_migrations
            return True
    return False


def token_errors(out: StreamOutcome, expected: list[int]) -> list[str]:
    """What is wrong with the tokens a request received: index gaps or repeats, and tokens that
    differ from the greedy reference (all of them for a completed request, a prefix otherwise)."""
    errors = list(out.index_errors)
    got = out.token_ids
    want = expected if out.status == OK else expected[:len(got)]
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        errors.append(f"{len(got)} tokens, expected {len(want)}; first difference at position {first}")
    return errors


def process_group_pids(pgid: int) -> list[int]:
    """Live processes of a process group (a component and the rank processes it spawned)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def status_kib(pid: int, key: str) -> int | None:
    """A `/proc/<pid>/status` memory line (VmHWM, VmRSS) in KiB; None when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
