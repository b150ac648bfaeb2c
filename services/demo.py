"""`pdserve demo` (what `make demo` runs): start a local cluster on the demo model, stream a
few chat prompts through the disaggregated path, print TTFT / throughput / KV transferred, stop."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from services.client import AsyncClient, GenerationResult
from services.common.logs import setup_logging
from services.local_cluster import ClusterSpec, LocalCluster

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "List three primary colors.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory; default: the demo model")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every engine")
    parser.add_argument("--log-dir", default="/tmp/pdserve-demo-logs", help="component logs go here")


def kv_bytes_per_token(model_dir: str) -> int:
    """KV bytes one token occupies across all layers (float32 working cache)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    return int(cfg["num_hidden_layers"]) * 2 * int(kv_heads) * int(head_dim) * 4


async def _ask(client: AsyncClient, index: int, prompt: str, max_tokens: int) -> GenerationResult:
    result = await client.generate(prompt, chat=True, max_tokens=max_tokens, temperature=0.0, timeout=300)
    print(f"\n[{index}] {prompt}\n    -> {result.text.strip()!r}", flush=True)
    return result


async def _run_prompts(target: str, max_tokens: int) -> tuple[list[GenerationResult], float]:
    async with AsyncClient(target) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_ask(client, i, p, max_tokens) for i, p in enumerate(DEMO_PROMPTS)))
        return list(results), time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    setup_logging("WARNING", "demo")
    from engine.demo_model import demo_model_dir

    model = args.model or str(demo_model_dir())
    print(f"pdserve demo: model {model}; starting scheduler + 1 prefill + 1 decode engine "
          f"(logs in {args.log_dir}) ...", flush=True)
    spec = ClusterSpec(model=model, num_prefill=1, num_decode=1, tp=args.tp, log_dir=args.log_dir)
    with LocalCluster(spec) as cluster:
        print(f"cluster ready at {cluster.target}; sending {len(DEMO_PROMPTS)} prompts concurrently", flush=True)
        results, wall = asyncio.run(_run_prompts(cluster.target, args.max_tokens))
    generated = sum(r.generated_tokens for r in results)
    transferred = sum(r.transferred_tokens for r in results)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    print("\nsummary")
    print(f"  requests             {len(results)} (all finished: {all(r.finish_reason for r in results)})")
    if ttfts:
        print(f"  TTFT                 median {statistics.median(ttfts) * 1000:.0f} ms, max {max(ttfts) * 1000:.0f} ms")
    print(f"  generated            {generated} tokens in {wall:.1f} s = {generated / wall:.1f} tokens/s")
    print(f"  KV transferred       {transferred} prompt tokens = "
          f"{transferred * kv_bytes_per_token(model) / 2**20:.1f} MiB over UCX")
    print("  cluster stopped cleanly")
    return 0
