"""`pdserve bench scale`: one real scheduler process against simulated engines, 128 -> 1,024 ranks.

Per point (`--ranks`, a comma-separated list; engines = ranks / `--tp`, half prefill, half
decode) the benchmark starts a fresh `pdserve scheduler` process (prefix-aware routing, the
demo model's tokenizer facts) and:

- `--sim-procs` engine-simulator processes. Every simulated rank holds its own real Control
  stream and speaks it as `ControlClient` does (Hello, Welcome, numbered StepReports, queued
  reports coalesced into a ReportBatch, Acks, heartbeats at the scheduler's interval: rank 0
  always, with the engine load; other ranks only when they sent nothing since). Each engine steps at `--step-hz`; each step has `--events-per-step` worker-side BlockStored events
  (medium CPU_OFFLOAD, the same on every rank, encoded once per step into
  `packed_worker_events`: the aggregator publishes them once all ranks counted). With
  `--report-per rank` (default: what pdserve's and vLLM's engines send) every rank reports every
  step, events and transfer results; with `--report-per engine` rank 0 reports every step,
  carrying the events for all its ranks (`merged_event_ranks`, accepted by the scheduler but
  sent by no engine yet), and the other ranks report a step only when it has transfer results. Rank 0 of each engine serves a real Engine gRPC service with no model: Prefill
  answers a transfer descriptor with the prompt's leading blocks it already holds as cached
  tokens, and publishes the new ones (GPU BlockStored, on rank 0's next report) so prefix
  routing sees them (`prefix_hit_rate`: requests that found cached blocks); every prefill rank reports
  `finished_sending` at its next step. Decode reports `finished_recving` on every rank at once,
  waits for KVReady, then streams `--output-tokens` tokens. The KVReady round trip is timed from
  the moment the last rank's report was handed to its stream: a real engine's ranks are separate
  processes that write at once, while here one event loop writes the engine's reports one
  after another; that spread is the simulator's own time and is reported apart
  (`sim_rank_spread_p50_ms`/`_p99_ms`), not charged to the control plane.
- `--transfer-per rank` (default: what pdserve's engines send today) has every rank report its
  own finished transfers; `--transfer-per engine` has rank 0 report them once for all its ranks
  (`StepReport.merged_transfer_ranks`), as an engine whose ranks' results meet in one process
  (vLLM's executor aggregates its workers' KVConnectorOutputs) can.
- `--scheduler-loop asyncio,uvloop` runs every point once per scheduler event loop
  (`pdserve scheduler --event-loop`), side by side.
- `--worker-events packed` (default) sends the events as `packed_worker_events` and
  `engine_events.events`; `compact` as `compact_worker_events` and `compact_engine_events`, what
  `ControlClient` sends to a scheduler that accepts them (the simulators then spend more CPU).
- one client process sending Generate requests (token-id prompts sharing `--prefixes` prefixes,
  `--request-rate` requests/s per engine) and one KVEvents gRPC subscriber counting events.

Measured over `--duration` s: routing decisions/s (completed Generate requests), control-plane
overhead per request (the scheduler's own `scheduler_overhead_ms` from Complete, plus the
KVReady round trip from the last decode rank's report) p50/p99, events/s received by the subscriber,
scheduler CPU (utime+stime of its process) per rank per second, scheduler RSS (current VmRSS
at the end) and `false_down`: ranks of engines the scheduler announced as left (PeerUpdate) or
whose control stream it ended, while every simulated rank was alive and reporting.

The baseline is the same scheduler at the smallest point: the table reports how each figure
grows from the first to the last point (ratios), and `--plot PATH` draws them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.event_loop import EVENT_LOOPS

_MODULE = "bench.scale"
# What `--repeat` (bench/repeats.py) summarizes beside ratios: the largest point's figures and
# their growth from the smallest point (the baseline).
HEADLINE_KEYS = ("overhead_p50_ms", "overhead_p99_ms", "events_per_s", "rss_mib", "false_down",
                 "growth_first_to_last.overhead_p50_ms", "growth_first_to_last.overhead_p99_ms",
                 "growth_first_to_last.cpu_ms_per_rank_s")
_COMPAT = "bench-scale"
_BLOCK = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", default="128,256,512,1024",
                        help="comma-separated rank counts, one scheduler run each")
    parser.add_argument("--tp", type=int, default=8, help="ranks per engine (one control stream each)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per point")
    parser.add_argument("--step-hz", type=float, default=2.0, help="engine steps per second (each rank reports)")
    parser.add_argument("--events-per-step", type=int, default=16,
                        help="worker-side BlockStored events per rank report")
    parser.add_argument("--report-per", choices=["engine", "rank"], default="rank",
                        help="worker events from every rank (default: the protocol the engines speak) or "
                             "once per engine step from rank 0 (StepReport.merged_event_ranks; other ranks "
                             "report only transfer results; no engine sends these yet)")
    parser.add_argument("--worker-events", choices=["packed", "compact"], default="packed",
                        help="the form of the events in rank reports: packed (packed_worker_events and "
                             "engine_events.events, every pass's figures) or compact (compact_worker_events and "
                             "compact_engine_events, what ControlClient sends to a scheduler that accepts them; "
                             "the simulator then spends more CPU encoding, which on a shared machine shows up "
                             "in the KVReady figures)")
    parser.add_argument("--transfer-per", default="rank",
                        help="comma-separated: rank (every rank reports its transfer results, as pdserve's "
                             "engines do today) and/or engine (rank 0 reports them once for all its ranks, "
                             "StepReport.merged_transfer_ranks: what an engine whose ranks' results meet in one "
                             "process, e.g. vLLM's executor, can send); each rank count runs once per value")
    parser.add_argument("--request-rate", type=float, default=0.25,
                        help="Generate requests per second per engine")
    parser.add_argument("--prompt-blocks", type=int, default=8, help="prompt length in KV blocks of 16 tokens")
    parser.add_argument("--prefixes", type=int, default=16, help="distinct shared prompt prefixes (half the prompt)")
    parser.add_argument("--output-tokens", type=int, default=4, help="tokens each decode streams")
    parser.add_argument("--sim-procs", type=int, default=2, help="engine-simulator processes")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="scheduler heartbeat interval (s)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="scheduler heartbeat timeout (s)")
    parser.add_argument("--scheduler-loop", default="asyncio",
                        help="comma-separated event loops of the scheduler process (its --event-loop: uvloop, "
                             "asyncio); each rank count runs once per loop, in the order given, side by side")
    parser.add_argument("--plot", default="", help="write a PNG of the figures against ranks to this path")
    parser.add_argument("--from-json", default="",
                        help="print (and --plot) a saved `--json` result instead of running")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _compact_proto(events: list[Any]) -> Any:
    """`events` as a CompactWorkerEvents message (the benchmark's events always qualify)."""
    from connectors import compact_events

    compact = compact_events.encode(events)
    if compact is None:
        raise ValueError("bench scale: the simulated events do not qualify for the compact form")
    return compact_events.to_proto(compact)


def _pythonpath() -> dict[str, str]:
    root = os.getcwd()
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "protos"),
                                                       os.environ.get("PYTHONPATH", "")]))


# -- the engine simulator ------------------------------------------------------------------------

@dataclass(slots=True)
class _Rank:
    index: int
    outbox: asyncio.Queue[Any]
    seq: int = 0
    acked: int = 0
    last_sent: float = 0.0
    sending: list[str] = field(default_factory=list)
    recving: list[str] = field(default_factory=list)


class SimEngine:
    """One simulated engine: `tp` raw Control streams and (rank 0) an Engine gRPC server."""

    def __init__(self, index: int, role: str, tp: int, args: argparse.Namespace, stats: dict[str, Any]) -> None:
        self.index = index
        self.engine_id = f"{role[0]}{index}"
        self.role = role
        self.tp = tp
        self.epoch = random.getrandbits(62) | 1
        self.args = args
        self.stats = stats
        self.ranks = [_Rank(r, asyncio.Queue()) for r in range(tp)]
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

    async def start(self, control: str, channel: Any) -> None:
        from bench.events import rank_messages
        from pdserve.v1 import control_pb2 as cpb
        from pdserve.v1 import control_pb2_grpc, engine_pb2_grpc
        from services.common.grpc_server import ServiceServer

        self.server = ServiceServer(["pdserve.v1.Engine"])
        engine_pb2_grpc.add_EngineServicer_to_server(_EngineApi(self), self.server.server)
        port = self.server.bind("127.0.0.1", 0)
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        stub = control_pb2_grpc.ControlStub(channel)
        role = cpb.ROLE_PREFILL if self.role == "prefill" else cpb.ROLE_DECODE
        for rank in self.ranks:
            identity = cpb.RankIdentity(engine_id=self.engine_id, role=role, epoch=self.epoch, tp_rank=rank.index,
                                        tp_size=self.tp, pp_size=1)
            rank.outbox.put_nowait(cpb.RankMessage(hello=cpb.Hello(
                rank=identity, compatibility_hash=_COMPAT, protocol_version=1, engine_address=self.address,
                hash_seed=self.args.hash_seed, block_size=_BLOCK)))
            call = stub.Connect(self._noting_handed(rank_messages(rank.outbox)))
            first = await call.read()
            if first.WhichOneof("payload") != "welcome":
                raise RuntimeError(f"{self.engine_id} rank {rank.index}: no Welcome ({first})")
            self.tasks.append(asyncio.ensure_future(self._read(rank, call)))
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

    async def _read(self, rank: _Rank, call: Any) -> None:
        import grpc

        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                kind = msg.WhichOneof("payload")
                if kind == "ack":
                    rank.acked = msg.ack.seq
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

        rank.seq += 1
        report = cpb.StepReport(seq=rank.seq, finished_sending=rank.sending, finished_recving=rank.recving)
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
        rank.outbox.put_nowait(cpb.RankMessage(report=report))
        self.stats["reports"] += 1

    async def _steps(self, end: float) -> None:
        from bench.events import scrambled_base
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
                rank.last_sent = now
                beat = cpb.Heartbeat()
                if rank.index == 0:
                    beat.load.CopyFrom(cpb.EngineLoad(num_running=self.running, kv_usage=0.1,
                                                      num_free_blocks=1000))
                rank.outbox.put_nowait(cpb.RankMessage(heartbeat=beat))
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
            rank.outbox.put_nowait(None)
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

    stats: dict[str, Any] = {"left": set(), "streams_ended": [], "reports": 0, "kv_wait_ms": {}, "kv_spread_ms": {},
                             "kv_untimed_ranks": 0, "kv_failed": 0}
    engines = []
    for i in range(a.first, a.first + a.count):
        engines.append(SimEngine(i // 2, "prefill" if i % 2 == 0 else "decode", a.tp, a, stats))
    channels = [insecure_channel(a.control) for _ in engines]
    for engine, channel in zip(engines, channels, strict=True):
        await engine.start(a.control, channel)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    stats["reports"] = 0
    end = time.monotonic() + a.duration
    for engine in engines:
        engine.run(end)
    await asyncio.sleep(a.duration)
    unacked = sum(r.seq - r.acked for e in engines for r in e.ranks)
    # the figures go out once the client's last requests finished; the ranks keep beating
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    print(json.dumps({"reports": stats["reports"], "left": sorted(stats["left"]),
                      "streams_ended": stats["streams_ended"], "kv_wait_ms": stats["kv_wait_ms"],
                      "kv_spread_ms": stats["kv_spread_ms"], "kv_untimed_ranks": stats["kv_untimed_ranks"],
                      "kv_failed": stats["kv_failed"], "unacked_reports": unacked,
                      "steps": sum(e.steps for e in engines)}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    stats["stopping"] = True
    for engine in engines:
        await engine.stop()
    for channel in channels:
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
    channel = insecure_channel(a.target)
    events_channel = insecure_channel(a.events)
    stub = generation_pb2_grpc.GenerationStub(channel)
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

    async def one(i: int) -> None:
        prompt = rng.choice(prefixes) + [rng.randrange(10, 1000) for _ in range(half)]
        request = gen_pb.GenerateRequest(request_id=f"s{i}", token_ids=gen_pb.TokenIds(ids=prompt),
                                         sampling=gen_pb.SamplingParams(max_tokens=a.output_tokens,
                                                                        ignore_eos=True))
        t0 = time.monotonic()
        try:
            async for msg in stub.Generate(request, timeout=60):
                if msg.WhichOneof("payload") == "complete":
                    c = msg.complete
                    results.append({"id": f"s{i}", "overhead_ms": c.scheduler_overhead_ms,
                                    "e2e_ms": (time.monotonic() - t0) * 1e3,
                                    "cached": c.usage.cached_tokens})
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
    await channel.close()
    await events_channel.close()


# -- the driver ---------------------------------------------------------------------------------

def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _spawn(argv: list[str], stdin: bool = True) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                            text=True, env=_pythonpath())


def _readline(proc: subprocess.Popen[str], what: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"bench scale: the {what} process exited with {proc.wait()}")
    return line.strip()


def _tell(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _wait_serving(port: int, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"bench scale: the scheduler exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"bench scale: the scheduler did not listen on {port} within {timeout} s")


def _point(args: argparse.Namespace, ranks: int, event_loop: str, transfer_per: str) -> dict[str, Any]:
    from services.common.config import SchedulerConfig
    from services.local_cluster import free_port

    engines = max(2, ranks // args.tp)
    ranks = engines * args.tp
    hash_seed = SchedulerConfig().hash_seed
    port, control, events = free_port(), free_port(), free_port()
    exe = [sys.executable, "-m", "services.common.cli"]
    sched = _spawn([*exe, "scheduler", "--port", str(port), "--control-port", str(control), "--events-port",
                    str(events), "--metrics-port", "0", "--routing-policy", "prefix", "--log-level", "WARNING",
                    "--heartbeat-interval-s", str(args.heartbeat_interval),
                    "--heartbeat-timeout-s", str(args.heartbeat_timeout),
                    "--max-queue-per-engine", "4096", "--event-loop", event_loop,
                    # every request takes the disaggregated path: its transfer is control-plane work
                    "--path-policy", "remote"], stdin=False)
    procs: list[subprocess.Popen[str]] = [sched]
    try:
        _wait_serving(control, sched)
        _wait_serving(port, sched)
        sims = []
        nproc = max(1, min(args.sim_procs, engines))
        for k in range(nproc):
            first, count = k * engines // nproc, (k + 1) * engines // nproc - k * engines // nproc
            sims.append(_spawn([sys.executable, "-m", _MODULE, "--role", "engines", "--control",
                                f"127.0.0.1:{control}", "--first", str(first), "--count", str(count), "--tp",
                                str(args.tp), "--step-hz", str(args.step_hz), "--events-per-step",
                                str(args.events_per_step), "--report-per", args.report_per,
                                "--transfer-per", transfer_per, "--worker-events", args.worker_events,
                                "--duration", str(args.duration), "--heartbeat-interval",
                                str(args.heartbeat_interval), "--hash-seed", hash_seed]))
        procs += sims
        t0 = time.monotonic()
        for sim in sims:
            if _readline(sim, "engine simulator") != "ready":
                raise RuntimeError("bench scale: engine simulator not ready")
        setup_s = time.monotonic() - t0
        client = _spawn([sys.executable, "-m", _MODULE, "--role", "client", "--target", f"127.0.0.1:{port}",
                         "--events", f"127.0.0.1:{events}", "--rate", str(args.request_rate * engines),
                         "--duration", str(args.duration), "--prompt-blocks", str(args.prompt_blocks),
                         "--prefixes", str(args.prefixes), "--output-tokens", str(args.output_tokens)])
        procs.append(client)
        _readline(client, "client")
        time.sleep(1.0)  # a first round of heartbeats
        rss0 = _proc_rss_mib(sched.pid)
        load = [*sims, client]
        cpu0, w0 = _proc_cpu_s(sched.pid), time.monotonic()
        load_cpu0 = sum(_proc_cpu_s(p.pid) for p in load)
        for p in load:
            _tell(p)
        time.sleep(args.duration)
        cpu1, w1 = _proc_cpu_s(sched.pid), time.monotonic()
        load_cpu1 = sum(_proc_cpu_s(p.pid) for p in load)
        rss1 = _proc_rss_mib(sched.pid)
        got = json.loads(_readline(client, "client"))  # after its last request ended
        for sim in sims:
            _tell(sim)
        sim_out = [json.loads(_readline(sim, "engine simulator")) for sim in sims]
        for sim in sims:
            _tell(sim)
        for p in sims:
            p.wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    kv_wait: dict[str, float] = {}
    kv_spread: dict[str, float] = {}
    for s in sim_out:
        kv_wait.update(s["kv_wait_ms"])
        kv_spread.update(s["kv_spread_ms"])
    overheads = [r["overhead_ms"] + kv_wait.get(r["id"], 0.0) for r in got["results"]]
    left = {x for s in sim_out for x in s["left"]}
    ended = [x for s in sim_out for x in s["streams_ended"]]
    seconds = w1 - w0
    return {"ranks": ranks, "event_loop": event_loop, "transfer_per": transfer_per, "engines": engines, "seconds": seconds, "setup_s": setup_s,
            "requests_sent": got["sent"], "requests_ok": len(got["results"]), "request_errors": got["errors"],
            "routing_decisions_per_s": len(got["results"]) / got["seconds"],
            "overhead_p50_ms": percentile(overheads, 50), "overhead_p99_ms": percentile(overheads, 99),
            "scheduler_only_overhead_p50_ms": percentile([r["overhead_ms"] for r in got["results"]], 50),
            "kv_ready_p50_ms": percentile(list(kv_wait.values()), 50),
            "kv_ready_p99_ms": percentile(list(kv_wait.values()), 99),
            "sim_rank_spread_p50_ms": percentile(list(kv_spread.values()), 50),
            "sim_rank_spread_p99_ms": percentile(list(kv_spread.values()), 99),
            "kv_ready_from_first_report": sum(s["kv_untimed_ranks"] for s in sim_out),
            "prefix_hit_rate": (sum(1 for r in got["results"] if r["cached"]) / len(got["results"])
                                if got["results"] else 0.0),
            "events_per_s": got["events"] / got["seconds"],
            "rank_reports_per_s": sum(s["reports"] for s in sim_out) / seconds,
            "unacked_reports_at_end": sum(s["unacked_reports"] for s in sim_out),
            "scheduler_cpu_share": (cpu1 - cpu0) / seconds,
            # the engine simulators and the client on the same cores, for the CPU split
            "load_generator_cpu_share": (load_cpu1 - load_cpu0) / seconds,
            "cpu_ms_per_rank_s": (cpu1 - cpu0) / seconds / ranks * 1e3,
            "rss_mib": rss1, "rss_start_mib": rss0,
            "false_down": len(left) + len(ended), "left": sorted(left)[:10], "streams_ended": ended[:10]}


def _plot(points: list[dict[str, Any]], path: str) -> None:
    """Draws the points of the last (scheduler loop, transfer mode) run against ranks."""
    import matplotlib

    last = (points[-1].get("event_loop"), points[-1].get("transfer_per"))
    points = [p for p in points if (p.get("event_loop"), p.get("transfer_per")) == last]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["ranks"] for p in points]
    panels = [("control-plane overhead per request (ms)", [("p50", "overhead_p50_ms"), ("p99", "overhead_p99_ms")]),
              ("scheduler CPU (ms per rank per s)", [("cpu", "cpu_ms_per_rank_s")]),
              ("throughput (/s)", [("events", "events_per_s"), ("rank reports", "rank_reports_per_s"),
                                   ("routing decisions", "routing_decisions_per_s")]),
              ("scheduler RSS (MiB)", [("rss", "rss_mib")])]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (title, series) in zip(axes, panels, strict=True):
        for label, key in series:
            ax.plot(xs, [p[key] for p in points], marker="o", label=label)
        ax.set_title(title, fontsize=9)
        if series[0][1].startswith("overhead"):
            ax.set_yscale("log")
            for goal, label in ((2.0, "goal p50"), (20.0, "goal p99")):  # issue 18's goals at 1,024 ranks
                ax.axhline(goal, color="grey", linestyle=":", linewidth=1)
                ax.annotate(label, (xs[0], goal), fontsize=6, color="grey", va="bottom")
        ax.set_xlabel("ranks")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        return _report(args, saved["points"], saved.get("config", {}), saved.get("load_average"))
    try:
        sizes = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--ranks: expected comma-separated integers, got {args.ranks!r}") from None
    if not sizes or min(sizes) < 2:
        raise ValueError(f"--ranks: every value must be >= 2, got {args.ranks!r}")
    if args.tp < 1 or args.duration <= 0 or args.step_hz <= 0 or args.sim_procs < 1:
        raise ValueError("--tp and --sim-procs must be >= 1, --duration and --step-hz > 0")
    if not 0 <= args.events_per_step <= 128:
        raise ValueError(f"--events-per-step must be in 0..128, got {args.events_per_step}")
    loops = [x.strip() for x in args.scheduler_loop.split(",") if x.strip()]
    if not loops or any(x not in EVENT_LOOPS for x in loops):
        raise ValueError(f"--scheduler-loop: expected a comma-separated list of {', '.join(EVENT_LOOPS)}, "
                         f"got {args.scheduler_loop!r}")
    transfers = [x.strip() for x in args.transfer_per.split(",") if x.strip()]
    if not transfers or any(x not in ("rank", "engine") for x in transfers):
        raise ValueError(f"--transfer-per: expected a comma-separated list of rank, engine, got {args.transfer_per!r}")
    points = []
    # The smallest point is the baseline: with --repeat (bench/repeats.py) every other run
    # measures the points largest first, so a machine drifting during the runs charges both ends.
    baseline_first = getattr(args, "baseline_first", True)
    for n in sizes if baseline_first else sizes[::-1]:
        for loop in loops:
            for transfer in transfers:
                what = f"{n} ranks, scheduler on {loop}, transfer results per {transfer}"
                print(f"bench scale: {what} (a fresh scheduler; registration, then {args.duration:g} s measured) ...",
                      file=sys.stderr, flush=True)
                points.append(_point(args, n, loop, transfer))
                p = points[-1]
                print(f"bench scale: {what} done: setup {p['setup_s']:.0f} s, overhead p50 "
                      f"{p['overhead_p50_ms']:.2f} ms, false down {p['false_down']}", file=sys.stderr, flush=True)
    points.sort(key=lambda p: sizes.index(p["ranks"]))  # stable: loops and transfer modes keep their order
    config = {k: getattr(args, k) for k in ("scheduler_loop", "tp", "duration", "step_hz", "events_per_step", "report_per",
                                            "worker_events", "transfer_per", "request_rate",
                                            "prompt_blocks", "output_tokens", "sim_procs", "heartbeat_interval",
                                            "heartbeat_timeout")}
    config["baseline_first"] = baseline_first
    return _report(args, points, config, list(os.getloadavg()))


def _report(args: argparse.Namespace, points: list[dict[str, Any]], config: dict[str, Any],
            load: list[float] | None) -> int:
    last = points[-1]  # growth compares points of the last-listed scheduler loop and transfer mode
    first = next(p for p in points if (p.get("event_loop"), p.get("transfer_per"))
                 == (last.get("event_loop"), last.get("transfer_per")))
    growth = {k: (last[k] / first[k] if first[k] else None)
              for k in ("overhead_p50_ms", "overhead_p99_ms", "events_per_s", "cpu_ms_per_rank_s", "rss_mib",
                        "routing_decisions_per_s")}
    result: dict[str, Any] = {k: last[k] for k in ("ranks", "overhead_p50_ms", "overhead_p99_ms", "events_per_s",
                                                   "rss_mib", "false_down")}
    result |= {"points": points, "growth_first_to_last": growth, "config": config, "load_average": load}
    if len({p["ranks"] for p in points}) > 1:
        result["baseline_first"] = config.get("baseline_first", True)
    if args.plot:
        _plot(points, args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"Scheduler at scale: tp {config.get('tp')}, {config.get('step_hz')} steps/s per engine x "
          f"{config.get('events_per_step')} events per rank report, {config.get('request_rate')} req/s per engine "
          f"(load average at the end {load[0] if load else float('nan'):.1f})")
    print(f"  {'ranks':>6} {'loop':>7} {'xfer':>6} {'req/s':>7} {'ovh p50':>8} {'ovh p99':>8} {'events/s':>9} {'reports/s':>10} "
          f"{'CPU ms/rank/s':>14} {'sched/gen CPU':>13} {'RSS MiB':>8} {'false down':>10} {'errors':>7}")
    for p in points:
        print(f"  {p['ranks']:>6} {p.get('event_loop', 'asyncio'):>7} {p.get('transfer_per', config.get('transfer_per', 'rank')):>6} "
              f"{p['routing_decisions_per_s']:>7.1f} {p['overhead_p50_ms']:>8.2f} "
              f"{p['overhead_p99_ms']:>8.2f} {p['events_per_s']:>9.0f} {p['rank_reports_per_s']:>10.0f} "
              f"{p['cpu_ms_per_rank_s']:>14.3f} "
              f"{p['scheduler_cpu_share']:>6.2f}/{p.get('load_generator_cpu_share', float('nan')):<6.2f} "
              f"{p['rss_mib']:>8.0f} {p['false_down']:>10} "
              f"{sum(p['request_errors'].values()):>7}")
    print("  growth first -> last point: " + ", ".join(f"{k} {v:.2f}x" for k, v in growth.items() if v))
    if args.plot:
        print(f"  plot: {args.plot}")
    return 0


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
    a = p.parse_args()
    if a.role == "engines":
        asyncio.run(_sim_main(a))
    else:
        asyncio.run(_client_main(a))


if __name__ == "__main__":
    _main()
