"""A Generation service of the test's own on a real gRPC server (benchmark clients driven
against it without a cluster)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from pdserve.v1 import generation_pb2_grpc as pb_grpc


@contextlib.asynccontextmanager
async def serving(servicer: pb_grpc.GenerationServicer) -> AsyncIterator[str]:
    """Serves `servicer` on an ephemeral local port; yields its target (host:port)."""
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
