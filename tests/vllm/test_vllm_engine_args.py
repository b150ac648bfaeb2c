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
    # the share is also vLLM's gpu_memory_utilization: its start-up check wants that much free,
    # not its default 0.92 (which the second engine on a shared GPU never finds)
    assert vengine.kv_budget(gpu, cuda=True, device_memory_bytes=80 << 30) == {
        "kv_cache_memory_bytes": 20 << 30, "gpu_memory_utilization": 0.25}
    args = vengine.engine_args(gpu, cuda=True, device_memory_bytes=80 << 30)
    assert (args.kv_cache_memory_bytes, args.gpu_memory_utilization) == (20 << 30, 0.25)
    # --vllm-arg still has the last word
    args = vengine.engine_args(_settings(vengine, gpu_memory_fraction=0.25, vllm_args={"gpu_memory_utilization": 0.5}),
                               cuda=True, device_memory_bytes=80 << 30)
    assert args.gpu_memory_utilization == 0.5
    # no fraction given: vLLM's gpu_memory_utilization decides
    assert vengine.kv_budget(_settings(vengine), cuda=True, device_memory_bytes=80 << 30) == {}
    args = vengine.engine_args(_settings(vengine), cuda=True, device_memory_bytes=80 << 30)
    assert args.kv_cache_memory_bytes is None


def test_devices_become_the_workers_cuda_visible_devices(vengine: ModuleType) -> None:
    env = vengine.worker_environment(_settings(vengine, devices="2,3", torch_threads=2), {})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["OMP_NUM_THREADS"] == "2" and env["PYTHONHASHSEED"]
    # indices among the GPUs the engine process sees (a device plugin's list, or UUIDs)
    inherited = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "OMP_NUM_THREADS": "1"}
    env = vengine.worker_environment(_settings(vengine, devices="1,3", torch_threads=2), inherited)
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7" and "OMP_NUM_THREADS" not in env
    env = vengine.worker_environment(_settings(vengine, devices="0"), {"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2"})
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a1"
    with pytest.raises(ValueError, match=r"--devices 2: this process sees 2 GPU\(s\)"):
        vengine.worker_environment(_settings(vengine, devices="2"), {"CUDA_VISIBLE_DEVICES": "4,5"})
    # no --devices: the inherited placement stands
    assert "CUDA_VISIBLE_DEVICES" not in vengine.worker_environment(_settings(vengine), inherited)


def test_cpu_tp1_worker_runs_in_the_engine_core_process(vengine: ModuleType) -> None:
    """On CPU at tp 1 the "uni" executor (no worker process busy-waiting beside the engine core);
    tp 2 and CUDA keep vLLM's own executor choice."""
    assert vengine.executor_env(_settings(vengine), cuda=False) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert vengine.executor_env(_settings(vengine, tp=2), cuda=False) == {}
    assert vengine.executor_env(_settings(vengine), cuda=True) == {}


def test_cpu_runs_the_model_eagerly_unless_the_user_chose(vengine: ModuleType) -> None:
    """vLLM's compiled CPU graph answered the README's question wrongly in bfloat16 (decision
    0040): CPU engines run eagerly by default; an explicit compile setting stands; CUDA keeps
    vLLM's compiled default (checked at start by the self-check)."""
    assert vengine.engine_args(_settings(vengine), cuda=False).enforce_eager is True
    compiled = vengine.engine_args(_settings(vengine, vllm_args={"enforce_eager": False}), cuda=False)
    assert compiled.enforce_eager is False
    chosen = vengine.engine_args(_settings(vengine, vllm_args={"compilation_config": {"mode": 3}}), cuda=False)
    assert chosen.enforce_eager is False
    assert vengine.engine_args(_settings(vengine), cuda=True, device_memory_bytes=80 << 30).enforce_eager is False
