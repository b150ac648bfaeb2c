"""`pdserve up --device cuda`: engines spread over the visible GPUs, each rank's KV share, the
dtype and device printed — with hand-built hosts (no CUDA needed)."""

from __future__ import annotations

import argparse

import pytest

from engine.device import DeviceUnavailableError, HostDevices
from services import up

ONE_GPU = HostDevices(num_gpus=1, cuda_build="13.0", native_bf16=False)
TWO_GPUS = HostDevices(num_gpus=2, cuda_build="13.0", native_bf16=False)
NO_GPU = HostDevices(num_gpus=0, cuda_build=None, native_bf16=True)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_one_gpu_carries_one_prefill_and_one_decode_engine_with_split_kv_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "probe_host", lambda: ONE_GPU)
    args = parse("--device", "cuda")
    placement = up.gpu_placement(args)
    assert placement.engine_devices == ["0", "0"] and placement.memory_fraction == pytest.approx(0.25)
    assert placement.describe() == ("cuda (1 GPU(s), up to 2 engine rank(s) per GPU, KV 0.25 of GPU memory per "
                                    "rank), dtype bfloat16")
    spec = up.spec_from_args(args)
    assert spec.engine_devices == ["0", "0"]
    assert spec.engine_args == ["--device", "cuda", "--gpu-memory-fraction", "0.2500"]


def test_tp_engines_take_distinct_gpus_and_explicit_settings_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "probe_host", lambda: TWO_GPUS)
    args = parse("--tp", "2", "--dtype", "float16", "--kv-staging", "host", "--gpu-memory-fraction", "0.3")
    spec = up.spec_from_args(args)
    assert spec.engine_devices == ["0,1", "0,1"]
    assert spec.engine_args == ["--device", "cuda", "--dtype", "float16", "--kv-staging", "host",
                                "--gpu-memory-fraction", "0.3000"]
    monkeypatch.setattr(up, "probe_host", lambda: ONE_GPU)
    with pytest.raises(ValueError, match=r"0.6 times 2 ranks per GPU must stay below 1"):
        up.spec_from_args(parse("--gpu-memory-fraction", "0.6"))


def test_cpu_cluster_states_its_dtype_and_cuda_without_a_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "probe_host", lambda: NO_GPU)
    placement = up.gpu_placement(parse())
    assert (placement.kind, placement.describe()) == ("cpu", "cpu, dtype bfloat16")
    assert up.spec_from_args(parse()).engine_args == []
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
        up.spec_from_args(parse("--device", "cuda"))
    with pytest.raises(ValueError, match="tp 2 needs 2 GPUs per engine; 1 visible"):
        monkeypatch.setattr(up, "probe_host", lambda: ONE_GPU)
        up.spec_from_args(parse("--tp", "2"))


def test_kv_transport_passes_to_every_engine_only_when_not_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "probe_host", lambda: NO_GPU)
    assert "--kv-transport" not in up.spec_from_args(parse()).engine_args
    args = up.spec_from_args(parse("--kv-transport", "nixl", "--prefill-tp", "2")).engine_args
    assert args[args.index("--kv-transport") + 1] == "nixl"
