"""The `pdserve` command: a thin dispatcher over one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported
only when chosen, so `pdserve generate` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from services.common.bound_ports import EXIT_PORT_IN_USE, PortInUse
from services.common.errors import NotAvailableError

# name -> (module, one-line description)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.up", "run scheduler, prefill and decode engines as local processes"),
    "scheduler": ("services.scheduler.main", "run the central scheduler service"),
    "prefill": ("services.prefill.main", "run a prefill engine (all its tp ranks)"),
    "decode": ("services.decode.main", "run a decode engine (all its tp ranks)"),
    "generate": ("services.generate", "send a prompt to the scheduler and stream the answer"),
    "role": ("services.role", "show engine roles, or change one engine's role in place"),
    "events": ("services.events", "print the cluster's KV events as JSON lines"),
    "health": ("services.health", "check a server's gRPC health (exit 0 when SERVING)"),
    "offline": ("engine.offline", "run the engine in-process on prompts (no services)"),
    "bench": ("bench.cli", "benchmarks: engine, transfer, aggregator, serve, events, scale, chaos, load, gpu-check"),
    "model": ("engine.demo_model", "model utilities (prepare-demo: convert the demo model)"),
    "demo": ("services.demo", "the demo: start a local cluster, stream a few prompts, summarize"),
}


def build_parser(name: str) -> argparse.ArgumentParser:
    module_name, description = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"pdserve {name}", description=description)
    module.add_arguments(parser)
    parser.set_defaults(_run=module.run)
    return parser


def _top_level_help() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: pdserve <command> [options]", "",
             "pdserve: disaggregated prefill/decode LLM serving.", "", "commands:"]
    lines += [f"  {n.ljust(width)}  {d}" for n, (_, d) in SUBCOMMANDS.items()]
    lines += ["", "Run `pdserve <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_level_help())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from services.common.version import __version__

        print(f"pdserve {__version__}")
        return 0
    name = argv[0]
    if name not in SUBCOMMANDS:
        print(f"pdserve: unknown command {name!r}\n\n{_top_level_help()}", file=sys.stderr)
        return 2
    parser = build_parser(name)
    args = parser.parse_args(argv[1:])
    try:
        return int(args._run(args) or 0)
    except PortInUse as e:
        print(f"pdserve {name}: {e.strerror}", file=sys.stderr)
        return EXIT_PORT_IN_USE
    except NotAvailableError as e:
        print(f"pdserve {name}: not available yet: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"pdserve {name}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
