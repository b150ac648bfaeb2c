"""What pdserve's settings become in vLLM's engine arguments: defaults mean vLLM's own (dtype
auto, auto-fit context), the KV budget follows the platform (CPU bytes, a share of the GPU, or
vLLM's gpu_memory_utilization)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from engine.demo_model import demo_model_dir


@pytest.fixture
def vengine() -> ModuleType:
    """connectors.vllm.engine, imported here rather than at the top: it imports vLLM, and the
    main .venv (no vLLM) must still collect this module to skip it (tests/vllm/conftest.py)."""
    import connectors.vllm.engine as module
    return module


def _settings(vengine: ModuleType, **kw: object) -> Any:
    from connectors.vllm.params import PdserveConnectorConfig
    base: dict[str, object] = dict(model=str(demo_model_dir()), tp=1, dtype="auto", block_size=32,
                                   kv_cache_bytes=256 << 20, max_num_seqs=8, max_num_batched_tokens=512,
                                   max_model_len=0, connector=PdserveConnectorConfig(engine_id="e"), vllm_args={})
    return vengine.VllmEngineSettings(**{**base, **kw})


def test_defaults_are_vllms_own(vengine: ModuleType) -> None:
    args = vengine.engine_args(_settings(vengine))
    assert args.dtype == "auto" and args.max_model_len == vengine.AUTO_FIT_MAX_MODEL_LEN == -1
    assert args.kv_cache_memory_bytes == 256 << 20


def test_explicit_settings_pass_through(vengine: ModuleType) -> None:
    args = vengine.engine_args(_settings(vengine, dtype="float32", max_model_len=2048))
    assert args.dtype == "float32" and args.max_model_len == 2048


def test_kv_budget_per_platform(vengine: ModuleType) -> None:
    assert vengine.kv_budget(_settings(vengine), cuda=False) == {"kv_cache_memory_bytes": 256 << 20}
    gpu = _settings(vengine, gpu_memory_fraction=0.25)
    assert vengine.kv_budget(gpu, cuda=True, device_memory_bytes=80 << 30) == {"kv_cache_memory_bytes": 20 << 30}
    # no fraction given: vLLM's gpu_memory_utilization decides
    assert vengine.kv_budget(_settings(vengine), cuda=True, device_memory_bytes=80 << 30) == {}
    args = vengine.engine_args(_settings(vengine), cuda=True, device_memory_bytes=80 << 30)
    assert args.kv_cache_memory_bytes is None


def test_cpu_tp1_worker_runs_in_the_engine_core_process(vengine: ModuleType) -> None:
    """On CPU at tp 1 the "uni" executor (no worker process busy-waiting beside the engine core);
    tp 2 and CUDA keep vLLM's own executor choice."""
    assert vengine.executor_env(_settings(vengine), cuda=False) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert vengine.executor_env(_settings(vengine, tp=2), cuda=False) == {}
    assert vengine.executor_env(_settings(vengine), cuda=True) == {}
