"""`ServeSide`: the writer side of the `ucx` worker connector (a prefill rank serving its KV).

A prefill rank pins a request's blocks with `expect_send(request_id, block_ids)` BEFORE the
descriptor leaves the engine (a lease of `lease_s`, renewed by live readers); the transport
then calls back as readers' pulls arrive: `on_pull_request` validates a pull against our epoch
and the lease (refused without touching memory otherwise), `source_segments` says where its
bytes are (with host staging: slots of the pool the blocks were copied into, per lease or per
pull), `on_serve_ended` / `on_reader_done` / `on_reader_released` count readers done, and
`on_renew` extends leases. The request is reported in `finished_sending` once every expected
reader is done and every send completed, or when the lease ran out with no send in flight
(`_expire_leases_locked`, at each drain). The contracts are stated in connectors/ucx/worker.py;
the shared state and lock in connectors/ucx/worker_state.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from connectors.ucx.handshake import PeerKey
from connectors.ucx.transport import PullRequest, Segment
from connectors.ucx.worker_state import WorkerState

logger = logging.getLogger(__name__)

_EXPECT_PULL_S = 0.02


class ReadyFence(Protocol):
    """Completion of the compute that wrote a prefill's blocks (a CUDA event on the engine's
    stream: `connectors/vllm/kv_region.py`); `wait()` returns once it is done."""

    def wait(self) -> None: ...


@dataclass(slots=True)
class _Lease:
    block_ids: frozenset[int]
    expires_at: float
    readers_left: int
    active: int = 0
    ready: ReadyFence | None = None  # waited on before the first byte is served
    slots: dict[int, int] | None = None  # host staging: block id -> its slot in the pool (None: staged per pull)
    staged: Any = None  # host staging: the Future of the copy into the slots
    released: set[PeerKey] = field(default_factory=set)  # readers that ended a chunked read


class ServeSide(WorkerState):
    """Writer-side state and methods of `UcxWorkerConnector`; see the module docstring."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._leases: dict[str, _Lease] = {}
        # Host staging of a lease staged per pull: pulls waiting for a run of slots (FIFO), and
        # the copies into the runs of pulls being served, by (reader, xfer id).
        self._serve_waiting: dict[tuple[PeerKey, int], tuple[PullRequest, Any]] = {}
        self._serve_copies: dict[tuple[PeerKey, int], Any] = {}

    def expect_send(self, request_id: str, block_ids: list[int], lease_s: float | None = None,
                    num_readers: int = 1, ready: ReadyFence | None = None) -> None:
        """Pins `block_ids` of `request_id` for `num_readers` readers until they are done or the
        lease (default `config.lease_s`, renewed by live readers) runs out. Call it before the
        descriptor is handed out. `num_readers` is how many decode ranks read this rank
        (`head_map.readers_of`); 0 (a rank no reader needs, e.g. a replica of an MQA head) pins
        nothing and reports the id in `finished_sending` at the next drain. Raises ValueError
        (no state change) on a known id, ids out of range, or a bad lease / reader count.
        With host staging the blocks are copied into the pool now when a run of them is free,
        else each pull of them is when it arrives (`source_segments`).
        `ready`: the blocks' bytes are final only once it is done (GPU compute still queued);
        the first pull of them waits for it on the transport's thread before a byte moves."""
        num_blocks = self.handshake_metadata.region.num_blocks
        ids = frozenset(int(b) for b in block_ids)
        if any(not 0 <= b < num_blocks for b in ids):
            raise ValueError(f"request {request_id}: block ids must be in [0, {num_blocks})")
        lease = self.config.lease_s if lease_s is None else lease_s
        if lease <= 0 or num_readers < 0:
            raise ValueError(f"request {request_id}: lease_s must be > 0 and num_readers >= 0")
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id} is already pinned for sending")
            if num_readers == 0:
                self._results.finished_sending.add(request_id)
                self._changed.notify_all()
                return
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id} is already pinned for sending")
            pinned = _Lease(ids, time.monotonic() + lease, num_readers, ready=ready)
            if self._staging is not None:
                self._stage_out_locked(request_id, pinned)
            self._leases[request_id] = pinned
        if self._transport is not None:
            # The reader's pull usually follows within milliseconds: poll briefly for it
            # instead of paying a wake-up on a busy host.
            self._transport.expect_activity(_EXPECT_PULL_S)

    def _stage_out_locked(self, request_id: str, lease: _Lease) -> None:
        """Host staging: a run of slots for the request's blocks (ascending, so consecutive
        blocks stay consecutive) and the copy into them, which the first reader waits for
        (after the compute fence). A request larger than the pool, or one that finds no free
        run, is staged per pull instead (`source_segments`): its blocks stay pinned in the KV
        cache and each pull is copied into a run of its own when it arrives."""
        from connectors.ucx.host_staging import CopyFence

        assert self._staging is not None
        pool, ordered = self._staging.pool, sorted(lease.block_ids)
        run = pool.allocate(("send", request_id), len(ordered)) if pool.fits(len(ordered)) else None
        if run is None:
            return
        lease.slots = {b: run.start + i for i, b in enumerate(ordered)}
        lease.staged = self._staging.copy_out(ordered, run, after=lease.ready)
        lease.ready = CopyFence(lease.staged)

    def _lease_ended_locked(self, request_id: str, lease: _Lease) -> None:
        """A lease is gone: its staging slots return (after its copy, if still running); pulls
        of it waiting for slots are refused."""
        if self._staging is not None and lease.slots is None:
            self._dispatch_serves_locked()
        if lease.slots is None:
            return
        if lease.staged is not None and not lease.staged.done():
            self._free_slots_later(("send", request_id))
        else:
            self._free_slots_locked(("send", request_id))

    def source_segments(self, request: PullRequest, resume: Any = None) -> tuple[Segment, ...] | str | None:
        """Transport callback (writer, after `on_pull_request` accepted): with host staging the
        request's blocks are served from their slots: at once where the lease holds a run
        (a reason refusing the pull if it was cancelled since: its slots are gone); for a lease
        staged per pull None, and `resume(slot segments | reason)` once this pull's blocks are
        copied into a run of its own (waiting in line while no run is free). Without staging
        from where they are."""
        if self._staging is None:
            return request.segments
        with self._lock:
            lease = self._leases.get(request.request_id)
            if lease is None:
                return "unknown_request"
            if lease.slots is not None:
                slots = lease.slots
                return tuple(dataclasses.replace(seg, remote_block=slots[seg.remote_block])
                             for seg in request.segments)
            if resume is None:
                return "staging_pool_too_small"
            self._serve_waiting[(request.reader, request.xfer_id)] = (request, resume)
            self._dispatch_serves_locked()
            return None

    def _dispatch_serves_locked(self) -> None:
        """Writer, host staging: copies waiting pulls (in arrival order) into free runs; a pull
        whose lease ended meanwhile is refused."""
        assert self._staging is not None
        for key, (request, resume) in list(self._serve_waiting.items()):
            if request.request_id not in self._leases:
                del self._serve_waiting[key]
                resume("unknown_request")
                continue
            ids = [b for seg in request.segments for b in range(seg.remote_block, seg.remote_block + seg.num_blocks)]
            run = self._staging.pool.allocate(("serve", *key), len(ids))
            if run is None:
                return  # back-pressure: a returning run dispatches it
            del self._serve_waiting[key]
            segments, at = [], run.start
            for seg in request.segments:
                segments.append(dataclasses.replace(seg, remote_block=at))
                at += seg.num_blocks
            staged = tuple(segments)
            future = self._serve_copies[key] = self._staging.copy_out(ids, run)
            future.add_done_callback(
                lambda f, staged=staged, resume=resume: resume(staged if f.exception() is None else "staging_error"))

    def on_pull_request(self, request: PullRequest) -> str | None:
        """Transport callback: validates a reader's pull against our epoch and leases (after
        the lease's `ready` fence, if any, is done: the bytes are served right after)."""
        self._wait_ready(request.request_id)
        with self._lock:
            why = self._pull_problem_locked(request)
            if why is not None:
                self._stats.pair(self.key.engine_id, request.reader.engine_id).record_failure(f"refused:{why}")
                logger.warning("refused a pull of %s by %s: %s", request.request_id, request.reader, why)
                return why
            self._leases[request.request_id].active += 1
            return None

    def _pull_problem_locked(self, request: PullRequest) -> str | None:
        if request.engine_id != self.key.engine_id or request.epoch != self.key.epoch:
            return "stale_epoch"
        lease = self._leases.get(request.request_id)
        if lease is None:
            return "unknown_request"
        if time.monotonic() >= lease.expires_at:
            return "lease_expired"
        if any(b not in lease.block_ids for s in request.segments for b in range(s.remote_block,
                                                                               s.remote_block + s.num_blocks)):
            return "not_pinned"
        if (self._staging is not None and lease.slots is None
                and not self._staging.pool.fits(sum(s.num_blocks for s in request.segments))):
            return "staging_pool_too_small"  # a reader that does not chunk (an older build)
        return None

    def _wait_ready(self, request_id: str) -> None:
        """Waits (outside the lock) for the compute that wrote the request's blocks; once done,
        the fence is dropped so later readers do not wait again."""
        with self._lock:
            lease = self._leases.get(request_id)
            fence = lease.ready if lease is not None else None
        if fence is None:
            return
        fence.wait()
        with self._lock:
            if lease is not None:
                lease.ready = None

    def on_reader_done(self, request_id: str, reader: PeerKey, ok: bool) -> None:
        """Transport callback: a reader finished and every send of it completed (an unchunked
        pull; `on_serve_ended` says the same with the pull's id)."""
        self.on_serve_ended(request_id, reader, 0, ok, True)

    def on_serve_ended(self, request_id: str, reader: PeerKey, xfer_id: int, ok: bool, last: bool) -> None:
        """Transport callback: one accepted pull ended (every send completed and the reader
        said `done`, or it was refused after acceptance, or its reader was dropped): a run it
        was staged in returns; with `last` the reader's read ended too."""
        with self._lock:
            key = (reader, xfer_id)
            if self._staging is not None and xfer_id:
                self._serve_waiting.pop(key, None)
                copy = self._serve_copies.pop(key, None)
                if self._staging.pool.holds(("serve", *key)) is not None:
                    if copy is not None and not copy.done():
                        self._free_slots_later(("serve", *key))
                    else:
                        self._free_slots_locked(("serve", *key))
            lease = self._leases.get(request_id)
            if lease is None:
                return
            lease.active -= 1
            if last:
                lease.readers_left -= 1
            self._maybe_lease_done_locked(request_id, lease)

    def on_reader_released(self, request_id: str, reader: PeerKey) -> None:
        """Transport callback: `reader` ended its chunked read of `request_id` (counted once)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or reader in lease.released:
                return
            lease.released.add(reader)
            lease.readers_left -= 1
            self._maybe_lease_done_locked(request_id, lease)

    def _maybe_lease_done_locked(self, request_id: str, lease: _Lease) -> None:
        if lease.readers_left <= 0 and lease.active <= 0:
            del self._leases[request_id]
            self._lease_ended_locked(request_id, lease)
            self._results.finished_sending.add(request_id)
            self._changed.notify_all()

    def on_renew(self, request_ids: list[str], reader: PeerKey) -> None:
        """Transport callback: extends the leases of requests a live reader still wants."""
        with self._lock:
            until = time.monotonic() + self.config.lease_s
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is not None:
                    lease.expires_at = max(lease.expires_at, until)

    def _expire_leases_locked(self) -> None:
        now = time.monotonic()
        for rid, lease in list(self._leases.items()):
            if now >= lease.expires_at and lease.active <= 0:
                del self._leases[rid]
                self._lease_ended_locked(rid, lease)
                self._results.finished_sending.add(rid)
                logger.info("lease of %s expired before every reader was done", rid)
                self._stats.lease_expiries += 1
                self._stats.record("num_kv_expired_reqs", 1)
