"""ZMQ PUB + ROUTER replay speaking vLLM's KV-event wire format byte for byte.

Live: every republished batch goes out as three frames `[topic, seq (8 bytes big-endian),
msgpack KVEventBatch]` with the republisher's sequence numbers (the same numbers as the gRPC
stream: 0, 1, 2, ... per scheduler process). The payload is vLLM's `KVEventBatch` encoding
(`connectors.wire.encode_batch`), with `data_parallel_rank` stamped 0 when the producer left it
unset, as vLLM's publisher does.

Replay (optional ROUTER, always bound): a request `[b"", start_seq (8 bytes BE)]` from a
DEALER (or an 8-byte frame from a REQ) is answered with `[b"", topic, seq, payload]` for every
ring batch with seq >= start_seq, oldest first, then the end marker `[b"", b"", FF x 8, b""]`.
A start older than the ring starts at the oldest buffered batch (the consumer sees the gap in
the seqs, as with vLLM); a malformed request gets no reply. The ring is the republisher's.

Snapshot (pdserve's addition on the same ROUTER, for consumers moving between scheduler
replicas, whose seqs are their own): a request `[b"", b"pdserve.snapshot"]` is answered with the
index as vLLM-format `BlockStored` batches (parent None, no tokens, block_size 0; one per
engine and medium, up to 1,024 hashes each) `[b"", topic, S - 1, payload]`, then
`[b"", b"", FF x 8, S]`: the state after batch S - 1, so the consumer goes on with live (and
replayed) batches from seq S. A replica whose index has not converged yet (it restarted) ends
at once with `[b"", b"", FF x 8, reason]` (not 8 bytes: ask another replica).

The topic is a template: `{engine_id}` and `{model}` are filled in per batch, so a consumer of
one central stream knows which engine a batch is from (the default `kv@{engine_id}@{model}` is
the form llm-d's KV-cache indexer parses); a plain string works as with vLLM (default "").

Differences from vLLM's `ZmqEventPublisher`, on purpose: the PUB socket always binds (the
scheduler is the server consumers connect to); publishing never blocks the producer (no
intermediate queue: the batch is encoded and handed to ZMQ inline; at the HWM ZMQ drops, which
the replay ring makes recoverable).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

import zmq

from connectors.compact_events import zmq_payload
from connectors.kv_events import KVEventBatch
from services.scheduler.event_sink import CompactBatch
from services.scheduler.events.republisher import (
    EventRepublisher,
    SequencedBatch,
    SnapshotBatch,
    StreamNotice,
)

_MORE = zmq.SNDMORE | zmq.NOBLOCK
logger = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
SNAPSHOT_REQUEST = b"pdserve.snapshot"
DEFAULT_TOPIC = "kv@{engine_id}@{model}"
_POLL_MS = 100


def encode_payload(batch: KVEventBatch, *, legacy: bool = False) -> bytes:
    """vLLM msgpack of a batch, with data_parallel_rank stamped 0 when unset."""
    from connectors.wire import encode_batch

    if batch.data_parallel_rank is None:
        batch = replace(batch, data_parallel_rank=0)
    return encode_batch(batch, legacy=legacy)


class ZmqEventPublisher:
    """Mirrors an `EventRepublisher` onto ZMQ. `start()` binds; `close()` unbinds and stops.

    `endpoint` / `replay_endpoint` are ZMQ addresses to bind (tcp://host:port, tcp://*:port,
    ipc://..., inproc://...; port `*` picks a free one, see `bound_endpoint`).
    """

    def __init__(self, republisher: EventRepublisher, endpoint: str, replay_endpoint: str | None = None, *,
                 topic: str = DEFAULT_TOPIC, model: str = "", hwm: int = 100_000, legacy: bool = False,
                 context: zmq.Context | None = None) -> None:
        if not endpoint:
            raise ValueError("zmq endpoint must not be empty")
        self.republisher = republisher
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint or None
        self.topic = topic
        self.model = model
        self.hwm = hwm
        self.legacy = legacy
        self._context = context or zmq.Context.instance()
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._topics: dict[str, bytes] = {}
        self._wire_key = "zmq-legacy" if legacy else "zmq"
        self.bound_endpoint = ""
        self.bound_replay_endpoint = ""
        self.num_sent = 0
        self.num_send_errors = 0
        self.num_replays = 0
        self.num_snapshots = 0
        # Whether this replica's index is complete (set by the scheduler service): a snapshot
        # asked of one that is not yet is refused.
        self.converged: Callable[[], bool] = lambda: True

    def start(self) -> None:
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.endpoint)
        self._pub = pub
        self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.replay_endpoint:
            router = self._context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint)
            self._router = router
            self.bound_replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, name="zmq-kv-replay", daemon=True)
            self._thread.start()
        self.republisher.add_listener(self._on_batch)
        logger.info("KV events on ZMQ %s (replay %s)", self.bound_endpoint, self.bound_replay_endpoint or "off")

    def close(self) -> None:
        self.republisher.remove_listener(self._on_batch)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        with self.republisher._lock:
            if self._pub is not None:
                self._pub.close(linger=0)
                self._pub = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None

    def topic_of(self, engine_id: str) -> bytes:
        topic = self._topics.get(engine_id)
        if topic is None:
            topic = self.topic.format(engine_id=engine_id, model=self.model).encode()
            self._topics[engine_id] = topic
        return topic

    def payload_of(self, sb: SequencedBatch) -> bytes:
        payload = sb.wire.get(self._wire_key)
        if payload is None:
            b = sb.batch
            if type(b) is CompactBatch and not self.legacy:
                # The rank's own msgpack of the events, framed: the bytes encode_payload gives.
                dp = 0 if b.data_parallel_rank is None else b.data_parallel_rank
                payload = zmq_payload(b.compact.msgpack_events, b.ts, dp)
            else:
                payload = encode_payload(b, legacy=self.legacy)
            sb.wire[self._wire_key] = payload
        return payload

    def _on_batch(self, sb: SequencedBatch) -> None:
        # Runs under the republisher's lock, which also serialises use of the PUB socket.
        if self._pub is None:
            return
        pub, payload = self._pub, self.payload_of(sb)
        try:
            # The three frames as three sends (send_multipart's per-frame checks cost as much
            # again); copy=True: for frames of a few KiB a copy costs less than zero-copy's
            # tracking. A PUB socket never blocks and queues a message's frames until its last.
            pub.send(self.topic_of(sb.engine_id), _MORE, copy=True)
            pub.send(sb.seq.to_bytes(8, "big"), _MORE, copy=True)
            pub.send(payload, zmq.NOBLOCK, copy=True)
            self.num_sent += 1
        except zmq.ZMQError as e:
            self.num_send_errors += 1
            logger.warning("ZMQ PUB send of seq %d failed: %s", sb.seq, e)

    def _serve_replay(self) -> None:
        router = self._router
        if router is None:
            return
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(_POLL_MS):
                    continue
                frames = router.recv_multipart()
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            self._answer(router, frames)

    def _answer(self, router: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) == 3 and frames[1] == b"" and frames[2] == SNAPSHOT_REQUEST:
            self._answer_snapshot(router, frames[0])
            return
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("ignoring malformed ZMQ replay request (%d frames)", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        self.num_replays += 1
        for sb in self.republisher.replay(start):
            router.send_multipart([identity, b"", self.topic_of(sb.engine_id), sb.seq.to_bytes(8, "big"),
                                   self.payload_of(sb)])
        router.send_multipart([identity, b"", b"", END_SEQ, b""])

    def _answer_snapshot(self, router: zmq.Socket, identity: bytes) -> None:
        if not self.converged():
            router.send_multipart([identity, b"", b"", END_SEQ,
                                   b"not converged: this replica restarted and its index is incomplete"])
            return
        self.num_snapshots += 1
        items = self.republisher.snapshot()
        end = items[-1]
        assert isinstance(end, StreamNotice)  # SNAPSHOT_END
        next_seq = end.next_seq
        last = max(0, next_seq - 1).to_bytes(8, "big")
        for item in items:
            if isinstance(item, SnapshotBatch):
                router.send_multipart([identity, b"", self.topic_of(item.engine_id), last,
                                       encode_payload(item.batch, legacy=self.legacy)])
        router.send_multipart([identity, b"", b"", END_SEQ, next_seq.to_bytes(8, "big")])
