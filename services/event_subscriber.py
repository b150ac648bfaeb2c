"""`EventSubscriber`: a KV-event consumer that follows the cluster's block state across scheduler
replicas, surviving the death of the one it reads from.

    sub = EventSubscriber("10.0.0.1:50053,10.0.0.2:50053")
    sub.start()                      # a daemon thread reads and applies the stream
    sub.blocks()                     # {engine_id: {(medium, block_hash), ...}} of live epochs
    sub.close()

Each replica numbers its batches on its own, so a consumer cannot resume at another replica by
seq. It resumes by state: every (re)subscription asks for a snapshot (`SubscribeRequest.snapshot`)
and the state the snapshot describes *replaces* the consumer's at SNAPSHOT_END; live batches
follow from there with no gap (the replica's guarantee). So nothing is missed and nothing is
counted twice, whatever the consumer saw before. A replica that is not converged yet answers
UNAVAILABLE and the next one is tried; a RESYNC (the consumer fell behind) is followed by a
snapshot and handled the same way.

Contract of `BlockState` (pure): `feed(msg)` applies one `EventStreamMessage`; `blocks()` is the
state after the last complete snapshot and every live batch since. A full AllBlocksCleared clears
the engine epoch (one with a medium clears that medium); a newer epoch of an engine replaces
the older one's blocks.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, event_from_proto
from pdserve.v1 import kv_events_pb2 as pb
from pdserve.v1 import kv_events_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.security import ChannelSecurity, open_sync_channel
from services.scheduler.prefix_index import DEFAULT_MEDIUM

logger = logging.getLogger(__name__)

Block = tuple[str, object]  # (medium, block hash)


def apply_block_event(blocks: set[Block], event: KVCacheEvent) -> None:
    """One event applied to a consumer's block set. No medium is the default one (GPU), as in
    the index the snapshots come from; AllBlocksCleared without a medium clears every medium."""
    if isinstance(event, BlockStored):
        blocks.update((event.medium or DEFAULT_MEDIUM, h) for h in event.block_hashes)
    elif isinstance(event, BlockRemoved):
        blocks.difference_update((event.medium or DEFAULT_MEDIUM, h) for h in event.block_hashes)
    elif isinstance(event, AllBlocksCleared):
        if event.medium is None:
            blocks.clear()
        else:
            blocks.difference_update([b for b in blocks if b[0] == event.medium])


class BlockState:
    """See the module docstring."""

    def __init__(self) -> None:
        self._live: dict[str, tuple[int, set[Block]]] = {}
        self._staging: dict[str, tuple[int, set[Block]]] | None = None
        self.num_snapshots = 0
        self.last_seq = 0

    def blocks(self) -> dict[str, set[Block]]:
        return {e: set(b) for e, (_, b) in self._live.items() if b}

    def feed(self, msg: pb.EventStreamMessage) -> None:
        if msg.HasField("notice"):
            kind = msg.notice.kind
            if kind == pb.StreamNotice.SNAPSHOT_BEGIN:
                self._staging = {}
            elif kind == pb.StreamNotice.SNAPSHOT_END and self._staging is not None:
                self._live, self._staging = self._staging, None
                self.num_snapshots += 1
            return
        for batch in ([msg.batch] if msg.HasField("batch") else msg.batches):
            if batch.seq == 0 and self._staging is not None:
                self._apply(self._staging, batch)
            elif self._staging is None:
                self._apply(self._live, batch)
                self.last_seq = batch.seq

    @staticmethod
    def _apply(state: dict[str, tuple[int, set[Block]]], batch: pb.EventBatch) -> None:
        epoch, blocks = state.get(batch.engine_id, (batch.epoch, set()))
        if batch.epoch < epoch:
            return  # a late batch of a replaced epoch
        if batch.epoch > epoch:
            blocks = set()
        state[batch.engine_id] = (batch.epoch, blocks)
        for e in batch.events:
            apply_block_event(blocks, event_from_proto(e))


class EventSubscriber:
    """Reads the first reachable replica of `targets` (comma list of KVEvents host:port) and
    moves to the next when its stream fails (see the module docstring)."""

    def __init__(self, targets: str, *, security: ChannelSecurity | None = None,
                 retry_interval_s: float = 0.2) -> None:
        self.targets = [t.strip() for t in targets.split(",") if t.strip()]
        if not self.targets:
            raise ValueError("targets: no KVEvents endpoint given")
        self.security = security
        self.retry_interval_s = retry_interval_s
        self.state = BlockState()
        self.target = ""
        self.num_switches = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._call: grpc.Future | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="event-subscriber", daemon=True)
        self._thread.start()

    def blocks(self) -> dict[str, set[Block]]:
        with self._lock:
            return self.state.blocks()

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self) -> None:
        i = 0
        while not self._closed.is_set():
            target = self.targets[i % len(self.targets)]
            try:
                self._follow(target)
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                logger.info("KV events from %s ended (%s): resuming at the next replica from a snapshot",
                            target, e.code().name if hasattr(e, "code") else e)
            i += 1
            self.num_switches += 1
            self._closed.wait(self.retry_interval_s)

    def _follow(self, target: str) -> None:
        metadata = self.security.metadata() if self.security is not None else ()
        with open_sync_channel(target, self.security, CHANNEL_OPTIONS) as channel:
            call = kv_events_pb2_grpc.KVEventsStub(channel).Subscribe(pb.SubscribeRequest(snapshot=True),
                                                                      metadata=metadata)
            self._call = call  # type: ignore[assignment]
            self.target = target
            started = time.monotonic()
            for msg in call:
                with self._lock:
                    self.state.feed(msg)
            logger.info("KV events from %s ended after %.1f s", target, time.monotonic() - started)
