"""`run_on_loop`: runs a process's main coroutine on the event loop its config names.

"uvloop" (libuv's loop) or "asyncio" (the standard library's; the scheduler's default). Every
server and client the scheduler runs works on both: grpc aio (it wakes the loop from its
completion-queue poller thread through a socket the loop reads, which any loop implementing
`add_reader` serves), uvicorn (it supports uvloop itself) and the ZMQ publisher (plain blocking
sockets and a thread, no loop integration). asyncio is the default: on the machine this was
measured on, uvloop did not lower the request path's cost, which sits in grpc aio's own layers
(docs/decisions/0006-request-path-floor.md), nor the scheduler's cost per rank message at 1,024
ranks (docs/decisions/0050-scheduler-cost-per-rank-message.md). Where uvloop cannot be imported
(a platform without its wheel), "uvloop" runs on asyncio's loop and says so in the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

EVENT_LOOPS = ("uvloop", "asyncio")


def run_on_loop(main: Coroutine[Any, Any, T], event_loop: str) -> T:
    """Runs `main` to completion on a new loop of kind `event_loop` (one of EVENT_LOOPS) and
    closes it, as `asyncio.run` does; "uvloop" without uvloop installed runs on asyncio's loop.
    Raises ValueError for an unknown kind (before running)."""
    if event_loop not in EVENT_LOOPS:
        main.close()
        raise ValueError(f"event_loop: must be one of {', '.join(EVENT_LOOPS)}, got {event_loop!r}")
    if event_loop == "uvloop":
        try:
            import uvloop
        except ImportError as e:
            logger.warning("event loop uvloop is not available (%s); running on asyncio's", e)
        else:
            return uvloop.run(main)
    return asyncio.run(main)
