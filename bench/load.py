"""`pdserve bench load`: many concurrent streaming clients against a local cluster.

`--clients` clients (default 1,000) each open one greedy streaming request at the same moment
(they share `--channels` gRPC connections). Requests beyond the scheduler's admission bound
(`--max-queue-per-engine` in flight per engine) are answered RESOURCE_EXHAUSTED; such a client
backs off exponentially (0.5 s doubling to 8 s, jittered) and retries within `--deadline`, as a
well-behaved client does, so every client should end with its full answer. Any other status, a lost stream or a token error (against the greedy
output of the in-process engine) is a failure.

Reports throughput, TTFT / inter-token / end-to-end percentiles, how many requests were turned
away with RESOURCE_EXHAUSTED, and the peak RSS (VmHWM) of the scheduler and of each engine's
processes (rank processes included). The scheduler's memory per open stream is its peak RSS
growth over its idle RSS divided by the number of clients: the bound the load shows.

Side by side (unless `--no-unbounded`): the same clients against a fresh cluster whose bound is
the number of clients, so nothing is refused; the ratios show what the bound costs in
throughput and saves in scheduler memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from bench.workload import (
    OK,
    REFERENCE_DTYPE,
    StreamOutcome,
    greedy_reference,
    model_vocab_size,
    percentiles,
    process_group_pids,
    random_prompts,
    status_kib,
    stream_checked,
    token_errors,
)
from services.client import AsyncClient
from services.local_cluster import ClusterSpec, LocalCluster

RETRY = (grpc.StatusCode.RESOURCE_EXHAUSTED,)


@dataclass(slots=True)
class LoadConfig:
    clients: int = 1000
    channels: int = 50
    num_prefill: int = 1
    num_decode: int = 2
    max_queue_per_engine: int = 256
    num_prompts: int = 32
    prompt_len: tuple[int, int] = (8, 48)
    max_tokens: int = 8
    deadline_s: float = 600.0
    seed: int = 0
    model: str = ""
    log_dir: str = ""

    def validate(self) -> None:
        if self.clients < 1 or self.channels < 1 or self.max_tokens < 1 or self.num_prompts < 1:
            raise ValueError("clients, channels, max_tokens and num_prompts must be >= 1")
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError(f"need >= 1 decode and >= 0 prefill engines, got {self.num_decode}, {self.num_prefill}")


def peak_rss_mb(cluster: LocalCluster) -> dict[str, float]:
    """VmHWM of every component: for an engine the largest of its processes (rank 0 and the
    spawned ranks), with `<name>.ranks` = their sum when it has more than one process."""
    peaks: dict[str, float] = {}
    for name, comp in cluster.components.items():
        if comp.proc is None:
            continue
        values = [v for v in (status_kib(p, "VmHWM") for p in process_group_pids(comp.proc.pid)) if v is not None]
        if values:
            peaks[name] = round(max(values) / 1024, 1)
            if len(values) > 1:
                peaks[f"{name}.ranks"] = round(sum(values) / 1024, 1)
    return peaks


async def _drive(cfg: LoadConfig, target: str, prompts: list[list[int]]) -> tuple[list[StreamOutcome], float]:
    clients = [AsyncClient(target) for _ in range(min(cfg.channels, cfg.clients))]
    done = 0

    async def one(i: int) -> StreamOutcome:
        nonlocal done
        p = i % len(prompts)
        out = await stream_checked(clients[i % len(clients)], prompts[p], cfg.max_tokens, prompt_index=p,
                                   request_id=f"load-{i}", answer_timeout_s=cfg.deadline_s + 30.0,
                                   budget_s=cfg.deadline_s, retry_codes=RETRY, retry_backoff_s=0.5,
                                   retry_backoff_max_s=8.0)
        done += 1
        if done % 50 == 0 or done == cfg.clients:
            print(f"\r  {done}/{cfg.clients} clients answered", end="", file=sys.stderr, flush=True)
        return out

    try:
        for c in clients:  # connect every channel before the clock starts
            await c.server_info()
        start = time.perf_counter()
        outcomes = list(await asyncio.gather(*(one(i) for i in range(cfg.clients))))
        wall = time.perf_counter() - start
        print(file=sys.stderr)
        return outcomes, wall
    finally:
        for c in clients:
            await c.close()


def summarize(cfg: LoadConfig, outcomes: list[StreamOutcome], expected: list[list[int]], wall_s: float,
              peaks: dict[str, float], idle_mb: float) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    bad_tokens = 0
    for o in outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
        bad_tokens += 1 if token_errors(o, expected[o.prompt_index]) else 0
    exhausted = sum(o.num_retried_statuses.get("RESOURCE_EXHAUSTED", 0) for o in outcomes)
    tokens = sum(len(o.token_ids) for o in outcomes)
    ok = [o for o in outcomes if o.status == OK]
    itl = [(b - a) * 1000 for o in ok for a, b in zip(o.token_times_s, o.token_times_s[1:], strict=False)]
    sched = peaks.get("scheduler", 0.0)
    engines = {k: v for k, v in peaks.items() if k != "scheduler"}
    return {
        "clients": cfg.clients, "completed": len(ok),
        "failures": len(outcomes) - len(ok), "failures_by_status": {k: v for k, v in statuses.items() if k != OK},
        "token_errors": bad_tokens, "resource_exhausted_answers": exhausted,
        "throughput_tok_s": round(tokens / wall_s, 1), "requests_per_s": round(len(ok) / wall_s, 2),
        "ttft_ms": percentiles([o.ttft_s * 1000 for o in ok if o.ttft_s is not None]),
        "itl_ms": percentiles(itl), "e2e_ms": percentiles([o.e2e_s * 1000 for o in ok]),
        "scheduler_peak_rss_mb": sched, "scheduler_idle_rss_mb": round(idle_mb, 1),
        "scheduler_kib_per_client": round((sched - idle_mb) * 1024 / cfg.clients, 1),
        "engine_peak_rss_mb": engines, "wall_s": round(wall_s, 2),
        "config": {"channels": cfg.channels, "prefill": cfg.num_prefill, "decode": cfg.num_decode,
                   "max_queue_per_engine": cfg.max_queue_per_engine, "max_tokens": cfg.max_tokens,
                   "prompt_len": list(cfg.prompt_len)},
    }


def run_load(cfg: LoadConfig) -> dict[str, Any]:
    """Starts a cluster, runs every client to its end, reads the peaks, stops the cluster."""
    cfg.validate()
    from engine.demo_model import demo_model_dir

    model = cfg.model or str(demo_model_dir())
    prompts = random_prompts(cfg.seed, cfg.num_prompts, *cfg.prompt_len, model_vocab_size(model))
    print(f"greedy reference for {len(prompts)} prompts (in-process engine)", file=sys.stderr)
    expected = greedy_reference(model, prompts, cfg.max_tokens)
    spec = ClusterSpec(model=model, num_prefill=cfg.num_prefill, num_decode=cfg.num_decode, torch_threads=1,
                       dtype=REFERENCE_DTYPE,
                       kv_cache_memory="128MiB", log_dir=cfg.log_dir,
                       scheduler_args=["--max-queue-per-engine", str(cfg.max_queue_per_engine),
                                       "--default-deadline-s", str(cfg.deadline_s)],
                       engine_args=["--max-num-seqs", "128"])
    print(f"starting a local cluster: {cfg.num_prefill} prefill + {cfg.num_decode} decode engines", file=sys.stderr)
    with LocalCluster(spec) as cluster:
        sched = cluster.components["scheduler"].proc
        idle_kib = status_kib(sched.pid, "VmRSS") if sched is not None else None
        print(f"{cfg.clients} clients streaming", file=sys.stderr)
        outcomes, wall = asyncio.run(_drive(cfg, cluster.target, prompts))
        peaks = peak_rss_mb(cluster)
        leaks = cluster.wait_no_leaks(timeout=15.0)
    report = summarize(cfg, outcomes, expected, wall, peaks, (idle_kib or 0) / 1024)
    report["leaks"] = leaks
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=1000, help="concurrent streaming clients")
    parser.add_argument("--channels", type=int, default=50, help="gRPC connections the clients share")
    parser.add_argument("--prefill", type=int, default=1, help="prefill engines")
    parser.add_argument("--decode", type=int, default=2, help="decode engines")
    parser.add_argument("--max-queue-per-engine", type=int, default=256,
                        help="scheduler admission bound: in-flight requests per engine")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per request (greedy, ignore_eos)")
    parser.add_argument("--prompt-len", default="8:48", help="prompt length range MIN:MAX")
    parser.add_argument("--deadline", type=float, default=600.0, help="per-client budget and scheduler deadline")
    parser.add_argument("--no-unbounded", action="store_true",
                        help="skip the side-by-side run whose admission bound is the number of clients")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--model", default="", help="model directory; default: the demo model")
    parser.add_argument("--out", default="bench-results", help="directory for load.json and the cluster logs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lo, _, hi = args.prompt_len.partition(":")
    cfg = LoadConfig(clients=args.clients, channels=args.channels, num_prefill=args.prefill, num_decode=args.decode,
                     max_queue_per_engine=args.max_queue_per_engine, max_tokens=args.max_tokens,
                     prompt_len=(int(lo), int(hi or lo)), deadline_s=args.deadline, seed=args.seed,
                     model=args.model, log_dir=str(out / "logs" / "load"))
    report = run_load(cfg)
    if not args.no_unbounded:
        print(f"side by side: admission bound {cfg.clients} per engine (nothing refused)", file=sys.stderr)
        unbounded = run_load(replace(cfg, max_queue_per_engine=cfg.clients, log_dir=str(out / "logs" / "unbounded")))
        report["unbounded"] = {k: unbounded[k] for k in ("completed", "failures", "token_errors", "throughput_tok_s", "ttft_ms",
                                                          "e2e_ms", "scheduler_peak_rss_mb", "engine_peak_rss_mb",
                                                          "wall_s", "leaks")}
        report["ratios"] = {
            "throughput_bounded_over_unbounded": round(report["throughput_tok_s"]
                                                       / max(unbounded["throughput_tok_s"], 1e-9), 2),
            "scheduler_peak_rss_bounded_over_unbounded": round(report["scheduler_peak_rss_mb"]
                                                               / max(unbounded["scheduler_peak_rss_mb"], 1e-9), 2),
        }
    (out / "load.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    runs = [report, report.get("unbounded", report)]
    return 0 if all(r["failures"] == 0 and r["token_errors"] == 0 and not r["leaks"] for r in runs) else 1
