"""ZMQ (vLLM wire format) consumers across scheduler replicas: the replay ROUTER's snapshot
request, and `ZmqEventSubscriber` moving from a replica whose sockets closed to another, whose
seqs differ, with the same block state as a consumer that never moved; a gap in the live stream
(a drop) is filled from the ring; an unconverged replica refuses the snapshot. Real ZMQ over
loopback TCP, in process; about 2 s."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from connectors.kv_events import BlockRemoved, BlockStored, KVEventBatch
from connectors.wire import decode_batch
from services.scheduler.events import EventRepublisher
from services.scheduler.events.zmq_publisher import END_SEQ, SNAPSHOT_REQUEST, ZmqEventPublisher
from services.scheduler.prefix_index import InMemoryPrefixIndex
from services.zmq_event_subscriber import ZmqEventSubscriber

Replica = tuple[EventRepublisher, ZmqEventPublisher]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def replica(ctx: zmq.Context) -> Replica:
    rp = EventRepublisher(InMemoryPrefixIndex(), ring_size=64)
    pub = ZmqEventPublisher(rp, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", model="demo", context=ctx)
    pub.start()
    return rp, pub


def endpoints(r: Replica) -> tuple[str, str]:
    return r[1].bound_endpoint, r[1].bound_replay_endpoint


def stored(*hashes: int) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockStored(hashes, None, (), 16, medium="GPU")])


def removed(*hashes: int) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockRemoved(hashes, medium="GPU")])


def publish(replicas: list[Replica], engine_id: str, batch: KVEventBatch) -> None:
    """What every engine does: the same batch to every replica."""
    for rp, _ in replicas:
        rp.publish(engine_id, 1, batch)


def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_snapshot_request_answers_the_index_in_vllm_format_then_the_seq_to_go_on_from(ctx: zmq.Context) -> None:
    rp, pub = r = replica(ctx)
    try:
        publish([r], "prefill-0", stored(1, 2, 3))
        publish([r], "prefill-0", removed(2))
        publish([r], "decode-0", stored(7))
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.bound_replay_endpoint)
        dealer.send_multipart([b"", SNAPSHOT_REQUEST])
        replies = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                break
            replies.append(frames)
        assert frames == [b"", b"", END_SEQ, (3).to_bytes(8, "big")]
        state = {(topic, h) for _, topic, seq, payload in replies if seq == (2).to_bytes(8, "big")
                 for e in decode_batch(payload).events for h in e.block_hashes}
        assert state == {(b"kv@prefill-0@demo", 1), (b"kv@prefill-0@demo", 3), (b"kv@decode-0@demo", 7)}

        pub.converged = lambda: False  # restarted, not converged yet: refused, try another replica
        dealer.send_multipart([b"", SNAPSHOT_REQUEST])
        assert dealer.poll(5000)
        _, _, end, reason = dealer.recv_multipart()
        assert end == END_SEQ and reason.startswith(b"not converged")
        dealer.close(linger=0)
    finally:
        pub.close()


def test_consumer_that_lost_its_replica_ends_with_the_same_block_state(ctx: zmq.Context) -> None:
    a, b = replica(ctx), replica(ctx)
    b[0].publish("other", 1, stored(99))  # b's seqs run one ahead of a's: they are its own
    b[0].remove_engine("other")
    moving = ZmqEventSubscriber([endpoints(a), endpoints(b)], answer_timeout_s=2.0, heartbeat_s=0.2)
    steady = ZmqEventSubscriber([endpoints(b)], answer_timeout_s=2.0, heartbeat_s=0.2)
    try:
        publish([a, b], "prefill-0", stored(1, 2, 3))  # before the consumers: from the snapshots
        moving.start()
        steady.start()
        eventually(lambda: moving.num_snapshots == 1 and steady.num_snapshots == 1)
        publish([a, b], "prefill-0", stored(4))
        publish([a, b], "decode-0", stored(5, 6))
        eventually(lambda: moving.blocks() == steady.blocks() and len(steady.blocks().get(b"kv@decode-0@demo", ())) == 2)
        assert moving.endpoint == a[1].bound_endpoint

        a[1].close()  # replica a dies: its sockets close
        publish([b], "prefill-0", removed(1))  # what a never published: the snapshot at b has it
        eventually(lambda: moving.endpoint == b[1].bound_endpoint and moving.num_snapshots == 2)
        publish([b], "decode-0", stored(8))
        publish([b], "prefill-0", removed(4))
        expected = {b"kv@prefill-0@demo": {("GPU", 2), ("GPU", 3)},
                    b"kv@decode-0@demo": {("GPU", 5), ("GPU", 6), ("GPU", 8)}}
        eventually(lambda: steady.blocks() == expected and moving.blocks() == expected)
        assert moving.next_seq == steady.next_seq == b[0].next_seq
    finally:
        moving.close()
        steady.close()
        a[1].close()
        b[1].close()


def test_a_live_gap_is_filled_from_the_ring(ctx: zmq.Context) -> None:
    r = replica(ctx)
    sub = ZmqEventSubscriber([endpoints(r)], answer_timeout_s=2.0)
    try:
        sub.start()
        eventually(lambda: sub.num_snapshots == 1)
        listener = r[1]._on_batch
        r[0].remove_listener(listener)  # the PUB drops two batches (as at its HWM)
        publish([r], "prefill-0", stored(1))
        publish([r], "prefill-0", stored(2))
        r[0].add_listener(listener)
        publish([r], "prefill-0", stored(3))
        eventually(lambda: sub.blocks() == {b"kv@prefill-0@demo": {("GPU", 1), ("GPU", 2), ("GPU", 3)}})
        assert sub.num_gap_replays == 1 and sub.num_snapshots == 1
    finally:
        sub.close()
        r[1].close()
