"""`pdserve scheduler`: run the central scheduler service."""

from __future__ import annotations

import argparse

from services.common.config import SchedulerConfig, add_config_arguments, load_config
from services.common.errors import NotAvailableError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, SchedulerConfig)


def run(args: argparse.Namespace) -> int:
    load_config(SchedulerConfig, args)
    raise NotAvailableError("the scheduler service comes with the serving-path issue")
