"""`pdserve bench`: benchmarks, each side by side with its baseline in one run."""

from __future__ import annotations

import argparse

from services.common.cli import NotAvailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, text in [("engine", "pdserve engine vs transformers generate"),
                       ("transfer", "UCX connector vs raw ucxx, NIXL, gRPC and memcpy"),
                       ("aggregator", "per-rank reports per second through the aggregator"),
                       ("serve", "load generator against a cluster: disaggregated vs colocated"),
                       ("events", "KV-event plane throughput and latency"),
                       ("chaos", "kill engines and the scheduler under load"),
                       ("load", "1,000 concurrent streaming clients")]:
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:

    raise NotAvailableError("benchmarks come with their issues")
