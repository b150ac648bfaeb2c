"""`BlockPoolEventForwarder`: vLLM's block-pool KV events onto the pdserve event plane.

vLLM publishes its block pool's BlockStored / BlockRemoved / AllBlocksCleared (with medium) from
the engine core through its own `ZmqEventPublisher` (the engine service enables it on a private
`ipc://` endpoint). Rank 0's worker connector subscribes there, decodes vLLM's wire format with
pdserve's codec (`connectors.wire.msgpack_codec`) and reports each batch on rank 0's control
stream as `engine_events`, exactly as a pdserve engine's rank 0 does; the scheduler's event plane
(prefix index, `pdserve events`, the vLLM-format ZMQ republisher) cannot tell the difference.

Why not `EventPublisherFactory.register_publisher`: vLLM 0.32's `KVEventsConfig.publisher` is a
`Literal["null", "zmq"]` validated by pydantic, so a registered publisher can never be named in
the config. The ZMQ hop costs one local socket per engine and works for any executor (the
publisher lives in the engine core, rank 0 may be another process).

Contract: batches are forwarded in vLLM's order. A gap in vLLM's sequence numbers (ZMQ dropped at
its high-water mark) is logged and counted, nothing is synthesized: a lost BlockStored only makes
routing under-estimate; a lost BlockRemoved leaves an entry that the next AllBlocksCleared, a new
epoch or the index's own eviction removes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from connectors.kv_events import KVCacheEvent
from connectors.wire.msgpack_codec import WireFormatError, decode_batch

logger = logging.getLogger(__name__)

_POLL_MS = 100


class BlockPoolEventForwarder:
    """Reads vLLM's KV-event PUB at `endpoint` on its own thread; `report(events, ts)` is called
    for every non-empty batch."""

    def __init__(self, endpoint: str, report: Callable[[list[KVCacheEvent], float], None]) -> None:
        self.endpoint = endpoint
        self._report = report
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self.num_batches = 0
        self.num_gaps = 0

    def start(self, timeout: float = 5.0) -> None:
        """Starts the thread and returns once it is subscribed."""
        self._thread.start()
        self._ready.wait(timeout)

    def _run(self) -> None:
        context: Any = zmq.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        self._ready.set()
        last_seq: int | None = None
        try:
            while not self._stop.is_set():
                if not sub.poll(_POLL_MS):
                    continue
                frames = sub.recv_multipart()
                last_seq = self._handle(frames, last_seq)
        finally:
            sub.close(0)

    def _handle(self, frames: list[bytes], last_seq: int | None) -> int | None:
        if len(frames) != 3:
            logger.warning("vLLM KV events: ignoring a message of %d frames", len(frames))
            return last_seq
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if last_seq is not None and seq != last_seq + 1:
            self.num_gaps += 1
            logger.warning("vLLM KV events: gap from seq %d to %d (dropped by ZMQ)", last_seq, seq)
        try:
            batch = decode_batch(payload)
        except WireFormatError as e:
            logger.warning("vLLM KV events: undecodable batch %d: %s", seq, e)
            return seq
        if batch.events:
            self.num_batches += 1
            self._report(list(batch.events), batch.ts)
        return seq

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
