"""`pdserve bench <name>`: benchmarks, each running pdserve and its baseline side by side.

Each benchmark is one module `bench/<name>.py` exposing `add_arguments(parser)` and
`run(args) -> int`; it is imported only when chosen.
"""

from __future__ import annotations

import argparse
import importlib

from bench.repeats import run_repeated
from services.common.errors import NotAvailableError

BENCHMARKS: dict[str, str] = {
    "engine": "pdserve engine vs transformers generate (batch 1 and mixed 16 requests)",
    "transfer": "UCX connector vs raw ucxx, NIXL, gRPC and memcpy",
    "aggregator": "per-rank reports per second through the aggregator",
    "serve": "load generator against a cluster: disaggregated vs colocated",
    "events": "KV-event plane throughput and latency (gRPC and ZMQ subscribers)",
    "scale": "one scheduler process against 128 -> 1,024 simulated ranks on real control streams",
    "chaos": "kill engines and the scheduler under load; count lost requests",
    "load": "1,000 concurrent streaming clients against a local cluster",
    "gpu-check": "pdserve on one GPU: parity with transformers, a 1P1D cluster, CUDA KV bandwidth (one JSON)",
}

# Benchmarks with a baseline take `--repeat N` (bench/repeats.py: interleaved ABBA runs, the
# median and min–max of every ratio); the value is the default N. Headline figures in
# docs/benchmarks.md use --repeat 3 or more; the defaults keep the smoke tests short.
REPEATABLE: dict[str, int] = {"aggregator": 3, "serve": 1, "events": 1, "scale": 1, "transfer": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, text in BENCHMARKS.items():
        p = sub.add_parser(name, help=text, description=text)
        module_name = f"bench.{name.replace('-', '_')}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            p.add_argument("--json", action="store_true", help="print one JSON object")
            p.set_defaults(_bench_run=None)
            continue
        module.add_arguments(p)
        if name in REPEATABLE:
            p.add_argument("--repeat", type=int, default=REPEATABLE[name],
                           help="runs, sides interleaved ABBA; reports each ratio's median, min-max and "
                                f"per-run values (default {REPEATABLE[name]}; headlines use 3 or more)")
        p.set_defaults(_bench_run=module.run, _bench_headline=tuple(getattr(module, "HEADLINE_KEYS", ())))


def run(args: argparse.Namespace) -> int:
    if args._bench_run is None:
        raise NotAvailableError(f"benchmark {args.bench!r} comes with its issue")
    repeat = getattr(args, "repeat", 1)
    if repeat != 1 and not (getattr(args, "from_json", None) or getattr(args, "target", None)):
        return run_repeated(args._bench_run, args, args._bench_headline)
    return int(args._bench_run(args) or 0)
