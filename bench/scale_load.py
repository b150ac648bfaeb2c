"""The load `pdserve bench scale` (bench/scale.py) drives, run as its own processes:

- `--role engines`: simulated engines. Every rank holds a real Control stream to every
  scheduler replica in `--control` (a comma list) and speaks it as `ControlClient` /
  `ControlFanout` do: Hello, numbered StepReports (its own seqs per replica; transfer results
  only to the replica that owns the request), ReportBatches, Acks, heartbeats. Rank 0 of each
  engine serves a model-free Engine gRPC service.
- `--role client`: Generate requests round-robin over the replicas in `--target` at `--rate`
  per second, one KVEvents subscriber; then, with `--saturate-s`, a closed loop of
  `--concurrency` requests in flight.

Each prints "ready", waits for a line on stdin to start, and prints its figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_COMPAT = "bench-scale"
_BLOCK = 16


def _compact_proto(events: list[Any]) -> Any:
    """`events` as a CompactWorkerEvents message (the benchmark's events always qualify)."""
    from connectors import compact_events

    compact = compact_events.encode(events)
    if compact is None:
        raise ValueError("bench scale: the simulated events do not qualify for the compact form")
    return compact_events.to_proto(compact)


# -- the engine simulator ------------------------------------------------------------------------

@dataclass(slots=True)
class _Stream:
    """One rank's control stream to one scheduler replica (its own seqs, as ControlFanout's
    clients keep)."""

    outbox: asyncio.Queue[Any]
    seq: int = 0
    acked: int = 0
    scheduler_id: str = ""  # from the replica's Welcome
    report_beats: bool = False  # the replica's Welcome: rank 0's beat may ride on a report

    def owns(self, request_id: str) -> bool:
        from services.common.request_owner import owner_of

        return owner_of(request_id) in (None, self.scheduler_id)


@dataclass(slots=True)
class _Rank:
    index: int
    streams: list[_Stream] = field(default_factory=list)
    last_sent: float = 0.0
    last_beat: float = 0.0
    sending: list[str] = field(default_factory=list)
    recving: list[str] = field(default_factory=list)


class SimEngine:
    """One simulated engine: `tp` raw Control streams per scheduler replica and (rank 0) an
    Engine gRPC server."""

    def __init__(self, index: int, role: str, tp: int, args: argparse.Namespace, stats: dict[str, Any]) -> None:
        self.index = index
        self.engine_id = f"{role[0]}{index}"
        self.role = role
        self.tp = tp
        self.epoch = random.getrandbits(62) | 1
        self.args = args
        self.stats = stats
        self.ranks = [_Rank(r) for r in range(tp)]
        self.kv_waiters: dict[str, asyncio.Future[bool]] = {}
        # request id -> when each decode rank's finished_recving report was handed to its stream
        self.recv_handed: dict[str, list[float]] = {}
        self.engine_events: list[int] = []
        self.stored: set[int] = set()  # prompt blocks this engine holds (never evicted here)
        self.steps = 0
        self.running = 0
        self.tasks: list[asyncio.Task[Any]] = []
        self.server: Any = None
        self.address = ""

    async def start(self, channels: list[Any]) -> None:
        """Registers every rank with every replica (one channel per replica), as ControlFanout does."""
        from bench.events_load import rank_messages
        from pdserve.v1 import control_pb2 as cpb
        from pdserve.v1 import control_pb2_grpc, engine_pb2_grpc
        from services.common.grpc_server import ServiceServer

        self.server = ServiceServer(["pdserve.v1.Engine"])
        engine_pb2_grpc.add_EngineServicer_to_server(_EngineApi(self), self.server.server)
        port = self.server.bind("127.0.0.1", 0)
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        role = cpb.ROLE_PREFILL if self.role == "prefill" else cpb.ROLE_DECODE
        for channel in channels:
            stub = control_pb2_grpc.ControlStub(channel)
            for rank in self.ranks:
                identity = cpb.RankIdentity(engine_id=self.engine_id, role=role, epoch=self.epoch,
                                            tp_rank=rank.index, tp_size=self.tp, pp_size=1)
                stream = _Stream(asyncio.Queue())
                stream.outbox.put_nowait(cpb.RankMessage(hello=cpb.Hello(
                    rank=identity, compatibility_hash=_COMPAT, protocol_version=1, engine_address=self.address,
                    hash_seed=self.args.hash_seed, block_size=_BLOCK)))
                call = stub.Connect(self._noting_handed(rank_messages(stream.outbox)))
                first = await call.read()
                if first.WhichOneof("payload") != "welcome":
                    raise RuntimeError(f"{self.engine_id} rank {rank.index}: no Welcome ({first})")
                stream.scheduler_id = first.welcome.scheduler_id
                stream.report_beats = first.welcome.accepts_report_beats
                rank.streams.append(stream)
                self.tasks.append(asyncio.ensure_future(self._read(rank, stream, call)))
        self.tasks.append(asyncio.ensure_future(self._beats(self.args.heartbeat_interval)))

    async def _noting_handed(self, messages: Any) -> Any:
        """`messages` as they are handed to the stream, noting when each rank's report of a
        finished receive went out (the KVReady round trip is timed from the last rank's)."""
        async for m in messages:
            kind = m.WhichOneof("payload")
            if kind in ("report", "reports"):
                reports = [m.report] if kind == "report" else m.reports.reports
                now = time.monotonic()
                for report in reports:
                    for rid in report.finished_recving:
                        handed = self.recv_handed.get(rid)
                        if handed is not None:
                            handed.append(now)
            yield m

    def run(self, end: float) -> None:
        self.tasks.append(asyncio.ensure_future(self._steps(end)))

    async def _read(self, rank: _Rank, stream: _Stream, call: Any) -> None:
        import grpc

        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                kind = msg.WhichOneof("payload")
                if kind == "ack":
                    stream.acked = msg.ack.seq
                elif kind in ("kv_ready", "kv_failed"):
                    rid = getattr(msg, kind).request_id
                    waiter = self.kv_waiters.pop(rid, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(kind == "kv_ready")
                elif kind == "peer_update":
                    for left in msg.peer_update.left:
                        self.stats["left"].add(f"{left.engine_id}/{left.tp_rank}")
        except grpc.aio.AioRpcError as e:
            if not self.stats.get("stopping"):
                self.stats["streams_ended"].append(f"{self.engine_id}/{rank.index}: {e.code().name}")
            return
        if not self.stats.get("stopping"):
            self.stats["streams_ended"].append(f"{self.engine_id}/{rank.index}: EOF")

    def _report(self, rank: _Rank, worker: Any = None, engine_hashes: list[int] | None = None,
                merged: range | None = None) -> None:
        """One report of `rank`: its pending transfer results (for every rank of the engine with
        `--transfer-per engine`), `worker` events (for the `merged` ranks too), engine events."""
        rank.last_sent = time.monotonic()
        from connectors.kv_events import BlockStored, event_to_proto
        from pdserve.v1 import control_pb2 as cpb
        from pdserve.v1 import kv_events_pb2

        report = cpb.StepReport(finished_sending=rank.sending, finished_recving=rank.recving)
        rank.sending, rank.recving = [], []
        if self.args.transfer_per == "engine" and (report.finished_sending or report.finished_recving):
            report.merged_transfer_ranks.extend(r for r in range(self.tp) if r != rank.index)
        if worker:  # encoded once per step, as ControlClient does for a scheduler that accepts it
            if isinstance(worker, bytes):
                report.packed_worker_events = worker
            else:
                report.compact_worker_events.CopyFrom(worker)
            if merged:
                report.merged_event_ranks.extend(merged)
        if engine_hashes:
            stored = BlockStored(tuple(engine_hashes), None, (), _BLOCK)
            if self.args.worker_events == "compact":
                report.compact_engine_events.CopyFrom(_compact_proto([stored]))
                report.engine_events.CopyFrom(kv_events_pb2.EventBatch(ts=time.time()))
            else:
                report.engine_events.CopyFrom(kv_events_pb2.EventBatch(ts=time.time(),
                                                                       events=[event_to_proto(stored)]))
        self._send(rank, report, self._riding_beat(rank))

    def _beat(self, rank: _Rank) -> Any:
        from pdserve.v1 import control_pb2 as cpb

        rank.last_beat = time.monotonic()
        beat = cpb.Heartbeat()
        if rank.index == 0:
            beat.load.CopyFrom(cpb.EngineLoad(num_running=self.running, kv_usage=0.1, num_free_blocks=1000))
        return beat

    def _riding_beat(self, rank: _Rank) -> Any:
        """Rank 0's beat riding on its report once half an interval passed since its last one, as
        ControlClient sends it to a scheduler that takes it (every replica of this bench does,
        or none)."""
        if rank.index or not rank.streams or not rank.streams[0].report_beats:
            return None
        if time.monotonic() - rank.last_beat < self.args.heartbeat_interval / 2:
            return None
        return self._beat(rank)

    def _send(self, rank: _Rank, report: Any, beat: Any = None) -> None:
        """`report` to every replica, each with its own seq; transfer results only to the replica
        that owns the request (`ControlFanout.for_replica`)."""
        from pdserve.v1 import control_pb2 as cpb

        transfers = bool(report.finished_sending or report.finished_recving)
        for i, stream in enumerate(rank.streams):
            mine = report
            if i + 1 < len(rank.streams):  # the last stream takes the original
                mine = cpb.StepReport()
                mine.CopyFrom(report)
            if transfers:
                for name in ("finished_sending", "finished_recving"):
                    ids = [r for r in getattr(report, name) if stream.owns(r)]
                    mine.ClearField(name)  # type: ignore[arg-type]
                    getattr(mine, name).extend(ids)
                if not (mine.finished_sending or mine.finished_recving):
                    mine.ClearField("merged_transfer_ranks")  # sent anyway, as ControlFanout does
            stream.seq += 1
            mine.seq = stream.seq
            stream.outbox.put_nowait(cpb.RankMessage(report=mine, beat=beat))
        self.stats["reports"] += 1

    async def _steps(self, end: float) -> None:
        from bench.events_load import scrambled_base
        from connectors.kv_events import MEDIUM_CPU_OFFLOAD, BlockStored, event_to_proto
        from pdserve.v1 import kv_events_pb2

        period = 1.0 / self.args.step_hz
        await asyncio.sleep(random.random() * period)
        n = self.args.events_per_step
        while time.monotonic() < end:
            # distinct per (engine, step, i), with entropy in every bit like real block hashes
            base = scrambled_base((self.index * 2 + (self.role == "decode")) * (1 << 32) + self.steps)
            events = [BlockStored((base + i,), None, (), _BLOCK, medium=MEDIUM_CPU_OFFLOAD) for i in range(n)]
            worker: Any = (_compact_proto(events) if self.args.worker_events == "compact"
                           else kv_events_pb2.EventBatch(events=[event_to_proto(e) for e in events]).SerializeToString())
            hashes, self.engine_events = self.engine_events, []
            if self.args.report_per == "engine":
                # rank 0 carries the step's worker events for every rank; the others report
                # only when they have transfer results (and beat when idle)
                self._report(self.ranks[0], worker, hashes, merged=range(1, self.tp))
                for rank in self.ranks[1:]:
                    if rank.sending or rank.recving:
                        self._report(rank)
            else:
                for rank in self.ranks:
                    self._report(rank, worker, hashes if rank.index == 0 else None)
            self.steps += 1
            await asyncio.sleep(period)

    async def _beats(self, beat_s: float) -> None:
        """Every rank beats at the scheduler's interval from registration on, as ControlClient does."""
        from pdserve.v1 import control_pb2 as cpb

        await asyncio.sleep(random.random() * beat_s)
        while True:
            now = time.monotonic()
            for rank in self.ranks:
                if rank.index and now - rank.last_sent < beat_s:
                    continue  # as ControlClient: reports since the last beat prove liveness
                if not rank.index and rank.streams and rank.streams[0].report_beats and now - rank.last_beat < beat_s:
                    continue  # rank 0's beats rode on its reports
                rank.last_sent = now
                beat = self._beat(rank)
                for stream in rank.streams:
                    stream.outbox.put_nowait(cpb.RankMessage(heartbeat=beat))
                self.stats["beats"] += 1
            await asyncio.sleep(beat_s)

    def transfer_done_on_every_rank(self, request_id: str, sending: bool) -> None:
        """Every rank finished its part: each reports it, or rank 0 for all (`--transfer-per engine`)."""
        for rank in self.reporting_ranks():
            (rank.sending if sending else rank.recving).append(request_id)

    def reporting_ranks(self) -> list[_Rank]:
        """The ranks that report a transfer result (rank 0 alone with `--transfer-per engine`)."""
        return self.ranks[:1] if self.args.transfer_per == "engine" else self.ranks

    async def stop(self) -> None:
        for rank in self.ranks:
            for stream in rank.streams:
                stream.outbox.put_nowait(None)
        for task in self.tasks:
            task.cancel()
        if self.server is not None:
            await self.server.stop(0)


class _EngineApi:
    """The Engine service of a simulated engine: no model, real gRPC."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        from connectors.hashing import BlockHasher

        self.hasher = BlockHasher(_BLOCK, engine.args.hash_seed)

    async def Prefill(self, request: Any, context: Any) -> Any:
        from pdserve.v1 import engine_pb2 as pb
        from pdserve.v1 import generation_pb2 as gen_pb

        e = self.engine
        tokens = list(request.prompt_token_ids)
        hashes = self.hasher.external_hashes(tokens)
        cached = 0
        while cached < len(hashes) and hashes[cached] in e.stored:
            cached += 1
        e.stored.update(hashes)
        e.engine_events.extend(hashes[cached:])
        e.transfer_done_on_every_rank(request.request_id, sending=True)
        descriptor = pb.TransferDescriptor(engine_id=e.engine_id, epoch=e.epoch, request_id=request.request_id,
                                           block_ids=list(range(len(tokens) // _BLOCK)), num_tokens=len(tokens),
                                           tp_size=e.tp, block_size=_BLOCK, num_kv_heads=e.tp,
                                           lease_expires_unix_ms=int((time.time() + 30) * 1000))
        return pb.PrefillResponse(request_id=request.request_id, first_token_id=1, descriptor=descriptor,
                                  num_cached_tokens=cached * _BLOCK, finish_reason=gen_pb.FINISH_REASON_UNSPECIFIED,
                                  first_token_text="a")

    async def Decode(self, request: Any, context: Any) -> Any:
        from pdserve.v1 import engine_pb2 as pb
        from pdserve.v1 import generation_pb2 as gen_pb

        e = self.engine
        e.running += 1
        try:
            if request.HasField("descriptor"):
                waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
                e.kv_waiters[request.request_id] = waiter
                t0 = time.monotonic()
                handed = e.recv_handed[request.request_id] = []
                reporting = e.reporting_ranks()
                for rank in reporting:
                    rank.recving.append(request.request_id)
                    e._report(rank)
                try:
                    ok = await waiter
                finally:
                    del e.recv_handed[request.request_id]
                done = time.monotonic()
                client_id = request.request_id.rsplit(".", 1)[0]
                # The control-plane round trip starts when the last rank's report left (a real
                # engine's ranks are processes writing at once; here one loop writes all of them
                # one after another, which is the simulator's time, reported apart).
                last = max(handed) if len(handed) == len(reporting) else t0
                e.stats["kv_untimed_ranks"] += len(handed) != len(reporting)  # not every report seen
                e.stats["kv_wait_ms"][client_id] = (done - last) * 1e3
                e.stats["kv_spread_ms"][client_id] = (last - t0) * 1e3
                if not ok:
                    e.stats["kv_failed"] += 1
            start = len(request.output_token_ids)
            last = request.sampling.max_tokens - 1
            for i in range(start, request.sampling.max_tokens):
                finish = gen_pb.FINISH_REASON_LENGTH if i == last else gen_pb.FINISH_REASON_UNSPECIFIED
                yield pb.DecodeResponse(request_id=request.request_id, token_ids=[2 + i % 50], text="b",
                                        finish_reason=finish)
        finally:
            e.running -= 1

    async def Abort(self, request: Any, context: Any) -> Any:
        from pdserve.v1 import engine_pb2 as pb

        return pb.AbortResponse(found=True)

    async def Release(self, request: Any, context: Any) -> Any:
        from pdserve.v1 import engine_pb2 as pb

        return pb.ReleaseResponse(found=True)

    async def Drain(self, request: Any, context: Any) -> Any:
        from pdserve.v1 import engine_pb2 as pb

        return pb.DrainResponse()

    async def Inspect(self, request: Any, context: Any) -> Any:
        from pdserve.v1 import engine_pb2 as pb

        return pb.InspectResponse()


async def _sim_main(a: argparse.Namespace) -> None:
    import logging

    from services.common.grpc_server import insecure_channel

    logging.getLogger("services").setLevel(logging.ERROR)  # one plaintext warning per Engine server

    stats: dict[str, Any] = {"left": set(), "streams_ended": [], "reports": 0, "beats": 0, "kv_wait_ms": {}, "kv_spread_ms": {},
                             "kv_untimed_ranks": 0, "kv_failed": 0}
    engines = []
    for i in range(a.first, a.first + a.count):
        engines.append(SimEngine(i // 2, "prefill" if i % 2 == 0 else "decode", a.tp, a, stats))
    targets = [t for t in a.control.split(",") if t]
    channels = [[insecure_channel(t) for t in targets] for _ in engines]
    for engine, engine_channels in zip(engines, channels, strict=True):
        await engine.start(engine_channels)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    stats["reports"] = stats["beats"] = 0
    end = time.monotonic() + a.duration
    for engine in engines:
        engine.run(end)
    await asyncio.sleep(a.duration)
    unacked = sum(s.seq - s.acked for e in engines for r in e.ranks for s in r.streams)
    beats = stats["beats"]
    # the figures go out once the client's last requests finished; the ranks keep beating
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    print(json.dumps({"reports": stats["reports"], "beats": beats, "left": sorted(stats["left"]),
                      "streams_ended": stats["streams_ended"], "kv_wait_ms": stats["kv_wait_ms"],
                      "kv_spread_ms": stats["kv_spread_ms"], "kv_untimed_ranks": stats["kv_untimed_ranks"],
                      "kv_failed": stats["kv_failed"], "unacked_reports": unacked,
                      "steps": sum(e.steps for e in engines), "seconds": a.duration}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    stats["stopping"] = True
    for engine in engines:
        await engine.stop()
    for engine_channels in channels:
        for channel in engine_channels:
            await channel.close()


# -- the client: Generate traffic and one KVEvents subscriber -------------------------------------

async def _client_main(a: argparse.Namespace) -> None:
    import grpc

    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.v1 import generation_pb2_grpc, kv_events_pb2_grpc
    from pdserve.v1 import kv_events_pb2 as ev_pb
    from services.common.grpc_server import insecure_channel

    rng = random.Random(7)
    half = a.prompt_blocks * _BLOCK // 2
    prefixes = [[rng.randrange(10, 1000) for _ in range(half)] for _ in range(a.prefixes)]
    channels = [insecure_channel(t) for t in a.target.split(",") if t]
    events_channel = insecure_channel(a.events)
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]  # requests round-robin over replicas
    counted = {"events": 0}
    results: list[dict[str, Any]] = []
    errors: dict[str, int] = {}

    async def subscribe() -> None:
        call = kv_events_pb2_grpc.KVEventsStub(events_channel).Subscribe(ev_pb.SubscribeRequest())
        try:
            async for msg in call:
                if msg.WhichOneof("payload") == "batch":
                    counted["events"] += len(msg.batch.events)
        except grpc.aio.AioRpcError:
            pass

    async def one(i: int, name: str = "s", into: list[dict[str, Any]] = results) -> None:
        prompt = rng.choice(prefixes) + [rng.randrange(10, 1000) for _ in range(half)]
        request = gen_pb.GenerateRequest(request_id=f"{name}{i}", token_ids=gen_pb.TokenIds(ids=prompt),
                                         sampling=gen_pb.SamplingParams(max_tokens=a.output_tokens,
                                                                        ignore_eos=True))
        t0 = time.monotonic()
        try:
            async for msg in stubs[i % len(stubs)].Generate(request, timeout=60):
                if msg.WhichOneof("payload") == "complete":
                    c = msg.complete
                    into.append({"id": f"{name}{i}", "overhead_ms": c.scheduler_overhead_ms,
                                 "e2e_ms": (time.monotonic() - t0) * 1e3, "cached": c.usage.cached_tokens})
        except grpc.aio.AioRpcError as e:
            errors[e.code().name] = errors.get(e.code().name, 0) + 1

    sub = asyncio.ensure_future(subscribe())
    await asyncio.sleep(0.5)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    start = time.monotonic()
    events0 = counted["events"]
    tasks: list[asyncio.Task[None]] = []
    i = 0
    while (now := time.monotonic()) < start + a.duration:
        due = int((now - start) * a.rate)
        while i < due:
            tasks.append(asyncio.ensure_future(one(i)))
            i += 1
        await asyncio.sleep(0.005)
    events = counted["events"] - events0
    elapsed = time.monotonic() - start
    await asyncio.wait(tasks, timeout=30) if tasks else None
    sub.cancel()
    print(json.dumps({"sent": i, "results": results, "errors": errors, "events": events,
                      "seconds": elapsed}), flush=True)
    if a.saturate_s > 0:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        before = sum(errors.values())
        saturated = await _saturate(a, one)
        print(json.dumps(saturated | {"errors": sum(errors.values()) - before}), flush=True)
    for channel in channels:
        await channel.close()
    await events_channel.close()


async def _saturate(a: argparse.Namespace, one: Any) -> dict[str, Any]:
    """Closed loop: `a.concurrency` requests in flight for `a.saturate_s` seconds, each sent as
    the one before it ended (round-robin over the replicas); what completed per second."""
    done: list[dict[str, Any]] = []
    start = time.monotonic()
    end = start + a.saturate_s
    counter = iter(range(1 << 30))

    async def worker() -> None:
        while time.monotonic() < end:
            await one(next(counter), "x", done)

    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    return {"completed": len(done), "seconds": time.monotonic() - start,
            "overhead_ms": {r["id"]: r["overhead_ms"] for r in done}}


def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["engines", "client"], required=True)
    p.add_argument("--control", default="")
    p.add_argument("--target", default="")
    p.add_argument("--events", default="")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--step-hz", type=float, default=2.0)
    p.add_argument("--events-per-step", type=int, default=16)
    p.add_argument("--report-per", choices=["engine", "rank"], default="rank")
    p.add_argument("--transfer-per", choices=["engine", "rank"], default="rank")
    p.add_argument("--worker-events", choices=["packed", "compact"], default="packed")
    p.add_argument("--duration", type=float, default=1.0)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--hash-seed", default="")
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--prompt-blocks", type=int, default=8)
    p.add_argument("--prefixes", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--saturate-s", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=32)
    a = p.parse_args()
    if a.role == "engines":
        asyncio.run(_sim_main(a))
    else:
        asyncio.run(_client_main(a))


if __name__ == "__main__":
    _main()
