"""The engine backends by name (`--engine`), and the one check that a chosen one can run here.

Each backend is a package exposing `create_backend(config, engine_address) -> EngineBackend`.
`native` is pdserve's own engine (`services.engine.native`); `vllm` is vLLM's async engine
(`services.engine.vllm`, needs vLLM: `make install-vllm`, `.venv-vllm/bin/pdserve`). A new
backend is one entry here and one package; nothing else names backends.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from services.common.config import EngineConfig
from services.engine.backend import EngineBackend

BackendFactory = Callable[[EngineConfig, str], EngineBackend]


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot run in this environment (the message says why, in one line)."""


class EngineRefused(RuntimeError):
    """The backend refused the model or configuration while starting (the message says why, in
    one line; `pdserve prefill/decode` exits with status 2 and it)."""


@dataclass(frozen=True, slots=True)
class BackendEntry:
    module: str  # the package exposing create_backend
    requires: tuple[str, ...] = ()  # top-level modules it imports that may be missing
    missing_hint: str = ""  # the one-line reason when a required module is missing


BACKENDS: dict[str, BackendEntry] = {
    "native": BackendEntry("services.engine.native"),
    "vllm": BackendEntry("services.engine.vllm", requires=("vllm",),
                         missing_hint="vLLM is not installed in this environment: run `make install-vllm` and use "
                                      ".venv-vllm/bin/pdserve"),
}


def check_backend(name: str) -> BackendEntry:
    """Raises BackendUnavailable unless `name` is a known backend whose modules are installed.
    Finds modules without importing them: answers in well under a second."""
    entry = BACKENDS.get(name)
    if entry is None:
        raise BackendUnavailable(f"unknown engine backend {name!r} (choose from {', '.join(BACKENDS)})")
    for module in entry.requires:
        if importlib.util.find_spec(module) is None:
            raise BackendUnavailable(entry.missing_hint or f"{module} is not installed in this environment")
    if importlib.util.find_spec(entry.module) is None:
        raise BackendUnavailable(f"the {name} engine backend is not part of this pdserve build "
                                 f"({entry.module} is missing)")
    return entry


def backend_factory(name: str) -> BackendFactory:
    """The backend's `create_backend`, importing its package (this may take seconds: torch, vLLM)."""
    entry = check_backend(name)
    try:
        module = importlib.import_module(entry.module)
    except ImportError as e:
        raise BackendUnavailable(f"the {name} engine backend cannot be imported here: {e}") from e
    factory: BackendFactory = module.create_backend
    return factory
