"""`pdserve events`: print the cluster's KV events as JSON lines.

gRPC (default): subscribes to the scheduler's KVEvents service. One line per batch
`{"seq", "engine_id", "epoch", "ts", "data_parallel_rank", "events": [...]}`; snapshot batches
carry `"snapshot": true` (and seq 0); notices are `{"notice": "SNAPSHOT_BEGIN" | "SNAPSHOT_END" |
"RESYNC", "next_seq", "reason"}`. Resume without loss with `--from-seq <last seq + 1>` at the same
scheduler replica; at another (its seqs are its own) with `--snapshot`: the index, then live.

ZMQ (`--zmq ENDPOINT`): reads vLLM's wire format from a PUB endpoint (the scheduler's or a vLLM
engine's). With `--from-seq N` and `--zmq-replay ENDPOINT` it first replays from N over a DEALER,
then continues live without duplicates. Lines carry `"topic"` instead of engine and epoch.
Across scheduler replicas: `--zmq a_pub,b_pub --zmq-replay a_rep,b_rep --snapshot` takes a
snapshot from a replica's replay socket, then follows its live stream from the snapshot's seq,
and moves to the next replica (a new snapshot) when it is lost (services/zmq_event_subscriber.py);
notices are `{"notice": "SNAPSHOT_BEGIN" | "SNAPSHOT_END", "next_seq", "endpoint"}`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any, TextIO

import grpc

from connectors.kv_events import KVCacheEvent, KVEventBatch, event_from_proto
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.security import (
    add_client_security_arguments,
    client_security_from_args,
    open_sync_channel,
)

END_SEQ = b"\xff" * 8
_TYPES = {"BlockStored": 1, "BlockRemoved": 2, "AllBlocksCleared": 3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50053", help="scheduler KVEvents host:port")
    parser.add_argument("--from-seq", type=int, help="replay from this sequence number (default: live only)")
    parser.add_argument("--snapshot", action="store_true",
                        help="start with a snapshot of the index, then live (how to resume at another replica)")
    parser.add_argument("--engine", action="append", default=[], help="only this engine id (repeatable)")
    parser.add_argument("--medium", action="append", default=[], help="only this medium, e.g. GPU (repeatable)")
    parser.add_argument("--type", action="append", default=[], choices=sorted(_TYPES),
                        help="only this event type (repeatable)")
    parser.add_argument("--zmq", metavar="ENDPOINT", help="read vLLM-format events from a ZMQ PUB endpoint "
                                                          "(a comma list of replicas with --snapshot)")
    parser.add_argument("--zmq-replay", metavar="ENDPOINT", help="ZMQ ROUTER replay endpoint (with --from-seq; a "
                                                                 "comma list, one per --zmq replica, with --snapshot)")
    parser.add_argument("--limit", type=int, default=0, help="exit after this many batches (0: never)")
    parser.add_argument("--duration", type=float, default=0.0, help="exit after this many seconds (0: never)")
    parser.add_argument("--json", action="store_true", help="JSON lines (the default output; accepted for symmetry)")
    add_client_security_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.from_seq is not None and args.from_seq < 0:
        raise ValueError(f"--from-seq must be >= 0, got {args.from_seq}")
    if args.limit < 0 or args.duration < 0:
        raise ValueError("--limit and --duration must be >= 0")
    if args.snapshot and args.from_seq is not None:
        raise ValueError("--snapshot: not with --from-seq (a seq belongs to one replica)")
    if args.zmq_replay and not args.zmq:
        raise ValueError("--zmq-replay needs --zmq")
    if args.zmq and args.snapshot:
        return _run_zmq_replicas(args, sys.stdout)
    if args.zmq and "," in args.zmq:
        raise ValueError("--zmq with several replicas needs --snapshot (each replica's seqs are its own)")
    if args.zmq:
        return _run_zmq(args, sys.stdout)
    return _run_grpc(args, sys.stdout)


def event_to_dict(event: KVCacheEvent) -> dict[str, Any]:
    """vLLM's field names, with the event type under "type" (as in vLLM's map encoding)."""
    return {"type": type(event).__name__, **asdict(event)}


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _emit(out: TextIO, line: dict[str, Any]) -> None:
    out.write(json.dumps(line, default=_json_default) + "\n")
    out.flush()


@contextlib.contextmanager
def _signals_cancel(call: Any) -> Iterator[list[int]]:
    """SIGINT / SIGTERM cancel the stream (the loop then ends with CANCELLED) instead of raising
    KeyboardInterrupt wherever the main thread is: inside gRPC's iterator an interrupt could
    leave the channel half closed and the process unable to exit (seen: `pdserve events` lived
    on 30 s after Ctrl-C). Yields the signals received; outside the main thread, nothing."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def cancel(signum: int, _frame: object) -> None:
        received.append(signum)
        call.cancel()

    previous = {sig: signal.signal(sig, cancel) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_grpc(args: argparse.Namespace, out: TextIO) -> int:
    from pdserve.v1 import kv_events_pb2 as pb
    from pdserve.v1 import kv_events_pb2_grpc as pb_grpc

    request = pb.SubscribeRequest(engine_ids=args.engine, media=args.medium, types=[_TYPES[t] for t in args.type],
                                  snapshot=args.snapshot)
    if args.from_seq is not None:
        request.from_seq = args.from_seq
    security = client_security_from_args(args)
    with open_sync_channel(args.target, security, CHANNEL_OPTIONS) as channel:
        call = pb_grpc.KVEventsStub(channel).Subscribe(request, timeout=args.duration or None,
                                                       metadata=security.metadata() if security else ())
        with _signals_cancel(call) as received:
            return _follow(call, args.limit, out, received)


def _follow(call: Any, limit: int, out: TextIO, received: list[int]) -> int:
    """Prints the stream until it ends, `limit` batches (0: no limit), or a signal cancelled it
    (exit 128 + the signal, as a shell reports it)."""
    from pdserve.v1 import kv_events_pb2 as pb

    snapshot = False
    num_batches = 0
    try:
        for msg in call:
            if msg.WhichOneof("payload") == "notice":
                kind = pb.StreamNotice.Kind.Name(msg.notice.kind)
                snapshot = kind in ("SNAPSHOT_BEGIN", "RESYNC")
                _emit(out, {"notice": kind, "next_seq": msg.notice.next_seq, "reason": msg.notice.reason})
                continue
            b = msg.batch
            line: dict[str, Any] = {"seq": b.seq, "engine_id": b.engine_id, "epoch": b.epoch, "ts": b.ts,
                                    "data_parallel_rank": b.data_parallel_rank if b.HasField(
                                        "data_parallel_rank") else None,
                                    "events": [event_to_dict(event_from_proto(e)) for e in b.events]}
            if snapshot:
                line["snapshot"] = True
            _emit(out, line)
            num_batches += 1
            if limit and num_batches >= limit:
                call.cancel()
                break
    except grpc.RpcError as e:
        if received and e.code() == grpc.StatusCode.CANCELLED:
            return 128 + received[0]
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            print(f"pdserve events: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 128 + received[0] if received else 0


def _zmq_line(topic: bytes, seq: int, batch: KVEventBatch) -> dict[str, Any]:
    return {"seq": seq, "topic": topic.decode(errors="replace"), "ts": batch.ts,
            "data_parallel_rank": batch.data_parallel_rank, "events": [event_to_dict(e) for e in batch.events]}


def _run_zmq(args: argparse.Namespace, out: TextIO) -> int:
    import zmq

    from connectors.wire import decode_batch

    ctx = zmq.Context()
    deadline = time.monotonic() + args.duration if args.duration else None
    num_batches = 0
    last_seq: int | None = None

    def emit(topic: bytes, seq: int, payload: bytes) -> bool:
        nonlocal num_batches, last_seq
        _emit(out, _zmq_line(topic, seq, decode_batch(payload)))
        last_seq = seq
        num_batches += 1
        return bool(args.limit) and num_batches >= args.limit

    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(args.zmq)
        if args.from_seq is not None and args.zmq_replay:
            replay = ctx.socket(zmq.DEALER)
            replay.connect(args.zmq_replay)
            replay.send_multipart([b"", args.from_seq.to_bytes(8, "big")])
            while True:
                if not replay.poll(10_000):
                    print("pdserve events: no answer from the replay endpoint", file=sys.stderr)
                    return 1
                frames = replay.recv_multipart()
                if len(frames) < 4 or frames[2] == END_SEQ:
                    break
                if emit(frames[1], int.from_bytes(frames[2], "big"), frames[3]):
                    return 0
        while deadline is None or time.monotonic() < deadline:
            if not sub.poll(100):
                continue
            topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if last_seq is not None and seq <= last_seq:
                continue  # already printed from the replay
            if emit(topic, seq, payload):
                return 0
        return 0
    finally:
        ctx.destroy(linger=0)


def zmq_replica_endpoints(pubs: str, replays: str | None) -> list[tuple[str, str]]:
    """(PUB, replay) per replica from the comma lists; ValueError when they do not pair up."""
    pub_list = [p.strip() for p in pubs.split(",") if p.strip()]
    replay_list = [r.strip() for r in (replays or "").split(",") if r.strip()]
    if not pub_list or len(pub_list) != len(replay_list):
        raise ValueError(f"--zmq --snapshot: one --zmq-replay endpoint per --zmq endpoint "
                         f"(got {len(pub_list)} and {len(replay_list)})")
    return list(zip(pub_list, replay_list, strict=True))


def _run_zmq_replicas(args: argparse.Namespace, out: TextIO) -> int:
    import threading

    from services.zmq_event_subscriber import ZmqEventSubscriber

    endpoints = zmq_replica_endpoints(args.zmq, args.zmq_replay)
    num_batches = 0

    def on_batch(topic: bytes, seq: int, batch: KVEventBatch, snapshot: bool) -> None:
        nonlocal num_batches
        if args.limit and num_batches >= args.limit:
            return
        line = _zmq_line(topic, seq, batch)
        if snapshot:
            line["snapshot"] = True
        _emit(out, line)
        num_batches += 1
        if args.limit and num_batches >= args.limit:
            sub.close()

    def on_notice(kind: str, endpoint: str, next_seq: int) -> None:
        _emit(out, {"notice": kind, "next_seq": next_seq, "endpoint": endpoint})

    sub = ZmqEventSubscriber(endpoints, on_batch=on_batch, on_notice=on_notice)
    timer = threading.Timer(args.duration, sub.close) if args.duration else None
    if timer is not None:
        timer.start()
    try:
        sub.run()
    finally:
        if timer is not None:
            timer.cancel()
    return 0
