"""The measuring side of `pdserve bench events`: the subscriber process, and the figures every
side (pdserve's and the vLLM baseline's) reports alike from it.

The subscriber process (`subscribers_main`, spawned by `spawn_subscribers` as `bench.events
--role subscribers`) holds `--subscribers` ZMQ SUB subscribers decoding vLLM's msgpack (each
on its own thread; by default reading each message's event count and first hash only,
`zmq_batch_head`), plus `--grpc-subscribers` gRPC `Subscribe` ones on pdserve's side. Latency
is from the send time stamped into the first block hash (`bench.events_load.sent_at`) to the
subscriber's receipt.

Every side is measured alike (`delivery`): the same ZMQ subscribers, one stop rule (when pacing
ends the subscribers keep reading until each holds every event offered, or `--drain-s` passed),
`lost` = events offered while paced that a subscriber did not receive by then, summed over
subscribers (a resync's skipped events count), `events_per_s` = events a subscriber received
over the paced time plus the drain time used. `spawn`, `read_line` and `tell` are the plumbing
of the helper processes (a line on stdin starts or stops them, a JSON line on stdout reports).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from bench.events_load import sent_at

_MODULE = "bench.events"  # the entry point of every helper process (`--role ...`)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@dataclass
class SubStats:
    transport: str
    batches: int = 0
    events: int = 0
    resyncs: int = 0
    gaps: int = 0
    last_seq: int | None = None
    last_at: float = 0.0  # time.monotonic() of the last batch received

    def seen(self, seq: int, n_events: int, first_hash: int, now: float, latencies: list[float]) -> None:
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq
        self.batches += 1
        self.events += n_events
        latencies.append(now - sent_at(first_hash))


async def _grpc_subscriber(target: str, stats: SubStats, latencies: list[float], stop: asyncio.Event) -> None:
    from pdserve.v1 import kv_events_pb2 as pb
    from pdserve.v1 import kv_events_pb2_grpc as pb_grpc
    from services.common.grpc_server import insecure_channel

    async with insecure_channel(target) as channel:
        # Batches that are ready together come in one message (the subscriber is behind).
        call = pb_grpc.KVEventsStub(channel).Subscribe(pb.SubscribeRequest(max_batches_per_message=64))
        reader = asyncio.ensure_future(_grpc_read(call, pb, stats, latencies))
        await stop.wait()
        call.cancel()
        reader.cancel()


async def _grpc_read(call: Any, pb: Any, stats: SubStats, latencies: list[float]) -> None:
    snapshot = False
    async for msg in call:
        if msg.WhichOneof("payload") == "notice":
            if msg.notice.kind == pb.StreamNotice.RESYNC:
                stats.resyncs += 1
            snapshot = msg.notice.kind in (pb.StreamNotice.RESYNC, pb.StreamNotice.SNAPSHOT_BEGIN)
            if msg.notice.kind == pb.StreamNotice.SNAPSHOT_END:
                snapshot, stats.last_seq = False, msg.notice.next_seq - 1
            continue
        if snapshot:
            continue
        now = time.time()
        for b in msg.batches if msg.batches else (msg.batch,):
            stats.seen(b.seq, len(b.events), b.events[0].block_stored.block_hashes[0], now, latencies)
        stats.last_at = time.monotonic()


def zmq_batch_head(payload: bytes) -> tuple[int, int]:
    """(number of events, the first event's first block hash) of a ZMQ payload in vLLM's
    msgpack (`[ts, events, data_parallel_rank]`, each event a map or a tagged array), reading
    the events' array header and the first event only."""
    unpacker = msgpack.Unpacker()
    unpacker.feed(payload)
    unpacker.read_array_header()
    unpacker.skip()  # ts
    n = unpacker.read_array_header()
    first = unpacker.unpack()
    return n, first["block_hashes"][0] if isinstance(first, dict) else first[1][0]


def zmq_batch_full(payload: bytes) -> tuple[int, int]:
    """`zmq_batch_head` decoding every event, as a consumer that indexes them does."""
    _, events, _ = msgpack.unpackb(payload)
    first = events[0]
    return len(events), first["block_hashes"][0] if isinstance(first, dict) else first[1][0]


def _zmq_subscriber(ctx: zmq.Context, endpoint: str, stats: SubStats, latencies: list[float],
                    stop: threading.Event, decode: Callable[[bytes], tuple[int, int]]) -> None:
    """A ZMQ SUB on its own thread (a blocking socket: no event-loop round per message), taking
    every message that is ready at each wake-up; runs until `stop`."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    while not stop.is_set():
        if not sock.poll(10):
            continue
        while True:
            try:
                _, seq, payload = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n, first_hash = decode(payload)
            stats.seen(int.from_bytes(seq, "big"), n, first_hash, time.time(), latencies)
            stats.last_at = time.monotonic()
    sock.close(linger=0)


async def subscribers_main(grpc_target: str, zmq_endpoint: str, n_grpc: int, n_zmq: int,
                            decode: str = "head", drain_s: float = 2.0) -> None:
    """Subscribers until told `go OFFERED` (pacing has ended; OFFERED events were handed to the
    publisher), then until every subscriber holds OFFERED events or `drain_s` passed: the one
    stop rule of both sides. Prints their counts, latencies and `drain_used_s` (pacing's end to
    the last batch received)."""
    ctx = zmq.Context()
    stop = asyncio.Event()
    zmq_stop = threading.Event()
    stats = [SubStats("grpc") for _ in range(n_grpc)] + [SubStats("zmq") for _ in range(n_zmq)]
    grpc_lat: list[float] = []
    zmq_lat: list[float] = []
    tasks = [asyncio.ensure_future(_grpc_subscriber(grpc_target, s, grpc_lat, stop)) for s in stats[:n_grpc]]
    decoder = zmq_batch_head if decode == "head" else zmq_batch_full
    threads = [threading.Thread(target=_zmq_subscriber, args=(ctx, zmq_endpoint, s, zmq_lat, zmq_stop, decoder),
                                daemon=True) for s in stats[n_grpc:]]
    for t in threads:
        t.start()
    await asyncio.sleep(1.0)
    print("ready", flush=True)
    cpu0, wall0 = time.process_time(), time.monotonic()
    told = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    paced_end = time.monotonic()
    offered = int(told.split()[1]) if len(told.split()) > 1 else None
    while time.monotonic() < paced_end + drain_s and (offered is None or any(s.events < offered for s in stats)):
        await asyncio.sleep(0.01)
    cpu_share = (time.process_time() - cpu0) / max(1e-9, time.monotonic() - wall0)
    stop.set()
    zmq_stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in threads:
        await asyncio.to_thread(t.join)
    ctx.destroy(linger=0)
    latencies = grpc_lat + zmq_lat
    by_transport = {t: [x * 1e3 for x in lat] for t, lat in (("grpc", grpc_lat), ("zmq", zmq_lat))}
    drain_used = max([s.last_at - paced_end for s in stats if s.last_at], default=0.0)
    print(json.dumps({"subscribers": [vars(s) for s in stats], "cpu_share": cpu_share,
                      "drain_used_s": max(0.0, drain_used),
                      "p50_ms": percentile(latencies, 50) * 1e3,
                      "p99_ms_by_transport": {t: percentile(v, 99) for t, v in by_transport.items() if v},
                      "p99_ms": percentile(latencies, 99) * 1e3, "max_ms": max(latencies, default=0.0) * 1e3}),
          flush=True)


# -- helper processes ----------------------------------------------------------------------------

def spawn(*argv: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.path.join(os.getcwd(), "protos"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", _MODULE, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)


async def read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = await asyncio.to_thread(proc.stdout.readline)
    if not line:
        raise RuntimeError(f"bench helper process exited with {proc.wait()}")
    return line.strip()


def tell(proc: subprocess.Popen[str], line: str = "go") -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def spawn_subscribers(args: argparse.Namespace, grpc_target: str, zmq_endpoint: str,
                      grpc: bool) -> subprocess.Popen[str]:
    """The subscriber process: `--subscribers` ZMQ subscribers on every side (the mix vLLM's
    publisher serves), plus `--grpc-subscribers` gRPC ones where the side has gRPC (pdserve)."""
    return spawn("--role", "subscribers", "--grpc", grpc_target, "--zmq", zmq_endpoint,
                 "--n-grpc", str(args.grpc_subscribers if grpc else 0), "--n-zmq", str(args.subscribers),
                 "--decode", args.subscriber_decode, "--drain", str(args.drain_s))


def delivery(got: dict[str, Any], offered: int, paced_s: float) -> dict[str, Any]:
    """The figures every side reports alike from its subscribers' counts: `lost` = events offered
    (handed to the publisher while paced) that a subscriber did not receive by the stop rule,
    summed over subscribers; `events_per_s` = events a subscriber received (the mean) over the
    paced time plus the drain time used."""
    received = [s["events"] for s in got["subscribers"]]
    seconds = paced_s + got.get("drain_used_s", 0.0)
    return {"offered_events": offered, "lost": sum(max(0, offered - r) for r in received),
            "events_per_s": statistics.fmean(received) / seconds if received and seconds > 0 else 0.0,
            "paced_s": paced_s, "drain_used_s": got.get("drain_used_s"),
            "p50_ms": got["p50_ms"], "p99_ms": got["p99_ms"], "max_ms": got["max_ms"],
            "p99_ms_by_transport": got["p99_ms_by_transport"], "subscribers": got["subscribers"]}
