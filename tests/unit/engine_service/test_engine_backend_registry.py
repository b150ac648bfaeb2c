"""The backend registry (`--engine`), the fast refusal of an unavailable backend, and the
import boundary that keeps that refusal fast (no torch, no vLLM before the backend loads)."""

import importlib.util
import subprocess
import sys
import time

import pytest

from services.common.config import ENGINES
from services.engine.registry import BACKENDS, BackendUnavailable, backend_factory, check_backend

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_registry_knows_exactly_the_configurable_engines() -> None:
    assert tuple(BACKENDS) == ENGINES


def test_native_backend_is_found_and_builds_from_config() -> None:
    from services.common.config import EngineConfig
    from services.engine.native import NativeBackend

    backend = backend_factory("native")(EngineConfig(role="decode"), "127.0.0.1:1")
    assert isinstance(backend, NativeBackend)
    assert not backend.ready and not backend.failed and backend.epoch % 2 == 1


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(BackendUnavailable, match="unknown engine backend 'sglang' \\(choose from native, vllm\\)"):
        check_backend("sglang")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed in this environment (tests/vllm covers it)")
def test_vllm_without_vllm_says_how_to_install_it() -> None:
    with pytest.raises(BackendUnavailable, match="vLLM is not installed in this environment: run `make install-vllm`"):
        check_backend("vllm")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed in this environment (tests/vllm covers it)")
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pdserve_engine_vllm_exits_at_once_with_one_line(role: str) -> None:
    """About 1 s per role (interpreter start-up plus config)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.common.cli", role, "--engine", "vllm",
                           "--vllm-arg", "enforce_eager=true"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"pdserve {role}: vLLM is not installed in this environment: run `make install-vllm` and use "
        ".venv-vllm/bin/pdserve"]
    assert time.monotonic() - start < 10


def test_bad_vllm_arg_exits_with_the_reason() -> None:
    proc = subprocess.run([sys.executable, "-m", "services.common.cli", "decode", "--engine", "vllm",
                           "--vllm-arg", "tensor_parallel_size=2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "vllm: tensor_parallel_size is set by pdserve: use --tp" in proc.stderr


PROBE = """
import sys
import services.engine.main, services.engine.servicer, services.engine.registry, services.engine.convert
print(sorted(m for m in ("torch", "vllm", "engine.llm_engine") if m in sys.modules))
"""


def test_service_layer_imports_no_engine() -> None:
    """The servicer, registry and entry point load no engine: choosing a backend that cannot
    run is refused before torch loads, and the servicer serves any backend."""
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
