"""`pdserve generate`: stream a generation from the scheduler."""

from __future__ import annotations

import argparse

from services.common.errors import NotAvailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50051", help="scheduler client API host:port")
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    parser.add_argument("--prompt-ids", action="append", help="comma-separated prompt token ids")
    parser.add_argument("--max-tokens", type=int, help="tokens to generate")
    parser.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    parser.add_argument("--json", action="store_true", help="print JSON lines")


def run(args: argparse.Namespace) -> int:

    raise NotAvailableError("the Generate client comes with the serving-path issue")
