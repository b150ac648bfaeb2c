"""`pdserve prefill`: run a prefill engine — rank 0 serves the Engine API, ranks 1..tp-1 are
spawned; every rank holds a control stream to the scheduler and a UCX data plane."""

from __future__ import annotations

import argparse

from services.common.config import EngineConfig, add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, EngineConfig)


def run(args: argparse.Namespace) -> int:
    from services.engine.main import run_engine  # the backend imports torch (or vLLM): only when serving

    return run_engine(args, "prefill")
