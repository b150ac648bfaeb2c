"""`NixlTransport`: KV pulls as ONE NIXL READ per `PullOp`, the writer passive.

The decode rank (reader) reads the prefill rank's (writer's) blocks itself: every piece of a
pull (`transport.pieces`: one per coalesced run of whole blocks, or one per block of a head
range when the TP sizes differ) becomes one row of a NIXL descriptor list, and the whole list
moves as one READ posted from C over NIXL's UCX backend (CMA or cuda_ipc on one host, RDMA
across hosts; over TCP, where UCX has no one-sided read, the writer's own UCX worker answers,
so the writer progresses its agent while it serves). Host regions are NIXL DRAM, GPU regions
VRAM with their device id (`NixlMemory`). The writer does no per-piece work: it validates the
pull and waits for the reader's `done`.
The reader describes each region to NIXL once (`prep_xfer_dlist` of a `strided_list`: one per
head range and side, made on its first READ, a peer's released when it is removed) and builds
each READ with `make_prepped_xfer` from block indices (`block_indices`), so the per-READ setup
does not grow with the blocks' descriptor list.

Control stays on the tag transport's CTRL messages (`UcxTagTransport`, subclassed here), so
validation, refusal, renewal and release are the tag transport's, message for message:

- reader → writer `pull` {x, rid, eid, ep, segs, ...} (as before); the writer validates it
  (epoch, lease, every block pinned for the request, range) and answers `go` {x} instead of
  sending DATA, or `refuse` {x, why} as before. The blocks stay pinned from `go` until the
  reader's `done` (or the serve timeout).
- Read ahead of `go` (host-memory writers; a GPU writer's READ waits for `go`, which follows
  its compute fence): the reader posts the READ right after sending `pull`, not after `go`, so
  the writer's wake-up and validation overlap the copy. The bytes count only when BOTH the READ
  is DONE and `go` arrived: `go` means the lease was live and every block pinned for the
  request at validation, and a pin, once dropped, never comes back for the same request (a
  lease that ended is gone: `unknown_request`), so the blocks were pinned, hence unchanged,
  from before the reader learned of the request until its `done`: also while an early READ
  ran. On `refuse` the READ is cancelled and the blocks are invalid, as with the tag
  transport. Reading is side-effect free for the writer.
- When the READ is DONE and `go` arrived, `done` {ok: true} goes back (the writer then reports
  `finished_sending` as before) and the pull succeeds. A READ that
  fails (the writer died: NIXL reports ERR or refuses to post with a disconnect) fails the pull
  with `read_error` / `peer_gone` and every block of the op invalid: NIXL does not say which
  pieces of a failed READ arrived. A pull that ends early (timeout, `remove_peer`, abandon)
  cancels its READ before the blocks are reported, so no late byte lands in freed blocks.

The handshake's worker-address slot carries a msgpack map {ucx: the UCX worker address of the
control path, nixl: the NIXL agent metadata (its registered region's remote key), base: the
region's address, nbytes}. nixl is optional at runtime: `NixlUnavailable` names the package.
Why NIXL, and what it measured: docs/decisions/0009-nixl-rma-transport.md.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from connectors.ucx.device_memory import is_device_region, region_nbytes
from connectors.ucx.handshake import PeerKey
from connectors.ucx.tag_transport import UcxTagTransport, _Pull, _Serve
from connectors.ucx.transport import HeadGeometry, PullOp, PullRequest, Segment, pieces

logger = logging.getLogger(__name__)

NIXL_PACKAGE = "nixl-cu12"
_MAX_ADDRESS_BYTES = 1 << 20
_agent_ids = itertools.count()


class NixlUnavailable(RuntimeError):
    """NIXL is not importable (the `nixl` transport was asked for)."""


def nixl_importable() -> bool:
    """Whether NIXL is installed, without loading it (its bundled native libraries are loaded
    only where an agent is made: loading them beside grpc_tools' protoc crashed a test run)."""
    return any(importlib.util.find_spec(name) is not None for name in ("nixl_cu12", "nixl"))


def require_nixl() -> None:
    """Raises NixlUnavailable, naming the package to install, unless NIXL imports."""
    _nixl_api()


def _nixl_api() -> Any:
    try:
        import nixl_cu12._api as api
    except ImportError:
        try:
            import nixl._api as api  # type: ignore[no-redef]
        except ImportError as e:
            raise NixlUnavailable(f"--kv-transport nixl needs the {NIXL_PACKAGE} package (pip install "
                                  f"{NIXL_PACKAGE}): {e}") from None
    return api


@dataclass(frozen=True, slots=True)
class NixlMemory:
    """Where a region lies, as NIXL names it: `mem_type` "DRAM" (host) or "VRAM" (a GPU, device
    id `device`, the CUDA ordinal), from `base` for `nbytes`."""

    mem_type: str
    device: int
    base: int
    nbytes: int

    @classmethod
    def of(cls, region: Any) -> NixlMemory:
        """A flat uint8 host array (DRAM, device 0) or CUDA array (VRAM on its tensor's device;
        anything with `__cuda_array_interface__` and a `device` with an `index`)."""
        nbytes = region_nbytes(region)
        if not is_device_region(region):
            return cls("DRAM", 0, int(region.ctypes.data), nbytes)
        index = getattr(getattr(region, "device", None), "index", None)
        if not isinstance(index, int) or index < 0:
            raise ValueError("a GPU KV region must say its CUDA device (a torch CUDA tensor)")
        return cls("VRAM", index, int(region.__cuda_array_interface__["data"][0]), nbytes)


def vram_problem(package: str, torch_cuda: str | None, mem_types: list[str], ucx_modules: list[str]) -> str | None:
    """Why this NIXL build cannot move GPU KV, or None: `package` the NIXL module imported
    (nixl_cu12...), `torch_cuda` the CUDA torch was built for (`torch.version.cuda`),
    `mem_types` its UCX backend's memory types, `ucx_modules` the UCX transport libraries
    it bundles (libuct_cuda...; empty: not known, not checked)."""
    if not any(t.startswith("VRAM") for t in mem_types):
        return (f"--kv-transport nixl: this NIXL build ({package}) registers no GPU memory (its UCX backend offers "
                f"{', '.join(mem_types) or 'nothing'}); install the NIXL wheel of your CUDA (nixl-cu12 / nixl-cu13), "
                "use --kv-transport ucx-tag, or --kv-staging host")
    if ucx_modules and not any("uct_cuda" in m for m in ucx_modules):
        return (f"--kv-transport nixl: this NIXL build ({package}) bundles a UCX without CUDA transports "
                f"({', '.join(sorted(ucx_modules))}); install the NIXL wheel of your CUDA, use --kv-transport "
                "ucx-tag, or --kv-staging host")
    built_for = package.rpartition("_cu")[2] if "_cu" in package else None
    if built_for and torch_cuda and torch_cuda.split(".")[0] != built_for:
        return (f"--kv-transport nixl: NIXL is built for CUDA {built_for} ({package}), torch for CUDA {torch_cuda}; "
                f"install nixl-cu{torch_cuda.split('.')[0]}")
    return None


def descriptor_rows(segments: tuple[Segment, ...], geometry: HeadGeometry, base: int, *,
                    remote: bool, device: int = 0) -> np.ndarray:
    """The NIXL descriptor list (Nx3 uint64: address, length, device id) of `segments` on one
    side: the writer's (`remote=True`, its region at `base`) or the reader's. Rows are `pieces`
    in wire order, so row i of the reader's list receives row i of the writer's. `device`: the
    region's CUDA device (0 for host memory)."""
    rows = [(base + offset, length, device) for seg in segments
            for offset, length in pieces(seg, geometry, remote=remote)]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def strided_list(base: int, geometry: HeadGeometry, num_blocks: int, head: int, num_heads: int,
                 device: int = 0) -> np.ndarray:
    """A prepared descriptor list of a region, in NIXL's compressed form (one Nx5 row: address,
    length, device id, stride, count): descriptor i is heads [head, head + num_heads) of block i
    of the region at `base` (whole blocks when the range is all of a block's heads)."""
    return np.array([[base + head * geometry.head_nbytes, num_heads * geometry.head_nbytes, device,
                      geometry.block_nbytes, num_blocks]], dtype=np.uint64)


def block_indices(segments: tuple[Segment, ...], *, remote: bool) -> np.ndarray:
    """The block ids `segments` move on one side (the writer's with `remote=True`), in wire
    order, as int32 indices into a `strided_list`: index i of the reader's list receives index
    i of the writer's. NIXL merges consecutive descriptors, so a run of whole blocks is still
    one copy."""
    if len(segments) == 1:
        seg = segments[0]
        first = seg.remote_block if remote else seg.local_block
        return np.arange(first, first + seg.num_blocks, dtype=np.int32)
    firsts = np.fromiter((s.remote_block if remote else s.local_block for s in segments), np.int64, len(segments))
    counts = np.fromiter((s.num_blocks for s in segments), np.int64, len(segments))
    starts = np.cumsum(counts) - counts
    return (np.repeat(firsts - starts, counts) + np.arange(int(counts.sum()))).astype(np.int32)


def head_span(segments: tuple[Segment, ...]) -> tuple[int, int, int] | None:
    """(remote head, local head, count) that every segment reads, count 0 for whole blocks;
    None when the segments read different head ranges (one READ cannot use one prepared list
    per side for them)."""
    first = segments[0]
    span = (first.remote_head, first.local_head, first.num_heads) if first.num_heads else (0, 0, 0)
    for seg in segments:
        if ((seg.remote_head, seg.local_head, seg.num_heads) if seg.num_heads else (0, 0, 0)) != span:
            return None
    return span


@dataclass(frozen=True, slots=True)
class NixlAddress:
    """A rank's worker-address blob (see the module docstring): how to reach its control path
    and read its region. `geometry` is the region's (its blocks may hold other heads than the
    reader's)."""

    ucx: bytes
    agent_metadata: bytes
    base: int
    nbytes: int
    geometry: HeadGeometry
    mem_type: str = "DRAM"  # "VRAM": the region is on GPU `device`
    device: int = 0

    def encode(self) -> bytes:
        return bytes(msgpack.packb({"ucx": self.ucx, "nixl": self.agent_metadata, "base": self.base,
                                    "nbytes": self.nbytes, "heads": self.geometry.num_local_heads,
                                    "head_nbytes": self.geometry.head_nbytes, "mem": self.mem_type,
                                    "dev": self.device}, use_bin_type=True))

    @classmethod
    def decode(cls, data: bytes) -> NixlAddress:
        """ValueError (never another exception) when `data` is not a nixl transport address."""
        if len(data) > _MAX_ADDRESS_BYTES:
            raise ValueError(f"nixl address of {len(data)} bytes")
        try:
            raw = msgpack.unpackb(data, raw=False)
            ucx, meta = raw["ucx"], raw["nixl"]
            ints = [raw[k] for k in ("base", "nbytes", "heads", "head_nbytes")] + [raw.get("dev", 0)]
            mem_type = raw.get("mem", "DRAM")
        except Exception as e:
            raise ValueError(f"not a nixl transport address ({type(e).__name__}: {e}); is the peer on "
                             "--kv-transport ucx-tag?") from None
        if not (isinstance(ucx, bytes) and isinstance(meta, bytes) and mem_type in ("DRAM", "VRAM")
                and all(isinstance(v, int) and v >= 0 for v in ints)):
            raise ValueError("malformed nixl transport address")
        base, nbytes, heads, head_nbytes, device = ints
        return cls(ucx, meta, base, nbytes, HeadGeometry(heads, head_nbytes), mem_type, device)


@dataclass(frozen=True, slots=True)
class _PeerRegion:
    agent: str  # the writer's NIXL agent name, once added
    address: NixlAddress
    # Prepared descriptor lists of the writer's region by (first head, heads): made on the
    # first READ of that head range, released when the peer is removed.
    lists: dict[tuple[int, int], Any] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return self.address.nbytes // self.address.geometry.block_nbytes if self.address.geometry.block_nbytes else 0


class NixlTransport(UcxTagTransport):
    """See the module docstring. A host region is registered as NIXL DRAM, a GPU region (a CUDA
    tensor) as VRAM with its device id; a NIXL build that cannot move GPU memory refuses a GPU
    region at start with the reason (`vram_problem`). Every NIXL call runs on the progress
    thread, apart from the agent's creation and the region's registration here."""

    def __init__(self, region: Any, block_nbytes: int, local_key: PeerKey, *,
                 ucx_config: dict[str, str] | None = None, serve_timeout_s: float = 30.0, name: str = "nixl",
                 geometry: HeadGeometry | None = None) -> None:
        api = _nixl_api()
        memory = NixlMemory.of(region)
        super().__init__(region, block_nbytes, local_key, ucx_config=ucx_config, serve_timeout_s=serve_timeout_s,
                         name=name, geometry=geometry)
        if geometry is None:
            self._geometry = HeadGeometry(1, block_nbytes)
        agent_name = f"{local_key.engine_id}-{local_key.epoch:x}-{local_key.tp_rank}-{os.getpid()}-{next(_agent_ids)}"
        # No NIXL progress thread: CMA / RDMA reads complete without the writer's CPU, and the
        # reader polls its own reads on this transport's thread.
        self._agent = api.nixl_agent(agent_name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        # Error handling off, as the tag transport: a dead writer surfaces as a failed / refused
        # READ (NIXL's UCX reports it; the reader process survives, checked in tests).
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        if memory.mem_type == "VRAM":
            problem = vram_problem(api.__name__.split(".")[0], _torch_cuda(), self._agent.get_backend_mem_types("UCX"),
                                   _bundled_ucx_modules(api))
            if problem is not None:
                os.close(self._wake_r)
                os.close(self._wake_w)
                raise RuntimeError(problem)
        self._memory = memory
        self._base, self._nbytes = memory.base, memory.nbytes
        self._reg = self._agent.register_memory([(memory.base, memory.nbytes, memory.device, "")], memory.mem_type)
        self._blob = NixlAddress(self._address, self._agent.get_agent_metadata(), self._base, self._nbytes,
                                 self._geometry, memory.mem_type, memory.device).encode()
        self._regions: dict[PeerKey, _PeerRegion] = {}
        self._reads: dict[int, Any] = {}  # xfer id -> live NIXL transfer handle
        self._cancelled: list[Any] = []  # handles NIXL could not release yet (retried)
        self._accepted: set[int] = set()  # pulls the writer said `go` to, their READ still running
        self._read_done: set[int] = set()  # pulls whose READ completed before the writer's `go`
        self._local_lists: dict[tuple[int, int], Any] = {}  # this region's prepared lists by head range
        # Lists (and agents) of removed peers, released once no uncancelled READ may use them.
        self._retired: list[tuple[list[Any], str | None]] = []

    def _register_region(self, region: Any, ucx_config: dict[str, str]) -> None:
        return None  # NIXL registers the region (its own UCX); the tag context carries control only

    @property
    def prepared_lists(self) -> int:
        """Prepared NIXL descriptor lists held (this region's, live peers' and removed peers'
        not yet released): bounded by the head ranges in use, whatever peers came and went.
        Safe from any thread (each container is copied in one step under the GIL)."""
        regions, retired = list(self._regions.values()), list(self._retired)
        return len(self._local_lists) + sum(len(r.lists) for r in regions) + sum(len(lists) for lists, _ in retired)

    @property
    def worker_address(self) -> bytes:
        return self._blob

    def shutdown(self) -> None:
        super().shutdown()
        for handle in [*self._reads.values(), *self._cancelled]:
            _release(handle)
        self._reads.clear()
        self._cancelled.clear()
        for region in self._regions.values():
            self._retired.append((list(region.lists.values()), None))
        self._retired.append((list(self._local_lists.values()), None))
        self._regions.clear()
        self._local_lists.clear()
        self._release_retired()

    # -- progress thread -----------------------------------------------------------------------

    def _ctrl_handlers(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        return {**super()._ctrl_handlers(), "go": self._on_go_msg}

    def _must_poll(self) -> bool:
        return bool(self._serves)

    def _reap(self) -> bool:
        busy = super()._reap()
        if self._serves:
            # Serving: over TCP (no one-sided RMA) a reader's READ is answered by this agent's
            # own UCX worker, which nothing else progresses (no NIXL progress thread: it spins
            # a core while idle). Fetching notifications progresses it.
            self._agent.get_new_notifs()
        if self._cancelled:
            self._cancelled = [h for h in self._cancelled if not _release(h)]
        self._release_retired()
        for xfer_id, handle in list(self._reads.items()):
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as e:
                logger.warning("%s: READ %d failed: %s", self._name, xfer_id, e)
                state = "ERR"
            if state == "PROC":
                continue
            busy = True
            del self._reads[xfer_id]
            _release(handle)
            pull = self._pulls.get(xfer_id)
            if pull is None or pull.finished:
                continue
            if state != "DONE":
                self._finish(pull, "read_error", notify_peer=True)
            elif xfer_id in self._accepted:
                self._complete(pull)
            else:
                self._read_done.add(xfer_id)  # the writer's `go` is still to come
        return busy

    def _complete(self, pull: _Pull) -> None:
        pull.done.update(range(len(pull.pieces)))
        pull.seg_left = [0] * len(pull.seg_left)
        self._finish(pull, None, notify_peer=True)

    # -- reader side ---------------------------------------------------------------------------

    def _do_add_peer(self, key: PeerKey, address: bytes) -> None:
        if key in self._peers:
            return
        peer = NixlAddress.decode(address)
        agent = self._agent.add_remote_agent(peer.agent_metadata)
        agent = agent.decode() if isinstance(agent, bytes) else str(agent)
        super()._do_add_peer(key, peer.ucx)
        self._regions[key] = _PeerRegion(agent, peer)

    def _do_remove_peer(self, key: PeerKey) -> None:
        super()._do_remove_peer(key)  # fails its pulls first: their READs are cancelled
        region = self._regions.pop(key, None)
        if region is not None:
            self._retired.append((list(region.lists.values()), region.agent))
            self._release_retired()

    def _release_retired(self) -> None:
        """Releases removed peers' prepared lists, then their agents (unless added again), once
        every cancelled READ is released: a READ NIXL could not cancel yet may still use them."""
        if self._cancelled or not self._retired:
            return
        live = {r.agent for r in self._regions.values()}
        for lists, agent in self._retired:
            for handle in lists:
                _release(handle)
            if agent is not None and agent not in live:
                try:
                    self._agent.remove_remote_agent(agent)
                except Exception as e:
                    logger.debug("%s: remove_remote_agent(%s): %s", self._name, agent, e)
        self._retired.clear()

    def _lay_out(self, pull: _Pull) -> None:
        """One piece per segment (its bytes on this side): a READ lands all of its op or, as far
        as NIXL says, nothing (no per-block Python on the hot path)."""
        head_nbytes = self._geometry.head_nbytes
        for index, seg in enumerate(pull.op.segments):
            offset = seg.local_block * self._block_nbytes + seg.local_head * head_nbytes * bool(seg.num_heads)
            length = seg.num_blocks * (seg.num_heads * head_nbytes if seg.num_heads else self._block_nbytes)
            pull.pieces.append((offset, length))
            pull.piece_seg.append(index)
            pull.seg_left.append(1)

    def _data_target(self, pull: _Pull | None, index: int, length: int) -> Any:
        return None  # a READ moves the bytes: a DATA message to this reader is a bad message

    def _do_pull(self, op: PullOp) -> None:
        super()._do_pull(op)  # validates locally, lays out the pieces, sends `pull`
        pull = self._pulls.get(op.xfer_id)
        region = self._regions.get(op.peer)
        # A GPU writer's blocks may still be written by compute queued before the descriptor
        # left (its fence is waited on before `go`): read them only after `go`.
        if pull is not None and not pull.finished and (region is None or region.address.mem_type != "VRAM"):
            self._post_read(pull)

    def _on_go_msg(self, message: dict[str, Any]) -> None:
        xfer_id = int(message["x"])
        pull = self._pulls.get(xfer_id)
        if pull is None or pull.finished:
            return
        if xfer_id not in self._reads and xfer_id not in self._read_done:  # a GPU writer: read now
            self._accepted.add(xfer_id)
            self._post_read(pull)
        elif xfer_id in self._read_done:
            self._complete(pull)
        else:
            self._accepted.add(xfer_id)

    def _post_read(self, pull: _Pull) -> None:
        """Posts the pull's READ at once, before the writer's answer: see the module docstring
        ("read ahead of `go`") for why the bytes count only once `go` has also arrived."""
        region = self._regions.get(pull.op.peer)
        if region is None:
            self._finish(pull, "peer_unknown", notify_peer=False)
            return
        problem = self._read_problem(pull.op.segments, region)
        if problem is not None:
            self._finish(pull, problem, notify_peer=True)
            return
        try:
            handle = self._make_read(pull.op.segments, region)
            state = self._agent.transfer(handle)
        except Exception as e:
            # NIXL refuses to post to a disconnected agent: the writer died.
            logger.warning("%s: READ %d not posted: %s", self._name, pull.op.xfer_id, e)
            self._finish(pull, "peer_gone" if "DISCONNECT" in str(e).upper() else "read_error", notify_peer=True)
            return
        self._reads[pull.op.xfer_id] = handle
        if state == "ERR":
            self._reap()

    def _read_problem(self, segments: tuple[Segment, ...], region: _PeerRegion) -> str | None:
        """Why `segments` cannot be read from the writer's region (checked here too: the READ
        is posted before the writer validates the pull)."""
        peer = region.address.geometry
        for seg in segments:
            if seg.remote_block < 0 or seg.remote_block + seg.num_blocks > region.num_blocks:
                return "out_of_range"
            if seg.num_heads == 0 and peer.block_nbytes != self._block_nbytes:
                return "bad_segments"
            if seg.num_heads and (seg.remote_head < 0 or seg.remote_head + seg.num_heads > peer.num_local_heads
                                  or peer.head_nbytes != self._geometry.head_nbytes):
                return "bad_segments"
        return None

    def _make_read(self, segments: tuple[Segment, ...], region: _PeerRegion) -> Any:
        """The READ's handle: from both sides' prepared lists and block indices, or, when the
        segments read different head ranges (no pairing of engines does this), from one-off
        descriptor lists."""
        span = head_span(segments)
        peer, mine = region.address, self._memory
        if span is None:
            local = descriptor_rows(segments, self._geometry, self._base, remote=False, device=mine.device)
            remote = descriptor_rows(segments, peer.geometry, peer.base, remote=True, device=peer.device)
            return self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, mine.mem_type),
                                               self._agent.get_xfer_descs(remote, peer.mem_type), region.agent)
        remote_head, local_head, num_heads = span
        remote_range = (remote_head, num_heads or peer.geometry.num_local_heads)
        local_range = (local_head, num_heads or self._geometry.num_local_heads)
        remote_list = region.lists.get(remote_range)
        if remote_list is None:
            remote_list = region.lists[remote_range] = self._agent.prep_xfer_dlist(
                region.agent, strided_list(peer.base, peer.geometry, region.num_blocks, *remote_range, peer.device),
                peer.mem_type)
        local_list = self._local_lists.get(local_range)
        if local_list is None:
            local_list = self._local_lists[local_range] = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", strided_list(self._base, self._geometry, self._num_blocks, *local_range,
                                                mine.device), mine.mem_type)
        return self._agent.make_prepped_xfer("READ", local_list, block_indices(segments, remote=False),
                                             remote_list, block_indices(segments, remote=True))

    def _finish(self, pull: _Pull, reason: str | None, *, notify_peer: bool) -> None:
        self._cancel_read(pull.op.xfer_id)
        self._accepted.discard(pull.op.xfer_id)
        self._read_done.discard(pull.op.xfer_id)
        super()._finish(pull, reason, notify_peer=notify_peer)

    def _do_abandon(self, xfer_id: int) -> None:
        self._cancel_read(xfer_id)
        self._accepted.discard(xfer_id)
        self._read_done.discard(xfer_id)
        super()._do_abandon(xfer_id)

    def _cancel_read(self, xfer_id: int) -> None:
        handle = self._reads.pop(xfer_id, None)
        if handle is not None and not _release(handle):
            self._cancelled.append(handle)

    # -- writer side ---------------------------------------------------------------------------

    def _accept_pull(self, ep: Any, request: PullRequest, chunked: bool = False) -> None:
        """Answers `go`: the reader reads; the serve (its blocks pinned) waits for its `done` only."""
        self._serves[(request.reader, request.xfer_id)] = _Serve(request.request_id, request.reader, 0,
                                                                 time.monotonic() + self._serve_timeout_s,
                                                                 chunked=chunked)
        self._send_ctrl(ep, {"k": "go", "x": request.xfer_id})


def _torch_cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def _bundled_ucx_modules(api: Any) -> list[str]:
    """The UCX transport libraries the NIXL wheel bundles (`<package>.libs/ucx/libuct_*.so*`;
    empty where it bundles none, e.g. a NIXL built against the system's UCX)."""
    package = api.__name__.split(".")[0]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    libs = os.path.join(os.path.dirname(next(iter(spec.submodule_search_locations))), f"{package}.libs", "ucx")
    try:
        return sorted(n for n in os.listdir(libs) if n.startswith("libuct_") and ".so" in n)
    except OSError:
        return []


def _release(handle: Any) -> bool:
    """Releases (cancelling if active) a NIXL transfer handle; False when NIXL could not yet."""
    try:
        handle.release()
    except Exception as e:
        logger.debug("NIXL handle release deferred: %s", e)
        return False
    return True
