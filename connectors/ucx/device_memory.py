"""KV regions in device (CUDA) memory for the UCX data plane: the start-up check of UCX's CUDA
transports, and the one registration of a region with UCX.

Contracts:
- `region_nbytes(region)` accepts a flat uint8 host array (numpy) or a flat uint8 device array
  (anything with `__cuda_array_interface__`, e.g. a CUDA torch tensor) and raises ValueError
  for anything else; `is_device_region` tells the two apart.
- `cuda_transport_problem(context_info, tls)` reads UCX's own context description (the
  resources it opened) and returns None when GPU memory can move between processes, else a
  message naming the missing transport and the `UCX_TLS` setting to change. The data plane
  refuses to start on that message: it never falls back silently to a host bounce
  (`--kv-staging host` is the explicit, labelled alternative).
- `MemoryRegistration` maps a region once (`ucp_mem_map`) at start-up and keeps the mapping
  until `close()`: UCX's registration cache then serves every message's rendezvous from it
  instead of registering (and for cuda_ipc, exporting) per message.
"""

from __future__ import annotations

import ctypes
import logging
import re
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# UCX transport (tl) names: cuda_copy moves between host and GPU and within a process, cuda_ipc
# between processes on one host (NVLink / PCIe peer access), gdr_copy speeds small copies;
# across hosts GPUDirect RDMA runs over InfiniBand / RoCE verbs transports.
CUDA_COPY = "cuda_copy"
CUDA_IPC = "cuda_ipc"
RDMA_TLS = ("rc_mlx5", "rc_verbs", "dc_mlx5", "ud_mlx5", "ud_verbs")
SUGGESTED_TLS = "cuda_copy,cuda_ipc,sm,tcp (add rc / dc for GPUDirect RDMA across hosts)"

UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1
_MAP_FIELD_ADDRESS, _MAP_FIELD_LENGTH, _MAP_FIELD_MEMORY_TYPE = 1 << 0, 1 << 1, 1 << 4
_RESOURCE = re.compile(r"resource\s+\d+\s*:.*--\s*([A-Za-z0-9_]+)/(\S+)")


def is_device_region(region: Any) -> bool:
    return hasattr(region, "__cuda_array_interface__")


def region_nbytes(region: Any) -> int:
    """Bytes of a flat uint8 region (host numpy array or CUDA array); ValueError otherwise."""
    if isinstance(region, np.ndarray):
        if region.dtype != np.uint8 or region.ndim != 1:
            raise ValueError("a host region must be a flat uint8 numpy array")
        return int(region.size)
    cai = getattr(region, "__cuda_array_interface__", None)
    if cai is None:
        raise ValueError(f"a region must be a numpy array or a CUDA array, got {type(region).__name__}")
    if cai.get("typestr") != "|u1" or len(cai.get("shape", ())) != 1 or cai.get("strides") not in (None, (1,)):
        raise ValueError("a device region must be a flat contiguous uint8 CUDA array")
    return int(cai["shape"][0])


def region_address(region: Any) -> int:
    if isinstance(region, np.ndarray):
        return int(region.ctypes.data)
    return int(region.__cuda_array_interface__["data"][0])


def transports(context_info: str) -> frozenset[str]:
    """The transport names of the resources in UCX's context description (`UCXContext.info`)."""
    return frozenset(m.group(1) for m in _RESOURCE.finditer(context_info))


def cuda_transport_problem(context_info: str, tls: str) -> str | None:
    """None when UCX can move GPU memory between processes, else what is missing (see module)."""
    have = transports(context_info)
    setting = f"UCX_TLS={tls}" if tls else "UCX_TLS (unset)"
    if CUDA_COPY not in have:
        return (f"UCX opened no {CUDA_COPY} transport, so it cannot touch GPU memory: this libucx was built "
                f"without CUDA, no NVIDIA driver was found, or {setting} excludes it. Install the CUDA-aware "
                f"libucx wheel (libucx-cu12 / -cu13), set UCX_TLS to include {SUGGESTED_TLS} "
                f"(--ucx-tls), or choose --kv-staging host (transports seen: {', '.join(sorted(have)) or 'none'})")
    if CUDA_IPC not in have and not have & set(RDMA_TLS):
        return (f"UCX opened {CUDA_COPY} but neither {CUDA_IPC} (GPU to GPU between processes on one host) nor an "
                f"RDMA transport for GPUDirect ({', '.join(RDMA_TLS)}); with {setting} GPU KV would bounce through "
                f"host memory. Set UCX_TLS to include {SUGGESTED_TLS} (--ucx-tls), or choose --kv-staging host "
                f"to accept the bounce (transports seen: {', '.join(sorted(have))})")
    return None


class _MapParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p), ("length", ctypes.c_size_t),
                ("flags", ctypes.c_uint), ("prot", ctypes.c_uint), ("memory_type", ctypes.c_int),
                ("exported_memh_buffer", ctypes.c_void_p)]


def _libucp() -> Any:
    """The libucp ucxx loaded (the same library and context state, found in this process's maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libucp.so" in path:
                lib = ctypes.CDLL(path)
                lib.ucp_mem_map.argtypes = [ctypes.c_void_p, ctypes.POINTER(_MapParams),
                                            ctypes.POINTER(ctypes.c_void_p)]
                lib.ucp_mem_unmap.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
                lib.ucs_status_string.restype = ctypes.c_char_p
                lib.ucs_status_string.argtypes = [ctypes.c_int]
                return lib
    raise RuntimeError("libucp is not loaded in this process (import ucxx first)")


class MemoryRegistration:
    """One `ucp_mem_map` of a whole region, held until `close()` (idempotent). `context` is a
    ucxx UCXContext, which must outlive the registration."""

    def __init__(self, context: Any, region: Any) -> None:
        self._lib = _libucp()
        self._context = context
        self.nbytes = region_nbytes(region)
        self.device = is_device_region(region)
        params = _MapParams(field_mask=_MAP_FIELD_ADDRESS | _MAP_FIELD_LENGTH | _MAP_FIELD_MEMORY_TYPE,
                            address=region_address(region), length=self.nbytes,
                            memory_type=UCS_MEMORY_TYPE_CUDA if self.device else UCS_MEMORY_TYPE_HOST)
        memh = ctypes.c_void_p()
        status = self._lib.ucp_mem_map(context.handle, ctypes.byref(params), ctypes.byref(memh))
        if status != 0:
            why = self._lib.ucs_status_string(status).decode()
            raise RuntimeError(f"UCX could not register the {'GPU' if self.device else 'host'} KV region "
                               f"({self.nbytes} bytes): {why}")
        self._memh: int | None = memh.value
        self._region = region  # the memory must outlive its mapping
        logger.info("registered a %s KV region of %.1f MiB with UCX", "GPU" if self.device else "host",
                    self.nbytes / 2**20)

    @property
    def mapped(self) -> bool:
        return self._memh is not None

    def close(self) -> None:
        if self._memh is None:
            return
        status = self._lib.ucp_mem_unmap(self._context.handle, ctypes.c_void_p(self._memh))
        self._memh = None
        if status != 0:
            logger.warning("ucp_mem_unmap failed: %s", self._lib.ucs_status_string(status).decode())
