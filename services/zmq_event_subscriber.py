"""`ZmqEventSubscriber`: a consumer of vLLM-format KV events (ZMQ PUB + replay ROUTER) that
follows the cluster's block state across scheduler replicas, surviving the death of the one it
reads from.

    sub = ZmqEventSubscriber([("tcp://a:5557", "tcp://a:5558"), ("tcp://b:5557", "tcp://b:5558")])
    sub.start()                      # a daemon thread reads and applies the stream
    sub.blocks()                     # {topic: {(medium, block_hash), ...}}
    sub.close()

How it resumes at a replica (each replica's seqs are its own, so never by seq across replicas):
1. SUB connects to the replica's PUB (everything subscribed) and waits for the ZMTP handshake;
2. `[b"", b"pdserve.snapshot"]` on the replica's replay ROUTER returns the index as BlockStored
   batches and S (services/scheduler/events/zmq_publisher.py): the state is *replaced* by the
   snapshot, which is the replica's state after its batch S - 1;
3. a replay from S adds what the PUB published before the subscription took effect;
4. live batches: seq < next is a duplicate (skipped), seq == next is applied, seq > next is a gap
   (a drop at the HWM): a replay from next fills it, or, when the ring no longer reaches back
   to next, a new snapshot replaces the state.
So nothing is missed and nothing is counted twice, whatever it saw before. The replica is lost
when the SUB's connection drops (ZMQ monitor; ZMTP heartbeats every `heartbeat_s` notice a host
that vanished) or its ROUTER does not answer within `answer_timeout_s`; the subscriber then
starts again at 1 with the next replica. A replica that refuses the snapshot (its index has not
converged: it restarted) is passed over the same way.

Contract of `TopicBlockState` (pure): `apply(topic, batch)`; BlockStored adds, BlockRemoved
removes, an AllBlocksCleared clears the topic (one with a medium, that medium); an event without
a medium is the default one (GPU), as in the index the snapshots come from.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from connectors.kv_events import KVEventBatch
from connectors.wire import WireFormatError, decode_batch
from services.event_subscriber import Block, apply_block_event
from services.scheduler.events.zmq_publisher import END_SEQ, SNAPSHOT_REQUEST

logger = logging.getLogger(__name__)

# on_batch(topic, seq, batch, from_snapshot); on_notice(kind, endpoint, next_seq)
BatchHook = Callable[[bytes, int, KVEventBatch, bool], None]
NoticeHook = Callable[[str, str, int], None]


class ReplicaLost(Exception):
    """The replica stopped answering (or refused a snapshot): move to the next one."""


class _Resnapshot(Exception):
    """The replay ring no longer reaches back to the next seq: take a new snapshot."""


class TopicBlockState:
    """See the module docstring."""

    def __init__(self) -> None:
        self.topics: dict[bytes, set[Block]] = {}

    def apply(self, topic: bytes, batch: KVEventBatch) -> None:
        blocks = self.topics.setdefault(topic, set())
        for event in batch.events:
            apply_block_event(blocks, event)


class ZmqEventSubscriber:
    """Reads the first replica of `endpoints` ((PUB, replay ROUTER) pairs) that answers and moves
    to the next when it is lost (see the module docstring). `run()` blocks until `close()`;
    `start()` runs it in a daemon thread."""

    def __init__(self, endpoints: list[tuple[str, str]], *, on_batch: BatchHook | None = None,
                 on_notice: NoticeHook | None = None, answer_timeout_s: float = 5.0, heartbeat_s: float = 1.0,
                 retry_interval_s: float = 0.2, context: zmq.Context | None = None) -> None:
        if not endpoints or any(not pub or not replay for pub, replay in endpoints):
            raise ValueError("endpoints: every replica needs a PUB and a replay endpoint")
        self.endpoints = endpoints
        self.on_batch = on_batch
        self.on_notice = on_notice
        self.answer_timeout_ms = int(answer_timeout_s * 1000)
        self.heartbeat_ms = int(heartbeat_s * 1000)
        self.retry_interval_s = retry_interval_s
        self.state = TopicBlockState()
        self.endpoint = ""  # the PUB endpoint being followed
        self.next_seq = 0
        self.num_snapshots = 0
        self.num_switches = 0
        self.num_gap_replays = 0
        self._context = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="zmq-event-subscriber", daemon=True)
        self._thread.start()

    def blocks(self) -> dict[bytes, set[Block]]:
        with self._lock:
            return {t: set(b) for t, b in self.state.topics.items() if b}

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def run(self) -> None:
        i = 0
        while not self._closed.is_set():
            pub, replay = self.endpoints[i % len(self.endpoints)]
            try:
                self._follow(pub, replay)
            except ReplicaLost as e:
                logger.info("KV events from %s: %s; resuming at the next replica from a snapshot", pub, e)
            except (zmq.ZMQError, WireFormatError) as e:
                logger.warning("KV events from %s failed (%s); resuming at the next replica from a snapshot", pub, e)
            if self._closed.is_set():
                return
            i += 1
            self.num_switches += 1
            self._closed.wait(self.retry_interval_s)

    # -- one replica ----------------------------------------------------------------------------

    def _follow(self, pub: str, replay: str) -> None:
        sub = self._context.socket(zmq.SUB)
        dealer = self._context.socket(zmq.DEALER)
        for s in (sub, dealer):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ms)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self.heartbeat_ms)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(pub)
            dealer.connect(replay)
            self._await_handshake(monitor)
            self.endpoint = pub
            self._snapshot(dealer)
            self._replay(dealer)
            self._live(sub, monitor, dealer)
        finally:
            sub.disable_monitor()
            for s in (monitor, sub, dealer):
                s.close(linger=0)

    def _await_handshake(self, monitor: zmq.Socket) -> None:
        if not monitor.poll(self.answer_timeout_ms):
            raise ReplicaLost("no connection to its PUB socket")
        event = recv_monitor_message(monitor)["event"]
        if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
            raise ReplicaLost(f"PUB connection failed (monitor event {event})")

    def _request(self, dealer: zmq.Socket, request: bytes) -> tuple[list[list[bytes]], bytes]:
        """The reply batches `[topic, seq, payload]` and the end marker's last frame."""
        dealer.send_multipart([b"", request])
        batches: list[list[bytes]] = []
        while True:
            if not dealer.poll(self.answer_timeout_ms):
                raise ReplicaLost(f"no answer from the replay endpoint within {self.answer_timeout_ms} ms")
            frames = dealer.recv_multipart()
            if len(frames) != 4:
                continue  # not a reply frame set (nothing else is expected on this socket)
            if frames[2] == END_SEQ and frames[1] == b"":
                return batches, frames[3]
            batches.append(frames[1:])

    def _snapshot(self, dealer: zmq.Socket) -> None:
        batches, end = self._request(dealer, SNAPSHOT_REQUEST)
        if len(end) != 8:
            raise ReplicaLost(f"snapshot refused: {end.decode(errors='replace')}")
        next_seq = int.from_bytes(end, "big")
        state = TopicBlockState()
        if self.on_notice is not None:
            self.on_notice("SNAPSHOT_BEGIN", self.endpoint, next_seq)
        for topic, seq, payload in batches:
            batch = decode_batch(payload)
            state.apply(topic, batch)
            if self.on_batch is not None:
                self.on_batch(topic, int.from_bytes(seq, "big"), batch, True)
        with self._lock:
            self.state, self.next_seq = state, next_seq
            self.num_snapshots += 1
        if self.on_notice is not None:
            self.on_notice("SNAPSHOT_END", self.endpoint, next_seq)

    def _replay(self, dealer: zmq.Socket) -> None:
        """Applies the ring's batches from next_seq on; a new snapshot when it starts later."""
        while True:
            batches, _ = self._request(dealer, self.next_seq.to_bytes(8, "big"))
            try:
                for topic, seq, payload in batches:
                    self._offer(topic, int.from_bytes(seq, "big"), payload)
                return
            except _Resnapshot:
                self._snapshot(dealer)

    def _live(self, sub: zmq.Socket, monitor: zmq.Socket, dealer: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while not self._closed.is_set():
            ready = dict(poller.poll(100))
            if monitor in ready and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                raise ReplicaLost("its PUB connection dropped")
            if sub not in ready:
                continue
            topic, seq_bytes, payload = sub.recv_multipart()
            try:
                self._offer(topic, int.from_bytes(seq_bytes, "big"), payload)
            except _Resnapshot:  # a gap: what the PUB dropped comes from the ring
                self.num_gap_replays += 1
                self._replay(dealer)

    def _offer(self, topic: bytes, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # already applied (from the replay, or the snapshot covers it)
        if seq > self.next_seq:
            raise _Resnapshot(f"seq {seq}, expected {self.next_seq}")
        batch = decode_batch(payload)
        with self._lock:
            self.state.apply(topic, batch)
            self.next_seq = seq + 1
        if self.on_batch is not None:
            self.on_batch(topic, seq, batch, False)
