"""`pdserve model`: model utilities."""

from __future__ import annotations

import argparse

from services.common.errors import NotAvailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("prepare-demo", help="convert the bundled SmolLM2-135M-Instruct GGUF into ~/.cache/pdserve")


def run(args: argparse.Namespace) -> int:

    raise NotAvailableError("demo-model conversion comes with the engine issue")
