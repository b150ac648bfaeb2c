"""A restarted replica's index converges from a peer's snapshot plus its own later batches: no
gap, no duplicate (services/scheduler/convergence.py, engine_positions.py, peer_snapshots.py)."""

from __future__ import annotations

from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pdserve.v1 import kv_events_pb2 as pb
from services.scheduler.convergence import EngineSnapshot, IndexConvergence, PeerSnapshot
from services.scheduler.engine_positions import EnginePositions
from services.scheduler.events import EventRepublisher
from services.scheduler.events.servicer import encode_item
from services.scheduler.peer_snapshots import SnapshotReader
from services.scheduler.prefix_index import InMemoryPrefixIndex


def stored(*hashes: int) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(hashes, None, (), 16, medium="GPU")])


def removed(*hashes: int) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockRemoved(hashes, medium="GPU")])


class Replica:
    """A replica's control-servicer view: positions advance, then the batch is published."""

    def __init__(self, converging: bool) -> None:
        self.index = InMemoryPrefixIndex(10_000)
        self.republisher = EventRepublisher(self.index)
        self.positions = EnginePositions()
        self.republisher.position_of = self.positions.last
        self.republisher.scheduler_id = "peer" if not converging else "new"
        self.conv = IndexConvergence(self.republisher, self.positions) if converging else None
        self.sink = self.conv or self.republisher

    def hello(self, engine: str, first: int) -> None:
        self.positions.hello(engine, 1, first)

    def report(self, engine: str, position: int, batch: KVEventBatch | None) -> None:
        self.positions.advance(engine, 1, position)
        if batch is not None:
            self.sink.publish(engine, 1, batch)

    def blocks(self) -> set[tuple[str, object]]:
        return {(part.engine_id, h) for part in self.index.snapshot() for h in part.block_hashes}


def history() -> list[KVEventBatch | None]:
    """Reports 1..8 of engine e: stores, a removal, an idle report."""
    return [stored(1, 2), stored(3), None, removed(2), stored(4, 5), removed(1), stored(6), stored(2)]


def snapshot_of(peer: Replica) -> PeerSnapshot:
    """The peer's snapshot as a restarted replica reads it off the wire."""
    reader = SnapshotReader()
    sub = peer.republisher.subscribe(None, snapshot=True)
    for item in sub.take(10_000):
        reader.feed(pb.EventStreamMessage.FromString(encode_item(item)))
    assert reader.done and reader.snapshot is not None
    return reader.snapshot


def test_snapshot_then_own_batches_after_its_position_equal_the_peer() -> None:
    peer, new = Replica(False), Replica(True)
    peer.hello("e", 1)
    events = history()
    for pos, b in enumerate(events[:5], 1):
        peer.report("e", pos, b)
    # The new replica hears reports from 3 on (its stream started there); the peer's snapshot
    # is taken after report 5: 3..5 are in both, 6.. only in the new replica's own stream.
    new.hello("e", 3)
    for pos in range(3, 6):
        new.report("e", pos, events[pos - 1])
    assert new.blocks() == set() and new.conv is not None and new.conv.num_held == 2
    snap = snapshot_of(peer)
    assert snap.scheduler_id == "peer" and snap.engines["e"].position == 5
    for pos in range(6, 9):
        peer.report("e", pos, events[pos - 1])
        new.report("e", pos, events[pos - 1])
    assert new.conv.install(snap) == [] and new.conv.converged
    assert new.blocks() == peer.blocks() == {("e", 2), ("e", 3), ("e", 4), ("e", 5), ("e", 6)}
    # From now on batches pass straight on.
    peer.report("e", 9, removed(6))
    new.report("e", 9, removed(6))
    assert new.blocks() == peer.blocks()


def test_a_snapshot_older_than_the_replica_s_hearing_is_not_installed() -> None:
    peer, new = Replica(False), Replica(True)
    peer.hello("e", 1)
    peer.report("e", 1, stored(1))
    snap = snapshot_of(peer)  # up to 1
    new.hello("e", 4)  # reports 2 and 3 reached neither
    assert new.conv is not None and new.conv.install(snap) == ["e"] and not new.conv.converged
    new.conv.finish("test timeout")
    assert new.conv.converged and new.conv.forced_reason == "test timeout"


def test_engines_heard_from_their_start_need_no_snapshot_and_unknown_ones_are_waited_for() -> None:
    new = Replica(True)
    new.hello("fresh", 1)
    new.report("fresh", 1, stored(7))
    assert new.blocks() == {("fresh", 7)}  # complete from its start: straight through
    snap = PeerSnapshot("peer", {"other": EngineSnapshot("other", 1, 3, {"GPU": [9]})})
    assert new.conv is not None and new.conv.install(snap) == ["other"]
    new.hello("other", 2)
    new.report("other", 2, stored(8))  # already in the snapshot (position 3)
    new.report("other", 4, stored(10))
    assert new.conv.install(snap) == [] and new.conv.converged
    assert new.blocks() == {("fresh", 7), ("other", 9), ("other", 10)}


def test_a_cleared_epoch_drops_what_was_held_and_dead_engines_are_not_waited_for() -> None:
    new = Replica(True)
    new.hello("e", 5)
    new.report("e", 5, stored(1))
    new.sink.publish("e", 1, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert new.conv is not None and new.conv.num_held == 0
    new.hello("gone", 5)
    new.conv.live = lambda engine_id, epoch: engine_id != "gone"
    assert new.conv.install(None) == [] and new.blocks() == set()
