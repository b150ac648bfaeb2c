"""`pdserve.v1.KVEvents` servicer: a typed gRPC stream over the republisher.

Each batch is converted to protobuf and serialised once, however many subscribers receive it
(the method is registered with a pass-through serializer and yields bytes). A subscriber that
sets `max_batches_per_message` gets the live batches that are ready together (it is behind) in
one message each run, up to that many: fewer messages for both ends when it matters. A slow subscriber
only ever fills its own bounded buffer; the republisher resyncs it (see republisher.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

import grpc

from connectors.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    event_from_proto,
    event_to_proto,
)
from connectors.wire.protobuf_bytes import varint
from pdserve.v1 import kv_events_pb2 as pb
from services.scheduler.events.republisher import (
    EventFilter,
    EventRepublisher,
    NoticeKind,
    SequencedBatch,
    SnapshotBatch,
    StreamItem,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.KVEvents"
_WIRE_KEY = "grpc"
_TYPES: dict[int, type] = {
    pb.EVENT_TYPE_BLOCK_STORED: BlockStored,
    pb.EVENT_TYPE_BLOCK_REMOVED: BlockRemoved,
    pb.EVENT_TYPE_ALL_BLOCKS_CLEARED: AllBlocksCleared,
}
_NOTICES = {
    NoticeKind.SNAPSHOT_BEGIN: pb.StreamNotice.SNAPSHOT_BEGIN,
    NoticeKind.SNAPSHOT_END: pb.StreamNotice.SNAPSHOT_END,
    NoticeKind.RESYNC: pb.StreamNotice.RESYNC,
}


def request_to_filter(request: pb.SubscribeRequest) -> tuple[int | None, EventFilter]:
    """(from_seq, filter) of a SubscribeRequest; ValueError names what is malformed."""
    if request.snapshot and request.HasField("from_seq"):
        raise ValueError("snapshot: only without from_seq (a from_seq resumes this replica's sequence)")
    types: set[type] = set()
    for t in request.types:
        if t not in _TYPES:
            raise ValueError(f"types: unknown event type {t}")
        types.add(_TYPES[t])
    if any(not e for e in request.engine_ids):
        raise ValueError("engine_ids: empty engine id")
    if any(not m for m in request.media):
        raise ValueError("media: empty medium name")
    from_seq = request.from_seq if request.HasField("from_seq") else None
    return from_seq, EventFilter(frozenset(request.engine_ids), frozenset(request.media), frozenset(types))


def batch_to_proto(seq: int, engine_id: str, epoch: int, batch: KVEventBatch) -> pb.EventBatch:
    """The batch as protobuf; a `ProtoBackedBatch` has its events copied from its messages or
    bytes (in C), any other batch converts event by event."""
    proto_events = getattr(batch, "proto_events", None)
    events_wire = getattr(batch, "events_wire", None)
    if events_wire is not None:
        msg = pb.EventBatch(seq=seq, ts=batch.ts, engine_id=engine_id, epoch=epoch)
        msg.MergeFromString(events_wire)
    elif proto_events is not None:
        msg = pb.EventBatch(seq=seq, ts=batch.ts, engine_id=engine_id, epoch=epoch)
        msg.events.extend(proto_events)
    else:
        msg = pb.EventBatch(seq=seq, ts=batch.ts, engine_id=engine_id, epoch=epoch,
                            events=[event_to_proto(e) for e in batch.events])
    if batch.data_parallel_rank is not None:
        msg.data_parallel_rank = batch.data_parallel_rank
    return msg


def batch_message_wire(seq: int, engine_id: str, epoch: int, batch: KVEventBatch, events_wire: bytes) -> bytes:
    """The serialized EventStreamMessage of a batch whose events are `events_wire` (an
    EventBatch with only `events` set): the header fields serialized, the events appended as
    they are (a message's fields may come in any order; parsing gives the same message)."""
    head = pb.EventBatch(seq=seq, ts=batch.ts, engine_id=engine_id, epoch=epoch)
    if batch.data_parallel_rank is not None:
        head.data_parallel_rank = batch.data_parallel_rank
    body = head.SerializeToString() + events_wire
    return b"\x0a" + varint(len(body)) + body  # EventStreamMessage.batch (field 1, bytes)


def encode_item(item: StreamItem) -> bytes:
    """The serialised EventStreamMessage of one stream item (cached for republished batches)."""
    if isinstance(item, SequencedBatch):
        wire = item.wire.get(_WIRE_KEY)
        if wire is None:
            events_wire = getattr(item.batch, "events_wire", None)
            if events_wire is not None:
                wire = batch_message_wire(item.seq, item.engine_id, item.epoch, item.batch, events_wire)
            else:
                proto = batch_to_proto(item.seq, item.engine_id, item.epoch, item.batch)
                wire = pb.EventStreamMessage(batch=proto).SerializeToString()
            item.wire[_WIRE_KEY] = wire
        return wire
    if isinstance(item, SnapshotBatch):
        proto = batch_to_proto(0, item.engine_id, item.epoch, item.batch)
        return pb.EventStreamMessage(batch=proto).SerializeToString()
    notice = pb.StreamNotice(kind=_NOTICES[item.kind], next_seq=item.next_seq, reason=item.reason,
                             scheduler_id=item.scheduler_id,
                             positions=[pb.EnginePosition(engine_id=e, epoch=epoch, position=p)
                                        for e, epoch, p in item.positions])
    return pb.EventStreamMessage(notice=notice).SerializeToString()


def encode_items(items: list[StreamItem], max_batches: int = 1) -> list[bytes]:
    """The stream messages of `items`, in order: with `max_batches` > 1, runs of consecutive
    live batches share one EventStreamMessage (its repeated `batches`, field 3), built from each
    batch's cached message by retagging field 1 as field 3 (no re-encoding)."""
    if max_batches <= 1:
        return [encode_item(item) for item in items]
    out: list[bytes] = []
    run: list[bytes] = []
    for item in items:
        if isinstance(item, SequencedBatch):
            run.append(encode_item(item))
            if len(run) == max_batches:
                out.append(_joined(run))
                run = []
            continue
        if run:
            out.append(_joined(run))
            run = []
        out.append(encode_item(item))
    if run:
        out.append(_joined(run))
    return out


def _joined(wires: list[bytes]) -> bytes:
    if len(wires) == 1:
        return wires[0]
    # Each wire is `0x0a (field 1, bytes) varint(len) body`; 0x1a is field 3 with the same length.
    return b"".join([b"\x1a" + w[1:] for w in wires])


class GrpcRingCodec:
    """`RingCodec` whose packed form is the batch's serialized EventStreamMessage: the bytes a
    gRPC subscriber receives, so packing a batch also encodes it for them (once)."""

    def pack(self, sb: SequencedBatch) -> bytes:
        return encode_item(sb)

    def unpack(self, data: bytes) -> KVEventBatch:
        b = pb.EventStreamMessage.FromString(data).batch
        return KVEventBatch(ts=b.ts, events=[event_from_proto(e) for e in b.events],
                            data_parallel_rank=b.data_parallel_rank if b.HasField("data_parallel_rank") else None)


def _pass_through(data: bytes) -> bytes:
    return data


class KVEventsServicer:
    """Serves `KVEvents.Subscribe` from an `EventRepublisher`."""

    def __init__(self, republisher: EventRepublisher, *, max_items_per_wakeup: int = 256) -> None:
        self.republisher = republisher
        self._max_items = max_items_per_wakeup
        # Whether this replica's index is complete (services/scheduler/convergence.py): a
        # snapshot asked of one that is not yet is refused with UNAVAILABLE (try another).
        self.converged: Callable[[], bool] = lambda: True

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers the service (use instead of the generated add_KVEventsServicer_to_server)."""
        handler = grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Subscribe": grpc.unary_stream_rpc_method_handler(
                self.Subscribe,
                request_deserializer=pb.SubscribeRequest.FromString,
                response_serializer=_pass_through,
            ),
        })
        server.add_generic_rpc_handlers((handler,))

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            from_seq, event_filter = request_to_filter(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        if request.snapshot and not self.converged():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this replica's prefix index has not converged yet "
                                                             "(it restarted): subscribe at another replica")
            return
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop_thread = threading.get_ident()

        def wake() -> None:
            if threading.get_ident() == loop_thread:
                ready.set()
            else:
                loop.call_soon_threadsafe(ready.set)

        per_message = min(max(1, request.max_batches_per_message), self._max_items)
        peer = context.peer()  # not after the call ended: grpc.aio crashes on that
        sub = self.republisher.subscribe(from_seq, event_filter, wake=wake, snapshot=request.snapshot)
        logger.info("KV-event subscriber %s joined (from_seq=%s)", peer, from_seq)
        try:
            while True:
                ready.clear()
                items = sub.take(self._max_items)
                if not items:
                    await ready.wait()
                    continue
                for wire in encode_items(items, per_message):
                    yield wire
        finally:
            sub.close()
            logger.info("KV-event subscriber %s left", peer)

