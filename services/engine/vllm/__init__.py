"""vLLM's async engine behind the Engine API (`--engine vllm`): `VllmBackend`."""

from __future__ import annotations

from services.common.config import EngineConfig
from services.engine.vllm.backend import VllmBackend


def create_backend(config: EngineConfig, engine_address: str) -> VllmBackend:
    return VllmBackend(config, engine_address)
