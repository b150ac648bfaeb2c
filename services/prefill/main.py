"""`pdserve prefill`: run a prefill engine (all its tp ranks)."""

from __future__ import annotations

import argparse

from services.common.config import EngineConfig, add_config_arguments, load_config
from services.common.errors import NotAvailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, EngineConfig)


def run(args: argparse.Namespace) -> int:
    load_config(EngineConfig, args, overrides={"role": "prefill"})
    raise NotAvailableError("the prefill service comes with the serving-path issue")
