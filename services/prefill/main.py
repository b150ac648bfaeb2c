"""`pdserve prefill`: run a prefill engine — rank 0 serves the Engine API, ranks 1..tp-1 are
spawned; every rank holds a control stream to the scheduler and a UCX data plane."""

from __future__ import annotations

import argparse
import asyncio
import socket

from services.common.config import EngineConfig, add_config_arguments, load_config
from services.common.logs import setup_logging
from services.common.tracing import setup_tracing, shutdown_tracing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, EngineConfig)


def run(args: argparse.Namespace) -> int:
    config = load_config(EngineConfig, args, overrides={"role": "prefill"})
    if not config.engine_id:
        config.engine_id = f"prefill-{socket.gethostname()}"
    setup_logging(config.log_level, config.engine_id)
    setup_tracing("prefill", attributes={"pdserve.engine_id": config.engine_id, "pdserve.rank": 0})
    from services.common.engine_server import serve

    try:
        asyncio.run(serve(config))
    finally:
        shutdown_tracing()  # flush batched spans (after the SIGTERM drain too)
    return 0
