"""Process-wide logging setup: one format, level from config; never prompt text at INFO."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def setup_logging(level: str = "INFO", component: str = "") -> None:
    """Configures the root logger once per process (idempotent)."""
    root = logging.getLogger()
    fmt = _FORMAT if not component else f"%(asctime)s %(levelname)s [{component}:{os.getpid()}] %(name)s: %(message)s"
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(fmt))
    root.setLevel(level.upper())
