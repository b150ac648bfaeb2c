"""The load generator of `pdserve bench events`: simulated ranks and the bytes they send.

Every engine step's `--batch-events` BlockStored (and, with `--removed-share`, BlockRemoved)
events, stamped with their send time in the block hashes (`step_base`, `sent_at`), encoded once
per step in the form a rank reports (`stamped_compact_wire`, `step_events_wire`); the ranks
themselves, either real `ControlClient`s on threads (`_ranks_main`) or raw Control streams on one
event loop (`_stream_ranks_main`, the default), which coalesce reports queued behind a busy
stream into one ReportBatch as ControlClient does. `Pacer` holds a paced rate. The ranks run in
their own process (bench/events.py spawns it with `--role ranks|stream-ranks`);
`drive_batches` and `drive_hashes` pace stamped batches into a publisher in the calling process
instead (the event plane alone, and vLLM's publisher: bench/events_baseline.py).
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack

from connectors.kv_events import MEDIUM_CPU_OFFLOAD, BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch
from connectors.wire.protobuf_bytes import length_delimited, varint

# Block hash of the i-th event of a step: step_base(send time) + i. The send time (µs) is
# scrambled by an invertible multiplication into bits 7..63 and i (< 128) fills bits 0..6, so
# the hashes spread over every bit as real (sha256) block hashes do: hashes with constant low
# bits (the earlier `µs * 4096 + i`) collide in Python's sets and dicts and made the scheduler's
# index and aggregator pay for long probe chains that no real cluster produces.
STAMP_BITS = 7
_MASK57 = (1 << 57) - 1
_MIX = 0x9E3779B97F4A7C15 & _MASK57 | 1
_UNMIX = pow(_MIX, -1, 1 << 57)

def scrambled_base(n: int) -> int:
    """A block hash for `n` < 2^57 with entropy in every bit and bits 0..6 clear (base + i, i <
    128, are distinct hashes); `n` is recovered by `unscramble`."""
    return ((n * _MIX) & _MASK57) << STAMP_BITS


def unscramble(block_hash: int) -> int:
    return ((block_hash >> STAMP_BITS) * _UNMIX) & _MASK57


def step_base(now: float) -> int:
    """The first block hash of a step sent at `now` (see STAMP_BITS)."""
    return scrambled_base(int(now * 1e6))


def stamp_events(now: float, n: int) -> list[KVCacheEvent]:
    base = step_base(now)
    return [BlockStored((base + i,), None, (), 0, medium=MEDIUM_CPU_OFFLOAD) for i in range(n)]


def step_events(now: float, n: int, prev: float | None = None, removed: int = 0) -> list[KVCacheEvent]:
    """A step's events: `n - removed` stamped BlockStored, then, when the engine had a step
    before (sent at `prev`), BlockRemoved of the first `removed` blocks that step stored."""
    events = stamp_events(now, n - removed)
    if prev is not None and removed:
        base = step_base(prev)
        events += [BlockRemoved((base + i,), MEDIUM_CPU_OFFLOAD) for i in range(removed)]
    return events


def removed_count(share: float, batch_events: int) -> int:
    """How many of a step's `batch_events` events are BlockRemoved (ValueError: share outside
    0..0.5, which would remove more blocks than the previous step stored)."""
    if not 0.0 <= share <= 0.5:
        raise ValueError(f"--removed-share must be in [0, 0.5], got {share}")
    return round(share * batch_events)


def sent_at(block_hash: int) -> float:
    """The send time stamped into the first hash of a step."""
    return unscramble(block_hash) / 1e6


class Pacer:
    """Yields how many units are due now to hold `rate` units/s."""

    def __init__(self, rate: float) -> None:
        self.rate, self.start, self.done = rate, time.monotonic(), 0

    def due(self) -> int:
        return int((time.monotonic() - self.start) * self.rate) - self.done

    def run(self, duration: float, step: Callable[[], Any]) -> int:
        """Calls `step` at the paced rate for `duration` seconds; returns how many times."""
        end = time.monotonic() + duration
        while time.monotonic() < end:
            due = self.due()
            if due <= 0:
                time.sleep(0.001)
                continue
            for _ in range(min(due, 64)):
                step()
                self.done += 1
        return self.done


def drive_batches(publish: Callable[[KVEventBatch], Any], rate: float, batch_events: int,
                  duration: float) -> int:
    """Publishes batches of `batch_events` stamped events at `rate` events/s for `duration` s;
    returns the events offered."""
    steps = Pacer(rate / batch_events).run(
        duration, lambda: publish(KVEventBatch(time.time(), list(stamp_events(time.time(), batch_events)))))
    return steps * batch_events


def drive_hashes(publish: Callable[[float, list[int]], Any], rate: float, batch_events: int,
                 duration: float) -> int:
    """`drive_batches` handing the publisher (send time, stamped block hashes), from which it
    builds its own event structs (vLLM's publisher takes vLLM's)."""
    def step() -> None:
        now = time.time()
        base = step_base(now)
        publish(now, [base + i for i in range(batch_events)])

    return Pacer(rate / batch_events).run(duration, step) * batch_events


def _ranks_main(target: str, engines: int, tp: int, batch_events: int, rate: float, duration: float,
                merged: bool = False, engine_events: bool = False, removed: int = 0) -> None:
    from services.engine.control_client import ControlClient, ControlHello, RankIdentity, StepReport

    clients: list[list[ControlClient]] = []
    for e in range(engines):
        ranks = []
        for r in range(tp):
            identity = RankIdentity(f"bench-p{e}", "prefill", 1000 + e, r, tp)
            hello = ControlHello(identity, "bench", "127.0.0.1:1", b"", hash_seed="0", block_size=16)
            client = ControlClient(target, hello)
            client.start(60.0)
            ranks.append(client)
        clients.append(ranks)
    print("ready", flush=True)
    sys.stdin.readline()
    others = tuple(range(1, tp))
    prev: list[float | None] = [None] * engines
    offered = [0]

    def step() -> None:
        now = time.time()
        e = pacer.done % engines
        events = step_events(now, batch_events, prev[e], removed)
        prev[e] = now
        offered[0] += len(events)
        if engine_events:  # rank 0's alone (the client encodes them compactly where the scheduler accepts it)
            clients[pacer.done % engines][0].report(StepReport(engine_events=KVEventBatch(now, events)))
            return
        if merged:
            clients[pacer.done % engines][0].report(StepReport(worker_events=events, merged_event_ranks=others))
            return
        for client in clients[pacer.done % engines]:
            client.report(StepReport(worker_events=events))

    pacer = Pacer(rate / batch_events)
    steps = pacer.run(duration, step)
    # Pacing has ended: the parent starts the drain window now; the streams keep going.
    print(json.dumps({"steps": steps, "rank_reports": steps * tp, "offered_events": offered[0],
                      "send_s": time.monotonic() - pacer.start,
                      "messages": steps * (1 if merged or engine_events else tp)}), flush=True)
    for ranks in clients:
        for client in ranks:
            client.wait_acked(client.last_seq, 30.0)
    for ranks in clients:
        for client in ranks:
            client.close(1.0)


_MEDIUM_FIELD = length_delimited(6, MEDIUM_CPU_OFFLOAD.encode())  # BlockStored.medium
_LOW_BYTES = [bytes([0x80 | i]) for i in range(128)]


def stamped_events_wire(now: float, n: int, field_number: int = 6) -> bytes:
    """`stamp_events(now, n)` serialized as repeated KVEvent field `field_number`: with 6 the
    bytes `EventBatch(events=[event_to_proto(e) ...]).SerializeToString()` gives (what a rank
    puts in `packed_worker_events`), with 7 a StepReport's `worker_events`. Built without a
    protobuf object per event: the hashes base + i (base a multiple of 2^7) share every varint
    byte but the first while i < 128."""
    base = step_base(now)
    if n > 128:
        return b"".join(length_delimited(field_number, length_delimited(1, length_delimited(1, varint(base + i)) + _MEDIUM_FIELD))
                        for i in range(n))
    tail = varint(base >> STAMP_BITS)
    size = 1 + len(tail)
    head = varint(field_number << 3 | 2) + varint(size + 4 + len(_MEDIUM_FIELD)) + b"\x0a" \
        + varint(size + 2 + len(_MEDIUM_FIELD)) + b"\x0a" + varint(size)
    rest = tail + _MEDIUM_FIELD
    # head + low byte i + rest, for each i: one join with the bytes between two low bytes.
    return head + (rest + head).join(_LOW_BYTES[:n]) + rest if n else b""


# A stamped event in vLLM's map-mode msgpack, around its one hash (`stamped_compact_wire`).
_MSGPACK_HEAD = msgpack.packb({"type": "BlockStored", "block_hashes": None})[:-1] + b"\x91"
_MSGPACK_TAIL = msgpack.packb({"parent_block_hash": None, "token_ids": [], "block_size": 0, "lora_id": None,
                               "medium": MEDIUM_CPU_OFFLOAD, "lora_name": None})[1:]
_BYTES = [bytes([b]) for b in range(256)]
_MSGPACK_HEAD = b"\x88" + _MSGPACK_HEAD[1:]  # one map of 8 keys
_COMPACT_MEDIUM = length_delimited(5, MEDIUM_CPU_OFFLOAD.encode())  # CompactEvents.medium


def stamped_compact_wire(now: float, n: int, prev: float | None = None, removed: int = 0) -> bytes:
    """`step_events(now, n, prev, removed)` as a serialized `CompactEvents` (what
    `connectors.compact_events.to_proto(encode(..., mixed=True))` gives), built from templates:
    the protobuf events as `step_events_wire`, each event's msgpack map around its packed hash,
    the hashes as one array, the kind bytes when some event is a BlockRemoved."""
    from array import array

    removing = removed if prev is not None else 0
    stored = n - removed
    total = stored + removing
    base = step_base(now)
    if base >> 32 and 0 < stored <= 1 << STAMP_BITS:  # msgpack uint64: 0xcf, 8 bytes big-endian;
        # i (< 2^7, base's low 7 bits clear) changes the last byte only
        head = _MSGPACK_HEAD + b"\xcf" + (base >> 8).to_bytes(7, "big")
        low = base & 0xFF
        parts = [head + (_MSGPACK_TAIL + head).join(_BYTES[low:low + stored]) + _MSGPACK_TAIL]
    else:
        parts = [_MSGPACK_HEAD + msgpack.packb(base + i) + _MSGPACK_TAIL for i in range(stored)]
    hashes = array("Q", range(base, base + stored))
    kinds = b""
    if removing:
        old = step_base(prev)  # type: ignore[arg-type]
        parts += [_REMOVED_HEAD + msgpack.packb(old + i) + _REMOVED_TAIL for i in range(removing)]
        hashes.extend(range(old, old + removing))
        kinds = length_delimited(7, b"\x01" * stored + b"\x02" * removing)
    events_msgpack = (b"\xdc" + total.to_bytes(2, "big") if total >= 16 else bytes([0x90 | total])) + b"".join(parts)
    if sys.byteorder == "big":
        hashes.byteswap()
    return (length_delimited(1, step_events_wire(now, n, prev, removed)) + length_delimited(2, events_msgpack)
            + length_delimited(3, hashes.tobytes()) + length_delimited(4, b"\x01" * total) + _COMPACT_MEDIUM
            + kinds)


_REMOVED_MEDIUM_FIELD = length_delimited(2, MEDIUM_CPU_OFFLOAD.encode())  # BlockRemoved.medium


def _removed_msgpack_template() -> tuple[bytes, bytes]:
    """vLLM's map-mode msgpack of a removed block of the bench's medium, split around its hash."""
    from connectors.wire.msgpack_codec import _event_out

    sentinel = 0xFEDC_BA98_7654_3210
    packed = msgpack.packb(_event_out(BlockRemoved((sentinel,), MEDIUM_CPU_OFFLOAD), False), use_bin_type=True)
    head, tail = packed.split(msgpack.packb(sentinel))
    return head, tail


_REMOVED_HEAD, _REMOVED_TAIL = _removed_msgpack_template()


def removed_events_wire(prev: float, n: int, field_number: int = 6) -> bytes:
    """The BlockRemoved of `step_events(..., prev, n)` as repeated KVEvent field `field_number`
    (as `stamped_events_wire`)."""
    base = step_base(prev)
    return b"".join(length_delimited(field_number, length_delimited(
        2, length_delimited(1, varint(base + i)) + _REMOVED_MEDIUM_FIELD)) for i in range(n))


def step_events_wire(now: float, n: int, prev: float | None, removed: int, field_number: int = 6) -> bytes:
    """`step_events(now, n, prev, removed)` as repeated KVEvent field `field_number`."""
    stored = stamped_events_wire(now, n - removed, field_number)
    return stored + removed_events_wire(prev, removed, field_number) if prev is not None and removed else stored


def engine_events_header(now: float, engine_id: str, epoch: int) -> bytes:
    """The fields of a StepReport.engine_events EventBatch before its events: ts, engine_id, epoch."""
    return b"\x11" + struct.pack("<d", now) + length_delimited(3, engine_id.encode()) + b"\x20" + varint(epoch)


async def _stream_ranks_main(target: str, engines: int, tp: int, batch_events: int, rate: float,
                             duration: float, encoding: str = "compact", merged: bool = False,
                             engine_events: bool = False, removed: int = 0) -> None:
    """All ranks as raw Control streams on one event loop (one channel per engine): the same
    protocol as ControlClient (Hello, Welcome, numbered StepReports, Acks) without a thread per
    rank, so one process can stand in for hundreds of ranks. The load generator is kept cheap so
    the scheduler gets the CPU it would have in production: a step's events are encoded once
    (`encoding`: `compact_worker_events`, `packed_worker_events` or `worker_events`), and every rank's message
    is written as bytes around them (no protobuf object per report). `merged`: one report per
    engine step, from rank 0, naming ranks 1..tp-1 in `merged_event_ranks` (the other ranks send
    nothing for the step). `engine_events`: rank 0 sends the step's events as engine events
    (`engine_events`, or its header plus `compact_engine_events`), one report per step.
    `removed`: that many of a step's events are BlockRemoved (`step_events`)."""
    import grpc

    from pdserve.v1 import control_pb2 as cpb
    from services.common.grpc_server import insecure_channel

    channels = [insecure_channel(target) for _ in range(engines)]
    outboxes: list[list[asyncio.Queue[Any]]] = []
    calls = []
    acked: dict[tuple[int, int], int] = {}

    async def drain(call: Any, key: tuple[int, int]) -> None:
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.WhichOneof("payload") == "ack":
                acked[key] = msg.ack.seq

    for e in range(engines):
        connect = channels[e].stream_stream("/pdserve.v1.Control/Connect", request_serializer=None,
                                            response_deserializer=cpb.SchedulerMessage.FromString)
        boxes: list[asyncio.Queue[Any]] = []
        for r in range(tp):
            box: asyncio.Queue[Any] = asyncio.Queue()
            identity = cpb.RankIdentity(engine_id=f"bench-p{e}", role=cpb.ROLE_PREFILL, epoch=1000 + e,
                                        tp_rank=r, tp_size=tp, pp_size=1)
            box.put_nowait(cpb.RankMessage(hello=cpb.Hello(
                rank=identity, compatibility_hash="bench", protocol_version=1, engine_address="127.0.0.1:1",
                hash_seed="0", block_size=16)).SerializeToString())
            call = connect(rank_message_bytes(box))
            await call.read()  # Welcome
            calls.append(asyncio.ensure_future(drain(call, (e, r))))
            boxes.append(box)
        outboxes.append(boxes)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    pacer = Pacer(rate / batch_events)
    cpu0 = time.process_time()
    end = time.monotonic() + duration
    steps = offered = 0
    seqs = [[0] * tp for _ in range(engines)]
    prevs: list[float | None] = [None] * engines
    # StepReport.merged_event_ranks (field 11, packed varints): every rank but rank 0.
    merged_field = length_delimited(11, b"".join(varint(r) for r in range(1, tp))) if merged and tp > 1 else b""
    while time.monotonic() < end:
        due = pacer.due()
        if due <= 0:
            await asyncio.sleep(0.001)
            continue
        for _ in range(min(due, 64)):
            e = steps % engines
            now = time.time()
            prev, prevs[e] = prevs[e], now
            offered += batch_events - (removed if prev is None else 0)  # as step_events builds them
            if engine_events:
                header = engine_events_header(now, f"bench-p{e}", 1000 + e)
                seqs[e][0] += 1
                if encoding == "compact":  # engine_events (field 8) header + compact_engine_events (field 14)
                    body = length_delimited(8, header) + length_delimited(
                        14, stamped_compact_wire(now, batch_events, prev, removed))
                else:  # engine_events (field 8) with its events (EventBatch.events, field 6)
                    body = length_delimited(8, header + step_events_wire(now, batch_events, prev, removed))
                outboxes[e][0].put_nowait(b"\x08" + varint(seqs[e][0]) + body)
                steps += 1
                pacer.done += 1
                continue
            if encoding == "compact":  # StepReport.compact_worker_events (field 12)
                body = length_delimited(12, stamped_compact_wire(now, batch_events, prev, removed))
            elif encoding == "packed":  # StepReport.packed_worker_events (field 10)
                body = length_delimited(10, step_events_wire(now, batch_events, prev, removed))
            else:  # StepReport.worker_events (repeated field 7)
                body = step_events_wire(now, batch_events, prev, removed, field_number=7)
            for r, box in enumerate(outboxes[e][:1] if merged else outboxes[e]):
                seqs[e][r] += 1
                box.put_nowait(b"\x08" + varint(seqs[e][r]) + body + merged_field)
            steps += 1
            pacer.done += 1
        await asyncio.sleep(0)
    send_s = time.monotonic() - pacer.start
    send_cpu = time.process_time() - cpu0
    # Pacing has ended: the parent starts the drain window now; the streams keep going.
    print(json.dumps({"steps": steps, "rank_reports": steps * tp, "offered_events": offered,
                      "messages": steps * (1 if merged or engine_events else tp), "send_s": send_s,
                      "send_cpu_s": send_cpu}), flush=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(acked.get((e, r), 0) < seqs[e][r]
                                              for e in range(engines) for r in range(tp)):
        await asyncio.sleep(0.01)
    for boxes in outboxes:
        for box in boxes:
            box.put_nowait(None)
    for task in calls:
        task.cancel()
    for channel in channels:
        await channel.close()


async def rank_message_bytes(box: asyncio.Queue[Any], max_batch: int = 64) -> AsyncIterator[bytes]:
    """`rank_messages` for serialized messages: `box` holds the Hello's RankMessage bytes, then
    serialized StepReports (None ends the stream); reports that queued up go out together in
    one ReportBatch (up to `max_batch`), as ControlClient sends them."""
    yield await box.get()
    while True:
        m = await box.get()
        if m is None:
            return
        if box.empty():
            yield length_delimited(2, m)  # RankMessage.report
            continue
        reports = [m]
        done = False
        while len(reports) < max_batch and not box.empty():
            nxt = box.get_nowait()
            if nxt is None:
                done = True
                break
            reports.append(nxt)
        yield length_delimited(4, b"".join(length_delimited(1, r) for r in reports))  # RankMessage.reports
        if done:
            return


async def rank_messages(box: asyncio.Queue[Any], max_batch: int = 64) -> AsyncIterator[Any]:
    """A simulated rank's outgoing RankMessages from `box` (None ends the stream), as
    `ControlClient` sends them: reports that queued up while the stream was busy go out
    together in one ReportBatch (up to `max_batch`), with the newest beat that rode on them."""
    from pdserve.v1 import control_pb2 as cpb

    held = None
    while True:
        m = held if held is not None else await box.get()
        held = None
        if m is None:
            return
        if m.WhichOneof("payload") != "report" or box.empty():
            yield m
            continue
        reports, beat = [m.report], m.beat if m.HasField("beat") else None
        while len(reports) < max_batch and not box.empty():
            nxt = box.get_nowait()
            if nxt is None or nxt.WhichOneof("payload") != "report":
                held = nxt
                break
            reports.append(nxt.report)
            beat = nxt.beat if nxt.HasField("beat") else beat
        yield cpb.RankMessage(report=reports[0], beat=beat) if len(reports) == 1 else cpb.RankMessage(
            reports=cpb.ReportBatch(reports=reports), beat=beat)
