"""`pdserve up`: run the whole cluster as local processes."""

from __future__ import annotations

import argparse

from services.common.errors import NotAvailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory; default: the demo model")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill engines")
    parser.add_argument("--decode", type=int, default=1, help="number of decode engines")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every engine")
    parser.add_argument("--port", type=int, default=50051, help="client API port")


def run(args: argparse.Namespace) -> int:

    raise NotAvailableError("local clusters come with the serving-path issue")
