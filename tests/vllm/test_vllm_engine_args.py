"""What pdserve's settings become in vLLM's engine arguments: defaults mean vLLM's own (dtype
auto, auto-fit context), the KV budget follows the platform (CPU bytes, a share of the GPU, or
vLLM's gpu_memory_utilization)."""

from __future__ import annotations

from connectors.vllm.engine import AUTO_FIT_MAX_MODEL_LEN, VllmEngineSettings, engine_args, kv_budget
from connectors.vllm.params import PdserveConnectorConfig
from engine.demo_model import demo_model_dir


def _settings(**kw: object) -> VllmEngineSettings:
    base: dict[str, object] = dict(model=str(demo_model_dir()), tp=1, dtype="auto", block_size=32,
                                   kv_cache_bytes=256 << 20, max_num_seqs=8, max_num_batched_tokens=512,
                                   max_model_len=0, connector=PdserveConnectorConfig(engine_id="e"), vllm_args={})
    return VllmEngineSettings(**{**base, **kw})  # type: ignore[arg-type]


def test_defaults_are_vllms_own() -> None:
    args = engine_args(_settings())
    assert args.dtype == "auto" and args.max_model_len == AUTO_FIT_MAX_MODEL_LEN == -1
    assert args.kv_cache_memory_bytes == 256 << 20


def test_explicit_settings_pass_through() -> None:
    args = engine_args(_settings(dtype="float32", max_model_len=2048))
    assert args.dtype == "float32" and args.max_model_len == 2048


def test_kv_budget_per_platform() -> None:
    assert kv_budget(_settings(), cuda=False) == {"kv_cache_memory_bytes": 256 << 20}
    gpu = _settings(gpu_memory_fraction=0.25)
    assert kv_budget(gpu, cuda=True, device_memory_bytes=80 << 30) == {"kv_cache_memory_bytes": 20 << 30}
    assert kv_budget(_settings(), cuda=True, device_memory_bytes=80 << 30) == {}  # gpu_memory_utilization decides
    args = engine_args(_settings(), cuda=True, device_memory_bytes=80 << 30)
    assert args.kv_cache_memory_bytes is None
