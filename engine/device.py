"""Where an engine's ranks run and in which dtype: the pure rules, and one probe of the host.

Contracts:
- `--device auto` is CUDA when torch sees a GPU, else CPU; `--device cuda` without a visible GPU
  raises `DeviceUnavailableError` (a ValueError, so the CLI exits 2 with the message) naming
  the missing CUDA — before any process or memory is set up.
- Rank r of an engine uses the r-th entry of `--devices` (indices among the GPUs
  `CUDA_VISIBLE_DEVICES` leaves visible; torch numbers them from 0), default the r-th visible
  GPU. A tensor-parallel engine needs as many distinct GPUs as ranks (NCCL runs one rank per
  GPU); several engines may share one GPU, each with its own share of memory (where
  `pdserve up` puts every engine's ranks is services/placement.py).
- dtype `auto`: bfloat16 on CUDA; on CPU bfloat16 where the CPU computes it natively (AVX512-BF16
  / AMX-BF16 on x86, the `bf16` feature on Arm), float32 elsewhere. Parity tests pin float32.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICE_KINDS = ("cpu", "cuda")
# CPU features that make bf16 matmuls native (no emulation through fp32 in software).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


class DeviceUnavailableError(ValueError):
    """The requested device kind does not exist on this host; the message says what is missing."""


@dataclass(frozen=True, slots=True)
class HostDevices:
    """What this host offers (from `probe_host()`; hand-built in tests)."""

    num_gpus: int
    cuda_build: str | None  # torch.version.cuda: None for a CPU-only torch build
    native_bf16: bool
    gpu_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """The resolved placement of one engine: device kind, one device per rank, the dtype."""

    kind: str  # "cpu" or "cuda"
    rank_devices: tuple[str, ...]  # "cpu" or "cuda:N", index r for rank r
    dtype: str

    def device_for(self, rank: int) -> str:
        return self.rank_devices[rank]

    def describe(self) -> str:
        """One line for start-up logs and `pdserve up`: e.g. `cuda:0,cuda:1 bfloat16`."""
        devices = ",".join(dict.fromkeys(self.rank_devices))
        return f"{devices} {self.dtype}"


def probe_host() -> HostDevices:
    """Asks torch about GPUs and the CPU flags about bf16 (cheap: no CUDA context is created
    when torch has no CUDA build or no driver)."""
    import torch

    num = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = tuple(torch.cuda.get_device_name(i) for i in range(num))
    return HostDevices(num, torch.version.cuda, cpu_has_native_bf16(), names)


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU feature flags (x86 `flags`, Arm `Features`) of /proc/cpuinfo or of `cpuinfo`."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bf16(flags: Iterable[str] | None = None) -> bool:
    """True when the CPU has bf16 arithmetic (override with PDSERVE_CPU_BF16=0/1)."""
    forced = os.environ.get("PDSERVE_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    if flags is None:
        if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
            return False
        flags = cpu_flags()
    return bool(NATIVE_BF16_FLAGS & set(flags))


def resolve_kind(device: str, host: HostDevices) -> str:
    """`auto`, `cpu` or `cuda` -> the kind (GPU indices come from `--devices`)."""
    kind = device
    if kind.startswith("cuda:"):
        raise ValueError(f"device {device!r}: give --device cuda --devices {device[5:]} instead")
    if kind not in ("auto", *DEVICE_KINDS):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if kind == "auto":
        return "cuda" if host.num_gpus > 0 else "cpu"
    if kind == "cuda" and host.num_gpus == 0:
        raise DeviceUnavailableError(missing_cuda_message(host))
    return kind


def missing_cuda_message(host: HostDevices) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if host.cuda_build is None:
        why = "this torch build has no CUDA (a CPU-only wheel); install a CUDA build of torch"
    elif visible is not None and not visible.strip():
        why = "CUDA_VISIBLE_DEVICES is empty"
    else:
        why = f"torch (CUDA {host.cuda_build}) sees no GPU: no NVIDIA driver or device on this host"
        if visible is not None:
            why += f" (CUDA_VISIBLE_DEVICES={visible})"
    return f"--device cuda: CUDA is not available: {why}; use --device cpu"


def resolve_dtype(dtype: str, kind: str, native_bf16: bool) -> str:
    """The dtype name for `dtype` (auto or a name) on a device of `kind`."""
    if dtype == "auto":
        if kind == "cuda" or native_bf16:
            return "bfloat16"
        return "float32"
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    return dtype


def parse_devices(text: str) -> tuple[int, ...]:
    """`"2,3"` -> (2, 3); empty -> (). Raises ValueError on anything but distinct indices >= 0."""
    if not text.strip():
        return ()
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--devices must be comma-separated GPU indices such as 2,3, got {text!r}") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"--devices must be distinct GPU indices >= 0, got {text!r}")
    return ids


def rank_devices(kind: str, tp: int, devices: tuple[int, ...], num_gpus: int) -> tuple[str, ...]:
    """One device per rank (see the module docstring). Raises ValueError when the GPUs chosen
    or visible cannot give every rank its own."""
    if kind == "cpu":
        if devices:
            raise ValueError("--devices selects GPUs; it needs --device cuda")
        return ("cpu",) * tp
    if not devices and tp > num_gpus:
        raise ValueError(f"tp {tp} needs {tp} GPUs (one per rank); {num_gpus} visible")
    chosen = devices or tuple(range(tp))
    if len(chosen) != tp:
        raise ValueError(f"--devices names {len(chosen)} GPU(s) for tp {tp}: give one per rank")
    out_of_range = [i for i in chosen if i >= num_gpus]
    if out_of_range:
        raise ValueError(f"GPU index {out_of_range[0]} is not visible: {num_gpus} GPU(s) visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    return tuple(f"cuda:{i}" for i in chosen)


def plan_devices(device: str, dtype: str, tp: int, devices: str = "", host: HostDevices | None = None) -> DevicePlan:
    """The whole resolution: kind, per-rank devices, dtype. `host` defaults to `probe_host()`."""
    host = host if host is not None else probe_host()
    kind = resolve_kind(device, host)
    ids = parse_devices(devices)
    return DevicePlan(kind, rank_devices(kind, tp, ids, host.num_gpus), resolve_dtype(dtype, kind, host.native_bf16))


def bind_thread_device(device: str) -> None:
    """Makes `device` ("cuda:N") the calling thread's current CUDA device; a no-op for "cpu".

    CUDA's current device is per thread: binding it in the thread that built the engine leaves
    every other thread on GPU 0, where a bare `torch.cuda.current_stream()` or synchronize
    would wait on the wrong GPU and open a stray context. Each thread that steps a rank calls
    this first."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))
