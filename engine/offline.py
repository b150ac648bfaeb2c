"""`pdserve offline`: run the engine in-process on prompts."""

from __future__ import annotations

import argparse

from services.common.errors import NotAvailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory; default: the demo model")
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    parser.add_argument("--prompt-ids", action="append", help="comma-separated prompt token ids")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def run(args: argparse.Namespace) -> int:

    raise NotAvailableError("the engine comes with the engine issue")
