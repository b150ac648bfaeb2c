"""`pdserve bench serve`: a load generator against a pdserve cluster.

By default it starts local clusters itself (`--up`) and runs the same workload twice, side by
side: disaggregated (prefill engine + decode engine, KV over UCX) and colocated (decode-only:
the decode engine computes the prompt). With `--compare-routing` it instead runs prefix-aware
vs round-robin prefill routing on `--prefill` (≥ 2) engines with a shared-prefix workload.
With `--compare-paths` it runs always-remote prefill vs the scheduler's path policy (remote
prefill + transfer or decode-local prefill, per request) on `--prefill` x `--decode` engines,
by default with `--workload mixed` (short chat turns and long shared-prefix prompts), and
reports short and long prompts apart, the policy's decisions by reason, its TTFT prediction
error (relative, median over decisions) and goodput under `--slo-ttft-ms` / `--slo-itl-ms`.
`--target HOST:PORT` measures an existing cluster as is (one section, "target"). With `--http`
it runs one cluster and sends the same kind of workload through the gRPC Generate API and the
OpenAI-compatible HTTP API (streamed /v1/completions, token-id prompts) in ABBA order on fresh
prompts per pass, reporting the HTTP path's added TTFT p50 and its throughput ratio.

Every mode gets the same CPU: all its processes are pinned to the same cores (`--cpus`, default
the cores this process may use) and its engines share the same total of torch threads
(`--threads`, default one per pinned core) split evenly over them — disaggregated 1P1D gives
each engine half, colocated gives its one engine all; the split is stated in the output (`cpu`).
`--compare vllm` runs the same workload against vLLM and pdserve instead (bench/vllm_compare.py).

Reports TTFT / inter-token latency / end-to-end percentiles, throughput, goodput under an SLO,
the scheduler's control-plane overhead per request (Complete.scheduler_overhead_ms), and
writes JSON + a PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workload import percentiles as _pct
from services.client import AsyncClient, GenerationResult
from services.local_cluster import ClusterSpec, LocalCluster

# Keys `--repeat` reports with min-max beside the ratios (bench/repeats.py).
HEADLINE_KEYS: tuple[str, ...] = ("ttft_prediction_error_p50", "control_plane_overhead_ms_p50", "ratios.http_added_round_trip_p50_ms",
                 "ratios.http_added_ttft_p50_ms_paired", "ratios.http_added_ttft_p50_ms")
# The classic disaggregated path for every prompt (the scheduler's default is the cost policy).
ALWAYS_REMOTE = ["--path-policy", "remote"]
VLLM_START_TIMEOUT_S = 900.0  # a cluster of vLLM engines on a loaded 2-core host

@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    # Per prompt: "short" or "long" (mixed workload), else "".
    kinds: list[str] | None = None
    # Sent with every request as its own TTFT / ITL targets (GenerateRequest.sampling), which the
    # path policy maximises the requests meeting; None: not sent.
    ttft_target_ms: float | None = None
    itl_target_ms: float | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="", help="measure an existing cluster at HOST:PORT instead of --up")
    parser.add_argument("--up", action="store_true", default=True, help="start local clusters (the default)")
    parser.add_argument("--model", default="", help="model directory for --up; default: the demo model")
    parser.add_argument("--num-requests", type=int, default=48, help="requests per mode")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--request-rate", type=float, default=0.0,
                        help="open-loop Poisson arrivals per second instead of fixed concurrency")
    parser.add_argument("--prompt-len", default="64:512", help="prompt length range MIN:MAX (uniform)")
    parser.add_argument("--output-len", default="16:32", help="output length range MIN:MAX (uniform)")
    parser.add_argument("--compare-kv-reuse", action="store_true",
                        help="KV reuse across engines (peer fetch) off vs on, 2 prefill + 2 decode engines "
                             "(bench/kv_reuse.py); --workload multi-turn, shared-prefix or random")
    parser.add_argument("--kv-reuse-mode", choices=["cost", "always"], default="cost",
                        help="--compare-kv-reuse: the scheduler's --peer-fetch on the reuse side")
    parser.add_argument("--conversations", type=int, default=6, help="multi-turn workload: conversations")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn workload: turns per conversation")
    parser.add_argument("--workload", choices=["random", "shared-prefix", "mixed", "multi-turn", "phased"], default="random",
                        help="shared-prefix: prompts share one of a few long prefixes; mixed: short chat turns "
                             "(--short-len) and long shared-prefix prompts (--prompt-len)")
    parser.add_argument("--short-len", default="8:32", help="mixed workload: short prompt length range MIN:MAX")
    parser.add_argument("--short-fraction", type=float, default=0.5, help="mixed workload: share of short prompts")
    parser.add_argument("--compare-paths", action="store_true",
                        help="always-remote prefill vs the path policy (default workload: mixed)")
    parser.add_argument("--path-policy", default="cost", choices=["cost", "threshold"],
                        help="--compare-paths: the policy measured against always-remote")
    parser.add_argument("--decode", type=int, default=1, help="decode engines per cluster (--up)")
    parser.add_argument("--num-prefixes", type=int, default=4, help="distinct shared prefixes")
    parser.add_argument("--prefix-len", type=int, default=384, help="tokens of each shared prefix")
    parser.add_argument("--compare-routing", action="store_true",
                        help="prefix-aware vs round-robin routing (needs --prefill >= 2)")
    parser.add_argument("--http", action="store_true",
                        help="HTTP (OpenAI API, streamed /v1/completions) vs gRPC Generate on one cluster, "
                             "same workload: added TTFT p50 and throughput ratio")
    parser.add_argument("--prefill", type=int, default=1, help="prefill engines per cluster (--up)")
    parser.add_argument("--kv-cache-memory", default="256MiB",
                        help="KV cache per engine rank (--up); a small cache makes routing matter")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0,
                        help="goodput SLO on TTFT (--compare-paths: also sent as every request's ttft_target_ms)")
    parser.add_argument("--slo-itl-ms", type=float, default=200.0,
                        help="goodput SLO on mean inter-token latency (--compare-paths: also sent as every "
                             "request's itl_target_ms)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="vLLM's goodput SLOs (ttft, tpot, e2el in ms), e.g. --goodput ttft:1000 tpot:100; "
                             "with --sweep-rates: goodput = the highest rate with >= 90 %% of requests good")
    parser.add_argument("--sweep-rates", default="",
                        help="comma-separated Poisson arrival rates (requests/s) to sweep, lowest first: reports "
                             "the attainment curve and goodput_rps (on --target, or one started cluster)")
    parser.add_argument("--planner", choices=["off", "advise", "on"], default="off",
                        help="--up clusters: the scheduler's role planner (docs/decisions/0044)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--out", default="bench-results", help="directory for serve.json and serve.png")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per mode, split evenly over its engines (0: one per pinned core)")
    parser.add_argument("--cpus", default="",
                        help="cores every process of every mode is pinned to, e.g. 0-1 or 0,2 (default: all allowed)")
    parser.add_argument("--compare", choices=["vllm"], default=None,
                        help="vllm: the same workload against vLLM colocated, vLLM 1P1D NixlConnector, pdserve, "
                             "and pdserve with vLLM engines where available")
    parser.add_argument("--systems", default="vllm_colocated,vllm_pd_nixl,pdserve,pdserve_vllm,pdserve_vllm_staging",
                        help="--compare vllm: which systems to run (comma-separated)")
    parser.add_argument("--phases", action="store_true",
                        help="--compare vllm: also time the workload's prefill-only and decode-only passes "
                             "on one vLLM engine's share of the cores (what bounds a 1P1D split)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--engine", choices=["native", "vllm"], default="native",
                        help="engine backend of every engine of the --up clusters (vllm: run from .venv-vllm)")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a vLLM engine argument for every engine (with --engine vllm; with --compare vllm "
                             "for every vLLM engine of every system, servers included)")
    parser.add_argument("--dtype", default="",
                        help="engine dtype for --up (float32, bfloat16; default: the engine's; "
                             "--compare vllm: bfloat16 for every system)")
    from bench import compare_planner

    compare_planner.add_arguments(parser)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise ValueError(f"length range must be MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return a, b


def build_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    p_lo, p_hi = _range(args.prompt_len)
    o_lo, o_hi = _range(args.output_len)
    token = lambda: rng.randrange(100, vocab)  # noqa: E731 - skip special tokens at the bottom
    prefixes = [[token() for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    prompts, outs, kinds = [], [], []
    s_lo, s_hi = _range(getattr(args, "short_len", "8:32"))
    if args.workload == "phased":
        return phased_workload(args, rng, token)
    for _ in range(args.num_requests):
        n = rng.randint(p_lo, p_hi)
        if args.workload == "mixed":
            short = rng.random() < args.short_fraction
            kinds.append("short" if short else "long")
            if short:
                n = rng.randint(s_lo, s_hi)
                prompts.append([token() for _ in range(n)])
            else:
                prefix = prefixes[rng.randrange(len(prefixes))]
                prompts.append(prefix + [token() for _ in range(max(1, n - args.prefix_len))])
        elif args.workload == "shared-prefix":
            prefix = prefixes[rng.randrange(len(prefixes))]  # random order: no accidental partition
            prompts.append(prefix + [token() for _ in range(max(1, n - args.prefix_len))])
        else:
            prompts.append([token() for _ in range(n)])
        outs.append(rng.randint(o_lo, o_hi))
    return Workload(prompts, outs, kinds or None)


PHASES = ("prefill_heavy", "decode_heavy", "mixed")
HEADLINE_KEYS += tuple(f"{k}.{p}.{ph}" for k in ("planner_vs_best_static", "planner_vs_worst_static",
                                                 "planner_vs_vllm_colocated")
                       for p in ("ttft_tight", "itl_tight") for ph in ("overall", *PHASES))
HEADLINE_KEYS += tuple(f"goodput_rps.{p}.{s}.overall" for p in ("ttft_tight", "itl_tight")
                       for s in ("static_1p1d", "static_2mixed", "planner", "vllm_colocated"))
HEADLINE_KEYS += ("role_changes.ttft_tight", "role_changes.itl_tight", "requests_lost.total")


def phased_workload(args: argparse.Namespace, rng: random.Random, token: Callable[[], int]) -> Workload:
    """Thirds of the requests in order (arrivals keep that order): prefill-heavy (prompts from
    the top half of --prompt-len, the shortest --output-len), decode-heavy (--short-len prompts,
    4x the longest --output-len), then mixed (either, at random). `kinds` names each phase."""
    p_lo, p_hi = _range(args.prompt_len)
    o_lo, o_hi = _range(args.output_len)
    s_lo, s_hi = _range(args.short_len)
    prompts, outs, kinds = [], [], []
    for i in range(args.num_requests):
        phase = PHASES[min(2, 3 * i // max(1, args.num_requests))]
        heavy = phase if phase != "mixed" else PHASES[rng.randrange(2)]
        if heavy == "prefill_heavy":
            prompts.append([token() for _ in range(rng.randint((p_lo + p_hi) // 2, p_hi))])
            outs.append(o_lo)
        else:
            prompts.append([token() for _ in range(rng.randint(s_lo, s_hi))])
            outs.append(4 * o_hi)
        kinds.append(phase)
    return Workload(prompts, outs, kinds)


async def _drive(target: str, wl: Workload, concurrency: int, rate: float) -> tuple[list[GenerationResult], float]:
    async with AsyncClient(target) as client:
        sem = asyncio.Semaphore(concurrency if rate <= 0 else len(wl.prompts))
        done = 0

        async def one(i: int) -> GenerationResult:
            nonlocal done
            async with sem:
                r = await client.generate(wl.prompts[i], max_tokens=wl.max_tokens[i], temperature=0.0,
                                          ignore_eos=True, timeout=600, ttft_target_ms=wl.ttft_target_ms,
                                          itl_target_ms=wl.itl_target_ms)
            done += 1
            print(f"\r  {done}/{len(wl.prompts)} requests", end="", file=sys.stderr, flush=True)
            return r

        start = time.perf_counter()
        tasks = []
        rng = random.Random(1)
        for i in range(len(wl.prompts)):
            tasks.append(asyncio.create_task(one(i)))
            if rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = list(await asyncio.gather(*tasks))
        print(file=sys.stderr)
        return results, time.perf_counter() - start


async def _drive_http(base_url: str, wl: Workload, concurrency: int,
                      rate: float) -> tuple[list[GenerationResult], float]:
    """The `_drive` workload over the HTTP API: streamed /v1/completions, token ids in and out,
    usage from the final chunk (`stream_options.include_usage`)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(concurrency, 8))
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency if rate <= 0 else len(wl.prompts))

        async def one(i: int) -> GenerationResult:
            body = {"prompt": wl.prompts[i], "max_tokens": wl.max_tokens[i], "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True}
            async with sem:
                return await _http_stream(client, body, f"http-{i}")

        start = time.perf_counter()
        tasks, rng = [], random.Random(1)
        for i in range(len(wl.prompts)):
            tasks.append(asyncio.create_task(one(i)))
            if rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


async def _http_stream(client: Any, body: dict[str, Any], request_id: str) -> GenerationResult:
    """One streamed completion, timed like services.client's gRPC results."""
    r = GenerationResult(request_id=request_id)
    start = time.perf_counter()
    async with client.stream("POST", "/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.perf_counter() - start
            for choice in event.get("choices", []):
                ids = choice.get("token_ids", [])
                if ids and r.ttft_s is None:
                    r.ttft_s = now
                r.token_ids.extend(ids)
                r.token_times_s.extend([now] * len(ids))
                r.finish_reason = choice.get("finish_reason") or r.finish_reason
            usage = event.get("usage")
            if usage:
                r.prompt_tokens, r.generated_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                # pdserve's own usage fields; other servers (vLLM) have none
                r.cached_tokens, r.transferred_tokens = usage.get("cached_tokens", 0), usage.get("transferred_tokens", 0)
            if "error" in event:
                raise RuntimeError(f"in-band error: {event['error']}")
    r.e2e_s = time.perf_counter() - start
    return r


def paired_ttft(target: str, base_url: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """TTFT of the two APIs one request at a time, in pairs, over one warm connection each:
    each pair sends two fresh prompts of the same length, one per API, in alternating order, so
    slow drift of the machine (other processes) cancels in the pair's difference."""
    import httpx

    wl = build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + 7}), vocab)
    rng = random.Random(args.seed + 8)

    async def run() -> tuple[list[float], dict[str, list[float]]]:
        diffs: list[float] = []
        ttft: dict[str, list[float]] = {"grpc": [], "http": []}
        async with AsyncClient(target) as grpc_client, httpx.AsyncClient(base_url=base_url, timeout=600) as http:
            async def one(proto: str, prompt: list[int]) -> float:
                if proto == "grpc":
                    r = await grpc_client.generate(prompt, max_tokens=2, temperature=0.0, ignore_eos=True, timeout=600)
                else:
                    r = await _http_stream(http, {"prompt": prompt, "max_tokens": 2, "temperature": 0.0,
                                                  "ignore_eos": True, "stream": True, "return_token_ids": True}, "p")
                return (r.ttft_s or 0.0) * 1000

            warm = [rng.randrange(100, vocab) for _ in range(8)]
            await one("grpc", warm)
            await one("http", warm[::-1])
            for i, prompt in enumerate(wl.prompts):
                twin = [prompt, [rng.randrange(100, vocab) for _ in prompt]]
                order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")
                got = {proto: await one(proto, twin[j]) for j, proto in enumerate(order)}
                for proto, ms in got.items():
                    ttft[proto].append(ms)
                diffs.append(got["http"] - got["grpc"])
        return diffs, ttft

    diffs, ttft = asyncio.run(run())
    return {"pairs": len(diffs), "http_minus_grpc_ttft_ms": _pct(diffs),
            "grpc_ttft_ms": _pct(ttft["grpc"]), "http_ttft_ms": _pct(ttft["http"])}


def refusal_round_trip(target: str, base_url: str, n: int, prompt_len: int = 64) -> dict[str, Any]:
    """The protocols' own cost without an engine: `n` interleaved requests per API that the
    scheduler parses, validates and refuses (token ids, max_tokens 0), over warm
    connections; round-trip percentiles in ms. Both APIs run the same validation."""
    import grpc
    import httpx

    prompt = list(range(100, 100 + prompt_len))

    async def run() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {"grpc": [], "http": []}
        async with AsyncClient(target) as grpc_client, httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            for i in range(n + 5):
                for proto in (("grpc", "http") if i % 2 == 0 else ("http", "grpc")):
                    start = time.perf_counter()
                    if proto == "grpc":
                        try:
                            await grpc_client.generate(prompt, max_tokens=0, timeout=60)
                        except grpc.aio.AioRpcError as e:
                            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
                    else:
                        r = await http.post("/completions", json={"prompt": prompt, "max_tokens": 0, "stream": True})
                        assert r.status_code == 400, r.text
                    if i >= 5:  # the first ones warm both paths
                        times[proto].append((time.perf_counter() - start) * 1000)
        return times

    times = asyncio.run(run())
    diffs = [h - g for g, h in zip(times["grpc"], times["http"], strict=True)]
    return {"requests_per_api": n, "grpc_ms": _pct(times["grpc"]), "http_ms": _pct(times["http"]),
            "http_minus_grpc_ms": _pct(diffs)}


def http_vs_grpc(target: str, base_url: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """ABBA passes (gRPC, HTTP, HTTP, gRPC) at the workload's concurrency, each on its own
    prompts of the same shape, against one running cluster (per-protocol summaries over both of
    its passes, and the ratios); then `paired_ttft`, one request at a time."""
    passes: dict[str, list[tuple[list[GenerationResult], float]]] = {"grpc": [], "http": []}
    for k, proto in enumerate(("grpc", "http", "http", "grpc")):
        wl = build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * (k + 1)}), vocab)
        print(f"[{proto}] pass {k + 1}/4", file=sys.stderr)
        if proto == "grpc":
            passes[proto].append(asyncio.run(_drive(target, wl, args.concurrency, args.request_rate)))
        else:
            passes[proto].append(asyncio.run(_drive_http(base_url, wl, args.concurrency, args.request_rate)))
    report: dict[str, Any] = {}
    for proto, runs in passes.items():
        report[proto] = summarize([r for rs, _ in runs for r in rs], sum(w for _, w in runs), args)
    g, h = report["grpc"], report["http"]
    report["ratios"] = {
        "http_added_ttft_p50_ms": round(h["ttft_ms"]["p50"] - g["ttft_ms"]["p50"], 3),
        "http_added_itl_p50_ms": round(h["itl_ms"]["p50"] - g["itl_ms"]["p50"], 3),
        "throughput_http_over_grpc": round(h["throughput_tok_s"] / max(g["throughput_tok_s"], 1e-9), 3),
    }
    print("[paired] one request at a time, alternating APIs", file=sys.stderr)
    report["paired"] = paired_ttft(target, base_url, args, vocab)
    report["ratios"]["http_added_ttft_p50_ms_paired"] = report["paired"]["http_minus_grpc_ttft_ms"]["p50"]
    print("[refusal] protocol round trips without an engine", file=sys.stderr)
    report["refusal_round_trip"] = refusal_round_trip(target, base_url, max(20, 10 * args.num_requests))
    report["ratios"]["http_added_round_trip_p50_ms"] = report["refusal_round_trip"]["http_minus_grpc_ms"]["p50"]
    return report


def summarize(results: list[GenerationResult], wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    ttft = [r.ttft_s * 1000 for r in results if r.ttft_s is not None]
    itl: list[float] = []
    good = 0
    for r in results:
        gaps = [(b - a) * 1000 for a, b in zip(r.token_times_s, r.token_times_s[1:], strict=False)]
        itl.extend(gaps)
        mean_itl = statistics.fmean(gaps) if gaps else 0.0
        if r.ttft_s is not None and r.ttft_s * 1000 <= args.slo_ttft_ms and mean_itl <= args.slo_itl_ms:
            good += 1
    tokens = sum(r.generated_tokens for r in results)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    return {
        "requests": len(results),
        "ttft_ms": _pct(ttft), "itl_ms": _pct(itl), "e2e_ms": _pct([r.e2e_s * 1000 for r in results]),
        "throughput_tok_s": round(tokens / wall_s, 2),
        "goodput_req_s": round(good / wall_s, 3),
        "control_plane_overhead_ms_p50": _pct([r.scheduler_overhead_ms for r in results])["p50"],
        # Prompt tokens served from any prefix cache (prefill's or the decode engine's own).
        "prefix_hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
        "transferred_tokens": sum(r.transferred_tokens for r in results),
        "wall_s": round(wall_s, 2),
    }


def _engine_cluster_args(args: argparse.Namespace, cluster: dict[str, Any]) -> dict[str, Any]:
    """The --engine / --vllm-arg / --dtype choice applied to one cluster's spec (vLLM's CPU
    attention needs a block size that is a multiple of 32, on the scheduler as on the engines)."""
    engine = getattr(args, "engine", "native")
    engine_args = list(cluster.pop("engine_args", []))
    scheduler_args = list(cluster.pop("scheduler_args", []))
    if getattr(args, "dtype", ""):
        engine_args += ["--dtype", args.dtype]
    if engine == "vllm":
        from services.up import VLLM_BLOCK_SIZE

        engine_args += ["--block-size", str(VLLM_BLOCK_SIZE), "--max-model-len", "2048"]
        scheduler_args += ["--block-size", str(VLLM_BLOCK_SIZE)]
        cluster.update(engine="vllm", vllm_args=list(getattr(args, "vllm_arg", [])),
                       env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING"})
    return {**cluster, "engine_args": engine_args, "scheduler_args": scheduler_args}


@contextlib.contextmanager
def _started(spec: ClusterSpec) -> Iterator[LocalCluster]:
    """A started cluster, stopped at exit; vLLM engines get longer to start (~30 s each unloaded)."""
    c = LocalCluster(spec)
    try:
        c.start(timeout=VLLM_START_TIMEOUT_S if spec.engine == "vllm" else 180.0)
        yield c
    finally:
        c.stop()


def parse_cpus(text: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6]; empty: the cores this process may run on."""
    if not text.strip():
        return sorted(os.sched_getaffinity(0))
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or int(hi or lo) < int(lo):
            raise ValueError(f"--cpus must list cores like 0-3,6, got {text!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


@dataclass(frozen=True, slots=True)
class CpuShare:
    """The CPU one mode gets: its pinned cores and its engines' torch threads."""

    cpus: tuple[int, ...]
    engines: int
    threads_per_engine: int

    @property
    def total_threads(self) -> int:
        return self.engines * self.threads_per_engine

    def describe(self) -> dict[str, Any]:
        return {"cpus": list(self.cpus), "engines": self.engines, "torch_threads_per_engine": self.threads_per_engine,
                "total_torch_threads": self.total_threads}


def cpu_share(args: argparse.Namespace, engines: int) -> CpuShare:
    """Splits `--threads` (default: one per pinned core) evenly over `engines` processes."""
    cpus = tuple(parse_cpus(args.cpus))
    threads = args.threads or len(cpus)
    if threads < engines or threads % engines:
        raise ValueError(f"--threads {threads} does not split evenly over {engines} engines")
    return CpuShare(cpus, engines, threads // engines)


def pin(share: CpuShare) -> None:
    """Pins this process (and so every process it starts from now on) to the share's cores."""
    unknown = set(share.cpus) - set(range(os.cpu_count() or 1))
    if unknown:
        raise ValueError(f"--cpus names cores this machine lacks: {sorted(unknown)}")
    os.sched_setaffinity(0, share.cpus)


def _run_mode(name: str, args: argparse.Namespace, wl: Workload, **cluster: Any) -> dict[str, Any]:
    results, wall, (share, before, after) = run_mode_results(name, args, wl, **cluster)
    summary = summarize(results, wall, args)
    summary["decisions"] = dict(sorted(Counter(r.path_reason or "unknown" for r in results).items()))
    summary["ttft_prediction_error"] = prediction_errors(results)
    if wl.kinds:
        summary["by_kind_and_path"] = path_breakdown(results, wl.kinds)
        summary["by_kind"] = {k: summarize([r for r, kind in zip(results, wl.kinds, strict=True) if kind == k],
                                           wall, args) for k in sorted(set(wl.kinds))}
    queried = after[0] - before[0]
    summary["prefill_prefix_hit_rate"] = round((after[1] - before[1]) / queried, 4) if queried else 0.0
    summary["cpu"] = share.describe()
    print(f"[{name}] TTFT p50 {summary['ttft_ms']['p50']} ms, ITL p50 {summary['itl_ms']['p50']} ms, "
          f"{summary['throughput_tok_s']} tok/s, overhead p50 {summary['control_plane_overhead_ms_p50']} ms",
          file=sys.stderr)
    return summary


def run_mode_results(name: str, args: argparse.Namespace, wl: Workload, **cluster: Any
                     ) -> tuple[list[GenerationResult], float, tuple[CpuShare, tuple[float, float], tuple[float, float]]]:
    """Starts one local cluster on its CPU share, warms it up, drives the workload; returns the
    results, the wall time, and (share, prefill cache counters before, after)."""
    share = cpu_share(args, cluster.get("num_prefill", 1) + cluster.get("num_decode", 1))
    with started_cluster(name, args, **cluster) as c:
        asyncio.run(_drive(c.target, warm_up_workload(), 2, 0.0))
        before = _prefill_cache_counters(c)
        results, wall = asyncio.run(_drive(c.target, wl, args.concurrency, args.request_rate))
        after = _prefill_cache_counters(c)
    return results, wall, (share, before, after)


@contextlib.contextmanager
def started_cluster(name: str, args: argparse.Namespace, **cluster: Any) -> Iterator[LocalCluster]:
    """A local cluster of `cluster`'s engines on their CPU share (pinned), ready to serve."""
    share = cpu_share(args, cluster.get("num_prefill", 1) + cluster.get("num_decode", 1))
    pin(share)
    # A benchmark measures latency; the scheduler's default deadline (60 s) would only drop
    # requests on a loaded machine, so it gets the client's own 600 s.
    cluster["scheduler_args"] = ["--default-deadline-s", "600", *cluster.get("scheduler_args", [])]
    cluster = _engine_cluster_args(args, cluster)
    print(f"[{name}] starting a local cluster ({cluster}; {share.describe()})", file=sys.stderr)
    spec = ClusterSpec(model=args.model, log_dir=str(Path(args.out) / "logs" / name),
                       torch_threads=share.threads_per_engine, kv_cache_memory=args.kv_cache_memory, metrics=True,
                       **cluster)
    with _started(spec) as c:
        yield c


def warm_up_workload() -> Workload:
    """Every system's warm-up: two 24-token prompts that share nothing with the workload, 2 tokens each."""
    rng = random.Random(-1)
    return Workload([[rng.randrange(100, 1000) for _ in range(24)] for _ in range(2)], [2, 2])


def _prefill_cache_counters(cluster: LocalCluster) -> tuple[float, float]:
    """(queried, hit) prompt tokens of every prefill engine's own prefix cache, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    queried = hit = 0.0
    for comp in cluster.components.values():
        if not comp.name.startswith("prefill") or not comp.metrics_port:
            continue
        text = urllib.request.urlopen(f"http://127.0.0.1:{comp.metrics_port}/metrics", timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "pdserve_engine_prefix_cache_queries_tokens_total":
                    queried += s.value
                elif s.name == "pdserve_engine_prefix_cache_hits_tokens_total":
                    hit += s.value
    return queried, hit


def _vocab(args: argparse.Namespace) -> int:
    from engine.demo_model import demo_model_dir

    model = Path(args.model or demo_model_dir())
    args.model = str(model)
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in report if isinstance(report[m], dict) and "ttft_ms" in report[m]]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT (ms)", "ITL (ms)", "end-to-end (ms)"),
                              strict=True):
        for i, m in enumerate(modes):
            vals = [report[m][key][p] for p in ("p50", "p90", "p99")]
            ax.bar([x + i * 0.8 / len(modes) for x in range(3)], vals, width=0.8 / len(modes), label=m)
        ax.set_xticks([x + 0.4 - 0.4 / len(modes) for x in range(3)], ["p50", "p90", "p99"])
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle("pdserve bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _compare_paths(args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    """Always-remote vs the path policy on the same engines and workload, one after the other;
    every request carries the goodput SLOs as its own TTFT / ITL targets (both sides send them;
    always-remote ignores them)."""
    wl = dataclasses.replace(wl, ttft_target_ms=args.slo_ttft_ms, itl_target_ms=args.slo_itl_ms)
    engines = {"num_prefill": max(1, args.prefill), "num_decode": max(1, args.decode)}
    runs = _in_order(args, {
        "always_remote": lambda: _run_mode("always_remote", args, wl, scheduler_args=ALWAYS_REMOTE, **engines),
        "path_policy": lambda: _run_mode("path_policy", args, wl, scheduler_args=["--path-policy", args.path_policy],
                                         **engines)})
    remote, policy = runs["always_remote"], runs["path_policy"]
    out: dict[str, Any] = {"always_remote": remote, "path_policy": policy, "decisions": policy["decisions"],
                           "targets_ms": {"ttft": wl.ttft_target_ms, "itl": wl.itl_target_ms}}
    by_r, by_p = remote.get("by_kind", {}), policy.get("by_kind", {})
    if "short" in by_r and "short" in by_p:
        out["short_ttft_p50_speedup"] = _ratio(by_r["short"]["ttft_ms"]["p50"], by_p["short"]["ttft_ms"]["p50"])
    if "long" in by_r and "long" in by_p:
        out["long_ttft_p50_ratio"] = _ratio(by_r["long"]["ttft_ms"]["p50"], by_p["long"]["ttft_ms"]["p50"])
    out["ttft_p90_ratio"] = _ratio(remote["ttft_ms"]["p90"], policy["ttft_ms"]["p90"])
    out["throughput_ratio"] = _ratio(policy["throughput_tok_s"], remote["throughput_tok_s"])
    out["goodput_ratio"] = _ratio(policy["goodput_req_s"], remote["goodput_req_s"])
    out["transferred_tokens_ratio"] = _ratio(policy["transferred_tokens"], remote["transferred_tokens"])
    out["ttft_prediction_error_p50"] = policy["ttft_prediction_error"]["p50"]
    return out


def _in_order(args: argparse.Namespace, modes: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Runs `modes` (the baseline first in the dict) in that order, or pdserve's first when
    `--repeat` (bench/repeats.py) sets `args.baseline_first` False for this run."""
    names = list(modes) if getattr(args, "baseline_first", True) else list(modes)[::-1]
    return {name: modes[name]() for name in names}


def prediction_errors(results: list[GenerationResult]) -> dict[str, Any]:
    """The path policy's relative TTFT prediction error per decision, |predicted - actual| /
    actual (both the scheduler's: arrival to first token), median overall and per path taken."""
    errors: dict[str, list[float]] = {}
    for r in results:
        if r.predicted_ttft_ms > 0 and r.scheduler_ttft_ms > 0:
            path = "remote" if r.prefill_engine_id else "decode_local"
            errors.setdefault(path, []).append(abs(r.predicted_ttft_ms - r.scheduler_ttft_ms) / r.scheduler_ttft_ms)
    every = [e for errs in errors.values() for e in errs]
    return {"p50": round(statistics.median(every), 3) if every else None, "decisions": len(every),
            "by_path_p50": {p: round(statistics.median(errs), 3) for p, errs in sorted(errors.items())}}


def path_breakdown(results: list[GenerationResult], kinds: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per prompt kind and path taken: requests, and the p50 of the client's TTFT and of the
    policy's predicted TTFT on the path taken and on the other one (ms) — where each kind's
    time to first token comes from."""
    groups: dict[tuple[str, str], list[GenerationResult]] = {}
    for r, kind in zip(results, kinds, strict=True):
        groups.setdefault((kind, "remote" if r.prefill_engine_id else "decode_local"), []).append(r)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (kind, path), rs in sorted(groups.items()):
        alternatives = [r.alternative_ttft_ms for r in rs if r.alternative_ttft_ms is not None]
        out.setdefault(kind, {})[path] = {
            "requests": len(rs),
            "ttft_ms_p50": _pct([r.ttft_s * 1000 for r in rs if r.ttft_s is not None])["p50"],
            "predicted_ttft_ms_p50": _pct([r.predicted_ttft_ms for r in rs])["p50"],
            "alternative_ttft_ms_p50": _pct(alternatives)["p50"] if alternatives else None}
    return out


def _goodput_sweep(args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    """Open-loop Poisson arrivals at each `--sweep-rates` rate on one system (`--target`, or a
    started cluster of --prefill / --decode engines with --planner): the attainment curve and
    the goodput (bench/goodput.py)."""
    from bench.goodput import GoodputSlo, RatePoint, goodput_rps, parse_goodput, sweep

    slo = parse_goodput(args.goodput) if args.goodput else GoodputSlo(args.slo_ttft_ms, args.slo_itl_ms)
    rates = [float(r) for r in args.sweep_rates.split(",") if r.strip()]
    if not rates or min(rates) <= 0:
        raise ValueError(f"--sweep-rates: positive rates needed, got {args.sweep_rates!r}")

    def on(target: str) -> list[RatePoint]:
        return sweep(lambda rate: asyncio.run(_drive(target, wl, args.concurrency, rate)), rates, slo)

    if args.target:
        curve = on(args.target)
    else:
        planner = ["--planner", args.planner] if args.planner != "off" else []
        with started_cluster("sweep", args, num_prefill=args.prefill, num_decode=args.decode,
                             scheduler_args=[*planner, *ALWAYS_REMOTE]) as c:
            asyncio.run(_drive(c.target, warm_up_workload(), 2, 0.0))
            curve = on(c.target)
    return {"slo_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms, "e2el": slo.e2el_ms},
            "attainment_curve": [dataclasses.asdict(p) for p in curve],
            "goodput_rps": goodput_rps(curve)}


def _ratio(a: float, b: float) -> float:
    """a / b rounded; 0.0 when b is 0 (nothing measured)."""
    return round(a / b, 2) if b else 0.0


def run(args: argparse.Namespace) -> int:
    if args.compare == "vllm":
        from bench.vllm_compare import run_compare

        return run_compare(args)
    if args.compare_planner:
        from bench import compare_planner

        return compare_planner.run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _vocab(args) if not args.target else 49152
    if args.compare_routing:
        args.workload = "shared-prefix"
    if args.compare_paths and args.workload == "random":
        args.workload = "mixed"
    wl = build_workload(args, vocab)
    report: dict[str, Any] = {"workload": {k: getattr(args, k) for k in (
        "num_requests", "concurrency", "request_rate", "prompt_len", "output_len", "workload", "seed",
        "short_len", "short_fraction", "prefix_len", "num_prefixes", "prefill", "decode")}}
    if args.http:
        spec = ClusterSpec(model=args.model, log_dir=str(out / "logs" / "http"), torch_threads=1,
                           kv_cache_memory=args.kv_cache_memory, num_prefill=args.prefill)
        with LocalCluster(spec) as c:
            rng = random.Random(-1)
            warm = Workload([[rng.randrange(100, 1000) for _ in range(24)] for _ in range(2)], [2, 2])
            asyncio.run(_drive(c.target, warm, 2, 0.0))
            asyncio.run(_drive_http(c.http_url, warm, 2, 0.0))
            report.update(http_vs_grpc(c.target, c.http_url, args, vocab))
    elif args.sweep_rates:
        report.update(_goodput_sweep(args, wl))
    elif args.target:
        results, wall = asyncio.run(_drive(args.target, wl, args.concurrency, args.request_rate))
        report["target"] = summarize(results, wall, args)
    elif args.compare_kv_reuse:
        from bench.kv_reuse import compare_kv_reuse

        report.update(compare_kv_reuse(args, vocab))
        report["baseline_first"] = getattr(args, "baseline_first", True)
    elif args.compare_paths:
        report.update(_compare_paths(args, wl))
        report["baseline_first"] = getattr(args, "baseline_first", True)
    elif args.compare_routing:
        n = max(2, args.prefill)
        report.update(_in_order(args, {
            "round_robin": lambda: _run_mode("round_robin", args, wl, num_prefill=n,
                                             scheduler_args=["--routing-policy", "round_robin", *ALWAYS_REMOTE]),
            "prefix_aware": lambda: _run_mode("prefix_aware", args, wl, num_prefill=n,
                                              scheduler_args=["--routing-policy", "prefix", *ALWAYS_REMOTE])}))
        report["baseline_first"] = getattr(args, "baseline_first", True)
        a, b = report["prefix_aware"]["ttft_ms"]["p50"], report["round_robin"]["ttft_ms"]["p50"]
        report["ttft_p50_speedup"] = round(b / a, 2) if a else 0.0
    else:
        report.update(_in_order(args, {
            "colocated": lambda: _run_mode("colocated", args, wl, num_prefill=0),
            "disaggregated": lambda: _run_mode("disaggregated", args, wl, num_prefill=args.prefill,
                                               scheduler_args=ALWAYS_REMOTE)}))
        report["baseline_first"] = getattr(args, "baseline_first", True)
        report["control_plane_overhead_ms_p50"] = report["disaggregated"]["control_plane_overhead_ms_p50"]
        d, c = report["disaggregated"], report["colocated"]
        report["ratios"] = {
            "ttft_p50_colocated_over_disaggregated": round(c["ttft_ms"]["p50"] / max(d["ttft_ms"]["p50"], 1e-9), 2),
            "itl_p50_colocated_over_disaggregated": round(c["itl_ms"]["p50"] / max(d["itl_ms"]["p50"], 1e-9), 2),
            "throughput_disaggregated_over_colocated": round(
                d["throughput_tok_s"] / max(c["throughput_tok_s"], 1e-9), 2),
        }
    report["cpu"] = {m: report[m]["cpu"] for m in report if isinstance(report[m], dict) and "cpu" in report[m]}
    (out / "serve.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "serve.png")
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
        print(f"wrote {out / 'serve.json'} and {out / 'serve.png'}")
    return 0
