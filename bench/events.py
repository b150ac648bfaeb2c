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

Every side is measured alike by the same subscribers, one stop rule and one loss count
(bench/events_subscribers.py, `delivery`): `lost` = events offered while paced that a
subscriber did not receive by the stop rule, summed over subscribers; `events_per_s` = events a
subscriber received over the paced time plus the drain time used.

Baseline (section "vllm", bench/events_baseline.py): vLLM's own `ZmqEventPublisher` (or, where
vLLM does not import, a labelled re-implementation of its design) fed the same batches
directly, paced at the same rate as each pdserve section that ran, so every ratio compares
equal offered rates.

Overload (section "overload"): the republisher driven unpaced for `--overload-seconds` with one
subscriber that never reads and one that keeps up: publish rate, the stalled subscriber's
largest buffer (bounded by `subscriber_buffer`), resyncs, and the process's current RSS
(VmRSS) before and after.

The load generator (the simulated ranks, the stamped events and their wire forms, the pacing)
is bench/events_load.py; the plot and the text summary bench/events_report.py. This module
runs the sections and is also the entry point of the helper processes (`--role`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from bench.events_baseline import baselines
from bench.events_load import _ranks_main, _stream_ranks_main, drive_batches, removed_count, stamp_events
from bench.events_report import plot_results, print_summary
from bench.events_subscribers import delivery, read_line, spawn, spawn_subscribers, subscribers_main, tell
from connectors.kv_events import KVEventBatch
from services.common.event_loop import EVENT_LOOPS, run_on_loop

SECTIONS = ("pdserve", "decode_per_rank", "direct", "vllm", "overload")
HEADLINE_KEYS = ("events_per_s", "p99_ms", "lost", "vllm.events_per_s", "vllm.p99_ms", "vllm.lost")


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
    parser.add_argument("--scheduler-loop", choices=EVENT_LOOPS, default="asyncio",
                        help="the event loop the pdserve sections' scheduler (in this process) runs on "
                             "(`pdserve scheduler --event-loop`)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default="",
                        help="write a PNG of p99, loss and scheduler CPU per event against the offered rate")
    parser.add_argument("--from-json", nargs="+", default=[], metavar="FILE",
                        help="draw saved `--json` results (one per offered rate and variant) with --plot "
                             "instead of running")


# -- pdserve's sections --------------------------------------------------------------------------

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
    subs = spawn_subscribers(args, f"127.0.0.1:{port}", plane.zmq.bound_endpoint, grpc=True)
    ranks = spawn("--role", "ranks" if args.rank_client == "control-client" else "stream-ranks",
                  "--grpc", f"127.0.0.1:{port}", "--engines", str(args.engines),
                  "--tp", str(args.tp), "--batch-events", str(args.batch_events), "--rate", str(args.rate),
                  "--duration", str(args.duration), "--report-encoding", encoding,
                  "--report-per", args.report_per, "--event-source", args.event_source,
                  "--removed-share", str(args.removed_share))
    try:
        await read_line(subs)
        t0 = time.monotonic()
        await read_line(ranks)
        setup_s = time.monotonic() - t0
        start_batches = plane.republisher.stats().num_batches
        tell(ranks)
        t0, cpu0 = time.monotonic(), time.process_time()
        sent = json.loads(await read_line(ranks))  # pacing has ended
        tell(subs, f"go {sent['offered_events']}")
        got = json.loads(await read_line(subs))  # delivered, or the drain window passed
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
            "scheduler_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],  # uvloop, asyncio
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
    subs = spawn_subscribers(args, f"127.0.0.1:{port}", plane.zmq.bound_endpoint, grpc=True)
    engines = [f"bench-p{e}" for e in range(args.engines)]
    turn = iter(range(1 << 62))

    def publish(batch: KVEventBatch) -> None:
        plane.republisher.publish(engines[next(turn) % len(engines)], 1, batch)

    try:
        await read_line(subs)
        t0 = time.monotonic()
        published = await asyncio.to_thread(drive_batches, publish, args.direct_rate, args.batch_events,
                                            args.duration)
        elapsed = time.monotonic() - t0
        tell(subs, f"go {published}")
        got = json.loads(await read_line(subs))
    finally:
        subs.kill() if subs.poll() is None else None
        await server.stop(0)
        plane.close()
    return {**delivery(got, published, elapsed), "published_events": published,
            "resyncs": plane.republisher.stats().num_resyncs}


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
        baseline, baseline_direct = baselines(args, *ours)
    loop = args.scheduler_loop
    pdserve = run_on_loop(_pdserve_section(args), loop) if "pdserve" in sections else None
    per_rank = run_on_loop(_pdserve_section(args, decode_per_rank=True), loop) if "decode_per_rank" in sections else None
    direct = asyncio.run(_direct_section(args)) if "direct" in sections else None
    if not baseline_first and "vllm" in sections:
        baseline, baseline_direct = baselines(args, *ours)
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
                   "subscriber_decode": args.subscriber_decode, "scheduler_loop": args.scheduler_loop},
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
    print_summary(args, result)
    return 0


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
        asyncio.run(subscribers_main(a.grpc, a.zmq, a.n_grpc, a.n_zmq, a.decode, a.drain))
    elif a.role == "stream-ranks":
        asyncio.run(_stream_ranks_main(a.grpc, a.engines, a.tp, a.batch_events, a.rate, a.duration,
                                       encoding=a.report_encoding, merged=merged, engine_events=engine_events,
                                       removed=removed))
    else:
        _ranks_main(a.grpc, a.engines, a.tp, a.batch_events, a.rate, a.duration, merged=merged,
                    engine_events=engine_events, removed=removed)


if __name__ == "__main__":
    _main()
