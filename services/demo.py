"""`pdserve demo`: the demo."""

from __future__ import annotations

import argparse

from services.common.errors import NotAvailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory; default: the demo model")


def run(args: argparse.Namespace) -> int:

    raise NotAvailableError("the demo needs the serving path (pdserve up); nothing to run yet")
