"""`pdserve up --device cuda`: engines placed on the visible GPUs by their role's TP
(services/placement.py), each engine's KV share, the dtype and device printed — with hand-built
hosts (no CUDA needed)."""

from __future__ import annotations

import argparse

import pytest

from engine.device import DeviceUnavailableError, HostDevices
from services import up

ONE_GPU = HostDevices(num_gpus=1, cuda_build="13.0", native_bf16=False)
FOUR_GPUS = HostDevices(num_gpus=4, cuda_build="13.0", native_bf16=False)
NO_GPU = HostDevices(num_gpus=0, cuda_build=None, native_bf16=True)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_one_gpu_carries_prefill_and_decode_unless_exclusive_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "probe_host", lambda: ONE_GPU)
    with pytest.raises(ValueError, match="2 ranks need 2 GPUs, 1 available: drop --exclusive-gpus"):
        up.spec_from_args(parse("--device", "cuda", "--exclusive-gpus"))
    args = parse("--device", "cuda")
    placement = up.gpu_placement(args)
    assert placement.engine_devices == ["0", "0"] and placement.memory_fractions == [0.25, 0.25]
    assert placement.describe() == ("cuda (1 GPU(s), up to 2 engine rank(s) per GPU, KV 0.25 of GPU memory per "
                                    "rank), dtype bfloat16")
    spec = up.spec_from_args(args)
    assert (spec.engine_devices, spec.engine_memory_fractions) == (["0", "0"], [0.25, 0.25])
    assert spec.engine_args == ["--device", "cuda"]


def test_each_role_places_by_its_own_tp_and_explicit_settings_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "probe_host", lambda: FOUR_GPUS)
    spec = up.spec_from_args(parse("--prefill-tp", "2", "--decode-tp", "1"))
    assert (spec.engine_devices, spec.engine_memory_fractions) == (["0,1", "2"], [0.5, 0.5])
    args = parse("--tp", "2", "--dtype", "float16", "--kv-staging", "host", "--kv-staging-blocks", "512",
                 "--gpu-memory-fraction", "0.3")
    spec = up.spec_from_args(args)
    assert (spec.engine_devices, spec.engine_memory_fractions) == (["0,1", "2,3"], [0.3, 0.3])
    assert spec.engine_args == ["--device", "cuda", "--dtype", "float16", "--kv-staging", "host",
                                "--kv-staging-blocks", "512"]
    monkeypatch.setattr(up, "probe_host", lambda: ONE_GPU)
    with pytest.raises(ValueError, match=r"0.6 times 2 ranks on GPU 0 must stay below 1"):
        up.spec_from_args(parse("--gpu-memory-fraction", "0.6"))


def test_engines_receive_their_own_devices_and_memory_share(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.local_cluster import LocalCluster

    monkeypatch.setattr(up, "probe_host", lambda: FOUR_GPUS)
    cluster = LocalCluster(up.spec_from_args(parse("--prefill-tp", "2", "--decode-tp", "1", "--port", "0",
                                                   "--control-port", "0", "--events-port", "0",
                                                   "--http-port", "0")))
    prefill = cluster._engine_component("prefill", 0).argv
    decode = cluster._engine_component("decode", 0).argv
    assert prefill[prefill.index("--tp") + 1] == "2" and decode[decode.index("--tp") + 1] == "1"
    assert prefill[prefill.index("--devices") + 1] == "0,1" and decode[decode.index("--devices") + 1] == "2"
    assert decode[decode.index("--gpu-memory-fraction") + 1] == "0.5000"


def test_cpu_cluster_states_its_dtype_and_cuda_without_a_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "probe_host", lambda: NO_GPU)
    placement = up.gpu_placement(parse())
    assert (placement.kind, placement.describe()) == ("cpu", "cpu, dtype bfloat16")
    assert up.spec_from_args(parse()).engine_args == []
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
        up.spec_from_args(parse("--device", "cuda"))
    with pytest.raises(ValueError, match=r"prefill tp 2 needs 2 GPUs \(one per rank\), 1 available"):
        monkeypatch.setattr(up, "probe_host", lambda: ONE_GPU)
        up.spec_from_args(parse("--tp", "2"))


def test_kv_transport_passes_to_every_engine_only_when_not_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "probe_host", lambda: NO_GPU)
    assert "--kv-transport" not in up.spec_from_args(parse()).engine_args
    args = up.spec_from_args(parse("--kv-transport", "nixl", "--prefill-tp", "2")).engine_args
    assert args[args.index("--kv-transport") + 1] == "nixl"
