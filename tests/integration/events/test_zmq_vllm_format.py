"""The ZMQ publisher as a vLLM consumer sees it: decoded here with zmq + msgpack directly,
written from the reference spec (§1.3, §1.5), not with pdserve's codec."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from services.scheduler.events import EventRepublisher
from services.scheduler.events.zmq_publisher import ZmqEventPublisher
from services.scheduler.prefix_index import InMemoryPrefixIndex

END = b"\xff" * 8
RECV_MS = 5000


def vllm_decode(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """What a vLLM consumer does: an outer [ts, events, dp_rank] array, events as tagged maps."""
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float)
    return ts, events, dp_rank


@pytest.fixture
def zmq_plane() -> Iterator[tuple[EventRepublisher, ZmqEventPublisher, zmq.Context]]:
    ctx = zmq.Context()
    rp = EventRepublisher(InMemoryPrefixIndex(), ring_size=6)
    pub = ZmqEventPublisher(rp, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", model="demo", context=ctx)
    pub.start()
    yield rp, pub, ctx
    pub.close()
    ctx.destroy(linger=0)


def subscriber(ctx: zmq.Context, endpoint: str, rp: EventRepublisher) -> zmq.Socket:
    """A SUB socket that provably receives: probe batches until one arrives (slow joiner)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 50)
    sub.connect(endpoint)
    for _ in range(100):
        rp.publish("probe", 1, KVEventBatch(0.0, [AllBlocksCleared()]))
        try:
            sub.recv_multipart()
            break
        except zmq.Again:
            continue
    sub.setsockopt(zmq.RCVTIMEO, RECV_MS)
    while True:  # drain probes
        if not sub.poll(200):
            return sub
        sub.recv_multipart()


def dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.RCVTIMEO, RECV_MS)
    d.connect(endpoint)
    return d


def test_live_frames_seqs_and_payload(zmq_plane: tuple[EventRepublisher, ZmqEventPublisher, zmq.Context]) -> None:
    rp, pub, ctx = zmq_plane
    sub = subscriber(ctx, pub.bound_endpoint, rp)
    core = rp.subscribe(None)
    first = rp.next_seq
    rp.publish("p0", 9, KVEventBatch(1.5, [BlockStored((2**64 - 1, 5), None, (1, 2, 3, 4, 5, 6, 7, 8), 4,
                                                     medium="GPU", group_idx=0)]))
    rp.publish("p1", 3, KVEventBatch(2.5, [BlockStored((6,), 5, (), 0, medium="CPU_OFFLOAD")], 2))
    rp.publish("p0", 9, KVEventBatch(3.5, [BlockRemoved((5,), "GPU")]))
    frames = [sub.recv_multipart() for _ in range(3)]
    assert all(len(f) == 3 for f in frames)
    assert [f[0] for f in frames] == [b"kv@p0@demo", b"kv@p1@demo", b"kv@p0@demo"]
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == [first, first + 1, first + 2] and all(len(f[1]) == 8 for f in frames)
    assert [b.seq for b in core.take()] == seqs  # type: ignore[union-attr]  # gRPC numbers = ZMQ numbers
    ts, events, dp = vllm_decode(frames[0][2])
    assert (ts, dp) == (1.5, 0)  # unset dp rank stamped 0, as vLLM's publisher does
    (stored,) = events
    assert list(stored)[:8] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                "lora_id", "medium", "lora_name"]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [2**64 - 1, 5]
    assert stored["parent_block_hash"] is None and stored["medium"] == "GPU" and stored["group_idx"] == 0
    assert frames[0][2][:1] == b"\x93" and frames[0][2][1:2] == b"\xcb"  # fixarray(3), float64 ts
    _, events, dp = vllm_decode(frames[1][2])
    assert dp == 2 and events[0]["parent_block_hash"] == 5 and events[0]["medium"] == "CPU_OFFLOAD"
    _, events, _ = vllm_decode(frames[2][2])
    assert events == [{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}]
    sub.close(linger=0)


def test_replay_protocol_and_end_marker(zmq_plane: tuple[EventRepublisher, ZmqEventPublisher, zmq.Context]) -> None:
    rp, pub, ctx = zmq_plane
    for i in range(4):
        rp.publish("p0", 1, KVEventBatch(float(i), [BlockStored((i,), None, (), 4, medium="GPU")]))
    d = dealer(ctx, pub.bound_replay_endpoint)
    d.send_multipart([b"", (2).to_bytes(8, "big")])
    replies = [d.recv_multipart() for _ in range(3)]
    assert [r[0] for r in replies[:2]] == [b"", b""] and all(len(r) == 4 for r in replies[:2])
    assert [int.from_bytes(r[2], "big") for r in replies[:2]] == [2, 3]
    assert replies[0][1] == b"kv@p0@demo" and vllm_decode(replies[0][3])[1][0]["block_hashes"] == [2]
    assert replies[2] == [b"", b"", END, b""]
    d.send_multipart([b"", (99).to_bytes(8, "big")])  # newer than the last seq: end marker only
    assert d.recv_multipart() == [b"", b"", END, b""]
    d.send_multipart([b"", b"abc"])  # malformed: no reply at all
    assert not d.poll(300)
    for i in range(4, 9):  # ring of 6 now holds seqs 3..8
        rp.publish("p0", 1, KVEventBatch(float(i), [BlockStored((i,), None, (), 4, medium="GPU")]))
    d.send_multipart([b"", (0).to_bytes(8, "big")])
    got = []
    while (r := d.recv_multipart())[2] != END:
        got.append(int.from_bytes(r[2], "big"))
    assert got == [3, 4, 5, 6, 7, 8]  # starts at the oldest buffered seq, as vLLM does
    d.close(linger=0)


def test_req_socket_replay(zmq_plane: tuple[EventRepublisher, ZmqEventPublisher, zmq.Context]) -> None:
    rp, pub, ctx = zmq_plane
    rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((1,), None, (), 4, medium="GPU")]))
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.RCVTIMEO, RECV_MS)
    req.connect(pub.bound_replay_endpoint)
    req.send((0).to_bytes(8, "big"))
    topic, seq, payload = req.recv_multipart()  # a REQ sees only the first reply
    assert (topic, int.from_bytes(seq, "big"), vllm_decode(payload)[1][0]["block_hashes"]) == (b"kv@p0@demo", 0, [1])
    req.close(linger=0)


def test_plain_topic_and_bad_endpoint() -> None:
    rp = EventRepublisher(InMemoryPrefixIndex())
    with pytest.raises(ValueError, match='zmq endpoint must not be empty'):
        ZmqEventPublisher(rp, "")
    ctx = zmq.Context()
    pub = ZmqEventPublisher(rp, "inproc://kv-test", topic="", context=ctx)
    pub.start()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect("inproc://kv-test")
        rp.publish("p0", 1, KVEventBatch(1.0, [AllBlocksCleared()]))
        assert sub.poll(RECV_MS)
        topic, seq, payload = sub.recv_multipart()
        assert (topic, seq) == (b"", (0).to_bytes(8, "big"))
        assert payload == b"\x93\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x91\x81\xa4type\xb0AllBlocksCleared\x00"
        sub.close(linger=0)
    finally:
        pub.close()
        ctx.destroy(linger=0)


def test_legacy_array_events_for_old_consumers() -> None:
    ctx = zmq.Context()
    rp = EventRepublisher(InMemoryPrefixIndex())
    pub = ZmqEventPublisher(rp, "inproc://kv-legacy", topic="", legacy=True, context=ctx)
    pub.start()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect("inproc://kv-legacy")
        rp.publish("p0", 1, KVEventBatch(1.0, [BlockRemoved((7,), "GPU")]))
        assert sub.poll(RECV_MS)
        _, _, payload = sub.recv_multipart()
        _, events, _ = vllm_decode(payload)
        assert events == [["BlockRemoved", [7], "GPU", None]]
        sub.close(linger=0)
    finally:
        pub.close()
        ctx.destroy(linger=0)
