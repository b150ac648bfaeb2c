"""`pdserve offline`: run the engine in-process (all its tp ranks) on one or more prompts.

Prompts come from repeated `--prompt TEXT` / `--prompt-ids 1,2,3` flags and from `--jsonl FILE`
(one object per line with "prompt" or "prompt_ids"); they run concurrently. Output is printed in
input order: the text per prompt, or with `--json` one JSON object per line with `token_ids`
(generated tokens only), `text`, `finish_reason` and `num_cached_tokens`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory; default: the demo model")
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    parser.add_argument("--prompt-ids", action="append", default=[], help="comma-separated prompt token ids (repeatable)")
    parser.add_argument("--jsonl", help="file with one {\"prompt\": ...} or {\"prompt_ids\": [...]} per line")
    parser.add_argument("--chat", action="store_true", help="wrap text prompts in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV cache budget per rank")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    parser.add_argument("--max-model-len", type=int, default=0, help="longest sequence; 0 = model config")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when a GPU is visible)")
    parser.add_argument("--devices", default="", help="GPU indices of the ranks, e.g. 2,3 (default: rank r on GPU r)")
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16, float16 or auto (bfloat16 on CUDA and on CPUs with native bf16)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.0,
                        help="share of each rank's GPU memory for its KV cache (CUDA; 0 = --kv-cache-memory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def _collect_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    prompts: list[str | list[int]] = list(args.prompt)
    for text in args.prompt_ids:
        try:
            prompts.append([int(t) for t in text.replace(" ", "").split(",") if t])
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if args.jsonl:
        for n, line in enumerate(Path(args.jsonl).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.jsonl}:{n}: not JSON ({e})") from None
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                prompts.append(obj["prompt"])
            elif isinstance(obj, dict) and isinstance(obj.get("prompt_ids"), list):
                prompts.append([int(t) for t in obj["prompt_ids"]])
            else:
                raise ValueError(f"{args.jsonl}:{n}: expected {{\"prompt\": str}} or {{\"prompt_ids\": [int]}}")
    if not prompts:
        raise ValueError("give at least one --prompt, --prompt-ids or --jsonl")
    return prompts


def _encode(engine: Any, prompt: str | list[int], chat: bool) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if engine.tokenizer is None:
        raise ValueError("this model has no tokenizer.json; use --prompt-ids")
    if chat:
        prompt = apply_chat_template(Path(engine.model_config.model_dir), prompt)
    return list(engine.tokenizer.encode(prompt).ids)


def apply_chat_template(model_dir: Path, user_text: str) -> str:
    """Renders one user turn with the model's chat template (tokenizer_config.json or
    chat_template.jinja), ending with the assistant's generation prompt."""
    import jinja2

    template = None
    cfg_path = model_dir / "tokenizer_config.json"
    if cfg_path.is_file():
        template = json.loads(cfg_path.read_text()).get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if not isinstance(template, str):
        raise ValueError(f"{model_dir} has no chat template; drop --chat")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=[{"role": "user", "content": user_text}],
                                            add_generation_prompt=True)


def run(args: argparse.Namespace) -> int:
    from engine.device import plan_devices
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    plan_devices(args.device, args.dtype, args.tp, args.devices)  # a missing GPU fails here, in milliseconds
    prompts = _collect_prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos)
    with LLMEngine(args.model or None, tp=args.tp, kv_cache_memory=args.kv_cache_memory,
                   block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                   device=args.device, dtype=args.dtype, devices=args.devices,
                   gpu_memory_fraction=args.gpu_memory_fraction) as engine:
        params.validate(engine.model_config.vocab_size)
        encoded = [_encode(engine, p, args.chat) for p in prompts]
        ids = [f"offline-{i}" for i in range(len(encoded))]
        results: dict[str, dict[str, Any]] = {
            rid: {"token_ids": [], "text": "", "finish_reason": None, "num_cached_tokens": 0} for rid in ids}
        for rid, prompt in zip(ids, encoded, strict=True):
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                r = results[out.request_id]
                r["token_ids"] += out.new_token_ids
                r["text"] += out.text_delta
                r["num_cached_tokens"] = out.num_cached_tokens
                if out.finished:
                    r["finish_reason"] = out.finish_reason
    for rid in ids:
        r = results[rid]
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(r["text"] if r["text"] or not r["token_ids"] else " ".join(map(str, r["token_ids"])))
            if len(ids) > 1:
                print("---")
    sys.stdout.flush()
    return 0
