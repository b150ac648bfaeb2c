"""`PullSide`: the reader side of the `ucx` worker connector (a decode rank pulling prompt KV).

A decode rank registers the prefill ranks it may read (`add_peer` / `remove_peer`, from Welcome
and PeerUpdate), then `start_pull(request_id, descriptor, local_block_ids)` reads a request's
blocks from the prefill ranks holding its KV heads (the same rank under equal TP; under
different TP sizes one or several ranks, each read for a head range straight into our blocks,
see `connectors.head_map`). Each rank read is one `PullOp`, or with host staging several chunk
pulls of at most half the smaller pool, ended by a `release`; at most
`max_inflight_transfers` ops are in flight, the rest wait in a FIFO. A request ends once every
op ended: in `finished_recving`, or in `failed_recving` with its reason
(`take_failure_reasons`) and the local blocks that did not receive all their bytes
(`get_block_ids_with_load_errors`). The contracts are stated in connectors/ucx/worker.py; the
shared state and lock in connectors/ucx/worker_state.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from connectors.head_map import HeadRead, mapping_problem, rank_heads, read_plan
from connectors.ucx.ep_info import UNKNOWN, TransportExpectation
from connectors.ucx.handshake import KVTransferDescriptor, PeerKey, UcxHandshakeMetadata
from connectors.ucx.transport import PullOp, PullResult, Segment, coalesce, split_segments
from connectors.ucx.worker_state import WorkerState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Recv:
    """One request's pull: one `PullOp` per prefill rank read (one under equal TP)."""

    request_id: str
    engine_id: str  # the prefill engine
    local_block_ids: tuple[int, ...]
    ops: tuple[PullOp, ...] = ()
    open: set[int] = field(default_factory=set)  # xfer ids not ended yet
    # xfer id -> the local blocks a failed op fully delivered (None: it succeeded: all of its
    # blocks); an op absent never delivered (not ended yet, or dropped before it was sent)
    delivered: dict[int, set[int] | None] = field(default_factory=dict)
    reason: str | None = None  # the first failure
    num_bytes: int = 0
    seconds: float = 0.0
    bytes_by_transport: dict[str, int] = field(default_factory=dict)
    copying: list[Any] = field(default_factory=list)  # host staging: copies into the KV tensor under way


class PullSide(WorkerState):
    """Reader-side state and methods of `UcxWorkerConnector`; see the module docstring."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._peers: dict[PeerKey, UcxHandshakeMetadata] = {}
        self._xfer_ids = itertools.count(1)
        self._recvs: dict[str, _Recv] = {}
        self._by_xfer: dict[int, str] = {}
        self._queued: list[tuple[str, PullOp]] = []
        self._inflight = 0
        self._load_errors: set[int] = set()
        self._failure_reasons: dict[str, str] = {}
        self._last_renew = time.monotonic()
        self._op_slots: dict[int, tuple[Any, tuple[int, ...]]] = {}  # staging: xfer id -> (slot run, KV ids)
        self._expected = TransportExpectation.parse(self.config.expected_transports)
        self._peer_transports: dict[PeerKey, str] = {}  # the transport of the last pull from each writer
        self._warned_fallbacks: set[PeerKey] = set()

    # -- peers ---------------------------------------------------------------------------------

    def add_peer(self, metadata: bytes | UcxHandshakeMetadata) -> PeerKey:
        """Registers a prefill rank and connects to it; a new epoch of a known engine replaces
        the old one (its pulls fail with peer_gone). Raises ValueError, changing nothing, on
        malformed or incompatible metadata."""
        meta = (metadata if isinstance(metadata, UcxHandshakeMetadata)
                else UcxHandshakeMetadata.decode(metadata, expected_hash=self.compatibility_hash,
                                                 expected_transport=self.config.kv_transport))
        if meta.kv_transport != self.config.kv_transport:
            raise ValueError(f"peer {meta.engine_id}: moves KV with --kv-transport {meta.kv_transport}, this engine "
                             f"with {self.config.kv_transport}: both engines of a pair must use the same KV transport")
        if meta.compatibility_hash != self.compatibility_hash:
            raise ValueError(f"peer {meta.engine_id}: compatibility hash differs from ours")
        meta.validate()
        mine = self.handshake_metadata.region
        if (meta.region.num_layers, meta.region.dtype, meta.region.block_size, meta.region.head_dim,
                meta.region.layout) != (mine.num_layers, mine.dtype, mine.block_size, mine.head_dim, mine.layout):
            raise ValueError(f"peer {meta.engine_id}: KV layout differs (layers, dtype, block size, head dim or "
                             f"layout {meta.region.layout} vs {mine.layout})")
        transport = self._require_transport()
        with self._lock:
            stale = [k for k in self._peers if k.engine_id == meta.engine_id and k.epoch != meta.epoch]
            for key in stale:
                self._drop_peer_locked(key)
            self._peers[meta.key] = meta
        transport.add_peer(meta.key, meta.worker_address)
        return meta.key

    def remove_peer(self, engine_id: str, epoch: int | None = None) -> None:
        """Forgets an engine's ranks (of `epoch`, or every epoch): their pulls fail with peer_gone."""
        with self._lock:
            for key in [k for k in self._peers if k.engine_id == engine_id and (epoch is None or k.epoch == epoch)]:
                self._drop_peer_locked(key)

    def _drop_peer_locked(self, key: PeerKey) -> None:
        del self._peers[key]
        self._peer_transports.pop(key, None)
        self._warned_fallbacks.discard(key)
        if self._transport is not None:
            self._transport.remove_peer(key)
        for rid, op in [(rid, op) for rid, op in self._queued if op.peer == key]:
            if (rid, op) in self._queued:  # (a failed chunk pull drops the rest of its read)
                self._queued.remove((rid, op))
                self._op_ended_locked(self._recvs[rid], op, "peer_gone", (), 0, 0.0)

    # -- pulls ---------------------------------------------------------------------------------

    def start_pull(self, request_id: str, descriptor: KVTransferDescriptor, local_block_ids: list[int]) -> None:
        """Starts pulling `descriptor`'s blocks into `local_block_ids`.

        `local_block_ids` are the blocks still missing locally, in prompt order; with a local
        prefix cached only the LAST `len(local_block_ids)` remote blocks are read. Under a
        prefill TP other than ours the pull reads each of our head ranges from the prefill rank
        `head_map.read_plan` names (one transport op per rank read); the request ends once
        every op ended. Raises ValueError (no state change) for caller errors: a request already
        pulling, bad or duplicate local ids, more local than remote blocks. Problems of the
        descriptor (stale epoch, unknown peer, blocks out of range, unmappable TP) are transfer
        failures: the request is reported in `failed_recving` at the next drain.
        """
        self._require_transport()
        local = tuple(int(b) for b in local_block_ids)
        num_local_blocks = self.handshake_metadata.region.num_blocks
        if any(not 0 <= b < num_local_blocks for b in local) or len(set(local)) != len(local):
            raise ValueError(f"request {request_id}: local block ids must be distinct and in [0, {num_local_blocks})")
        if len(local) > len(descriptor.block_ids):
            raise ValueError(f"request {request_id}: {len(local)} local blocks for "
                             f"{len(descriptor.block_ids)} remote blocks")
        with self._lock:
            if request_id in self._recvs:
                raise ValueError(f"request {request_id} is already pulling")
            recv = _Recv(request_id, descriptor.engine_id, local)
            if not local:
                self._results.finished_recving.add(request_id)
                return
            plan, reason = self._plan_locked(descriptor)
            if reason is not None:
                self._fail_locked(recv, reason, set())
                return
            remote = [int(b) for b in descriptor.block_ids[len(descriptor.block_ids) - len(local):]]
            recv.ops = tuple(PullOp(next(self._xfer_ids), PeerKey(descriptor.engine_id, descriptor.epoch, read.src_rank),
                                    descriptor.request_id, self._segments(read, descriptor.tp_size, remote, local),
                                    self.config.transfer_timeout_s) for read in plan)
            chunked, too_big = self._chunked_locked(recv.ops)
            if too_big is not None:
                logger.error("cannot pull %s: %s", request_id, too_big)
                self._fail_locked(recv, "staging_pool_too_small", set())
                return
            recv.ops = chunked
            recv.open = {op.xfer_id for op in recv.ops}
            self._recvs[request_id] = recv
            self._queued.extend((request_id, op) for op in recv.ops)
            self._dispatch_locked()

    def _plan_locked(self, d: KVTransferDescriptor) -> tuple[tuple[HeadRead, ...], str | None]:
        """The head reads of a descriptor, or why it cannot be read."""
        known_epochs = {k.epoch for k in self._peers if k.engine_id == d.engine_id}
        if not known_epochs:
            return (), "peer_unknown"
        if d.epoch not in known_epochs:
            return (), "stale_epoch"
        if d.num_kv_heads != self.num_kv_heads:
            return (), "incompatible"
        if mapping_problem(d.tp_size, self.tp_size, self.num_kv_heads) is not None:
            return (), "unsupported_tp"
        plan = read_plan(self.key.tp_rank, self.tp_size, d.tp_size, self.num_kv_heads)
        mine = self.handshake_metadata.region
        for read in plan:
            meta = self._peers.get(PeerKey(d.engine_id, d.epoch, read.src_rank))
            if meta is None or meta.tp_size != d.tp_size:
                return (), "peer_unknown"
            if meta.region.head_block_nbytes != mine.head_block_nbytes:
                return (), "incompatible"
            if any(not 0 <= b < meta.region.num_blocks for b in d.block_ids):
                return (), "out_of_range"
        return plan, None

    def _segments(self, read: HeadRead, prefill_tp: int, remote: list[int],
                  local: tuple[int, ...]) -> tuple[Segment, ...]:
        """Block runs of one head read: whole blocks when both ranks hold exactly these heads,
        else head-range segments (one message per block)."""
        runs = coalesce(remote, list(local))
        src_start, src_end = rank_heads(read.src_rank, prefill_tp, self.num_kv_heads)
        if read.num_heads == self.handshake_metadata.region.num_local_heads == src_end - src_start:
            return tuple(runs)
        return tuple(Segment(s.remote_block, s.local_block, s.num_blocks, read.src_offset, read.dst_offset,
                             read.num_heads) for s in runs)

    def _chunked_locked(self, ops: tuple[PullOp, ...]) -> tuple[tuple[PullOp, ...], str | None]:
        """The ops with each read larger than a pull may be (our staging pool, or the writer's:
        its `max_pull_blocks`) split into chunk pulls of at most half that, so two run at once
        (one moving while the other is copied); or why a read cannot be pulled (a writer of an
        older build, which serves one pull per reader)."""
        out: list[PullOp] = []
        for op in ops:
            meta = self._peers[op.peer]
            limits = [n for n in (self._staging.pool.num_slots if self._staging else 0, meta.max_pull_blocks) if n]
            num_blocks = sum(s.num_blocks for s in op.segments)
            if not limits or num_blocks <= min(limits):
                out.append(op)
                continue
            if not meta.chunked_pulls:
                return (), (f"a pull of {num_blocks} blocks from one rank does not fit the KV staging pool of "
                            f"{min(limits)} blocks, and {op.peer.engine_id} (an older build) serves no chunked "
                            "pulls (raise --kv-staging-blocks)")
            half = max(1, min(limits) // 2)
            num_chunks = -(-num_blocks // half)
            for segments in split_segments(op.segments, -(-num_blocks // num_chunks)):
                out.append(dataclasses.replace(op, xfer_id=next(self._xfer_ids), segments=segments, chunked=True))
        return tuple(out), None

    def _dispatch_locked(self) -> None:
        while self._queued and self._inflight < self.config.max_inflight_transfers and self._transport is not None:
            request_id, op = self._queued[0]
            if self._staging is not None:
                staged = self._stage_op_locked(op)
                if staged is None:
                    return  # back-pressure: the pool has no free run for it yet; a returning run dispatches
                op = staged
            self._queued.pop(0)
            self._inflight += 1
            self._by_xfer[op.xfer_id] = request_id
            self._transport.pull(op)

    def _stage_op_locked(self, op: PullOp) -> PullOp | None:
        """The op landing in a run of staging slots (each segment in consecutive slots), or None
        while no run of its size is free."""
        assert self._staging is not None
        run = self._staging.pool.allocate(("pull", op.xfer_id), sum(s.num_blocks for s in op.segments))
        if run is None:
            return None
        segments: list[Segment] = []
        block_ids: list[int] = []
        at = run.start
        for seg in op.segments:
            segments.append(dataclasses.replace(seg, local_block=at))
            block_ids.extend(range(seg.local_block, seg.local_block + seg.num_blocks))
            at += seg.num_blocks
        self._op_slots[op.xfer_id] = (run, tuple(block_ids))
        return dataclasses.replace(op, segments=tuple(segments))

    def on_pull_finished(self, result: PullResult) -> None:
        """Transport callback (progress thread)."""
        with self._lock:
            request_id = self._by_xfer.pop(result.xfer_id, None)
            if request_id is None:
                return  # cancelled
            self._inflight -= 1
            recv = self._recvs[request_id]
            op = next(o for o in recv.ops if o.xfer_id == result.xfer_id)
            self._note_transport_locked(recv, op, result)
            staged = self._op_slots.pop(result.xfer_id, None)
            if staged is not None:
                if result.ok:  # the bytes are in the slots: copy them into the KV tensor first
                    self._copy_in_locked(recv, op, result, *staged)
                    self._dispatch_locked()
                    return
                self._free_slots_locked(("pull", result.xfer_id))
                result = dataclasses.replace(result, done_segments=())  # slot ids: count nothing as received
            if result.ok:
                self._op_ended_locked(recv, op, None, (), result.num_bytes, result.seconds)
            else:
                self._op_ended_locked(recv, op, result.reason or "unknown", _block_ids(result.done_segments),
                                      result.num_bytes, result.seconds)
            self._dispatch_locked()

    def _copy_in_locked(self, recv: _Recv, op: PullOp, result: PullResult, run: Any,
                        block_ids: tuple[int, ...]) -> None:
        """Host staging: slots -> KV blocks on the stager thread; the op ends once they are in."""
        assert self._staging is not None
        first = op.segments[0]
        heads = (first.local_head, first.num_heads) if first.num_heads else None

        def copied(error: BaseException | None) -> None:
            with self._lock:
                self._free_slots_locked(("pull", op.xfer_id))
                if self._recvs.get(recv.request_id) is recv and op.xfer_id in recv.open:
                    if error is not None:
                        logger.error("copying pulled KV of %s out of the staging pool failed: %s", recv.request_id,
                                     error)
                    self._op_ended_locked(recv, op, None if error is None else "staging_error", (), result.num_bytes,
                                          result.seconds)
                self._dispatch_locked()

        recv.copying.append(self._staging.copy_in(run, block_ids, heads, then=copied))

    def _note_transport_locked(self, recv: _Recv, op: PullOp, result: PullResult) -> None:
        """Records the transport a pull used; a fallback below `expected_transports` is counted
        per pull and logged once per writer rank."""
        transport = result.transport or UNKNOWN
        recv.bytes_by_transport[transport] = recv.bytes_by_transport.get(transport, 0) + result.num_bytes
        if result.transport:
            self._peer_transports[op.peer] = transport
        if not self._expected.fallback(transport):
            return
        stats = self._stats.pair(recv.engine_id, self.key.engine_id)
        key = (self._expected.label, transport)
        stats.fallbacks[key] = stats.fallbacks.get(key, 0) + 1
        if op.peer not in self._warned_fallbacks:
            self._warned_fallbacks.add(op.peer)
            logger.warning("KV pulls from %s rank %d to %s rank %d use UCX transport %s, slower than the expected %s "
                           "(--expected-transports): check the NIC, UCX_TLS and UCX_NET_DEVICES", op.peer.engine_id,
                           op.peer.tp_rank, self.key.engine_id, self.key.tp_rank, transport, self._expected.label)

    def peer_transports(self) -> dict[PeerKey, str]:
        """Every known writer rank -> the UCX transport its last pull used ("" before any pull)."""
        with self._lock:
            return {key: self._peer_transports.get(key, "") for key in self._peers}

    def _op_ended_locked(self, recv: _Recv, op: PullOp, reason: str | None, received: Any, num_bytes: int,
                         seconds: float) -> None:
        """One op of a request ended; the request ends with its last op (failed if any failed,
        its valid blocks those every read delivered in full: a read's delivered blocks are
        those of its ops that succeeded plus what its failed ops fully delivered; see
        `_valid_locked`). `received` (the blocks a failed op delivered) is ignored when
        `reason` is None. A failed chunk pull ends its read: the read's pulls not yet sent are
        dropped (they deliver nothing); a chunked read whose last pull ended is released at
        the writer."""
        recv.open.discard(op.xfer_id)
        recv.delivered[op.xfer_id] = None if reason is None else set(received)
        stats = self._stats.pair(recv.engine_id, self.key.engine_id)
        stats.num_operations += 1
        recv.num_bytes += num_bytes
        recv.seconds = max(recv.seconds, seconds)
        if reason is not None:
            recv.reason = recv.reason or reason
            if op.chunked:
                dropped = [(rid, q) for rid, q in self._queued if rid == recv.request_id and q.peer == op.peer]
                for entry in dropped:
                    self._queued.remove(entry)
                    recv.open.discard(entry[1].xfer_id)
        if op.chunked and not any(o.peer == op.peer and o.xfer_id in recv.open for o in recv.ops):
            self._release_locked(op.peer, op.request_id)
        if recv.open:
            return
        del self._recvs[recv.request_id]
        if recv.reason is None:
            stats.num_bytes += recv.num_bytes
            for transport, n in recv.bytes_by_transport.items():
                stats.bytes_by_transport[transport] = stats.bytes_by_transport.get(transport, 0) + n
            stats.num_blocks += len(recv.local_block_ids)
            stats.durations.append(recv.seconds)
            self._stats.record("transfer_duration", recv.seconds)
            self._stats.record("bytes_transferred", recv.num_bytes)
            self._results.finished_recving.add(recv.request_id)
            self._changed.notify_all()
        else:
            self._fail_locked(recv, recv.reason, self._valid_locked(recv))

    def _valid_locked(self, recv: _Recv) -> set[int]:
        """The local blocks of a failed request that received all their bytes: in every read
        (one per prefill rank read, the same blocks each for other heads), from one of its ops."""
        by_read: dict[PeerKey, set[int]] = {}
        for op in recv.ops:
            got = by_read.setdefault(op.peer, set())
            if op.xfer_id in recv.delivered:
                delivered = recv.delivered[op.xfer_id]
                got |= _block_ids(op.segments) if delivered is None else delivered
        return set.intersection(*by_read.values()) if by_read else set()

    def _release_locked(self, peer: PeerKey, request_id: str) -> None:
        """Ends our chunked read of `request_id` at `peer` (its every pull ended)."""
        if self._transport is None:
            return
        try:
            self._transport.release(peer, request_id)
        except RuntimeError:
            pass  # the transport is stopping: the writer's lease runs out instead

    def _fail_locked(self, recv: _Recv, reason: str, received: set[int]) -> None:
        invalid = set(recv.local_block_ids) - received
        self._results.failed_recving.add(recv.request_id)
        self._changed.notify_all()
        self._failure_reasons[recv.request_id] = reason
        self._load_errors |= invalid
        self._stats.pair(recv.engine_id, self.key.engine_id).record_failure(reason)
        self._stats.record("num_failed_transfers", 1)
        logger.warning("KV pull of %s from %s failed: %s (%d invalid blocks)", recv.request_id, recv.engine_id,
                       reason, len(invalid))

    # -- draining ------------------------------------------------------------------------------

    def take_failure_reasons(self) -> dict[str, str]:
        """Why each failed pull failed (request id -> reason, e.g. timeout, stale_epoch,
        peer_gone, out_of_range, refused:<why>) since the last call."""
        with self._lock:
            reasons, self._failure_reasons = self._failure_reasons, {}
        return reasons

    def _renewals_locked(self) -> dict[PeerKey, list[str]]:
        now = time.monotonic()
        if now - self._last_renew < self.config.lease_s / 3 or not self._recvs:
            return {}
        self._last_renew = now
        renew: dict[PeerKey, list[str]] = defaultdict(list)
        for recv in self._recvs.values():
            for peer, rid in {(op.peer, op.request_id) for op in recv.ops if op.xfer_id in recv.open}:
                renew[peer].append(rid)
        return renew

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose pull failed (bytes not fully received), since the last call.
        They are recorded before the request shows up in `failed_recving`."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors


def _block_ids(segments: tuple[Segment, ...]) -> set[int]:
    """The local block ids `segments` cover."""
    return {b for s in segments for b in range(s.local_block, s.local_block + s.num_blocks)}

