"""Which UCX transport an endpoint really moves KV over, and whether that is what was expected.

UCX picks transports per endpoint at connection time (shared memory or CMA on one host, RDMA or
TCP across hosts) and says so nowhere by default: a pull over TCP where RDMA was meant is only
slow. `EndpointInfo.transport(ep_handle)` asks libucp itself — `ucp_ep_print_info` on the
endpoint, through ctypes on the libucp ucxx already loaded — and `parse_transport` reads the
answer: the transport of the protocol UCX selected for large tagged messages from the region's
memory type (the row that ends in `inf` of its protocol table), else the endpoint's bandwidth
lanes (`rma_bw`, then `am`). Names are UCX's (`sysv`, `posix`, `cma`, `tcp`, `rc_mlx5`,
`cuda_ipc`...); several join with `+`; `unknown` when nothing could be read.

`TransportExpectation` is the configured floor (`--expected-transports`, e.g. `rdma`): every
transport has a speed class (`shm` and `cuda` > `rdma` > `tcp`), and a transport whose class
ranks below every expected one is a fallback. It is pure: the connector records and logs.

Threading: `EndpointInfo.transport` must run on the thread that progresses the endpoint's
worker (UCX workers are single-threaded here); results are cached by the caller per endpoint.
"""

from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

UNKNOWN = "unknown"

# Speed classes, fastest first; a transport's class is looked up by its UCX name.
CLASS_RANK = {"shm": 3, "cuda": 3, "rdma": 2, "tcp": 1}
_CLASS_OF = {
    "sysv": "shm", "posix": "shm", "xpmem": "shm", "cma": "shm", "knem": "shm", "self": "shm",
    "cuda_ipc": "cuda", "gdr_copy": "cuda", "cuda_copy": "cuda", "rocm_ipc": "cuda", "rocm_copy": "cuda",
    "rc": "rdma", "rc_v": "rdma", "rc_verbs": "rdma", "rc_x": "rdma", "rc_mlx5": "rdma", "dc": "rdma",
    "dc_x": "rdma", "dc_mlx5": "rdma", "ud": "rdma", "ud_v": "rdma", "ud_verbs": "rdma", "ud_x": "rdma",
    "ud_mlx5": "rdma", "ib": "rdma", "srd": "rdma",
    "tcp": "tcp", "sockcm": "tcp",
}

_LANE = re.compile(r"^#\s*lane\[\d+\]:\s*\d+:(?P<tl>[a-z0-9_]+)/\S+.*?->\s*\S+(?P<flags>.*)$")
_TL_NAME = re.compile(r"\b([a-z][a-z0-9_]*)/")


def transport_class(name: str) -> str | None:
    """The speed class of a UCX transport name, or of a class name itself; None if unknown."""
    if name in CLASS_RANK:
        return name
    return _CLASS_OF.get(name)


def transport_rank(transport: str) -> int | None:
    """The rank of a (possibly `+`-joined) transport: its slowest member's; None if any member is
    unknown. cuda_copy alone is a host<->device copy and ranks as its partner does."""
    names = [n for n in transport.split("+") if n]
    if len(names) > 1:
        names = [n for n in names if n != "cuda_copy"] or names
    ranks = [CLASS_RANK.get(transport_class(n) or "", 0) for n in names]
    if not ranks or 0 in ranks:
        return None
    return min(ranks)


def parse_transport(text: str, memory_type: str = "host") -> str:
    """The transport(s) `ucp_ep_print_info` output shows for large tagged sends from
    `memory_type` memory ("host" or "cuda"); UNKNOWN if the text names none."""
    names = _from_protocol_table(text, memory_type) or _from_lanes(text)
    return "+".join(names) if names else UNKNOWN


def _from_protocol_table(text: str, memory_type: str) -> list[str]:
    """The `inf` row of the "tagged message by ucp_tag_send* from <memory> memory" table (the
    plain send, which tag_send uses), else of any tagged-message table for that memory."""
    wanted = f"from {memory_type} memory"
    title: str | None = None
    found: list[str] = []
    for line in text.splitlines():
        body = line.lstrip("#").strip()
        if not body.startswith("|"):
            continue
        cells = [cell.strip() for cell in body.strip("|").split("|")]
        if len(cells) == 2:  # a table's header: context, operation
            title = cells[1] if "tagged message" in cells[1] and wanted in cells[1] else None
        elif len(cells) == 3 and title is not None and cells[0].endswith("inf"):
            names = _tl_names(cells[2])
            if names and "ucp_tag_send* from" in title:
                return names
            found = found or names
    return found


def _from_lanes(text: str) -> list[str]:
    """The transports of the endpoint's bandwidth lanes, else of its active-message lanes."""
    bw, am = [], []
    for line in text.splitlines():
        lane = _LANE.match(line)
        if lane is None:
            continue
        flags = lane.group("flags").split()
        if any(f.startswith(("rma_bw", "am_bw")) or f == "rkey_ptr" for f in flags):
            bw.append(lane.group("tl"))
        elif "am" in flags:
            am.append(lane.group("tl"))
    return sorted(set(bw or am))


def _tl_names(where: str) -> list[str]:
    return sorted(set(_TL_NAME.findall(where + " ")))


class EndpointInfo:
    """Reads UCX's own description of endpoints (one libucp per process; see the module
    docstring for the thread rule). Never raises: UNKNOWN when libucp cannot be asked."""

    def __init__(self) -> None:
        self._ucp: ctypes.CDLL | None = None
        self._libc: ctypes.CDLL | None = None
        self._failed = False

    def describe(self, ep_handle: int) -> str:
        """The text `ucp_ep_print_info` prints for the `ucp_ep_h` `ep_handle` ("" on failure)."""
        if not self._load():
            return ""
        assert self._ucp is not None and self._libc is not None
        buf = ctypes.c_void_p()
        size = ctypes.c_size_t()
        stream = self._libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        if not stream:
            return ""
        try:
            self._ucp.ucp_ep_print_info(ctypes.c_void_p(ep_handle), ctypes.c_void_p(stream))
        finally:
            self._libc.fclose(ctypes.c_void_p(stream))
        try:
            return ctypes.string_at(buf.value, size.value).decode(errors="replace") if buf.value else ""
        finally:
            self._libc.free(buf)

    def transport(self, ep_handle: int, memory_type: str = "host") -> str:
        """The transport the endpoint moves large tagged messages over (see `parse_transport`)."""
        try:
            return parse_transport(self.describe(ep_handle), memory_type)
        except Exception as e:  # a diagnostic must never break a pull
            logger.debug("ucp_ep_print_info failed: %s", e)
            return UNKNOWN

    def _load(self) -> bool:
        if self._ucp is not None:
            return True
        if self._failed:
            return False
        path = loaded_libucp()
        if path is None:
            self._failed = True
            logger.info("libucp is not loaded in this process: KV transports are reported as unknown")
            return False
        ucp = ctypes.CDLL(path)
        ucp.ucp_ep_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        ucp.ucp_ep_print_info.restype = None
        libc = ctypes.CDLL(None)
        libc.open_memstream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        libc.open_memstream.restype = ctypes.c_void_p
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
        self._ucp, self._libc = ucp, libc
        return True


def loaded_libucp() -> str | None:
    """The path of the libucp ucxx uses (the libucx wheel's, `.../libucx/lib/libucp.so`), or None.

    A process may map more than one libucp: NIXL's wheel bundles its own
    (`nixl_cu12.libs/libucp-<hash>.so`). Calling one copy's `ucp_ep_print_info` on an endpoint
    the other copy made crashes the process, so where the ucxx wheel's copy cannot be told apart
    from the others this returns None (transports are then reported as unknown)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.rsplit(None, 1)[-1] for line in maps}
    except OSError:
        return None
    libucps = sorted(path for path in paths if "/libucp.so" in path or "/libucp-" in path)
    ucxx_own = [path for path in libucps if path.endswith("/libucx/lib/libucp.so") or "/libucx/lib/libucp.so." in path]
    if len(ucxx_own) == 1:
        return ucxx_own[0]
    return libucps[0] if len(libucps) == 1 else None


@dataclass(frozen=True, slots=True)
class TransportExpectation:
    """The transports expected between engines: UCX names or classes (`rdma`, `tcp`, `shm`,
    `cuda`). Empty expects nothing (no fallback is ever reported)."""

    expected: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> TransportExpectation:
        """From a comma-separated list; ValueError naming an unknown entry."""
        names = tuple(dict.fromkeys(n.strip().lower() for n in spec.split(",") if n.strip()))
        for name in names:
            if transport_class(name) is None:
                known = ", ".join([*CLASS_RANK, *sorted(_CLASS_OF)])
                raise ValueError(f"expected transports: unknown transport {name!r} (known: {known})")
        return cls(names)

    @property
    def label(self) -> str:
        return ",".join(self.expected)

    def fallback(self, actual: str) -> bool:
        """True when `actual` ranks below every expected transport (slower than any allowed).
        An unknown transport is never a fallback: it cannot be told."""
        if not self.expected:
            return False
        rank = transport_rank(actual)
        if rank is None:
            return False
        return rank < min(CLASS_RANK[transport_class(n) or "tcp"] for n in self.expected)
