"""Device mapping and dtype defaults (engine/device.py) with hand-built hosts: no CUDA needed."""

from __future__ import annotations

import pytest

from engine.device import (
    DeviceUnavailableError,
    HostDevices,
    cpu_flags,
    cpu_has_native_bf16,
    parse_devices,
    plan_devices,
    rank_devices,
    resolve_dtype,
    resolve_kind,
)

NO_GPU_CPU_TORCH = HostDevices(num_gpus=0, cuda_build=None, native_bf16=False)
NO_GPU_CUDA_TORCH = HostDevices(num_gpus=0, cuda_build="13.0", native_bf16=True)
FOUR_GPUS = HostDevices(num_gpus=4, cuda_build="13.0", native_bf16=False)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PDSERVE_CPU_BF16", raising=False)


def test_rank_r_takes_the_rth_gpu_or_the_rth_entry_of_devices() -> None:
    assert rank_devices("cuda", 2, (), 4) == ("cuda:0", "cuda:1")
    assert rank_devices("cuda", 2, (2, 3), 4) == ("cuda:2", "cuda:3")
    assert rank_devices("cuda", 1, (3,), 4) == ("cuda:3",)
    assert rank_devices("cpu", 3, (), 0) == ("cpu", "cpu", "cpu")


def test_devices_must_fit_the_ranks_and_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="names 1 GPU.*for tp 2"):
        rank_devices("cuda", 2, (1,), 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ValueError, match=r"GPU index 2 is not visible: 2 GPU\(s\) visible \(CUDA_VISIBLE_DEVICES=4,5\)"):
        rank_devices("cuda", 1, (2,), 2)
    with pytest.raises(ValueError, match="tp 2 needs 2 GPUs"):
        rank_devices("cuda", 2, (), 1)  # falls back to (0, 1): index 1 is not visible
    with pytest.raises(ValueError, match="needs --device cuda"):
        rank_devices("cpu", 1, (0,), 0)


def test_parse_devices() -> None:
    assert parse_devices("") == ()
    assert parse_devices("2,3") == (2, 3)
    with pytest.raises(ValueError, match="comma-separated GPU indices"):
        parse_devices("a,b")
    with pytest.raises(ValueError, match="distinct GPU indices"):
        parse_devices("1,1")
    with pytest.raises(ValueError, match="distinct GPU indices"):
        parse_devices("-1")


def test_auto_is_cuda_only_when_a_gpu_is_visible() -> None:
    assert resolve_kind("auto", FOUR_GPUS) == "cuda"
    assert resolve_kind("auto", NO_GPU_CUDA_TORCH) == "cpu"
    assert resolve_kind("cpu", FOUR_GPUS) == "cpu"
    with pytest.raises(ValueError, match="give --device cuda --devices 1"):
        resolve_kind("cuda:1", FOUR_GPUS)
    with pytest.raises(ValueError, match="must be auto, cpu or cuda"):
        resolve_kind("tpu", FOUR_GPUS)


def test_cuda_without_a_gpu_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available: this torch build has no CUDA"):
        resolve_kind("cuda", NO_GPU_CPU_TORCH)
    with pytest.raises(DeviceUnavailableError, match=r"torch \(CUDA 13.0\) sees no GPU"):
        resolve_kind("cuda", NO_GPU_CUDA_TORCH)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceUnavailableError, match="CUDA_VISIBLE_DEVICES is empty"):
        resolve_kind("cuda", NO_GPU_CUDA_TORCH)


def test_dtype_defaults() -> None:
    assert resolve_dtype("auto", "cuda", native_bf16=False) == "bfloat16"
    assert resolve_dtype("auto", "cpu", native_bf16=True) == "bfloat16"
    assert resolve_dtype("auto", "cpu", native_bf16=False) == "float32"
    assert resolve_dtype("float32", "cuda", native_bf16=True) == "float32"  # explicit always wins
    with pytest.raises(ValueError, match="dtype must be auto"):
        resolve_dtype("int8", "cpu", native_bf16=False)


def test_native_bf16_from_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    x86 = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"
    old = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
    assert cpu_has_native_bf16(cpu_flags(x86))
    assert cpu_has_native_bf16(cpu_flags(arm))
    assert not cpu_has_native_bf16(cpu_flags(old))
    assert cpu_flags("no flags line") == frozenset()
    monkeypatch.setenv("PDSERVE_CPU_BF16", "0")
    assert not cpu_has_native_bf16(cpu_flags(x86))


def test_plan_on_cpu_and_on_gpus() -> None:
    plan = plan_devices("auto", "auto", 2, "", NO_GPU_CUDA_TORCH)
    assert (plan.kind, plan.rank_devices, plan.dtype) == ("cpu", ("cpu", "cpu"), "bfloat16")
    assert plan.describe() == "cpu bfloat16"
    plan = plan_devices("cuda", "auto", 2, "2,3", FOUR_GPUS)
    assert (plan.kind, plan.device_for(1), plan.dtype) == ("cuda", "cuda:3", "bfloat16")
    assert plan.describe() == "cuda:2,cuda:3 bfloat16"
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
        plan_devices("cuda", "float32", 1, "", NO_GPU_CPU_TORCH)


def test_compatibility_hash_covers_dtype_and_device_kind() -> None:
    from engine.config import ModelConfig
    from engine.kv_cache import make_kv_cache_spec
    from services.engine.rank_agent import compatibility_hash

    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}

    def digest(dtype: str, kind: str) -> str:
        config = ModelConfig.from_dict(raw, dtype=dtype)
        spec = make_kv_cache_spec(config, block_size=16, memory_bytes=1 << 20, device_kind=kind)
        return compatibility_hash(config, spec, "seed")

    assert digest("float32", "cpu") == digest("float32", "cpu")
    assert len({digest("float32", "cpu"), digest("bfloat16", "cpu"), digest("bfloat16", "cuda"),
                digest("float32", "cuda")}) == 4
