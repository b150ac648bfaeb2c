"""A consumer that moves between replicas by snapshot ends with the block state of one that never
moved (services/event_subscriber.py `BlockState`), though the replicas' seqs differ."""

from __future__ import annotations

from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pdserve.v1 import kv_events_pb2 as pb
from services.event_subscriber import BlockState
from services.scheduler.events import EventRepublisher, Subscription
from services.scheduler.events.servicer import encode_item
from services.scheduler.prefix_index import InMemoryPrefixIndex


def drain(sub: Subscription, state: BlockState) -> None:
    for item in sub.take(10_000):
        state.feed(pb.EventStreamMessage.FromString(encode_item(item)))


def batches() -> list[tuple[str, int, KVEventBatch]]:
    return [("p0", 1, KVEventBatch(0.0, [BlockStored((1, 2, 3), None, (), 16)])),
            ("p1", 1, KVEventBatch(0.0, [BlockStored((7,), None, (), 16, medium="CPU")])),
            ("p0", 1, KVEventBatch(0.0, [BlockRemoved((2,))])),
            ("p1", 1, KVEventBatch(0.0, [AllBlocksCleared(medium="CPU")])),
            ("p0", 1, KVEventBatch(0.0, [BlockStored((4,), None, (), 16, medium="GPU")])),
            ("p1", 2, KVEventBatch(0.0, [BlockStored((8, 9), None, (), 16)])),
            ("p0", 1, KVEventBatch(0.0, [BlockRemoved((1,), medium="GPU")]))]


def test_resuming_at_another_replica_by_snapshot_misses_nothing_and_counts_nothing_twice() -> None:
    dying, survivor = EventRepublisher(InMemoryPrefixIndex(100)), EventRepublisher(InMemoryPrefixIndex(100))
    survivor.publish("p9", 1, KVEventBatch(0.0, [BlockStored((5,), None, (), 16)]))  # its seqs run ahead
    steady, moving = BlockState(), BlockState()
    steady_sub = survivor.subscribe(None, snapshot=True)
    moving_sub = dying.subscribe(None, snapshot=True)
    events = batches()
    for engine, epoch, b in events[:4]:
        dying.publish(engine, epoch, b)
        survivor.publish(engine, epoch, b)
    drain(steady_sub, steady)
    drain(moving_sub, moving)
    dying.publish(*events[4])  # the dying replica's last batch, also in the survivor's snapshot
    survivor.publish(*events[4])
    drain(moving_sub, moving)
    moving_sub = survivor.subscribe(None, snapshot=True)  # resumes at the survivor
    for engine, epoch, b in events[5:]:
        survivor.publish(engine, epoch, b)
    drain(steady_sub, steady)
    drain(moving_sub, moving)
    assert moving.num_snapshots == 2 and steady.num_snapshots == 1
    assert moving.blocks() == steady.blocks() == {"p0": {("GPU", 3), ("GPU", 4)}, "p1": {("GPU", 8), ("GPU", 9)},
                                                   "p9": {("GPU", 5)}}
