"""`UcxTagTransport`: KV pulls over UCX tagged messages (ucxx core API, one progress thread).

Protocol (all ranks on one UCX worker each, endpoints from worker addresses, error handling
off so UCX may pick shared memory / CMA on one host and RDMA across hosts):

- Tags are 64 bits: kind (4) | xfer id (40) | piece index (20). CTRL messages (kind 1) are
  small msgpack maps; DATA messages (kind 2) carry one piece's bytes: a segment of whole
  blocks is one piece; a segment of a head range (ranks of different TP sizes) is one piece
  per block (`transport.pieces`: heads are outermost in a block), numbered in segment order.
- Reader → writer CTRL `pull` {x, rid, eid, ep, segs, addr, reader}: the writer validates it
  (listener), then sends piece i as DATA (x, i) straight from its region (zero copy,
  rendezvous), or answers CTRL `refuse` {x, why} without touching memory.
- The reader receives DATA only for a live pull it posted, into exactly the segment's bytes of
  its region (zero copy); anything else is drained into a scratch buffer. When every piece
  arrived it sends CTRL `done` {x, rid, ok} (at the end of that progress round, once the
  result reached the listener); on a failure (timeout...) `done` with ok=False.
- Reader → writer CTRL `renew` {rids, reader}: lease renewal.
- Chunked reads (a request's blocks read from one writer in several pulls, each fitting a
  staging pool; only to writers whose handshake says `chunked_pulls`): every such `pull`
  carries `chunk: true`, its `done` then ends that pull only, and the reader ends its read of
  the request with CTRL `release` {rid, reader} once every pull of it ended. A writer without
  the flag counts one `done` per reader (the unchunked protocol, unchanged).
- The writer's listener may stage a pull's bytes first (`source_segments` returns None and
  calls `resume` later, from any thread): the pull is served once they are in place.

Peer death is not signalled by UCX here (error handling is off); pulls end by timeout or by
`remove_peer` (the scheduler saw the peer's epoch die).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from connectors.ucx.device_memory import (
    MemoryRegistration,
    cuda_transport_problem,
    is_device_region,
    region_nbytes,
)
from connectors.ucx.ep_info import UNKNOWN, EndpointInfo
from connectors.ucx.handshake import PeerKey
from connectors.ucx.transport import (
    BlockAddressing,
    HeadGeometry,
    KVTransport,
    PullOp,
    PullRequest,
    PullResult,
    Segment,
    TransportListener,
    num_pieces,
    pieces,
)

logger = logging.getLogger(__name__)

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

KIND_SHIFT = 60
KIND_CTRL = 1
KIND_DATA = 2
XFER_BITS = 40
SEG_BITS = 20
KIND_MASK = 0xF << KIND_SHIFT
MAX_SEGMENTS = 1 << SEG_BITS
MAX_CTRL_BYTES = 16 << 20
# A gap longer than this between two looks at the clock on the progress thread (a pass takes
# microseconds, an idle wait at most _IDLE_WAIT_S) is time the thread could not run: see
# `_credit_stall`.
_STALL_S = 0.25
_SPIN_ROUNDS = 100
_PENDING_SPIN_S = 0.05
_PENDING_WAIT_S = 0.001
_IDLE_WAIT_S = 0.05


def data_tag(xfer_id: int, index: int) -> int:
    return (KIND_DATA << KIND_SHIFT) | ((xfer_id & ((1 << XFER_BITS) - 1)) << SEG_BITS) | index


def split_data_tag(tag: int) -> tuple[int, int]:
    return (tag >> SEG_BITS) & ((1 << XFER_BITS) - 1), tag & (MAX_SEGMENTS - 1)


_Tracked = tuple[Any, Callable[[str | None], None], Any]  # (UCX request, on_done(error), buffer kept alive)


@dataclass(slots=True)
class _Pull:
    op: PullOp
    started: float
    deadline: float
    pieces: list[tuple[int, int]] = field(default_factory=list)  # (local offset, length) by index
    piece_seg: list[int] = field(default_factory=list)  # segment index of each piece
    seg_left: list[int] = field(default_factory=list)  # pieces of each segment not yet received
    posted: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    in_flight: int = 0
    finished: bool = False


@dataclass(slots=True)
class _Serve:
    request_id: str
    reader: PeerKey
    pending_sends: int  # sends not completed (+1 while the listener stages the source)
    deadline: float
    done_ok: bool | None = None  # set when the reader's `done` arrived
    chunked: bool = False  # one pull of a chunked read: its end is not the reader's (a `release` is)


class UcxTagTransport(KVTransport):
    """See the module docstring. `region` is the rank's KV bytes (a flat uint8 view, in host
    memory or, checked and registered once, GPU memory: connectors/ucx/device_memory.py) and
    `local_key` this rank's identity as peers know it. A reader that has not said `done`
    `serve_timeout_s` after its pull is presumed dead: its endpoint is closed (cancelling
    its sends) and every request it was reading is reported done with ok=False. `geometry`
    (the region's layers and heads) is needed for head-range segments; without it they are
    refused (writer) or fail (reader) with `bad_segments`. `addressing` replaces the NHL2BD
    arithmetic for a region in another layout (vLLM's KV in place: a segment is then several
    ranges, posted together and complete together)."""

    def __init__(self, region: Any, block_nbytes: int, local_key: PeerKey, *,
                 ucx_config: dict[str, str] | None = None, serve_timeout_s: float = 30.0, name: str = "ucx",
                 geometry: HeadGeometry | None = None, addressing: BlockAddressing | None = None,
                 num_blocks: int | None = None) -> None:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array

        nbytes = region_nbytes(region)
        if addressing is None and (block_nbytes < 1 or nbytes % block_nbytes):
            raise ValueError("region must be a flat uint8 array of whole blocks")
        self._addressing = addressing
        self._api = ucx_api
        self._array = Array
        self._region = region
        # `num_blocks`: the blocks peers address when the region is a staging pool of fewer slots
        # (the listener's `source_segments` maps a served request's blocks to their slots).
        self._num_blocks = (addressing.num_blocks if addressing is not None
                            else num_blocks if num_blocks is not None else nbytes // block_nbytes)
        self._block_nbytes = block_nbytes
        if geometry is not None and geometry.block_nbytes != block_nbytes:
            raise ValueError(f"geometry {geometry} does not make blocks of {block_nbytes} bytes")
        self._geometry = geometry or HeadGeometry(1, 0)
        self._ctx = ucx_api.UCXContext(config_dict=dict(ucx_config or {}),
                                       feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._registration = self._register_region(region, ucx_config or {})
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self._address = bytes(self._worker.address.tobytes())
        self._name = name
        self._local_key = local_key
        self._serve_timeout_s = serve_timeout_s
        self._expect_until = 0.0
        self._ticked = time.monotonic()  # the progress thread's last look at the clock
        self._commands: deque[Callable[[], None]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._listener: TransportListener | None = None
        self._thread: threading.Thread | None = None
        self._running = False
        self._peers: dict[PeerKey, Any] = {}  # writer endpoints (reader side)
        self._reply_eps: dict[bytes, Any] = {}  # reader endpoints by worker address (writer side)
        self._reader_addr: dict[PeerKey, bytes] = {}
        self._pulls: dict[int, _Pull] = {}
        self._serves: dict[tuple[PeerKey, int], _Serve] = {}
        self._pending: list[_Tracked] = []
        # `done` messages of pulls that ended this progress round, sent at its end: after every
        # result of the round reached the listener, so a gather's last op is handed over
        # without waiting for the other ops' sends.
        self._dones: list[tuple[PeerKey, dict[str, Any]]] = []
        # Data requests of one pull or one serve, in posting order: they complete (nearly) in
        # order, so reaping checks each lane's head only (a pull of thousands of head-range
        # pieces would make a full scan per progress round quadratic).
        self._lanes: dict[Any, deque[_Tracked]] = {}
        # The UCX transport each writer endpoint uses (read once from UCX, on this thread).
        self._ep_info = EndpointInfo()
        self._memory_type = "cuda" if is_device_region(region) else "host"
        self._transports: dict[PeerKey, str] = {}

    # -- public API (any thread) ---------------------------------------------------------------

    @property
    def worker_address(self) -> bytes:
        return self._address

    def start(self, listener: TransportListener) -> None:
        if self._thread is not None:
            raise RuntimeError("transport already started")
        self._listener = listener
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=f"{self._name}-progress", daemon=True)
        self._thread.start()

    def add_peer(self, key: PeerKey, address: bytes) -> None:
        self._submit(lambda: self._do_add_peer(key, address))

    def remove_peer(self, key: PeerKey) -> None:
        self._submit(lambda: self._do_remove_peer(key))

    def pull(self, op: PullOp) -> None:
        if not 0 < len(op.segments) <= MAX_SEGMENTS:
            raise ValueError(f"a pull has 1..{MAX_SEGMENTS} segments, got {len(op.segments)}")
        self._submit(lambda: self._do_pull(op))

    def abandon(self, xfer_id: int) -> None:
        self._submit(lambda: self._do_abandon(xfer_id))

    def expect_activity(self, seconds: float) -> None:
        # A float store is atomic: no command round trip needed for a hint.
        self._expect_until = max(self._expect_until, time.monotonic() + seconds)

    def renew(self, peer: PeerKey, request_ids: list[str]) -> None:
        self._submit(lambda: self._do_renew(peer, request_ids))

    def release(self, peer: PeerKey, request_id: str) -> None:
        self._submit(lambda: self._do_release(peer, request_id))

    def shutdown(self) -> None:
        if not self._running:
            return
        self._running = False
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for ep in [*self._peers.values(), *self._reply_eps.values()]:
            _close(ep)
        self._peers.clear()
        self._reply_eps.clear()
        if self._registration is not None:
            self._registration.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- progress thread -----------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        if not self._running:
            raise RuntimeError("transport is not running")
        self._commands.append(command)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (already awake) or closed (shutting down)

    def _loop(self) -> None:
        efd = self._worker.epoll_file_descriptor
        last_busy = time.monotonic()
        idle_rounds = 0
        self._ticked = last_busy
        while self._running:
            self._credit_stall()
            busy = self._run_commands()
            if self._worker.progress_once():
                self._worker.progress()
                busy = True
            # Data first: a probe for CTRL (a masked tag) walks UCX's whole unexpected queue,
            # so drain the queued DATA pieces (thousands for a head-range pull) before it.
            busy |= self._probe_data()
            busy |= self._probe_ctrl()
            busy |= self._reap()
            self._credit_stall()
            self._expire()
            busy |= self._send_dones()
            if busy:
                last_busy, idle_rounds = time.monotonic(), 0
                continue
            idle_rounds += 1
            # A shared-memory rendezvous waits on the peer's copy without any event to wake
            # us, so while requests are pending keep polling (yielding the CPU) for a while
            # after the last progress; sleep on UCX's event fd only when nothing moves.
            now = time.monotonic()
            if self._must_poll() or ((self._pending or self._lanes or self._pulls) and now - last_busy < _PENDING_SPIN_S) \
                    or now < self._expect_until:
                os.sched_yield()
                continue
            if idle_rounds <= _SPIN_ROUNDS:
                os.sched_yield()  # (releases the GIL: a thread woken by a result takes it now)
                continue
            if self._worker.arm():
                timeout = _PENDING_WAIT_S if self._pending or self._lanes or self._pulls else _IDLE_WAIT_S
                try:
                    select.select([efd, self._wake_r], [], [], timeout)
                    os.read(self._wake_r, 4096)
                except (BlockingIOError, InterruptedError):
                    pass
        self._fail_all("shutdown")

    def _register_region(self, region: Any, ucx_config: dict[str, str]) -> MemoryRegistration | None:
        """Registers the region with this transport's UCX context (a subclass that moves the
        bytes through another library registers it there instead)."""
        return _register_device_region(self._ctx, region, ucx_config)

    def _must_poll(self) -> bool:
        """Whether work is under way that no UCX event of this worker announces (a subclass's
        other progress engine): the loop then polls without sleeping."""
        return False

    def _run_commands(self) -> bool:
        ran = False
        while self._commands:
            command = self._commands.popleft()
            ran = True
            try:
                command()
            except Exception:
                logger.exception("%s: transport command failed", self._name)
        return ran

    def _track(self, request: Any, on_done: Callable[[str | None], None], keepalive: Any) -> None:
        self._pending.append((request, on_done, keepalive))

    def _track_in_lane(self, lane: Any, request: Any, on_done: Callable[[str | None], None], keepalive: Any) -> None:
        queue = self._lanes.get(lane)
        if queue is None:
            queue = self._lanes[lane] = deque()
        queue.append((request, on_done, keepalive))

    def _reap(self) -> bool:
        reaped = self._reap_lanes()
        if not self._pending:
            return reaped
        still: list[_Tracked] = []
        finished: list[_Tracked] = []
        for item in self._pending:
            (finished if item[0].completed else still).append(item)
        self._pending = still
        for request, on_done, _ in finished:
            on_done(_error_of(request))
        return bool(finished) or reaped

    def _reap_lanes(self) -> bool:
        reaped = False
        for lane, queue in list(self._lanes.items()):
            while queue and queue[0][0].completed:
                request, on_done, _ = queue.popleft()
                reaped = True
                on_done(_error_of(request))
            if not queue:
                self._lanes.pop(lane, None)
        return reaped

    def _send_dones(self) -> bool:
        """Sends the round's `done` messages (to writers still known); True if there were any."""
        if not self._dones:
            return False
        dones, self._dones = self._dones, []
        for peer, message in dones:
            ep = self._peers.get(peer)
            if ep is not None:
                self._send_ctrl(ep, message)
        return True

    def _send_ctrl(self, ep: Any, message: dict[str, Any]) -> None:
        payload = np.frombuffer(msgpack.packb(message, use_bin_type=True), dtype=np.uint8)
        request = ep.tag_send(self._array(payload), self._api.UCXXTag(KIND_CTRL << KIND_SHIFT))
        self._track(request, self._on_ctrl_sent, payload)

    def _on_ctrl_sent(self, error: str | None) -> None:
        if error is not None:
            logger.warning("%s: control send failed: %s", self._name, error)

    def _probe_ctrl(self) -> bool:
        got = False
        while True:
            probe = self._worker.tag_probe(self._api.UCXXTag(KIND_CTRL << KIND_SHIFT),
                                           self._api.UCXXTagMask(KIND_MASK), remove=True)
            if not probe.matched:
                return got
            got = True
            buf = np.empty(probe.length, dtype=np.uint8)
            request = self._worker.tag_recv_with_handle(self._array(buf), probe)
            self._track(request, functools.partial(self._on_ctrl, buf=buf), buf)

    def _on_ctrl(self, error: str | None, *, buf: np.ndarray) -> None:
        if error is not None:
            logger.warning("%s: control receive failed: %s", self._name, error)
            return
        try:
            message = msgpack.unpackb(buf.tobytes(), raw=False)
            kind = message["k"]
            handler = self._ctrl_handlers()[kind]
            handler(message)
        except Exception as e:
            logger.warning("%s: dropped a malformed control message: %s", self._name, e)

    def _ctrl_handlers(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        """CTRL message kinds this transport understands (a subclass may add its own)."""
        return {"pull": self._on_pull_msg, "refuse": self._on_refuse_msg,
                "done": self._on_done_msg, "renew": self._on_renew_msg, "release": self._on_release_msg}

    # -- reader side ---------------------------------------------------------------------------

    def _do_add_peer(self, key: PeerKey, address: bytes) -> None:
        if key in self._peers:
            return
        ucx_address = self._api.UCXAddress.create_from_buffer(address)
        self._peers[key] = self._api.UCXEndpoint.create_from_worker_address(self._worker, ucx_address, False)

    def _do_remove_peer(self, key: PeerKey) -> None:
        for pull in list(self._pulls.values()):
            if pull.op.peer == key and not pull.finished:
                self._finish(pull, "peer_gone", notify_peer=False)
        ep = self._peers.pop(key, None)
        self._transports.pop(key, None)
        if ep is not None:
            _close(ep)
        address = self._reader_addr.pop(key, None)
        if address is not None:
            reply = self._reply_eps.pop(address, None)
            if reply is not None:
                _close(reply)
        for serve_key in [k for k in self._serves if k[0] == key]:
            self._serves.pop(serve_key)

    def _do_pull(self, op: PullOp) -> None:
        now = time.monotonic()
        pull = _Pull(op, started=now, deadline=now + op.timeout_s)
        self._pulls[op.xfer_id] = pull
        ep = self._peers.get(op.peer)
        if ep is None:
            self._finish(pull, "peer_unknown", notify_peer=False)
            return
        if self._segments_problem(op.segments, remote=False) is not None:
            self._finish(pull, "bad_segments", notify_peer=False)
            return
        self._lay_out(pull)
        self._send_ctrl(ep, {
            "k": "pull", "x": op.xfer_id, "rid": op.request_id, "eid": op.peer.engine_id, "ep": op.peer.epoch,
            "segs": [_segment_to_wire(s) for s in op.segments],
            "addr": self._address, "reader": _key_to_wire(self._reader_key()),
            **({"chunk": True} if op.chunked else {}),
        })

    def _lay_out(self, pull: _Pull) -> None:
        """Fills `pull.pieces` (what arrives, by index), `piece_seg` and `seg_left`: here one
        piece per DATA message (`pieces`)."""
        for index, seg in enumerate(pull.op.segments):
            seg_pieces = self._pieces(seg, remote=False)
            pull.pieces.extend(seg_pieces)
            pull.piece_seg.extend([index] * len(seg_pieces))
            pull.seg_left.append(len(seg_pieces))

    def _reader_key(self) -> PeerKey:
        return self._local_key

    def _probe_data(self) -> bool:
        got = False
        while True:
            probe = self._worker.tag_probe(self._api.UCXXTag(KIND_DATA << KIND_SHIFT),
                                           self._api.UCXXTagMask(KIND_MASK), remove=True)
            if not probe.matched:
                return got
            got = True
            xfer_id, index = split_data_tag(probe.sender_tag.value)
            pull = self._pulls.get(xfer_id)
            target = self._data_target(pull, index, probe.length)
            if target is None:
                scratch = np.empty(probe.length, dtype=np.uint8)
                request = self._worker.tag_recv_with_handle(self._array(scratch), probe)
                self._track(request, _ignore, scratch)
                if pull is not None and not pull.finished:
                    self._finish(pull, "bad_message", notify_peer=True)
                continue
            assert pull is not None
            pull.posted.add(index)
            pull.in_flight += 1
            request = self._worker.tag_recv_with_handle(self._array(target), probe)
            self._track_in_lane(("pull", xfer_id), request, functools.partial(self._on_data, pull=pull, index=index),
                                target)

    def _data_target(self, pull: _Pull | None, index: int, length: int) -> Any:
        if pull is None or pull.finished or index >= len(pull.pieces) or index in pull.posted:
            return None
        start, expected = pull.pieces[index]
        if length != expected:
            return None
        return self._region[start:start + length]

    def _on_data(self, error: str | None, *, pull: _Pull, index: int) -> None:
        pull.in_flight -= 1
        if pull.finished:
            self._forget_if_idle(pull)
            return
        if error is not None:
            self._finish(pull, "recv_error", notify_peer=True)
            return
        pull.done.add(index)
        pull.seg_left[pull.piece_seg[index]] -= 1
        if len(pull.done) == len(pull.pieces):
            self._finish(pull, None, notify_peer=True)

    def _finish(self, pull: _Pull, reason: str | None, *, notify_peer: bool) -> None:
        pull.finished = True
        if notify_peer and pull.op.peer in self._peers:
            self._dones.append((pull.op.peer, {"k": "done", "x": pull.op.xfer_id, "rid": pull.op.request_id,
                                               "ok": reason is None, "reader": _key_to_wire(self._reader_key())}))
        # (seg_left is empty when the pull ended before its pieces were laid out.)
        done = tuple(seg for seg, left in zip(pull.op.segments, pull.seg_left or [1] * len(pull.op.segments),
                                              strict=True) if left == 0)
        result = PullResult(pull.op.xfer_id, reason is None, reason, done,
                            sum(pull.pieces[i][1] for i in pull.done), time.monotonic() - pull.started,
                            self._transport_to(pull.op.peer))
        self._forget_if_idle(pull)
        if self._listener is not None:
            self._listener.on_pull_finished(result)

    def _transport_to(self, peer: PeerKey) -> str:
        """The UCX transport of the endpoint to `peer` ("" without one), asked once per endpoint."""
        transport = self._transports.get(peer)
        if transport is None:
            ep = self._peers.get(peer)
            if ep is None:
                return ""
            transport = self._ep_info.transport(ep.handle, self._memory_type)
            if transport != UNKNOWN:  # (asked again next time: UCX may still be wiring it up)
                self._transports[peer] = transport
        return transport

    def _forget_if_idle(self, pull: _Pull) -> None:
        # A failed pull stays known while receives into its blocks are in flight, so late
        # messages for it are drained instead of matched to nothing.
        if pull.finished and pull.in_flight == 0:
            self._pulls.pop(pull.op.xfer_id, None)

    def _do_abandon(self, xfer_id: int) -> None:
        pull = self._pulls.get(xfer_id)
        if pull is not None and not pull.finished:
            pull.finished = True
            ep = self._peers.get(pull.op.peer)
            if ep is not None:
                self._send_ctrl(ep, {"k": "done", "x": xfer_id, "rid": pull.op.request_id, "ok": False,
                                     "reader": _key_to_wire(self._reader_key())})
            self._forget_if_idle(pull)

    def _credit_stall(self) -> None:
        """Time this thread could not run does not count against a deadline: a gap past
        `_STALL_S` since the last look at the clock (the process starved of CPU, or the
        interpreter lock held by a long call elsewhere: seen for 34 s in a tp 2 vLLM decode
        worker on 2 shared cores, its writer's data long sent) moves every live pull's and
        serve's deadline on by the excess. A timeout judges the peer's silence, not our own;
        a thread that is merely slow (gaps just past the bound) still times out, later."""
        now = time.monotonic()
        stalled = now - self._ticked - _STALL_S
        self._ticked = now
        if stalled <= 0:
            return
        for pull in self._pulls.values():
            pull.deadline += stalled
        for serve in self._serves.values():
            serve.deadline += stalled

    def _expire(self) -> None:
        now = time.monotonic()
        for pull in list(self._pulls.values()):
            if not pull.finished and now >= pull.deadline:
                self._finish(pull, "timeout", notify_peer=True)
        dead = {key[0] for key, serve in self._serves.items() if now >= serve.deadline}
        for reader in dead:
            self._drop_reader(reader)

    def _drop_reader(self, reader: PeerKey) -> None:
        logger.warning("%s: reader %s silent past the serve timeout; closing its endpoint", self._name, reader)
        address = self._reader_addr.pop(reader, None)
        ep = self._reply_eps.pop(address, None) if address is not None else None
        if ep is not None:
            _close(ep)
        released: set[str] = set()
        for key in [k for k in self._serves if k[0] == reader]:
            serve = self._serves.pop(key)
            self._serve_ended(key, serve, False)
            if serve.chunked and serve.request_id not in released:  # it will not say `release` now
                released.add(serve.request_id)
                self._reader_released(serve.request_id, reader)

    def _on_refuse_msg(self, message: dict[str, Any]) -> None:
        pull = self._pulls.get(int(message["x"]))
        if pull is not None and not pull.finished:
            self._finish(pull, f"refused:{message['why']}", notify_peer=False)

    def _do_renew(self, peer: PeerKey, request_ids: list[str]) -> None:
        ep = self._peers.get(peer)
        if ep is not None:
            self._send_ctrl(ep, {"k": "renew", "rids": request_ids, "reader": _key_to_wire(self._reader_key())})

    def _do_release(self, peer: PeerKey, request_id: str) -> None:
        ep = self._peers.get(peer)
        if ep is not None:
            self._send_ctrl(ep, {"k": "release", "rid": request_id, "reader": _key_to_wire(self._reader_key())})

    def _fail_all(self, reason: str) -> None:
        for pull in list(self._pulls.values()):
            if not pull.finished:
                self._finish(pull, reason, notify_peer=False)

    # -- writer side ---------------------------------------------------------------------------

    def _on_pull_msg(self, message: dict[str, Any]) -> None:
        reader = _key_from_wire(message["reader"])
        address = bytes(message["addr"])
        ep = self._reply_ep(reader, address)
        segments = tuple(_segment_from_wire(raw) for raw in message["segs"])
        request = PullRequest(int(message["x"]), str(message["rid"]), str(message["eid"]), int(message["ep"]),
                              segments, reader)
        why = self._refusal(request)
        if why is None and self._listener is not None:
            why = self._listener.on_pull_request(request)
        if why is not None:
            self._send_ctrl(ep, {"k": "refuse", "x": request.xfer_id, "why": why})
            return
        chunked = bool(message.get("chunk", False))
        source = getattr(self._listener, "source_segments", None)
        if source is None:
            self._accept_pull(ep, request, chunked)
            return
        key = (reader, request.xfer_id)
        # Accepted: from here the serve ends exactly once (served, refused, or its reader gone).
        self._serves[key] = _Serve(request.request_id, reader, 1, time.monotonic() + self._serve_timeout_s,
                                   chunked=chunked)

        def resume(got: tuple[Segment, ...] | str) -> None:  # any thread
            try:
                self._submit(lambda: self._resume_serve(key, ep, request, got))
            except RuntimeError:
                pass  # shutting down

        got = source(request, resume)
        if isinstance(got, tuple):  # in place now: served at once (as a subclass serves)
            del self._serves[key]
            self._accept_pull(ep, dataclasses.replace(request, segments=got), chunked)
        elif got is not None:
            self._resume_serve(key, ep, request, got)

    def _resume_serve(self, key: tuple[PeerKey, int], ep: Any, request: PullRequest,
                      got: tuple[Segment, ...] | str) -> None:
        """The listener placed an accepted pull's source (`got`: where its blocks lie now, or why
        it cannot be served): sends it, unless the reader gave up meanwhile."""
        serve = self._serves.get(key)
        if serve is None:
            return  # its reader was dropped meanwhile (and the serve reported ended)
        serve.pending_sends -= 1
        if isinstance(got, str):
            if serve.done_ok is None:
                self._send_ctrl(ep, {"k": "refuse", "x": request.xfer_id, "why": got})
                serve.done_ok = False
            self._maybe_reader_done(key, serve)
            return
        if serve.done_ok is not None:
            self._maybe_reader_done(key, serve)
            return
        self._send_pieces(ep, key, serve, dataclasses.replace(request, segments=got))

    def _accept_pull(self, ep: Any, request: PullRequest, chunked: bool = False) -> None:
        """Serves a validated pull: sends its pieces as DATA and waits for the reader's `done`."""
        key = (request.reader, request.xfer_id)
        serve = self._serves[key] = _Serve(request.request_id, request.reader, 0,
                                           time.monotonic() + self._serve_timeout_s, chunked=chunked)
        self._send_pieces(ep, key, serve, request)

    def _send_pieces(self, ep: Any, key: tuple[PeerKey, int], serve: _Serve, request: PullRequest) -> None:
        send_pieces = [p for seg in request.segments for p in self._pieces(seg, remote=True)]
        serve.pending_sends += len(send_pieces)
        on_sent = functools.partial(self._on_sent, key=key)
        for index, (start, length) in enumerate(send_pieces):
            view = self._region[start:start + length]
            sent = ep.tag_send(self._array(view), self._api.UCXXTag(data_tag(request.xfer_id, index)))
            self._track_in_lane(key, sent, on_sent, view)

    def _pieces(self, seg: Segment, *, remote: bool) -> list[tuple[int, int]]:
        if self._addressing is not None:
            return self._addressing.pieces(seg, remote=remote)
        if seg.num_heads == 0:
            first = seg.remote_block if remote else seg.local_block
            return [(first * self._block_nbytes, seg.num_blocks * self._block_nbytes)]
        return pieces(seg, self._geometry, remote=remote)

    def _segments_problem(self, segments: tuple[Segment, ...], *, remote: bool) -> str | None:
        """Why `segments` cannot be moved from (remote) / into (local) this region."""
        if not 0 < len(segments) <= MAX_SEGMENTS:
            return "bad_segments"
        total = 0
        for seg in segments:
            first = seg.remote_block if remote else seg.local_block
            if seg.num_blocks < 1 or first < 0 or first + seg.num_blocks > self._num_blocks:
                return "out_of_range"
            if seg.num_heads:
                head = seg.remote_head if remote else seg.local_head
                heads = self._geometry.num_local_heads if self._addressing is None else self._addressing.num_local_heads
                if ((self._addressing is None and self._geometry.head_nbytes == 0) or seg.num_heads < 0 or head < 0
                        or head + seg.num_heads > heads):
                    return "bad_segments"
            total += num_pieces(seg) if self._addressing is None else self._addressing.num_pieces(seg)
        return None if total <= MAX_SEGMENTS else "bad_segments"

    def _refusal(self, request: PullRequest) -> str | None:
        """Transport-level checks: the segments must name blocks (and heads) of this region."""
        return self._segments_problem(request.segments, remote=True)

    def _reply_ep(self, reader: PeerKey, address: bytes) -> Any:
        ep = self._reply_eps.get(address)
        if ep is None:
            ucx_address = self._api.UCXAddress.create_from_buffer(address)
            ep = self._api.UCXEndpoint.create_from_worker_address(self._worker, ucx_address, False)
            self._reply_eps[address] = ep
            self._reader_addr[reader] = address
        return ep

    def _on_sent(self, error: str | None, *, key: tuple[PeerKey, int]) -> None:
        serve = self._serves.get(key)
        if serve is None:
            return
        if error is not None:
            logger.warning("%s: send of %s to %s failed: %s", self._name, serve.request_id, key[0], error)
        serve.pending_sends -= 1
        self._maybe_reader_done(key, serve)

    def _on_done_msg(self, message: dict[str, Any]) -> None:
        reader = _key_from_wire(message["reader"])
        key = (reader, int(message["x"]))
        serve = self._serves.get(key)
        if serve is None:
            return  # refused, or already finished: nothing pinned for it
        serve.done_ok = bool(message["ok"])
        self._maybe_reader_done(key, serve)

    def _maybe_reader_done(self, key: tuple[PeerKey, int], serve: _Serve) -> None:
        if serve.done_ok is None or serve.pending_sends > 0:
            return
        del self._serves[key]
        self._serve_ended(key, serve, serve.done_ok)

    def _serve_ended(self, key: tuple[PeerKey, int], serve: _Serve, ok: bool) -> None:
        """Tells the listener a serve ended: `on_serve_ended` (with the pull's id, and whether
        the reader's read ended with it) where it has one, else `on_reader_done` once per read."""
        if self._listener is None:
            return
        hook = getattr(self._listener, "on_serve_ended", None)
        if hook is not None:
            hook(serve.request_id, serve.reader, key[1], ok, not serve.chunked)
        elif not serve.chunked:
            self._listener.on_reader_done(serve.request_id, serve.reader, ok)

    def _reader_released(self, request_id: str, reader: PeerKey) -> None:
        hook = getattr(self._listener, "on_reader_released", None)
        if hook is not None:
            hook(request_id, reader)

    def _on_release_msg(self, message: dict[str, Any]) -> None:
        self._reader_released(str(message["rid"]), _key_from_wire(message["reader"]))

    def _on_renew_msg(self, message: dict[str, Any]) -> None:
        if self._listener is not None:
            self._listener.on_renew([str(r) for r in message["rids"]], _key_from_wire(message["reader"]))


def _error_of(request: Any) -> str | None:
    try:
        request.check_error()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _register_device_region(ctx: Any, region: Any, ucx_config: dict[str, str]) -> MemoryRegistration | None:
    """For a GPU region: checks UCX's CUDA transports (RuntimeError naming what is missing and
    the UCX_TLS to set) and registers the region once. Host regions: None (UCX registers host
    memory through its cache as before)."""
    if not is_device_region(region):
        return None
    tls = ucx_config.get("TLS") or os.environ.get("UCX_TLS", "")
    problem = cuda_transport_problem(ctx.info, tls)
    if problem is not None:
        raise RuntimeError(problem)
    return MemoryRegistration(ctx, region)


def _ignore(error: str | None) -> None:
    """Drained bytes nobody waits for."""


def _segment_to_wire(seg: Segment) -> list[int]:
    if seg.num_heads == 0:
        return [seg.remote_block, seg.local_block, seg.num_blocks]
    return [seg.remote_block, seg.local_block, seg.num_blocks, seg.remote_head, seg.local_head, seg.num_heads]


def _segment_from_wire(raw: Any) -> Segment:
    """A wire segment: 3 ints (whole blocks) or 6 (with a head range). Raises on anything else."""
    if not isinstance(raw, list) or len(raw) not in (3, 6):
        raise ValueError(f"malformed segment {raw!r}")
    return Segment(*(int(v) for v in raw))


def _key_to_wire(key: PeerKey) -> list[Any]:
    return [key.engine_id, key.epoch, key.tp_rank]


def _key_from_wire(raw: Any) -> PeerKey:
    engine_id, epoch, tp_rank = raw
    return PeerKey(str(engine_id), int(epoch), int(tp_rank))


def _close(ep: Any) -> None:
    try:
        ep.close_blocking(period=100_000_000, max_attempts=1)
    except Exception as e:
        logger.debug("endpoint close failed: %s", e)
