"""`pdserve bench engine`: pdserve's engine vs transformers `generate`, same model, same prompts.

Two workloads, each side in its own subprocess (so peak RSS and thread settings are its own):
- batch 1: one prompt, `--batch1-tokens` greedy tokens (EOS ignored); decode tokens/s.
- mixed 16: 16 requests with prompt lengths in [16, 256] and output lengths in [16, 128] (seeded);
  pdserve runs them concurrently (continuous batching), transformers as one left-padded static
  batch generating until the longest output. Tokens/s counts each request's own output tokens.
Ratios are pdserve / transformers tokens/s; > 1 means pdserve is faster.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory; default: the demo model")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per side (0: all cores)")
    parser.add_argument("--batch1-tokens", type=int, default=64, help="tokens generated at batch 1")
    parser.add_argument("--mixed-requests", type=int, default=16, help="requests of the mixed workload")
    parser.add_argument("--mixed-max-tokens", type=int, default=128,
                        help="longest output of the mixed workload (outputs are 16..this, or this when smaller)")
    parser.add_argument("--kv-cache-memory", default="512MiB", help="pdserve KV cache budget")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--side", choices=["pdserve", "transformers"], help=argparse.SUPPRESS)


def _workload(vocab: int, seed: int, batch1_tokens: int, num_mixed: int = 16, mixed_max_tokens: int = 128
              ) -> dict[str, Any]:
    rng = random.Random(seed)
    lo, hi = 100, min(vocab, 20000)  # ordinary tokens, away from the special ones
    batch1 = [rng.randrange(lo, hi) for _ in range(32)]
    mixed = []
    for _ in range(num_mixed):
        n, m = rng.randint(16, 256), rng.randint(min(16, mixed_max_tokens), mixed_max_tokens)
        mixed.append(([rng.randrange(lo, hi) for _ in range(n)], m))
    return {"batch1": (batch1, batch1_tokens), "mixed": mixed}


def _run_pdserve(model: str, work: dict[str, Any], kv_memory: str, threads: int) -> dict[str, float]:
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    engine = LLMEngine(model, kv_cache_memory=kv_memory, torch_threads=threads, dtype="float32")  # as transformers below
    engine.generate([work["batch1"][0][:8]], SamplingParams(max_tokens=4))  # warm-up
    prompt, n = work["batch1"]
    t0 = time.perf_counter()
    [out] = engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    batch1 = len(out) / (time.perf_counter() - t0)
    engine.reset_prefix_cache()
    prompts = [p for p, _ in work["mixed"]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in work["mixed"]]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    mixed = sum(len(o) for o in outs) / (time.perf_counter() - t0)
    assert engine.check_leaks() == []
    engine.shutdown()
    return {"batch1_tok_s": batch1, "mixed16_tok_s": mixed}


def _run_transformers(model: str, work: dict[str, Any], threads: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def gen(batch: list[list[int]], n: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=pad)

    gen([work["batch1"][0][:8]], 4)  # warm-up
    prompt, n = work["batch1"]
    t0 = time.perf_counter()
    gen([prompt], n)
    batch1 = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    gen([p for p, _ in work["mixed"]], max(m for _, m in work["mixed"]))
    mixed = sum(m for _, m in work["mixed"]) / (time.perf_counter() - t0)
    return {"batch1_tok_s": batch1, "mixed16_tok_s": mixed}


def _side_main(args: argparse.Namespace) -> int:
    import os

    import torch

    from engine.config import ModelConfig

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    work = _workload(ModelConfig.from_dir(args.model).vocab_size, args.seed, args.batch1_tokens,
                     args.mixed_requests, args.mixed_max_tokens)
    if args.side == "pdserve":
        result = _run_pdserve(args.model, work, args.kv_cache_memory, threads)
    else:
        result = _run_transformers(args.model, work, threads)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))
    return 0


def _side(args: argparse.Namespace, side: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "services.common.cli", "bench", "engine", "--side", side, "--model", args.model,
           "--threads", str(args.threads), "--batch1-tokens", str(args.batch1_tokens),
           "--kv-cache-memory", args.kv_cache_memory, "--seed", str(args.seed),
           "--mixed-requests", str(args.mixed_requests), "--mixed-max-tokens", str(args.mixed_max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} side failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def run(args: argparse.Namespace) -> int:
    if not args.model:
        from engine.demo_model import demo_model_dir

        args.model = str(demo_model_dir())
    if args.batch1_tokens < 1 or args.mixed_requests < 1 or args.mixed_max_tokens < 1:
        raise ValueError("--batch1-tokens, --mixed-requests and --mixed-max-tokens must be >= 1")
    if args.side:
        return _side_main(args)
    ours, theirs = _side(args, "pdserve"), _side(args, "transformers")
    result = {
        "model": args.model,
        "batch1_ratio": ours["batch1_tok_s"] / theirs["batch1_tok_s"],
        "mixed16_ratio": ours["mixed16_tok_s"] / theirs["mixed16_tok_s"],
        **{f"pdserve_{k}": v for k, v in ours.items()},
        **{f"transformers_{k}": v for k, v in theirs.items()},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model: {args.model}")
    print(f"{'':24}{'pdserve':>12}{'transformers':>14}{'ratio':>8}")
    for key, label in (("batch1_tok_s", "batch 1 (tok/s)"), ("mixed16_tok_s", "mixed 16 (tok/s)")):
        ratio = ours[key] / theirs[key]
        print(f"{label:24}{ours[key]:12.1f}{theirs[key]:14.1f}{ratio:7.2f}x")
    print(f"{'peak RSS (MiB)':24}{ours['peak_rss_mib']:12.0f}{theirs['peak_rss_mib']:14.0f}")
    return 0
