"""`pdserve bench scale`: one real scheduler process against simulated engines, 128 -> 1,024 ranks.

Per point (`--ranks`, a comma-separated list; engines = ranks / `--tp`, half prefill, half
decode) the benchmark starts a fresh `pdserve scheduler` process (prefix-aware routing, the
demo model's tokenizer facts) and:

- `--sim-procs` engine-simulator processes. Every simulated rank holds its own real Control
  stream and speaks it as `ControlClient` does (Hello, Welcome, numbered StepReports, queued
  reports coalesced into a ReportBatch, Acks, heartbeats at the scheduler's interval: rank 0's
  with the engine load, riding on its reports where the scheduler takes that; other ranks only
  when they sent nothing since). Each engine steps at `--step-hz`; each step has `--events-per-step` worker-side BlockStored events
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
- `--worker-events compact` (default) sends the events as `compact_worker_events` and
  `compact_engine_events`, what `ControlClient` sends to pdserve's scheduler (which accepts them);
  `packed` as `packed_worker_events` and `engine_events.events` (cheaper for the simulators).
- `--schedulers 1,2` runs every point once per replica count: N `pdserve scheduler` processes,
  every simulated rank connected to every one (its reports to each, transfer results to the
  owning replica alone, as `ControlFanout` does), requests round-robin over them. The CPU
  figures add every replica's; `cpu_ms_per_rank_s_per_replica` divides by N.
- `--saturate-s S` adds a closed loop after the measured phase (`--concurrency` requests in
  flight for S seconds): `routed_per_s` (requests completed per second), what they cost in
  scheduler CPU (`routed_per_scheduler_cpu_s`), and `replica_speedup` (N replicas' routed/s over
  the first count's, at the largest rank count). On a host with fewer free cores than replicas
  plus load generator, the replicas share cores and the speedup shows the host, not the design.
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
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.event_loop import EVENT_LOOPS

_MODULE = "bench.scale_load"  # the simulated engines and the client
# What `--repeat` (bench/repeats.py) summarizes beside ratios: the largest point's figures and
# their growth from the smallest point (the baseline).
HEADLINE_KEYS = ("overhead_p50_ms", "overhead_p99_ms", "events_per_s", "rss_mib", "false_down", "cpu_ms_per_rank_s",
                 "routed_per_s",
                 "growth_first_to_last.overhead_p50_ms", "growth_first_to_last.overhead_p99_ms",
                 "growth_first_to_last.cpu_ms_per_rank_s")


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
    parser.add_argument("--worker-events", choices=["packed", "compact"], default="compact",
                        help="the form of the events in rank reports: compact (compact_worker_events and "
                             "compact_engine_events, what ControlClient sends to pdserve's scheduler; the "
                             "simulator spends more CPU encoding, which on a shared machine shows up in the "
                             "KVReady figures) or packed (packed_worker_events and engine_events.events)")
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
    parser.add_argument("--schedulers", default="1",
                        help="comma-separated scheduler replica counts (each replica its own process, every "
                             "rank connected to every replica, requests round-robin over them); each rank count "
                             "runs once per value, the first value the baseline of `replica_speedup`")
    parser.add_argument("--saturate-s", type=float, default=0.0,
                        help="after the measured phase, this many seconds of a closed loop (`--concurrency` "
                             "requests in flight) measuring requests routed per second (0: skip)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight in the closed loop")
    parser.add_argument("--plot", default="", help="write a PNG of the figures against ranks to this path")
    parser.add_argument("--from-json", default="",
                        help="print (and --plot) a saved `--json` result instead of running")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _pythonpath() -> dict[str, str]:
    root = os.getcwd()
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "protos"),
                                                       os.environ.get("PYTHONPATH", "")]))


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


@dataclass(slots=True)
class _Replica:
    """One `pdserve scheduler` process and its ports."""

    proc: subprocess.Popen[str]
    port: int
    control: int
    events: int


def _start_replicas(args: argparse.Namespace, n: int, event_loop: str) -> list[_Replica]:
    """`n` scheduler replicas, each its own process on ports its OS picks, read back from its
    ports file (ranks connect to every one)."""
    ports_dir = Path(tempfile.mkdtemp(prefix="pdserve-scale-ports-"))
    started = []
    for i in range(n):
        ports_file = ports_dir / f"scheduler-{i}.jsonl"
        proc = _spawn([sys.executable, "-m", "services.common.cli", "scheduler", "--port", "0",
                       "--control-port", "0", "--events-port", "0", "--metrics-port", "0",
                       "--ports-file", str(ports_file),
                       "--routing-policy", "prefix", "--log-level", "WARNING",
                       "--heartbeat-interval-s", str(args.heartbeat_interval),
                       "--heartbeat-timeout-s", str(args.heartbeat_timeout),
                       "--max-queue-per-engine", "4096", "--event-loop", event_loop,
                       # every request takes the disaggregated path: its transfer is control-plane work
                       "--path-policy", "remote"], stdin=False)
        started.append((proc, ports_file))
    replicas = []
    for proc, ports_file in started:
        ports = _reported_ports(ports_file, proc, ("port", "control_port", "events_port"))
        replicas.append(_Replica(proc, ports["port"], ports["control_port"], ports["events_port"]))
    shutil.rmtree(ports_dir, ignore_errors=True)
    for r in replicas:
        _wait_serving(r.control, r.proc)
        _wait_serving(r.port, r.proc)
    return replicas


def _reported_ports(path: Path, proc: subprocess.Popen[str], settings: tuple[str, ...],
                    timeout: float = 60.0) -> dict[str, int]:
    """The ports a scheduler process reported binding (services/common/bound_ports.py)."""
    from services.common.bound_ports import read_ports

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ports = {setting: port for (setting, _), port in read_ports(path).items()}
        if set(settings) <= set(ports):
            return ports
        if proc.poll() is not None:
            raise RuntimeError(f"scheduler exited with status {proc.returncode} before reporting its ports")
        time.sleep(0.05)
    raise TimeoutError(f"scheduler did not report its ports in {timeout:.0f} s")


def _start_sims(args: argparse.Namespace, engines: int, transfer_per: str, replicas: list[_Replica],
                seconds: float) -> list[subprocess.Popen[str]]:
    from services.common.config import SchedulerConfig

    controls = ",".join(f"127.0.0.1:{r.control}" for r in replicas)
    sims = []
    nproc = max(1, min(args.sim_procs, engines))
    for k in range(nproc):
        first, count = k * engines // nproc, (k + 1) * engines // nproc - k * engines // nproc
        sims.append(_spawn([sys.executable, "-m", _MODULE, "--role", "engines", "--control", controls,
                            "--first", str(first), "--count", str(count), "--tp",
                            str(args.tp), "--step-hz", str(args.step_hz), "--events-per-step",
                            str(args.events_per_step), "--report-per", args.report_per,
                            "--transfer-per", transfer_per, "--worker-events", args.worker_events,
                            "--duration", str(seconds), "--heartbeat-interval",
                            str(args.heartbeat_interval), "--hash-seed", SchedulerConfig().hash_seed]))
    return sims


def _cpu(procs: list[subprocess.Popen[str]]) -> float:
    return sum(_proc_cpu_s(p.pid) for p in procs)


def _point(args: argparse.Namespace, ranks: int, event_loop: str, transfer_per: str,
           num_schedulers: int = 1) -> dict[str, Any]:
    engines = max(2, ranks // args.tp)
    ranks = engines * args.tp
    replicas = _start_replicas(args, num_schedulers, event_loop)
    scheds = [r.proc for r in replicas]
    procs: list[subprocess.Popen[str]] = list(scheds)
    try:
        sims = _start_sims(args, engines, transfer_per, replicas, args.duration + args.saturate_s)
        procs += sims
        t0 = time.monotonic()
        for sim in sims:
            if _readline(sim, "engine simulator") != "ready":
                raise RuntimeError("bench scale: engine simulator not ready")
        setup_s = time.monotonic() - t0
        client = _spawn([sys.executable, "-m", _MODULE, "--role", "client",
                         "--target", ",".join(f"127.0.0.1:{r.port}" for r in replicas),
                         "--events", f"127.0.0.1:{replicas[0].events}", "--rate", str(args.request_rate * engines),
                         "--duration", str(args.duration), "--prompt-blocks", str(args.prompt_blocks),
                         "--prefixes", str(args.prefixes), "--output-tokens", str(args.output_tokens),
                         "--saturate-s", str(args.saturate_s), "--concurrency", str(args.concurrency)])
        procs.append(client)
        _readline(client, "client")
        time.sleep(1.0)  # a first round of heartbeats
        rss0 = sum(_proc_rss_mib(p.pid) for p in scheds)
        load = [*sims, client]
        cpu0, w0, load_cpu0 = _cpu(scheds), time.monotonic(), _cpu(load)
        for p in load:
            _tell(p)
        time.sleep(args.duration)
        cpu1, w1, load_cpu1 = _cpu(scheds), time.monotonic(), _cpu(load)
        rss1 = sum(_proc_rss_mib(p.pid) for p in scheds)
        got = json.loads(_readline(client, "client"))  # after its last request ended
        saturated = _saturated(client, scheds, load) if args.saturate_s > 0 else None
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
    point = {"ranks": ranks, "event_loop": event_loop, "transfer_per": transfer_per, "schedulers": num_schedulers,
             "engines": engines, "seconds": w1 - w0, "setup_s": setup_s, "rss_mib": rss1, "rss_start_mib": rss0}
    point |= _figures(got, sim_out, ranks, num_schedulers, (cpu1 - cpu0) / (w1 - w0), (load_cpu1 - load_cpu0) / (w1 - w0))
    if saturated is not None:
        kv_wait = {k: v for sim in sim_out for k, v in sim["kv_wait_ms"].items()}
        overheads = [ms + kv_wait.get(rid, 0.0) for rid, ms in saturated.pop("overhead_ms").items()]
        point |= saturated | {"saturated_overhead_p50_ms": percentile(overheads, 50),
                              "saturated_overhead_p99_ms": percentile(overheads, 99)}
    return point


def _saturated(client: subprocess.Popen[str], scheds: list[subprocess.Popen[str]],
               load: list[subprocess.Popen[str]]) -> dict[str, Any]:
    """The closed-loop phase: requests routed per second with the replicas saturated, and what
    each routed request cost in scheduler CPU (the capacity one core per replica would give)."""
    cpu0, w0, load_cpu0 = _cpu(scheds), time.monotonic(), _cpu(load)
    _tell(client)
    got = json.loads(_readline(client, "client"))
    cpu1, w1, load_cpu1 = _cpu(scheds), time.monotonic(), _cpu(load)
    sched_s = cpu1 - cpu0
    return {"routed_per_s": got["completed"] / got["seconds"], "saturated_requests": got["completed"],
            "saturated_errors": got["errors"], "overhead_ms": got["overhead_ms"],
            "saturated_scheduler_cpu_share": sched_s / (w1 - w0),
            "saturated_load_generator_cpu_share": (load_cpu1 - load_cpu0) / (w1 - w0),
            "routed_per_scheduler_cpu_s": got["completed"] / sched_s if sched_s > 0 else 0.0}


def _figures(got: dict[str, Any], sim_out: list[dict[str, Any]], ranks: int, num_schedulers: int,
             sched_share: float, load_share: float) -> dict[str, Any]:
    """The open-loop phase's figures (`--request-rate`)."""
    ids = {r["id"] for r in got["results"]}  # this phase's requests (not the closed loop's)
    kv_wait: dict[str, float] = {}
    kv_spread: dict[str, float] = {}
    for s in sim_out:
        kv_wait.update((k, v) for k, v in s["kv_wait_ms"].items() if k in ids)
        kv_spread.update((k, v) for k, v in s["kv_spread_ms"].items() if k in ids)
    overheads = [r["overhead_ms"] + kv_wait.get(r["id"], 0.0) for r in got["results"]]
    left = {x for s in sim_out for x in s["left"]}
    ended = [x for s in sim_out for x in s["streams_ended"]]
    return {"requests_sent": got["sent"], "requests_ok": len(got["results"]), "request_errors": got["errors"],
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
            "rank_reports_per_s": sum(s["reports"] for s in sim_out) / max(s["seconds"] for s in sim_out),
            # heartbeat messages of their own (rank 0's ride on its reports where the scheduler takes them)
            "rank_beats_per_s": sum(s.get("beats", 0) for s in sim_out) / max(s["seconds"] for s in sim_out),
            "unacked_reports_at_end": sum(s["unacked_reports"] for s in sim_out),
            # every replica together; the engine simulators and the client on the same cores
            "scheduler_cpu_share": sched_share, "load_generator_cpu_share": load_share,
            "cpu_ms_per_rank_s": sched_share / ranks * 1e3,
            "cpu_ms_per_rank_s_per_replica": sched_share / ranks * 1e3 / num_schedulers,
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
    try:
        replicas = [int(x) for x in args.schedulers.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--schedulers: expected comma-separated integers, got {args.schedulers!r}") from None
    if not replicas or min(replicas) < 1:
        raise ValueError(f"--schedulers: every value must be >= 1, got {args.schedulers!r}")
    if args.saturate_s < 0 or args.concurrency < 1:
        raise ValueError("--saturate-s must be >= 0 and --concurrency >= 1")
    transfers = [x.strip() for x in args.transfer_per.split(",") if x.strip()]
    if not transfers or any(x not in ("rank", "engine") for x in transfers):
        raise ValueError(f"--transfer-per: expected a comma-separated list of rank, engine, got {args.transfer_per!r}")
    points = []
    # The smallest point (and the first replica count) is the baseline: with --repeat
    # (bench/repeats.py) every other run measures the points largest first, so a machine
    # drifting during the runs charges both ends.
    baseline_first = getattr(args, "baseline_first", True)
    order = (lambda xs: xs) if baseline_first else (lambda xs: xs[::-1])
    for n in order(sizes):
        for num in order(replicas):
            for loop in loops:
                for transfer in transfers:
                    points.append(_measure(args, n, loop, transfer, num))
    points.sort(key=lambda p: (sizes.index(p["ranks"]), replicas.index(p["schedulers"])))  # stable
    config = {k: getattr(args, k) for k in ("scheduler_loop", "tp", "duration", "step_hz", "events_per_step", "report_per",
                                            "worker_events", "transfer_per", "request_rate",
                                            "prompt_blocks", "output_tokens", "sim_procs", "heartbeat_interval",
                                            "heartbeat_timeout", "schedulers", "saturate_s", "concurrency")}
    config["baseline_first"] = baseline_first
    return _report(args, points, config, list(os.getloadavg()))


def _measure(args: argparse.Namespace, n: int, loop: str, transfer: str, num_schedulers: int) -> dict[str, Any]:
    what = f"{n} ranks, {num_schedulers} scheduler replica(s) on {loop}, transfer results per {transfer}"
    print(f"bench scale: {what} (fresh schedulers; registration, then {args.duration:g} s measured"
          f"{f' + {args.saturate_s:g} s saturated' if args.saturate_s else ''}) ...", file=sys.stderr, flush=True)
    p = _point(args, n, loop, transfer, num_schedulers)
    routed = f", routed {p['routed_per_s']:.0f}/s saturated" if "routed_per_s" in p else ""
    print(f"bench scale: {what} done: setup {p['setup_s']:.0f} s, overhead p50 {p['overhead_p50_ms']:.2f} ms"
          f"{routed}, false down {p['false_down']}", file=sys.stderr, flush=True)
    return p


def replica_speedups(points: list[dict[str, Any]]) -> dict[str, float]:
    """Requests routed per second (saturated) with N replicas over the first replica count's, at
    the largest rank count (same loop and transfer mode): {"2": 1.8, ...}."""
    last = points[-1]
    same = [p for p in points if "routed_per_s" in p and (p["ranks"], p.get("event_loop"), p.get("transfer_per"))
            == (last["ranks"], last.get("event_loop"), last.get("transfer_per"))]
    if len(same) < 2 or not same[0]["routed_per_s"]:
        return {}
    return {str(p["schedulers"]): p["routed_per_s"] / same[0]["routed_per_s"] for p in same[1:]}


def _report(args: argparse.Namespace, points: list[dict[str, Any]], config: dict[str, Any],
            load: list[float] | None) -> int:
    last = points[-1]  # growth compares points of the last-listed replica count, loop and transfer mode
    first = next(p for p in points if (p.get("event_loop"), p.get("transfer_per"), p.get("schedulers", 1))
                 == (last.get("event_loop"), last.get("transfer_per"), last.get("schedulers", 1)))
    growth = {k: (last[k] / first[k] if first[k] else None)
              for k in ("overhead_p50_ms", "overhead_p99_ms", "events_per_s", "cpu_ms_per_rank_s", "rss_mib",
                        "routing_decisions_per_s")}
    result: dict[str, Any] = {k: last[k] for k in ("ranks", "overhead_p50_ms", "overhead_p99_ms", "events_per_s",
                                                   "rss_mib", "false_down", "cpu_ms_per_rank_s")}
    result["schedulers"] = last.get("schedulers", 1)
    if "routed_per_s" in last:
        result["routed_per_s"] = last["routed_per_s"]
    speedups = replica_speedups(points)
    if speedups:
        result["replica_speedup"] = speedups[str(result["schedulers"])]
        result["replica_speedups"] = speedups
    result |= {"points": points, "growth_first_to_last": growth, "config": config, "load_average": load}
    if len({(p["ranks"], p.get("schedulers", 1)) for p in points}) > 1:
        result["baseline_first"] = config.get("baseline_first", True)
    if args.plot:
        _plot(points, args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"Scheduler at scale: tp {config.get('tp')}, {config.get('step_hz')} steps/s per engine x "
          f"{config.get('events_per_step')} events per rank report, {config.get('request_rate')} req/s per engine "
          f"(load average at the end {load[0] if load else float('nan'):.1f})")
    print(f"  {'ranks':>6} {'repl':>4} {'loop':>7} {'xfer':>6} {'req/s':>7} {'routed/s':>8} {'ovh p50':>8} {'ovh p99':>8} {'events/s':>9} {'reports/s':>10} "
          f"{'CPU ms/rank/s':>14} {'sched/gen CPU':>13} {'RSS MiB':>8} {'false down':>10} {'errors':>7}")
    for p in points:
        print(f"  {p['ranks']:>6} {p.get('schedulers', 1):>4} {p.get('event_loop', 'asyncio'):>7} "
              f"{p.get('transfer_per', config.get('transfer_per', 'rank')):>6} "
              f"{p['routing_decisions_per_s']:>7.1f} {p.get('routed_per_s', float('nan')):>8.1f} "
              f"{p['overhead_p50_ms']:>8.2f} "
              f"{p['overhead_p99_ms']:>8.2f} {p['events_per_s']:>9.0f} {p['rank_reports_per_s']:>10.0f} "
              f"{p['cpu_ms_per_rank_s']:>14.3f} "
              f"{p['scheduler_cpu_share']:>6.2f}/{p.get('load_generator_cpu_share', float('nan')):<6.2f} "
              f"{p['rss_mib']:>8.0f} {p['false_down']:>10} "
              f"{sum(p['request_errors'].values()):>7}")
    print("  growth first -> last point: " + ", ".join(f"{k} {v:.2f}x" for k, v in growth.items() if v))
    if speedups:
        print("  requests routed per second (saturated) over 1 replica's: "
              + ", ".join(f"{n} replicas {v:.2f}x" for n, v in speedups.items()))
    if args.plot:
        print(f"  plot: {args.plot}")
    return 0
