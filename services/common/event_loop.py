"""`run_on_loop`: runs a process's main coroutine on the event loop its config names.

"uvloop" (libuv's loop) or "asyncio" (the standard library's; the scheduler's default). Every
server and client the scheduler runs works on both: grpc aio (it wakes the loop from its
completion-queue poller thread through a socket the loop reads, which any loop implementing
`add_reader` serves), uvicorn (it supports uvloop itself) and the ZMQ publisher (plain blocking
sockets and a thread, no loop integration). asyncio is the default: on the machine this was
measured on, uvloop did not lower the request path's cost, which sits in grpc aio's own layers
(docs/decisions/0006-request-path-floor.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

EVENT_LOOPS = ("uvloop", "asyncio")


def run_on_loop(main: Coroutine[Any, Any, T], event_loop: str) -> T:
    """Runs `main` to completion on a new loop of kind `event_loop` (one of EVENT_LOOPS) and
    closes it, as `asyncio.run` does. Raises ValueError for an unknown kind (before running)."""
    if event_loop not in EVENT_LOOPS:
        main.close()
        raise ValueError(f"event_loop: must be one of {', '.join(EVENT_LOOPS)}, got {event_loop!r}")
    if event_loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
