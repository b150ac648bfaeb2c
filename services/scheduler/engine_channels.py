"""`EngineChannels`: the scheduler's gRPC channels to the engines, one per engine."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pdserve.v1 import engine_pb2_grpc as eng_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.security import ChannelSecurity, open_channel
from services.common.tracing import client_interceptors
from services.scheduler.registry import EngineState

ROTATION_GRACE_S = 600.0  # calls on a channel replaced after a certificate rotation may run this long


class EngineChannels:
    """One channel and Engine stub per engine, re-created when the engine's address changes or
    the scheduler's certificate files were rotated (calls in flight on the old channel finish)."""

    def __init__(self, security: ChannelSecurity | None = None) -> None:
        self.security = security  # mTLS towards the engines when the scheduler has certificates
        self._stubs: dict[str, tuple[tuple[str, Any], grpc.aio.Channel, eng_grpc.EngineStub]] = {}
        self._retired: dict[grpc.aio.Channel, asyncio.Task[None]] = {}  # closing after a rotation

    def stub(self, engine: EngineState) -> eng_grpc.EngineStub:
        key = (engine.address, self.security.stamp() if self.security is not None else None)
        entry = self._stubs.get(engine.engine_id)
        if entry is None or entry[0] != key:
            if entry is not None:
                grace = ROTATION_GRACE_S if entry[0][0] == engine.address else None
                old = entry[1]
                task = asyncio.get_running_loop().create_task(old.close(grace))
                self._retired[old] = task
                task.add_done_callback(lambda _: self._retired.pop(old, None))
            channel = open_channel(engine.address, self.security, CHANNEL_OPTIONS,
                                   interceptors=client_interceptors() or None)
            entry = (key, channel, eng_grpc.EngineStub(channel))
            self._stubs[engine.engine_id] = entry
        return entry[2]

    async def close(self) -> None:
        for _, channel, _ in self._stubs.values():
            await channel.close(None)
        for channel in list(self._retired):
            await channel.close(None)
        self._stubs.clear()
