"""`pdserve bench serve --compare-kv-reuse`: KV reuse across engines (peer fetch, decision 0043)
off against on, on one cluster layout — 2 prefill + 2 decode engines whose KV cache is smaller
than the workload's working set — with the same client and workload; `--repeat N` interleaves
the sides ABBA (bench/repeats.py).

Workloads (`--workload`):
- `multi-turn`: `--conversations` conversations of `--turns` turns (at least 4), each
  conversation's turns one after the other (a user waits for each answer), the conversations
  concurrently, so their turns interleave on the engines. Turn t+1's prompt is turn t's prompt,
  its answer (the tokens generated) and a new message of 16-64 tokens; `--prompt-len` is the
  first turn's (800:1000 puts the last turns' history past 1,000 tokens). Each side reports
  `history_tokens` (the last turns' prompt lengths, p50 and max) and `turns_away`: the share of
  follow-up turns computed (prefilled) on another engine than the one that decoded the turn
  before (where the history's KV is), the case a peer fetch exists for.
- `shared-prefix`: bench/serve.py's shared-prefix prompts (`--num-prefixes` prefixes of
  `--prefix-len` tokens).
- `random`: unrelated prompts (nothing to reuse: the cost of trying).

Each side's `decisions` count the path reasons: `decode_local:peer_fetch` (a fetch into the
decode engine), `remote:peer_fetch` (into the prefill engine, decision 0046).

Keys: ttft_p50_speedup, ttft_p90_speedup (off / on), throughput_ratio (on / off),
peer_hit_rate (prompt tokens fetched from a peer / prompt tokens, on), recomputed_tokens_ratio
(prompt tokens computed, on / off), prediction_error_p50 (the fetch decisions' |predicted -
actual| / actual TTFT), identical (every request's output tokens equal on both sides),
requests_lost (requests that failed, both sides).

Fairness: both sides run the scheduler's defaults (prefix routing, the cost path policy) and
differ only in `--peer-fetch` (off: no peer fetch and no decode-to-decode endpoints).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import Any

from bench.serve import (
    Workload,
    _in_order,
    _ratio,
    build_workload,
    started_cluster,
    summarize,
    warm_up_workload,
)
from services.client import AsyncClient, GenerationResult

ENGINES = {"num_prefill": 2, "num_decode": 2}


MIN_TURNS = 4


def _conversations(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], list[list[int]], list[int]]]:
    """Per conversation: the first prompt, the later turns' new messages, the output lengths."""
    if args.turns < MIN_TURNS or args.conversations < 1:
        raise ValueError(f"multi-turn: --turns must be >= {MIN_TURNS} and --conversations >= 1, "
                         f"got {args.turns} and {args.conversations}")
    rng = random.Random(args.seed)
    lo, _, hi = args.prompt_len.partition(":")
    o_lo, _, o_hi = args.output_len.partition(":")
    out = []
    for _ in range(args.conversations):
        first = [rng.randrange(100, vocab) for _ in range(rng.randint(int(lo), int(hi or lo)))]
        messages = [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 64))] for _ in range(args.turns - 1)]
        outs = [rng.randint(int(o_lo), int(o_hi or o_lo)) for _ in range(args.turns)]
        out.append((first, messages, outs))
    return out


async def _drive_conversations(target: str, convs: list[tuple[list[int], list[list[int]], list[int]]]
                               ) -> tuple[list[GenerationResult | None], float]:
    async with AsyncClient(target) as client:
        async def conversation(first: list[int], messages: list[list[int]], outs: list[int]
                               ) -> list[GenerationResult | None]:
            prompt = first
            results: list[GenerationResult | None] = []
            for turn, max_tokens in enumerate(outs):
                try:
                    r = await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                              timeout=600)
                except Exception as e:  # noqa: BLE001 - a lost request is counted, the conversation ends
                    print(f"  lost: {e}", file=sys.stderr)
                    return results + [None] * (len(outs) - turn)
                results.append(r)
                if turn < len(messages):
                    prompt = prompt + r.token_ids + messages[turn]
            return results

        start = time.perf_counter()
        per = await asyncio.gather(*(conversation(*c) for c in convs))
        return [r for rs in per for r in rs], time.perf_counter() - start


def turn_placement(results: list[GenerationResult | None], turns: int) -> dict[str, Any]:
    """`history_tokens` (the last turns' prompt lengths: p50, max) and `turns_away` (the share of
    follow-up turns whose computing engine — the prefill engine, or the decode engine when
    decode-local — is not the engine that decoded the turn before) of a multi-turn run's results,
    conversation by conversation (`turns` each, in order; None: lost)."""
    away = follow_ups = 0
    last: list[int] = []
    for c in range(0, len(results), turns):
        conv = results[c:c + turns]
        for before, turn in zip(conv, conv[1:], strict=False):
            if before is None or turn is None:
                continue
            follow_ups += 1
            away += (turn.prefill_engine_id or turn.decode_engine_id) != before.decode_engine_id
        if conv and conv[-1] is not None:
            last.append(conv[-1].prompt_tokens)
    return {"history_tokens": {"p50": statistics.median(last) if last else 0, "max": max(last, default=0)},
            "turns_away": round(away / follow_ups, 3) if follow_ups else 0.0}


async def _drive_prompts(target: str, wl: Workload, concurrency: int) -> tuple[list[GenerationResult | None], float]:
    async with AsyncClient(target) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> GenerationResult | None:
            async with sem:
                try:
                    return await client.generate(wl.prompts[i], max_tokens=wl.max_tokens[i], temperature=0.0,
                                                 ignore_eos=True, timeout=600)
                except Exception as e:  # noqa: BLE001 - counted as lost
                    print(f"  lost: {e}", file=sys.stderr)
                    return None

        start = time.perf_counter()
        results = list(await asyncio.gather(*(one(i) for i in range(len(wl.prompts)))))
        return results, time.perf_counter() - start


def _side(name: str, args: argparse.Namespace, mode: str, vocab: int) -> dict[str, Any]:
    scheduler_args = ["--peer-fetch", mode]
    with started_cluster(name, args, scheduler_args=scheduler_args, **ENGINES) as c:
        asyncio.run(_drive_prompts(c.target, warm_up_workload(), 2))
        if args.workload == "multi-turn":
            results, wall = asyncio.run(_drive_conversations(c.target, _conversations(args, vocab)))
        else:
            results, wall = asyncio.run(_drive_prompts(c.target, build_workload(args, vocab), args.concurrency))
    done = [r for r in results if r is not None]
    summary = summarize(done, wall, args)
    if args.workload == "multi-turn":
        summary.update(turn_placement(results, args.turns))
    prompt = sum(r.prompt_tokens for r in done)
    peer = sum(r.peer_fetched_tokens for r in done)
    # Computed somewhere (a prefill engine's tokens, later pulled, were computed too).
    computed = sum(max(0, r.prompt_tokens - r.cached_tokens - r.peer_fetched_tokens) for r in done)
    errors = [abs(r.predicted_ttft_ms - r.scheduler_ttft_ms) / r.scheduler_ttft_ms for r in done
              if r.peer_fetch_engine_id and r.predicted_ttft_ms > 0 and r.scheduler_ttft_ms > 0]
    summary.update(peer_fetched_tokens=peer, peer_hit_rate=round(peer / prompt, 4) if prompt else 0.0,
                   computed_prompt_tokens=computed, requests_lost=len(results) - len(done),
                   fetch_prediction_error_p50=round(statistics.median(errors), 3) if errors else None,
                   decisions=dict(sorted({k: sum(1 for r in done if r.path_reason == k)
                                          for k in {r.path_reason for r in done}}.items())),
                   outputs=[r.token_ids if r is not None else None for r in results])
    print(f"[{name}] TTFT p50 {summary['ttft_ms']['p50']} ms, {summary['throughput_tok_s']} tok/s, "
          f"peer hit rate {summary['peer_hit_rate']}", file=sys.stderr)
    return summary


def compare_kv_reuse(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    if args.workload == "multi-turn":
        _conversations(args, vocab)  # bad arguments end the run before any cluster starts
    runs = _in_order(args, {"reuse_off": lambda: _side("reuse_off", args, "off", vocab),
                            "reuse_on": lambda: _side("reuse_on", args, args.kv_reuse_mode, vocab)})
    off, on = runs["reuse_off"], runs["reuse_on"]
    identical = off.pop("outputs") == on.pop("outputs")
    return {
        "reuse_off": off, "reuse_on": on, "layout": ENGINES, "kv_cache_memory": args.kv_cache_memory,
        "ttft_p50_speedup": _ratio(off["ttft_ms"]["p50"], on["ttft_ms"]["p50"]),
        "ttft_p90_speedup": _ratio(off["ttft_ms"]["p90"], on["ttft_ms"]["p90"]),
        "throughput_ratio": _ratio(on["throughput_tok_s"], off["throughput_tok_s"]),
        "peer_hit_rate": on["peer_hit_rate"],
        "recomputed_tokens_ratio": _ratio(on["computed_prompt_tokens"], off["computed_prompt_tokens"]),
        "prediction_error_p50": on["fetch_prediction_error_p50"],
        "identical": 1.0 if identical else 0.0,
        "requests_lost": off["requests_lost"] + on["requests_lost"],
    }
