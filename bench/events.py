"""`pdserve bench events`: the KV-event plane end to end, beside a vLLM-style ZMQ publisher.

pdserve (section "pdserve"): a scheduler in this process (real Control servicer with its
registry and per-rank aggregator, the republisher, the KVEvents gRPC service and the ZMQ PUB);
a second process runs `--engines` x `--tp` simulated ranks, each a real `ControlClient` with its
own control stream. Every engine step has `--batch-events` worker-side BlockStored events
(medium CPU_OFFLOAD, one hash each: every rank holds its shard); with `--report-per rank` (the
default: what pdserve's and vLLM's engines send) each rank reports them itself, with
`--report-per engine` rank 0 reports them once for all its ranks (`StepReport.merged_event_ranks`,
a protocol the scheduler accepts but no engine speaks yet); the aggregator publishes them once
every rank is counted. With `--event-source engine` the same events are rank 0's engine events instead
(`StepReport.engine_events`, or `compact_engine_events` with `--report-encoding compact`: the
block pool's events as vLLM's forwarder hands them on), one report per engine step, not
aggregated. With `--removed-share F` a fraction F (at most a half) of each step's events are
BlockRemoved instead, after its BlockStored, of blocks the same engine stored in its previous
step (as an engine at full cache evicts as it stores): such mixed steps go compact too (the
`kinds` bytes). A third process holds `--subscribers` ZMQ SUB subscribers decoding vLLM's
msgpack (plus `--grpc-subscribers` gRPC `Subscribe` ones, pdserve's side only, 0 by default).
The rank stamps its send time into the block hashes, so latency is from the rank's send (the
engine step's first report) to the subscriber's receipt. Steps are paced to `--rate` events/s.

Every side is measured alike (`delivery`): the same ZMQ subscribers, one stop rule (when pacing
ends the subscribers keep reading until each holds every event offered, or `--drain-s` passed),
`lost` = events offered while paced that a subscriber did not receive by then, summed over
subscribers (a resync's skipped events count), `events_per_s` = events a subscriber received
over the paced time plus the drain time used.

Baseline (section "vllm"): vLLM's own `vllm.distributed.kv_events.ZmqEventPublisher` (msgspec
encoding, its publisher thread and queue, PUB + replay buffer), imported from the vLLM
environment (`.venv-vllm`), fed the same 64-event batches of vLLM's own `BlockStored` structs
directly (no aggregation, no control streams, no gRPC) to `--subscribers` ZMQ subscribers, at
the same paced rate as each pdserve section that ran: `--rate` beside "pdserve" and
`--direct-rate` beside "direct", so every ratio compares equal offered rates. Where vLLM does
not import, a re-implementation of its design from the reference spec §1.5 runs instead and
the output says so (`baseline` names which).

Overload (section "overload"): the republisher driven unpaced for `--overload-seconds` with one
subscriber that never reads and one that keeps up: publish rate, the stalled subscriber's
largest buffer (bounded by `subscriber_buffer`), resyncs, and the process's current RSS
(VmRSS) before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bench.events_load import (
    Pacer,
    _ranks_main,
    _stream_ranks_main,
    removed_count,
    sent_at,
    stamp_events,
    step_base,
)
from connectors.kv_events import MEDIUM_CPU_OFFLOAD, BlockStored, KVEventBatch
from connectors.wire import encode_batch

SECTIONS = ("pdserve", "decode_per_rank", "direct", "vllm", "overload")
HEADLINE_KEYS = ("events_per_s", "p99_ms", "lost", "vllm.events_per_s", "vllm.p99_ms", "vllm.lost")
_MODULE = "bench.events"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=64, help="simulated engines")
    parser.add_argument("--tp", type=int, default=8, help="ranks per engine (one control stream each)")
    parser.add_argument("--batch-events", type=int, default=64, help="BlockStored events per engine step")
    parser.add_argument("--rate", type=float, default=8000.0,
                        help="published events/s to pace the end-to-end section at")
    parser.add_argument("--direct-rate", type=float, default=64000.0,
                        help="events/s for the event plane alone (republisher fed directly)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of paced load per section")
    parser.add_argument("--report-encoding", choices=["compact", "packed", "proto"], default="compact",
                        help="simulated stream ranks send worker events in compact form "
                             "(compact_worker_events: protobuf and msgpack bytes plus one hash array), "
                             "pre-encoded (packed_worker_events) or as protobuf worker_events")
    parser.add_argument("--event-source", choices=["worker", "engine"], default="worker",
                        help="the events are worker events (aggregated across the engine's ranks) or rank "
                             "0's engine events (StepReport.engine_events / compact_engine_events; not "
                             "aggregated; --report-encoding packed does not apply)")
    parser.add_argument("--removed-share", type=float, default=0.0,
                        help="fraction (0..0.5) of each step's events that are BlockRemoved of blocks the "
                             "engine stored in its previous step, after the step's BlockStored")
    parser.add_argument("--verify-compact", action="store_true",
                        help="the scheduler checks every compact report's three forms event by event "
                             "(a full decode: for tests, not for figures)")
    parser.add_argument("--report-per", choices=["engine", "rank"], default="rank",
                        help="one report per rank and step (default: the protocol pdserve's and vLLM's "
                             "engines speak) or one per engine step (rank 0 carries every rank's identical "
                             "worker events: StepReport.merged_event_ranks; no engine sends these yet)")
    parser.add_argument("--rank-client", choices=["stream", "control-client"], default="stream",
                        help="simulated ranks as raw Control streams on one loop, or one ControlClient "
                             "(thread + loop) per rank")
    parser.add_argument("--subscribers", type=int, default=4,
                        help="ZMQ subscribers, on every side alike (pdserve's ZMQ PUB and vLLM's publisher)")
    parser.add_argument("--grpc-subscribers", type=int, default=0,
                        help="gRPC Subscribe subscribers added on pdserve's side only (vLLM has none): the "
                             "comparison is then no longer like for like, and the JSON says so")
    parser.add_argument("--drain-s", type=float, default=2.0,
                        help="the stop rule of every side: subscribers stop when each holds every event offered "
                             "while paced, or this many seconds after pacing ended")
    parser.add_argument("--subscriber-decode", choices=["head", "full"], default="head",
                        help="ZMQ subscribers read each message's event count and first event (they stand "
                             "in for consumers on other hosts, so they take little of the cores the "
                             "scheduler runs on) or decode every event, as a consumer that indexes them does")
    parser.add_argument("--overload-seconds", type=float, default=2.0, help="seconds of unpaced overload")
    parser.add_argument("--subscriber-buffer", type=int, default=1024, help="batches per subscriber")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, from {','.join(SECTIONS)}")
    parser.add_argument("--reimplemented-baseline", action="store_true",
                        help="use the re-implementation of vLLM's publisher even where vLLM imports")
    parser.add_argument("--stream-window-kib", type=int, default=None,
                        help="the scheduler's receive window per rank stream, KiB (0: gRPC's default, grown by "
                             "BDP probing; default: the Control servicer's, see ControlServicer.flow_options)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default="",
                        help="write a PNG of p99, loss and scheduler CPU per event against the offered rate")
    parser.add_argument("--from-json", nargs="+", default=[], metavar="FILE",
                        help="draw saved `--json` results (one per offered rate and variant) with --plot "
                             "instead of running")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


# -- subscriber process --------------------------------------------------------------------------

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


async def _subscribers_main(grpc_target: str, zmq_endpoint: str, n_grpc: int, n_zmq: int,
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


# -- rank process ----------------------------------------------------------------------------------

# -- in-process scheduler ------------------------------------------------------------------------

def _spawn(*argv: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.path.join(os.getcwd(), "protos"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", _MODULE, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)


async def _readline(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = await asyncio.to_thread(proc.stdout.readline)
    if not line:
        raise RuntimeError(f"bench helper process exited with {proc.wait()}")
    return line.strip()


def _tell(proc: subprocess.Popen[str], line: str = "go") -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _subscribers(args: argparse.Namespace, grpc_target: str, zmq_endpoint: str, grpc: bool) -> subprocess.Popen[str]:
    """The subscriber process: `--subscribers` ZMQ subscribers on every side (the mix vLLM's
    publisher serves), plus `--grpc-subscribers` gRPC ones where the side has gRPC (pdserve)."""
    return _spawn("--role", "subscribers", "--grpc", grpc_target, "--zmq", zmq_endpoint,
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


async def _pdserve_section(args: argparse.Namespace, decode_per_rank: bool = False) -> dict[str, Any]:
    """The end-to-end run. `decode_per_rank` restores the pre-cache Control servicer path (every
    rank's copy of every worker event decoded from protobuf) for a side-by-side comparison."""
    from pdserve.v1 import control_pb2_grpc
    from services.common.config import SchedulerConfig
    from services.common.grpc_server import ServiceServer
    from services.scheduler.control import ControlServicer
    from services.scheduler.control_convert import WorkerEventDecoder
    from services.scheduler.events.plane import EventPlane
    from services.scheduler.events.servicer import SERVICE_NAME
    from services.scheduler.main import settle_gc
    from services.scheduler.registry import EngineRegistry

    config = SchedulerConfig(zmq_endpoint="tcp://127.0.0.1:*", subscriber_buffer=args.subscriber_buffer,
                             prefix_index_max_entries=200_000)
    # The decode-per-rank comparison needs events the decoder sees (compact ones bypass it).
    encoding = "packed" if decode_per_rank and args.report_encoding == "compact" else args.report_encoding
    plane = EventPlane.from_config(config, model_name="bench")
    registry = EngineRegistry(block_size=16, hash_seed="0", heartbeat_timeout_s=120.0)
    control = ControlServicer(registry, sink=plane.republisher, heartbeat_interval_s=5.0, scheduler_id="bench")
    control.verify_compact = args.verify_compact
    window = getattr(args, "stream_window_kib", None)
    if window is not None:
        control.stream_window_bytes = window << 10 if window > 0 else None
    if decode_per_rank:
        control.worker_events = WorkerEventDecoder(max_entries=0)
    server = ServiceServer(["pdserve.v1.Control", SERVICE_NAME], options=control.flow_options())
    control_pb2_grpc.add_ControlServicer_to_server(control, server.server)
    plane.add_to_server(server.server)
    port = server.bind("127.0.0.1", 0)
    await server.start()
    plane.start()
    control.start_monitor()
    settle_gc()  # as `pdserve scheduler` does after start-up
    assert plane.zmq is not None
    subs = _subscribers(args, f"127.0.0.1:{port}", plane.zmq.bound_endpoint, grpc=True)
    ranks = _spawn("--role", "ranks" if args.rank_client == "control-client" else "stream-ranks",
                   "--grpc", f"127.0.0.1:{port}", "--engines", str(args.engines),
                   "--tp", str(args.tp), "--batch-events", str(args.batch_events), "--rate", str(args.rate),
                   "--duration", str(args.duration), "--report-encoding", encoding,
                   "--report-per", args.report_per, "--event-source", args.event_source,
                   "--removed-share", str(args.removed_share))
    try:
        await _readline(subs)
        t0 = time.monotonic()
        await _readline(ranks)
        setup_s = time.monotonic() - t0
        start_batches = plane.republisher.stats().num_batches
        _tell(ranks)
        t0, cpu0 = time.monotonic(), time.process_time()
        sent = json.loads(await _readline(ranks))  # pacing has ended
        _tell(subs, f"go {sent['offered_events']}")
        got = json.loads(await _readline(subs))  # delivered, or the drain window passed
        elapsed, cpu_s = time.monotonic() - t0, time.process_time() - cpu0
    finally:
        for p in (subs, ranks):
            p.kill() if p.poll() is None else None
        await control.stop()
        await server.stop(0)
        plane.close()
    stats = plane.republisher.stats()
    published = stats.num_events
    batches = stats.num_batches - start_batches
    paced_s = sent["send_s"]
    return {**delivery(got, sent["offered_events"], paced_s),
            "rank_events_per_s": sent["rank_reports"] * args.batch_events / paced_s,
            "published_events": published, "published_batches": batches, "engine_steps": sent["steps"],
            "seconds": elapsed, "setup_s": setup_s, "resyncs": stats.num_resyncs,
            # CPU of the whole scheduler process (all threads: gRPC, loop, republisher) per
            # published event: robust to other load on the machine, unlike latency.
            "scheduler_cpu_us_per_event": cpu_s / published * 1e6 if published else None,
            "scheduler_cpu_share": cpu_s / elapsed,
            # The other processes on the same cores: the simulated ranks while sending (all of
            # them on one loop) and the subscribers' process (4 subscribers).
            "generator_cpu_share": (sent["send_cpu_s"] / sent["send_s"]
                                    if sent.get("send_cpu_s") is not None and sent.get("send_s") else None),
            "subscribers_cpu_share": got.get("cpu_share"),
            "report_encoding": encoding, "report_per": args.report_per, "event_source": args.event_source,
            "report_messages_per_s": sent.get("messages", sent["rank_reports"]) / elapsed,
            "scheduler_loop_max_lag_ms": control.stalls.max_lag_s * 1e3,
            "reports_malformed": control.counters["reports_malformed"],
            "report_batches": control.counters["report_batches"],
            "reports_applied": control.counters["reports_applied"],
            "reports_compact_engine_events": control.counters["reports_compact_engine_events"],
            "removed_share": args.removed_share,
            "published_removed": stats.events_by_type.get("BlockRemoved", 0),
            "decode": {"hits": control.worker_events.hits, "misses": control.worker_events.misses}}


async def _direct_section(args: argparse.Namespace) -> dict[str, Any]:
    """The event plane alone: batches published straight into the republisher from a producer
    thread, fanned out over gRPC and ZMQ."""
    from services.common.config import SchedulerConfig
    from services.common.grpc_server import ServiceServer
    from services.scheduler.events.plane import EventPlane
    from services.scheduler.events.servicer import SERVICE_NAME

    config = SchedulerConfig(zmq_endpoint="tcp://127.0.0.1:*", subscriber_buffer=args.subscriber_buffer,
                             prefix_index_max_entries=200_000)
    plane = EventPlane.from_config(config, model_name="bench")
    server = ServiceServer([SERVICE_NAME])
    plane.add_to_server(server.server)
    port = server.bind("127.0.0.1", 0)
    await server.start()
    plane.start()
    assert plane.zmq is not None
    subs = _subscribers(args, f"127.0.0.1:{port}", plane.zmq.bound_endpoint, grpc=True)
    engines = [f"bench-p{e}" for e in range(args.engines)]
    turn = iter(range(1 << 62))

    def publish(batch: KVEventBatch) -> None:
        plane.republisher.publish(engines[next(turn) % len(engines)], 1, batch)

    try:
        await _readline(subs)
        t0 = time.monotonic()
        published = await asyncio.to_thread(_drive, publish, args.direct_rate, args.batch_events, args.duration)
        elapsed = time.monotonic() - t0
        _tell(subs, f"go {published}")
        got = json.loads(await _readline(subs))
    finally:
        subs.kill() if subs.poll() is None else None
        await server.stop(0)
        plane.close()
    return {**delivery(got, published, elapsed), "published_events": published,
            "resyncs": plane.republisher.stats().num_resyncs}


# -- baseline: vLLM's own ZmqEventPublisher, or its design re-implemented -------------------------

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


async def _baseline_section(args: argparse.Namespace, rate: float) -> dict[str, Any]:
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

    subs = _subscribers(args, "", endpoint, grpc=False)
    try:
        await _readline(subs)
        t0 = time.monotonic()
        published = await asyncio.to_thread(_drive_hashes, publish, rate, args.batch_events, args.duration)
        elapsed = time.monotonic() - t0
        _tell(subs, f"go {published}")
        got = json.loads(await _readline(subs))
    finally:
        subs.kill() if subs.poll() is None else None
        close()
    return {"baseline": name, "offered_rate": rate, **delivery(got, published, elapsed), "published_events": published}


def _drive(publish: Callable[[KVEventBatch], Any], rate: float, batch_events: int, duration: float) -> int:
    steps = Pacer(rate / batch_events).run(
        duration, lambda: publish(KVEventBatch(time.time(), list(stamp_events(time.time(), batch_events)))))
    return steps * batch_events


def _drive_hashes(publish: Callable[[float, list[int]], Any], rate: float, batch_events: int,
                  duration: float) -> int:
    def step() -> None:
        now = time.time()
        base = step_base(now)
        publish(now, [base + i for i in range(batch_events)])

    return Pacer(rate / batch_events).run(duration, step) * batch_events


# -- overload ------------------------------------------------------------------------------------

def _overload_section(args: argparse.Namespace) -> dict[str, Any]:
    from services.scheduler.events import EventRepublisher, NoticeKind, StreamNotice
    from services.scheduler.prefix_index import InMemoryPrefixIndex

    rp = EventRepublisher(InMemoryPrefixIndex(100_000), ring_size=4096, subscriber_buffer=args.subscriber_buffer)
    stalled = rp.subscribe(None)
    live = rp.subscribe(None)
    rss0 = current_rss_mib()
    end = time.monotonic() + args.overload_seconds
    events = max_lag = drained = 0
    t0 = time.monotonic()
    while time.monotonic() < end:
        rp.publish("p0", 1, KVEventBatch(time.time(), list(stamp_events(time.time(), args.batch_events))))
        events += args.batch_events
        max_lag = max(max_lag, stalled.lag)
        drained += len(live.take(1024))
    elapsed = time.monotonic() - t0
    resynced = [i for i in stalled.take(10) if isinstance(i, StreamNotice) and i.kind is NoticeKind.RESYNC]
    rss1 = current_rss_mib()
    return {"events_per_s": events / elapsed, "stalled_max_buffered_batches": max_lag,
            "subscriber_buffer": args.subscriber_buffer, "stalled_resyncs": stalled.num_resyncs,
            "stalled_told_resync": bool(resynced), "live_received_batches": drained,
            "published_batches": rp.stats().num_batches, "rss_before_mib": rss0, "rss_after_mib": rss1,
            "rss_growth_mib": rss1 - rss0}


def current_rss_mib() -> float:
    """This process's current resident set (VmRSS), not the high-water mark."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- entry points ----------------------------------------------------------------------------------

def _variant(result: dict[str, Any]) -> str:
    """A saved result's pdserve variant, as a legend label: event source, encoding, removals."""
    p = result.get("pdserve") or {}
    label = f"{p.get('event_source', 'worker')} events, {p.get('report_encoding', 'packed')}"
    config = result.get("config") or {}
    share = config.get("removed_share") or 0
    label = f"{label}, {share:.0%} removed" if share else label
    return label + _subscribers_label(result)


def _subscribers_label(result: dict[str, Any]) -> str:
    """How the run's ZMQ subscribers decoded (saved runs from before the option decoded fully)."""
    return ", subscribers read heads" if (result.get("config") or {}).get("subscriber_decode") == "head" else ""


def plot_results(results: list[dict[str, Any]], path: str) -> None:
    """Draws saved `--json` results against their offered rate (several runs of a variant at
    one rate: a line through their median and a dot per run): p99 (pdserve per variant and
    vLLM's publisher, issue 18's 50 ms goal dotted), the share of events lost, and the
    scheduler's CPU per event. Results without a pdserve section are skipped; ValueError when
    none has one."""
    import matplotlib

    runs = [r for r in results if r.get("pdserve")]
    if not runs:
        raise ValueError("--from-json: no result holds a pdserve section")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for r in runs:
        series.setdefault(_variant(r), []).append((r["config"]["rate"] / 1000, r["pdserve"]))
    baselines: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for r in runs:
        if r.get("vllm"):
            baselines.setdefault(_subscribers_label(r), []).append((r["config"]["rate"] / 1000, r["vllm"]))
    subscribers = runs[0]["config"].get("subscribers", 4)

    def lost_share(side: dict[str, Any]) -> float:
        return 100 * side["lost"] / max(1, side.get("offered_events", side["published_events"]) * subscribers)

    panels: list[tuple[str, Callable[[dict[str, Any]], float]]] = [
        ("p99 publish → subscriber (ms)", lambda side: side["p99_ms"]),
        ("events lost (% of deliveries)", lost_share),
        ("scheduler CPU per event (µs)", lambda side: side["scheduler_cpu_us_per_event"])]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for i, (ax, (title, value)) in enumerate(zip(axes, panels, strict=True)):
        for label, points in sorted(series.items()):
            # Several runs at one rate: the line goes through their median, each run a dot.
            by_rate: dict[float, list[float]] = {}
            for x, side in points:
                by_rate.setdefault(x, []).append(value(side))
            rates = sorted(by_rate)
            line, = ax.plot(rates, [statistics.median(by_rate[x]) for x in rates], marker="o", label=label)
            if any(len(v) > 1 for v in by_rate.values()):
                ax.scatter([x for x in rates for _ in by_rate[x]], [y for x in rates for y in by_rate[x]],
                           s=10, alpha=0.5, color=line.get_color())
        for j, (subs, baseline) in enumerate(sorted(baselines.items()) if i < 2 else ()):
            base_by_rate: dict[float, list[float]] = {}
            for x, side in baseline:
                base_by_rate.setdefault(x, []).append(value(side))
            base_rates = sorted(base_by_rate)
            ax.plot(base_rates, [statistics.median(base_by_rate[x]) for x in base_rates], marker="s",
                    color="black" if not j else "dimgrey", linestyle="--" if not j else ":",
                    label=f"{runs[0].get('baseline') or 'vLLM publisher'} alone{subs}")
        if i == 0:
            ax.set_yscale("log")
            ax.axhline(50.0, color="grey", linestyle=":", linewidth=1)
            ax.annotate("goal p99 50 ms", (min(x for x, _ in series[min(series)]), 50.0), fontsize=6,
                        color="grey", va="bottom")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("offered events/s (thousands)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        if not args.plot:
            raise ValueError("--from-json draws saved results: give --plot PATH")
        plot_results([json.loads(Path(f).read_text()) for f in args.from_json], args.plot)
        print(f"plot: {args.plot}")
        return 0
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        raise ValueError(f"--sections: unknown {unknown}, choose from {','.join(SECTIONS)}")
    if args.event_source == "engine" and (args.report_encoding == "packed" or "decode_per_rank" in sections):
        raise ValueError("--event-source engine: engine events have no packed form (--report-encoding "
                         "compact or proto) and no per-rank decode (drop the decode_per_rank section)")
    removed_count(args.removed_share, args.batch_events)  # ValueError before anything starts
    if args.subscribers < 1 or args.grpc_subscribers < 0 or args.drain_s < 0:
        raise ValueError("--subscribers must be >= 1, --grpc-subscribers and --drain-s >= 0")
    baseline_first = getattr(args, "baseline_first", False)
    ours = ("pdserve" in sections or "decode_per_rank" in sections, "direct" in sections)
    baseline = baseline_direct = None
    if baseline_first and "vllm" in sections:
        baseline, baseline_direct = _baselines(args, *ours)
    pdserve = asyncio.run(_pdserve_section(args)) if "pdserve" in sections else None
    per_rank = asyncio.run(_pdserve_section(args, decode_per_rank=True)) if "decode_per_rank" in sections else None
    direct = asyncio.run(_direct_section(args)) if "direct" in sections else None
    if not baseline_first and "vllm" in sections:
        baseline, baseline_direct = _baselines(args, *ours)
    overload = _overload_section(args) if "overload" in sections else None
    head = pdserve or per_rank or {}
    result: dict[str, Any] = {
        "events_per_s": head.get("events_per_s"), "p99_ms": head.get("p99_ms"), "lost": head.get("lost"),
        "pdserve": pdserve, "pdserve_decode_per_rank": per_rank, "event_plane_direct": direct,
        "vllm": baseline, "vllm_at_direct_rate": baseline_direct, "overload": overload,
        "baseline": (baseline or baseline_direct or {}).get("baseline"),
        "load_average": os.getloadavg(), "baseline_first": baseline_first,
        # Like for like: the same ZMQ subscribers on both sides, the same stop rule and loss count.
        "symmetric": args.grpc_subscribers == 0,
        "config": {"engines": args.engines, "tp": args.tp, "batch_events": args.batch_events,
                   "rate": args.rate, "direct_rate": args.direct_rate, "duration_s": args.duration,
                   "subscribers": args.subscribers, "grpc_subscribers": args.grpc_subscribers,
                   "drain_s": args.drain_s, "removed_share": args.removed_share,
                   "subscriber_decode": args.subscriber_decode},
        # Ratios at equal offered rates (each pdserve section against the baseline paced alike).
        "p99_ratio_vs_vllm": _ratio(head, baseline, "p99_ms"),
        "delivered_ratio_vs_vllm": _ratio(head, baseline, "events_per_s"),
        "direct_p99_ratio_vs_vllm": _ratio(direct, baseline_direct, "p99_ms"),
        "direct_delivered_ratio_vs_vllm": _ratio(direct, baseline_direct, "events_per_s"),
        # > 1: the decode-once path needs that many times less scheduler CPU per event.
        "cpu_per_event_ratio_vs_decode_per_rank": (
            per_rank["scheduler_cpu_us_per_event"] / pdserve["scheduler_cpu_us_per_event"]
            if pdserve and per_rank and pdserve["scheduler_cpu_us_per_event"]
            and per_rank["scheduler_cpu_us_per_event"] else None)}
    if args.plot and pdserve:
        plot_results([result], args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    removed = f" ({args.removed_share:.0%} BlockRemoved)" if args.removed_share else ""
    print(f"KV-event plane, {args.engines} engines x tp {args.tp}, {args.batch_events}-event batches{removed}, "
          f"{args.subscribers} ZMQ subscribers on each side"
          + (f" + {args.grpc_subscribers} gRPC on pdserve's (not like for like)" if args.grpc_subscribers else "")
          + f"; every side stops when each subscriber holds every offered event or {args.drain_s:g} s after pacing")
    label = "vLLM ZmqEventPublisher" if result["baseline"] and result["baseline"].startswith("vllm") \
        else "vLLM-style re-implementation"
    if result["baseline"]:
        print(f"  baseline: {result['baseline']}; load average {os.getloadavg()[0]:.1f}")
    for name, r in ((f"pdserve end to end, paced {args.rate:.0f}/s", pdserve),
                    ("  same, decoding every rank's copy (old path)", per_rank),
                    (f"{label}, paced {args.rate:.0f}/s", baseline),
                    (f"pdserve event plane alone, paced {args.direct_rate:.0f}/s", direct),
                    (f"{label}, paced {args.direct_rate:.0f}/s", baseline_direct)):
        if r is None:
            continue
        cpu = r.get("scheduler_cpu_us_per_event")
        print(f"  {name:45s} {r['events_per_s']:10.0f} events/s  p50 {r['p50_ms']:7.2f} ms  "
              f"p99 {r['p99_ms']:7.2f} ms  lost {r['lost']}" + (f"  scheduler CPU {cpu:.1f} us/event" if cpu else ""))
    if pdserve:
        print(f"  rank-side events (x tp): {pdserve['rank_events_per_s']:.0f}/s through {args.engines * args.tp} "
              f"control streams")
    if result["cpu_per_event_ratio_vs_decode_per_rank"]:
        print(f"  scheduler CPU per event, old path / new path: {result['cpu_per_event_ratio_vs_decode_per_rank']:.2f}x")
    if overload:
        o = overload
        print(f"  overload: {o['events_per_s']:.0f} events/s unpaced; stalled subscriber held at most "
              f"{o['stalled_max_buffered_batches']} batches (buffer {o['subscriber_buffer']}), resynced "
              f"{o['stalled_resyncs']}x, told: {o['stalled_told_resync']}; RSS {o['rss_before_mib']:.0f} -> "
              f"{o['rss_after_mib']:.0f} MiB (current VmRSS)")
    for key in ("p99_ratio_vs_vllm", "delivered_ratio_vs_vllm", "direct_p99_ratio_vs_vllm",
                "direct_delivered_ratio_vs_vllm"):
        if result[key] is not None:
            print(f"  {key}: {result[key]:.2f}x (equal offered rates)")
    return 0


def _baselines(args: argparse.Namespace, end_to_end: bool, direct: bool
               ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """vLLM's publisher at `--rate` (beside the end-to-end sections, or alone) and at
    `--direct-rate` (beside the event plane alone)."""
    at_rate = asyncio.run(_baseline_section(args, args.rate)) if end_to_end or not direct else None
    at_direct = asyncio.run(_baseline_section(args, args.direct_rate)) if direct else None
    return at_rate, at_direct


def _ratio(mine: dict[str, Any] | None, base: dict[str, Any] | None, key: str) -> float | None:
    if not mine or not base or not base.get(key):
        return None
    return float(mine[key]) / float(base[key])


def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["subscribers", "ranks", "stream-ranks"], required=True)
    p.add_argument("--grpc", default="")
    p.add_argument("--zmq", default="")
    p.add_argument("--n-grpc", type=int, default=0)
    p.add_argument("--n-zmq", type=int, default=0)
    p.add_argument("--decode", choices=["head", "full"], default="head")
    p.add_argument("--drain", type=float, default=2.0)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--batch-events", type=int, default=64)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--duration", type=float, default=1.0)
    p.add_argument("--report-encoding", choices=["compact", "packed", "proto"], default="compact")
    p.add_argument("--report-per", choices=["engine", "rank"], default="rank")
    p.add_argument("--event-source", choices=["worker", "engine"], default="worker")
    p.add_argument("--removed-share", type=float, default=0.0)
    a = p.parse_args()
    removed = removed_count(a.removed_share, a.batch_events)
    engine_events = a.event_source == "engine"
    merged = a.report_per == "engine"
    if a.role == "subscribers":
        asyncio.run(_subscribers_main(a.grpc, a.zmq, a.n_grpc, a.n_zmq, a.decode, a.drain))
    elif a.role == "stream-ranks":
        asyncio.run(_stream_ranks_main(a.grpc, a.engines, a.tp, a.batch_events, a.rate, a.duration,
                                       encoding=a.report_encoding, merged=merged, engine_events=engine_events,
                                       removed=removed))
    else:
        _ranks_main(a.grpc, a.engines, a.tp, a.batch_events, a.rate, a.duration, merged=merged,
                    engine_events=engine_events, removed=removed)


if __name__ == "__main__":
    _main()
