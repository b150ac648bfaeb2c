"""`pdserve events`: print the cluster's KV events as JSON lines."""

from __future__ import annotations

import argparse

from services.common.errors import NotAvailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50053", help="scheduler KVEvents host:port")
    parser.add_argument("--from-seq", type=int, help="replay from this sequence number")
    parser.add_argument("--zmq", metavar="ENDPOINT", help="read vLLM-format events from a ZMQ PUB endpoint")


def run(args: argparse.Namespace) -> int:

    raise NotAvailableError("the event plane comes with the KV-event issue")
