"""The baseline of `pdserve bench events`: vLLM's own `ZmqEventPublisher`, paced like pdserve.

vLLM's `vllm.distributed.kv_events.ZmqEventPublisher` (msgspec encoding, its publisher thread
and queue, PUB + replay buffer), imported from the vLLM environment (`.venv-vllm`), is fed the
same 64-event batches of vLLM's own `BlockStored` structs directly (no aggregation, no control
streams, no gRPC) and read by the same `--subscribers` ZMQ subscribers
(bench/events_subscribers.py), at the same paced rate as each pdserve section that ran:
`--rate` beside "pdserve" and `--direct-rate` beside "direct" (`baselines`), so every ratio
compares equal offered rates. Where vLLM does not import, `VllmStylePublisher`, a
re-implementation of its design from the reference spec §1.5, runs instead and the output says
so (`baseline` names which).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from bench.events_load import drive_hashes
from bench.events_subscribers import delivery, read_line, spawn_subscribers, tell
from connectors.kv_events import MEDIUM_CPU_OFFLOAD, BlockStored, KVEventBatch
from connectors.wire import encode_batch


def baselines(args: argparse.Namespace, end_to_end: bool, direct: bool
              ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """vLLM's publisher at `--rate` (beside the end-to-end sections, or alone) and at
    `--direct-rate` (beside the event plane alone)."""
    at_rate = asyncio.run(baseline_section(args, args.rate)) if end_to_end or not direct else None
    at_direct = asyncio.run(baseline_section(args, args.direct_rate)) if direct else None
    return at_rate, at_direct


def vllm_publisher(endpoint_port: int) -> tuple[Any, Callable[[float, list[int]], Any], str] | None:
    """(vLLM's ZmqEventPublisher bound on 127.0.0.1:port, a batch builder from (ts, hashes) using
    vLLM's own event structs, "vllm <version>"), or None when vLLM does not import here."""
    try:
        import vllm
        from vllm.distributed.kv_events import BlockStored as VllmBlockStored
        from vllm.distributed.kv_events import KVEventBatch as VllmBatch
        from vllm.distributed.kv_events import ZmqEventPublisher
    except Exception:  # noqa: BLE001 - any import failure means: no vLLM here
        return None
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{endpoint_port}")

    def build(ts: float, hashes: list[int]) -> Any:
        return VllmBatch(ts=ts, events=[VllmBlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[],
                                                        block_size=0, lora_id=None, medium=MEDIUM_CPU_OFFLOAD,
                                                        lora_name=None) for h in hashes])

    return publisher, build, f"vllm {vllm.__version__} ZmqEventPublisher"


class VllmStylePublisher:
    """Bounded queue, one publisher thread, PUB with an HWM, replay deque; put() blocks when full."""

    def __init__(self, endpoint: str, *, hwm: int = 100_000, max_queue_size: int = 100_000,
                 buffer_steps: int = 10_000) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = 0
        self._queue.put(batch)

    def _run(self) -> None:
        seq = 0
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            payload = encode_batch(batch)
            self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))
            seq += 1

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5.0)
        self._pub.close(linger=0)
        self._ctx.term()


async def baseline_section(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """vLLM's own publisher (or, without vLLM, the labelled re-implementation) paced at `rate`."""
    from services.local_cluster import free_port

    port = free_port()
    real = vllm_publisher(port) if not args.reimplemented_baseline else None
    if real is not None:
        publisher, build, name = real
        endpoint = f"tcp://127.0.0.1:{port}"

        def publish(ts: float, hashes: list[int]) -> None:
            publisher.publish(build(ts, hashes))

        close = publisher.shutdown
    else:
        reimpl = VllmStylePublisher("tcp://127.0.0.1:*")
        endpoint, name, close = reimpl.endpoint, "re-implementation of vLLM's ZmqEventPublisher (vLLM absent)", \
            reimpl.close

        def publish(ts: float, hashes: list[int]) -> None:
            reimpl.publish(KVEventBatch(ts, [BlockStored((h,), None, (), 0, medium=MEDIUM_CPU_OFFLOAD)
                                             for h in hashes]))

    subs = spawn_subscribers(args, "", endpoint, grpc=False)
    try:
        await read_line(subs)
        t0 = time.monotonic()
        published = await asyncio.to_thread(drive_hashes, publish, rate, args.batch_events, args.duration)
        elapsed = time.monotonic() - t0
        tell(subs, f"go {published}")
        got = json.loads(await read_line(subs))
    finally:
        subs.kill() if subs.poll() is None else None
        close()
    return {"baseline": name, "offered_rate": rate, **delivery(got, published, elapsed), "published_events": published}
