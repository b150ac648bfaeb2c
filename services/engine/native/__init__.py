"""pdserve's own engine behind the Engine API: `NativeBackend` over an `EngineLoop`."""

from __future__ import annotations

from services.common.config import EngineConfig
from services.engine.native.backend import NativeBackend


def create_backend(config: EngineConfig, engine_address: str) -> NativeBackend:
    return NativeBackend(config, engine_address)
