"""`pdserve generate`: send prompts to the scheduler and stream the answers."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc

from services.client import Client
from services.common.security import add_client_security_arguments, client_security_from_args

DEFAULT_TARGET = "127.0.0.1:50051"


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, help="tokens to generate (server default when unset)")
    parser.add_argument("--temperature", type=float, help="sampling temperature; 0 is greedy")
    parser.add_argument("--top-p", type=float, help="nucleus sampling probability mass")
    parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    parser.add_argument("--seed", type=int, help="per-request seed (reproducible sampling)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-ids", default="", help="comma-separated stop token ids")
    parser.add_argument("--ignore-eos", action="store_true", default=None, help="do not stop at EOS")
    parser.add_argument("--ttft-target-ms", type=float, help="TTFT target; the scheduler may prefill on the "
                                                             "decode engine to meet it")
    parser.add_argument("--itl-target-ms", type=float, help="ITL target; no prefill on this request's decode "
                                                            "engine stalls it longer")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "seed": args.seed, "stop": args.stop,
        "stop_token_ids": parse_ids(args.stop_token_ids) if args.stop_token_ids else [],
        "ignore_eos": args.ignore_eos,
        "ttft_target_ms": getattr(args, "ttft_target_ms", None), "itl_target_ms": getattr(args, "itl_target_ms", None),
    }


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"token ids must be comma-separated integers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"scheduler client API host:port, or every replica's as a comma list (a request "
                             "whose replica dies goes on at the next, resumed from the tokens it had; default: "
                             f"where `pdserve up` listens, {DEFAULT_TARGET})")
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    parser.add_argument("--prompt-ids", action="append", default=[], help="comma-separated prompt token ids (repeatable)")
    template = parser.add_mutually_exclusive_group()
    template.add_argument("--chat", action="store_true",
                          help="apply the model's chat template to text prompts (the default when the model has one)")
    template.add_argument("--raw", action="store_true",
                          help="send text prompts as they are, without the chat template (completion-style)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per prompt: token ids, text, finish reason, usage, the path "
                             "decision with its predicted and actual TTFT")
    add_sampling_arguments(parser)
    add_client_security_arguments(parser)


def run(args: argparse.Namespace) -> int:
    prompts: list[str | list[int]] = [*args.prompt, *(parse_ids(p) for p in args.prompt_ids)]
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    kwargs = sampling_kwargs(args)
    with Client(args.target, security=client_security_from_args(args)) as client:
        try:
            chat = use_chat_template(client, args, prompts)
            for prompt in prompts:
                templated = chat and isinstance(prompt, str)
                if args.json:
                    result = client.generate(prompt, timeout=args.timeout, chat=templated, **kwargs)
                    print(json.dumps(result.to_json()), flush=True)
                    continue
                result = client.generate(prompt, timeout=args.timeout, chat=templated,
                                         on_chunk=lambda c: print(c.text, end="", flush=True), **kwargs)
                print(f"\n[{result.finish_reason}; prompt {result.prompt_tokens}, cached {result.cached_tokens}, "
                      f"transferred {result.transferred_tokens}, peer-fetched {result.peer_fetched_tokens}, "
                      f"generated {result.generated_tokens} tokens]")
                if isinstance(prompt, str) and not templated and result.finish_reason == "stop" \
                        and result.generated_tokens <= 1:
                    print("pdserve generate: hint: the answer ended at its first token; an instruct model "
                          "usually needs its chat template (--chat)", file=sys.stderr)
        except grpc.RpcError as e:
            print(f"pdserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def use_chat_template(client: Client, args: argparse.Namespace, prompts: list[str | list[int]]) -> bool:
    """Text prompts get the model's chat template unless --raw: a question to an instruct
    model otherwise often ends at its first token (EOS). Asks the server only when it matters."""
    if args.chat or args.raw or not any(isinstance(p, str) for p in prompts):
        return bool(args.chat)
    return bool(client.server_info().has_chat_template)
