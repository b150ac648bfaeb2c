"""Server-streaming handlers whose generators end with their RPC.

A client that cancels while gRPC is sending one of a handler's responses cancels gRPC's send,
not the handler: the handler's generators stay suspended at their `yield` until the garbage
collector finalises them, and what they hold lives on: an engine's request, the scheduler's
decode leg, a KV-event subscription, a client's stream count. Measured before this: 2 of 40
cancelled Generate calls kept their decode request running 20 s. `MalformedRequestGuard` (the
first interceptor of every pdserve server) runs every streaming handler through `relay`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc

_CLOSING: set[asyncio.Task[None]] = set()


def close_when_done(context: grpc.aio.ServicerContext, responses: AsyncGenerator[Any, None]) -> None:
    """Closes `responses` when the RPC ends (a no-op for a generator that has ended)."""
    async def close() -> None:
        with contextlib.suppress(RuntimeError):  # still running: the task's own cancellation ends it
            await responses.aclose()

    def done(_: object) -> None:
        task = asyncio.get_running_loop().create_task(close())
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    context.add_done_callback(done)


async def relay(context: grpc.aio.ServicerContext, responses: AsyncGenerator[Any, None]) -> AsyncIterator[Any]:
    """Yields what `responses` yields; `responses` is closed when the RPC ends or this is closed."""
    close_when_done(context, responses)
    async with contextlib.aclosing(responses):
        async for item in responses:
            yield item
