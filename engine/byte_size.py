"""`parse_size`: byte sizes as people write them (512MiB, 2G, 1048576) — for KV budgets."""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20,
               "mb": 1000**2, "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3}


def parse_size(text: str | int) -> int:
    """Parses a byte size such as 512MiB, 2G or 1048576 (ValueError with examples otherwise)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 512MiB, 2GiB, 1048576)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
