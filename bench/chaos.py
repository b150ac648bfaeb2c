"""`pdserve bench chaos`: kill engines and the scheduler under a steady streaming load and count
what the clients lost.

A local cluster (default 2 prefill + 2 decode engines) serves `--concurrency` client loops, each
streaming greedy requests from a fixed prompt set back to back. Every `--kill-interval` seconds
(jittered ±50 %, and never before the previous victim is back) one component — an engine's
process group (rank processes included) or the scheduler, in rounds of random order that hit
every component once — gets SIGKILL and is restarted at once. With `--tp 2 --rank-kills`
single rank processes die too: the engine must then exit by itself (it cannot go on without a
rank), and is restarted. Clients resume a stream cut by UNAVAILABLE (a dead scheduler) with the
prompt plus the tokens they already hold, as any client of a restarted server would.

The report counts requests sent / completed / failed (by status code) / lost (never answered:
no Complete and no status within the scheduler's deadline plus a grace) / with token errors
(a repeated or skipped chunk index, or any token that differs from the greedy output of the
in-process engine), and the recovery time of every kill: from the SIGKILL until a probe
request sent after it completes (the cluster serves again); `restart` is until the victim is
registered again (back at full strength). Goal: 0 lost, 0 token errors, failures only with a
clear status for requests whose deadline passed.

The baseline, side by side: first `--baseline` seconds of the same load on the same cluster
without kills; the ratios compare completed requests per second and p99 end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from bench.workload import (
    OK,
    REFERENCE_DTYPE,
    StreamOutcome,
    greedy_reference,
    model_vocab_size,
    percentiles,
    process_group_pids,
    random_prompts,
    stream_checked,
    token_errors,
)
from services.client import AsyncClient
from services.local_cluster import ClusterSpec, LocalCluster

ANSWER_GRACE_S = 15.0
RANK_SEP = "/"
RANK_EXIT_TIMEOUT_S = 60.0


def _is_rank_process(pid: int) -> bool:
    """A process an engine spawned for a TP rank (multiprocessing spawn), not its helpers."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@dataclass(slots=True)
class ChaosConfig:
    """One chaos run. `schedule` fixes the kills as (seconds after the load starts, component
    name); without it kills come every `kill_interval_s` ± 50 %, in rounds that kill every
    component (and the scheduler, with `include_scheduler`) once, in random order."""

    duration_s: float = 120.0
    num_prefill: int = 2
    num_decode: int = 2
    kill_interval_s: float = 20.0
    concurrency: int = 6
    num_prompts: int = 16
    prompt_len: tuple[int, int] = (16, 96)
    max_tokens: int = 32
    deadline_s: float = 60.0
    seed: int = 0
    include_scheduler: bool = True
    schedule: list[tuple[float, str]] | None = None
    model: str = ""
    log_dir: str = ""
    lease_s: float = 8.0
    # Seconds of the same load without kills, on the same cluster before the chaos: the baseline.
    baseline_s: float = 0.0
    # Kill on schedule even while earlier victims are still restarting (both decode engines or
    # the scheduler and an engine can be down at once).
    overlap: bool = False
    tp: int = 1
    # With tp > 1, single rank processes (not only whole engines) are victims too.
    rank_kills: bool = False
    prefill_tp: int = 0  # 0: tp (heterogeneous TP: prefill and decode engines of different sizes)
    decode_tp: int = 0  # 0: tp
    # Scheduler replicas; with 2+ every client lists them all (a scheduler kill is survived by
    # the others) and `kill` picks the victims.
    num_schedulers: int = 1
    kill: str = "all"  # all | scheduler (scheduler replicas only) | engines

    def role_tp(self, engine_name: str) -> int:
        """TP size of an engine named `prefill-N` / `decode-N`."""
        own = self.prefill_tp if engine_name.startswith("prefill") else self.decode_tp
        return own or self.tp

    def validate(self) -> None:
        if self.duration_s <= 0 or self.kill_interval_s <= 0 or self.deadline_s <= 0:
            raise ValueError("duration, kill interval and deadline must be > 0")
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError(f"need >= 1 decode and >= 0 prefill engines, got {self.num_decode}, {self.num_prefill}")
        if self.concurrency < 1 or self.num_prompts < 1 or self.max_tokens < 1:
            raise ValueError("concurrency, num_prompts and max_tokens must be >= 1")
        if self.kill not in ("all", "scheduler", "engines") or self.num_schedulers < 1:
            raise ValueError(f"kill must be all, scheduler or engines and schedulers >= 1, got {self.kill}, "
                             f"{self.num_schedulers}")
        if self.tp < 1 or self.prefill_tp < 0 or self.decode_tp < 0:
            raise ValueError(f"tp must be >= 1 (prefill/decode tp >= 0), got {self.tp}, {self.prefill_tp}, "
                             f"{self.decode_tp}")


@dataclass(slots=True)
class Kill:
    """One SIGKILL: when (seconds into the load), whom, and how long until the cluster served a
    new request (`recovery_s`) and the victim was registered again (`restart_s`). A rank
    victim (`decode-0/1`: rank 1 of decode-0) also records when its engine process exited by
    itself (`engine_exit_s`; None: it had not after RANK_EXIT_TIMEOUT_S, then it is killed)."""

    at_s: float
    victim: str
    recovery_s: float | None = None
    restart_s: float | None = None
    engine_exit_s: float | None = None
    # A scheduler replica (with 2+): until it reported ready, its prefix index converged.
    ready_s: float | None = None


@dataclass(slots=True)
class ChaosReport:
    sent: int = 0
    completed: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    token_errors: int = 0
    resumed: int = 0
    migrated: int = 0
    kills: list[Kill] = field(default_factory=list)
    leaks: dict[str, list[str]] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    e2e_ms: dict[str, float] = field(default_factory=dict)
    # Streams resumed after tokens had arrived (with replicas: moved to another replica), and
    # what each resume added to the stream: the gap across it minus the median inter-token gap
    # of the streams that never resumed.
    moved_added_ms: list[float] = field(default_factory=list)
    baseline: ChaosReport | None = None

    @property
    def completed_per_s(self) -> float:
        return round(self.completed / self.wall_s, 3) if self.wall_s else 0.0

    @property
    def recovery_p99_s(self) -> float | None:
        values = [k.recovery_s for k in self.kills if k.recovery_s is not None]
        return percentiles(values)["p99"] if values else None

    @property
    def restart_p99_s(self) -> float | None:
        values = [k.restart_s for k in self.kills if k.restart_s is not None]
        return percentiles(values)["p99"] if values else None

    def to_json(self) -> dict[str, Any]:
        return {
            "sent": self.sent, "completed": self.completed, "failed": sum(self.failed.values()),
            "failed_by_status": self.failed, "lost": self.lost, "token_errors": self.token_errors,
            "recovery_p99_s": self.recovery_p99_s, "restart_p99_s": self.restart_p99_s,
            "resumed": self.resumed, "migrated": self.migrated, "e2e_ms": self.e2e_ms,
            "kills": [{"at_s": round(k.at_s, 2), "victim": k.victim,
                       "recovery_s": None if k.recovery_s is None else round(k.recovery_s, 2),
                       "restart_s": None if k.restart_s is None else round(k.restart_s, 2),
                       **({"ready_s": round(k.ready_s, 2)} if k.ready_s is not None else {}),
                       **({"engine_exit_s": None if k.engine_exit_s is None else round(k.engine_exit_s, 2)}
                          if RANK_SEP in k.victim else {})} for k in self.kills],
            "leaks": self.leaks, "examples": self.examples, "wall_s": round(self.wall_s, 2),
            "completed_per_s": self.completed_per_s,
            # the scheduler-replica view: requests that did not complete, and the longest time
            # from a scheduler kill until a new request was served again
            "requests": self.sent, "requests_lost": self.lost + sum(self.failed.values()),
            "moved": len(self.moved_added_ms),
            "moved_p99_added_ms": percentiles(self.moved_added_ms)["p99"] if self.moved_added_ms else None,
            "takeover_s": max((round(k.recovery_s, 2) for k in self.kills
                               if k.victim.startswith("scheduler") and k.recovery_s is not None), default=None),
            # the longest time from a replica's kill until its restart was ready (index converged)
            "replica_ready_s": max((round(k.ready_s, 2) for k in self.kills if k.ready_s is not None), default=None),
            **self._baseline_json(),
        }

    def _baseline_json(self) -> dict[str, Any]:
        b = self.baseline
        if b is None:
            return {}
        return {
            "baseline_no_kills": {"sent": b.sent, "completed": b.completed, "failed": sum(b.failed.values()),
                                  "lost": b.lost, "token_errors": b.token_errors,
                                  "completed_per_s": b.completed_per_s, "e2e_ms": b.e2e_ms},
            "ratios": {
                "completed_per_s_chaos_over_no_kills": round(self.completed_per_s / max(b.completed_per_s, 1e-9), 2),
                "e2e_p99_chaos_over_no_kills": round(self.e2e_ms.get("p99", 0.0) / max(b.e2e_ms.get("p99", 0.0), 1e-9),
                                                     2),
            },
        }


class ChaosRun:
    """Drives the load, the kills and the probes against one started cluster."""

    def __init__(self, cfg: ChaosConfig, cluster: LocalCluster, prompts: list[list[int]],
                 expected: list[list[int]], progress: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.prompts = prompts
        self.expected = expected
        self.progress = progress
        self.outcomes: list[StreamOutcome] = []
        self.kills: list[Kill] = []
        self.inflight = 0
        self.sent = 0
        self.rng = random.Random(cfg.seed)
        self.t0 = 0.0
        self.client: AsyncClient | str = cluster.targets  # one shared client with replicas (run())

    def _now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        if self.cfg.num_schedulers > 1:
            async with AsyncClient(self.cluster.targets) as client:  # retries take turns over the replicas
                self.client = client
                await self._run()
        else:
            await self._run()

    async def _run(self) -> None:
        self.t0 = time.monotonic()
        stop_at = self.t0 + self.cfg.duration_s
        workers = [asyncio.create_task(self._client_loop(i, stop_at)) for i in range(self.cfg.concurrency)]
        killer = asyncio.create_task(self._killer(stop_at))
        reporter = asyncio.create_task(self._reporter())
        try:
            await asyncio.gather(*workers, killer)
        finally:
            reporter.cancel()

    async def _client_loop(self, worker: int, stop_at: float) -> None:
        n = 0
        while time.monotonic() < stop_at:
            i = self.rng.randrange(len(self.prompts))
            self.sent += 1
            self.inflight += 1
            out = await stream_checked(self.client, self.prompts[i], self.cfg.max_tokens, prompt_index=i,
                                       request_id=f"chaos-{worker}-{n}",
                                       answer_timeout_s=self.cfg.deadline_s + ANSWER_GRACE_S,
                                       budget_s=self.cfg.deadline_s)
            self.inflight -= 1
            self.outcomes.append(out)
            n += 1
            if out.status != OK:
                await asyncio.sleep(0.2)  # a failed client backs off a little before its next request

    def _victims(self) -> list[str]:
        schedulers = self.cluster.scheduler_names if self.cfg.include_scheduler and self.cfg.kill != "engines" else []
        if self.cfg.kill == "scheduler":
            return schedulers
        names = self.cluster.engine_names
        ranks = ([f"{n}{RANK_SEP}{r}" for n in names for r in range(1, self.cfg.role_tp(n))]
                 if self.cfg.rank_kills else [])
        return names + ranks + schedulers

    def _schedule(self) -> list[tuple[float, str]]:
        if self.cfg.schedule is not None:
            return sorted(self.cfg.schedule)
        plan: list[tuple[float, str]] = []
        t = 0.0
        victims: list[str] = []
        while True:
            t += self.cfg.kill_interval_s * self.rng.uniform(0.5, 1.5)
            if t >= self.cfg.duration_s - 5.0:
                return plan
            if not victims:  # rounds in random order: every component dies once per round
                victims = self.rng.sample(self._victims(), len(self._victims()))
            plan.append((t, victims.pop()))

    async def _killer(self, stop_at: float) -> None:
        recovering: list[asyncio.Task[None]] = []
        for at_s, victim in self._schedule():
            await asyncio.sleep(max(0.0, self.t0 + at_s - time.monotonic()))
            if time.monotonic() >= stop_at:
                break
            if not self.cfg.overlap:
                await self._full_strength(300.0)
            kill = Kill(self._now(), victim)
            self.kills.append(kill)
            self.progress(f"t={kill.at_s:5.1f}s SIGKILL {victim} (and restart it)")
            killed_at = time.monotonic()
            if RANK_SEP in victim:
                await self._kill_rank(kill)
            else:
                await asyncio.to_thread(self.cluster.kill, victim, signal.SIGKILL)
            await asyncio.to_thread(self.cluster.restart, self._component(victim))
            recovering.append(asyncio.create_task(self._recover(kill, killed_at)))
            if not self.cfg.overlap:
                await recovering[-1]
        await asyncio.gather(*recovering)

    async def _recover(self, kill: Kill, killed_at: float) -> None:
        victim = self._component(kill.victim)
        probe = asyncio.create_task(self._probe(kill, killed_at))
        await asyncio.to_thread(self._wait_back, victim, 300.0)
        kill.restart_s = time.monotonic() - killed_at
        if self.cluster.is_scheduler(victim) and self.cfg.num_schedulers > 1:
            await asyncio.to_thread(self._wait_ready_replica, victim, 120.0)
            kill.ready_s = time.monotonic() - killed_at
        await probe
        self.progress(f"t={self._now():5.1f}s {victim} back: served again after {kill.recovery_s:.2f}s, "
                          f"registered after {kill.restart_s:.2f}s")

    @staticmethod
    def _component(victim: str) -> str:
        return victim.partition(RANK_SEP)[0]

    async def _kill_rank(self, kill: Kill) -> None:
        """SIGKILLs one spawned rank process of an engine, then waits for the engine's own
        process to notice and exit (it must not linger registered-but-dead)."""
        name, _, rank = kill.victim.partition(RANK_SEP)
        proc = self.cluster.components[name].proc
        assert proc is not None
        ranks = sorted(p for p in process_group_pids(proc.pid) if p != proc.pid and _is_rank_process(p))
        if len(ranks) < int(rank):
            raise RuntimeError(f"{name} has {len(ranks)} rank processes, no rank {rank}")
        os.kill(ranks[int(rank) - 1], signal.SIGKILL)
        started = time.monotonic()
        try:
            await asyncio.to_thread(proc.wait, RANK_EXIT_TIMEOUT_S)
            kill.engine_exit_s = time.monotonic() - started
        except subprocess.TimeoutExpired:
            self.progress(f"{name} still runs {RANK_EXIT_TIMEOUT_S:.0f}s after losing rank {rank}")
        await asyncio.to_thread(self.cluster.kill, name, signal.SIGKILL)

    async def _full_strength(self, timeout: float) -> None:
        await asyncio.to_thread(self.cluster.wait_ready, self.cfg.num_prefill, self.cfg.num_decode, timeout)

    def _wait_ready_replica(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.cluster.replica_ready(name):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{name} not ready (converged) after {timeout:.0f} s")
            time.sleep(0.1)

    def _wait_back(self, victim: str, timeout: float) -> None:
        """Blocks until the restarted victim serves (an engine answers Inspect, the scheduler
        answers GetServerInfo) and the scheduler sees every engine registered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if not self.cluster.is_scheduler(victim):
                    self.cluster.inspect(victim, timeout=2.0)
                self.cluster.wait_ready(self.cfg.num_prefill, self.cfg.num_decode, max(1.0, deadline - time.monotonic()))
                return
            except (grpc.RpcError, RuntimeError):  # RuntimeError: another victim is down (overlap)
                time.sleep(0.2)
        raise TimeoutError(f"{victim} not back after {timeout:.0f} s")

    async def _probe(self, kill: Kill, killed_at: float) -> None:
        """Sends one short request after another until one completes: the cluster serves again."""
        probe = self.prompts[0][:8]
        while True:
            out = await stream_checked(self.client, probe, 2, answer_timeout_s=self.cfg.deadline_s + ANSWER_GRACE_S,
                                       budget_s=0.0)
            if out.status == OK:
                kill.recovery_s = time.monotonic() - killed_at
                return
            await asyncio.sleep(0.1)

    async def _reporter(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            done = Counter(o.status for o in self.outcomes)
            self.progress(f"t={self._now():5.1f}s sent {self.sent}, completed {done[OK]}, "
                          f"not ok {sum(done.values()) - done[OK]}, in flight {self.inflight}, kills {len(self.kills)}")

    def report(self, leaks: dict[str, list[str]], wall_s: float) -> ChaosReport:
        r = ChaosReport(sent=self.sent, kills=self.kills, leaks=leaks, wall_s=wall_s)
        for out in self.outcomes:
            if out.status == OK:
                r.completed += 1
            elif out.status == "LOST":
                r.lost += 1
                r.examples.append(f"{out.request_id}: lost ({out.detail})")
            else:
                r.failed[out.status] = r.failed.get(out.status, 0) + 1
                r.examples.append(f"{out.request_id}: {out.status} {out.detail}")
            errors = token_errors(out, self.expected[out.prompt_index])
            if errors:
                r.token_errors += 1
                r.examples.append(f"{out.request_id}: token error: {'; '.join(errors[:3])}")
            r.resumed += 1 if out.num_resumes else 0
            r.migrated += 1 if out.num_migrations else 0
        r.examples = r.examples[:20]
        r.e2e_ms = percentiles([o.e2e_s * 1000 for o in self.outcomes if o.status == OK])
        r.moved_added_ms = moved_added_ms([o for o in self.outcomes if o.status == OK])
        return r


def moved_added_ms(outcomes: list[StreamOutcome]) -> list[float]:
    """Per stream that resumed after tokens arrived: the gaps across its resumes minus as many
    median inter-token gaps of the streams that never resumed (ms). What moving cost the stream."""
    steady = sorted(b - a for o in outcomes if not o.resumed_at
                    for a, b in zip(o.token_times_s, o.token_times_s[1:], strict=False) if b > a)
    typical = steady[len(steady) // 2] if steady else 0.0
    added = []
    for o in outcomes:
        # A resume that failed again (the replica not back yet) resumes at the same token: one gap.
        gaps = [o.token_times_s[k] - o.token_times_s[k - 1] for k in sorted(set(o.resumed_at))
                if 0 < k < len(o.token_times_s)]
        if gaps:
            added.append(round((sum(gaps) - typical * len(gaps)) * 1000, 1))
    return added


def run_chaos(cfg: ChaosConfig, progress: Callable[[str], None] | None = None) -> ChaosReport:
    """Starts a cluster, runs the load with kills for `cfg.duration_s`, waits for every request's
    answer, checks the engines for leaked blocks, stops the cluster and returns the report."""
    cfg.validate()
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    from engine.demo_model import demo_model_dir

    model = cfg.model or str(demo_model_dir())
    prompts = random_prompts(cfg.seed, cfg.num_prompts, *cfg.prompt_len, model_vocab_size(model))
    say(f"greedy reference for {len(prompts)} prompts x {cfg.max_tokens} tokens (in-process engine)")
    expected = greedy_reference(model, prompts, cfg.max_tokens)
    spec = ClusterSpec(model=model, num_prefill=cfg.num_prefill, num_decode=cfg.num_decode, tp=cfg.tp,
                       prefill_tp=cfg.prefill_tp, decode_tp=cfg.decode_tp, torch_threads=1,
                       dtype=REFERENCE_DTYPE,
                       kv_cache_memory="64MiB", log_dir=cfg.log_dir,
                       scheduler_args=["--default-deadline-s", str(cfg.deadline_s)],
                       engine_args=["--lease-s", str(cfg.lease_s)],
                       env={"PDSERVE_TRANSFER_TIMEOUT_S": "3"}, num_schedulers=cfg.num_schedulers)
    say(f"starting a local cluster: {cfg.num_prefill} prefill + {cfg.num_decode} decode engines")
    with LocalCluster(spec) as cluster:
        asyncio.run(_warm_up(cluster.target, prompts[:cfg.concurrency]))
        baseline = None
        if cfg.baseline_s > 0:
            say(f"baseline: {cfg.baseline_s:.0f} s of the same load without kills")
            baseline = _phase(replace(cfg, duration_s=cfg.baseline_s, schedule=[]), cluster, prompts, expected, say)
            say(f"baseline: {baseline.completed} of {baseline.sent} completed; now with kills")
        report = _phase(cfg, cluster, prompts, expected, say)
    report.baseline = baseline
    return report


async def _warm_up(target: str, prompts: list[list[int]]) -> None:
    """One short request per client loop, so neither phase pays the engines' first steps."""
    await asyncio.gather(*(stream_checked(target, p, 4, budget_s=60.0) for p in prompts))


def _phase(cfg: ChaosConfig, cluster: LocalCluster, prompts: list[list[int]], expected: list[list[int]],
           say: Callable[[str], None]) -> ChaosReport:
    chaos = ChaosRun(cfg, cluster, prompts, expected, say)
    started = time.monotonic()
    asyncio.run(chaos.run())
    wall = time.monotonic() - started
    cluster.wait_ready(cfg.num_prefill, cfg.num_decode, 300.0)
    leaks = cluster.wait_no_leaks(timeout=cfg.lease_s + 15.0)
    return chaos.report(leaks, wall)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load with kills")
    parser.add_argument("--prefill", type=int, default=2, help="prefill engines")
    parser.add_argument("--decode", type=int, default=2, help="decode engines")
    parser.add_argument("--kill-interval", type=float, default=20.0, help="mean seconds between kills (±50 %%)")
    parser.add_argument("--concurrency", type=int, default=6, help="client loops streaming back to back")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (greedy, ignore_eos)")
    parser.add_argument("--deadline", type=float, default=60.0, help="per-request deadline (scheduler default)")
    parser.add_argument("--overlap", action="store_true",
                        help="kill on schedule even while earlier victims are still restarting")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per engine")
    parser.add_argument("--rank-kills", action="store_true",
                        help="with --tp > 1, also kill single rank processes (the engine must exit, then restarts)")
    parser.add_argument("--no-scheduler-kills", action="store_true", help="kill engines only (as --kill engines)")
    parser.add_argument("--schedulers", type=int, default=1,
                        help="scheduler replicas; clients list them all and go on at another when one dies")
    parser.add_argument("--kill", default="all", choices=("all", "scheduler", "engines"),
                        help="victims: every component, scheduler replicas only, or engines only")
    parser.add_argument("--baseline", type=float, default=30.0,
                        help="seconds of the same load without kills first (0: none), for the ratios")
    parser.add_argument("--seed", type=int, default=0, help="workload and kill schedule seed")
    parser.add_argument("--model", default="", help="model directory; default: the demo model")
    parser.add_argument("--out", default="bench-results", help="directory for chaos.json and the cluster logs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ChaosConfig(duration_s=args.duration, num_prefill=args.prefill, num_decode=args.decode,
                      kill_interval_s=args.kill_interval, concurrency=args.concurrency, max_tokens=args.max_tokens,
                      deadline_s=args.deadline, seed=args.seed, include_scheduler=not args.no_scheduler_kills,
                      model=args.model, log_dir=str(out / "logs" / "chaos"), baseline_s=args.baseline,
                      overlap=args.overlap, tp=args.tp, rank_kills=args.rank_kills,
                      num_schedulers=args.schedulers, kill=args.kill)
    report = run_chaos(cfg).to_json()
    (out / "chaos.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    ok = (report["lost"] == 0 and report["token_errors"] == 0 and not report["leaks"]
          and set(report["failed_by_status"]) <= {"DEADLINE_EXCEEDED"})
    return 0 if ok else 1
