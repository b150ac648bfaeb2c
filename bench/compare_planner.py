"""`pdserve bench serve --compare-planner`: static splits, the role planner and vLLM colocated,
judged by goodput under two SLO pairs, over the phased workload.

Systems (each on the same pinned cores with the same total of compute threads, one after the
other; the order reverses on every other `--repeat` run):
- `static_1p1d`: pdserve, 1 prefill + 1 decode engine, every request on the remote path (the
  engines are pdserve's own, or vLLM's with `--engine vllm`, for every pdserve system).
- `static_2mixed`: the same cluster with both engines set to `mixed` (POST /admin/roles), i.e.
  two colocated engines, each computing its own prompts. These are the only distinct layouts of
  2 engines: 0P+2D routes like 2 mixed (a decode engine with no prefill engine computes its own
  prompts), and 1P+1M leaves the prefill engine idle (a mixed engine takes its requests
  decode-local) — one engine on half the cores, dominated by 2 mixed.
- `planner_<pair>`: a 1P1D cluster with `--planner on` (PLANNER_ARGS: decisions every 0.5 s over
  a 3 s load window, 2 s dwell, 10 % hysteresis, suited to phases of seconds) and that pair's
  targets (`--slo-ttft-ms`, `--slo-itl-ms`); the roles are set back to 1P1D before each probe.
- `vllm_colocated`: `vllm serve` (bench/vllm_compare.py's server) on all the cores; from
  .venv-vllm, else reported under `absent`.

One client for all: open-loop Poisson arrivals streaming `/v1/completions` (bench serve's httpx
client, token ids in and out, greedy, `ignore_eos`). A request still unanswered when no answer
could meet any pair's SLOs any more (TTFT + (tokens - 1) x TPOT after its arrival) is cut off
and counted not good; `requests_lost` counts only requests that failed or ended early.

Goodput per system and pair by search (bench/goodput_search.py; `--rate-range`, `--probes`),
per phase of the phased workload over the same probes. Writes compare_planner.json and
compare_planner.svg (roles over time against the offered load and attainment, bench/roles_svg.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.goodput import ATTAINMENT
from bench.goodput_search import Probe, ProbeRequest, SloPair, curve, goodput, parse_slo_pair, ratio, search
from bench.serve import (
    ALWAYS_REMOTE,
    PHASES,
    Workload,
    _http_stream,
    build_workload,
    cpu_share,
    pin,
    started_cluster,
)
from bench.serve import warm_up_workload as _warm_up

DEFAULT_SLO_PAIRS = ("ttft_tight=ttft:1500,tpot:400", "itl_tight=ttft:6000,tpot:200")
PLANNER_ARGS = {"--planner-interval-s": "0.5", "--planner-window-s": "3", "--planner-min-dwell-s": "2",
                "--planner-hysteresis": "0.1"}
STATIC = {"static_1p1d": ("prefill", "decode"), "static_2mixed": ("mixed", "mixed")}
START_ROLES = STATIC["static_1p1d"]
CUT_OFF_SLACK_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compare-planner", action="store_true",
                        help="every static split of 2 engines, the role planner and vLLM colocated: goodput "
                             "per SLO pair and per phase of --workload phased (bench/compare_planner.py)")
    parser.add_argument("--slo-pair", action="append", default=None, metavar="NAME=ttft:MS,tpot:MS",
                        help=f"--compare-planner: an SLO pair (repeatable; default {' and '.join(DEFAULT_SLO_PAIRS)})")
    parser.add_argument("--rate-range", default="0.25:4",
                        help="--compare-planner: LOW:HIGH requests/s the goodput search bisects (geometrically)")
    parser.add_argument("--probes", type=int, default=3, help="--compare-planner: probes per search")
    parser.add_argument("--planner-systems", default="vllm_colocated,static_1p1d,static_2mixed,planner",
                        help="--compare-planner: which systems to run (comma-separated)")


# -- the client ---------------------------------------------------------------------------------

async def _probe(base_url: str, wl: Workload, rate: float, pairs: list[SloPair]) -> tuple[list[ProbeRequest], float]:
    """The workload at `rate` (open-loop Poisson, seeded), every request cut off at its deadline."""
    import httpx

    assert wl.kinds is not None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        async def one(i: int, arrival: float) -> ProbeRequest:
            n = wl.max_tokens[i]
            body = {"prompt": wl.prompts[i], "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
            deadline = max(p.deadline_s(n) for p in pairs) + CUT_OFF_SLACK_S
            base = ProbeRequest(wl.kinds[i], arrival, n)  # type: ignore[index]
            try:
                r = await asyncio.wait_for(_http_stream(client, body, f"probe-{i}"), deadline)
            except TimeoutError:
                return base  # cut off: no answer could meet an SLO any more
            except Exception as e:  # noqa: BLE001 - a failed request is counted, not raised
                print(f"  request {i} failed: {type(e).__name__}: {e}", file=sys.stderr)
                return ProbeRequest(base.phase, arrival, n, lost=True)
            got = len(r.token_ids)
            tpot = 1000.0 * (r.e2e_s - (r.ttft_s or 0.0)) / (got - 1) if got > 1 else 0.0
            return ProbeRequest(base.phase, arrival, n, r.ttft_s, tpot, got, lost=got != n)

        start = time.perf_counter()
        tasks, rng = [], random.Random(1)
        for i in range(len(wl.prompts)):
            tasks.append(asyncio.create_task(one(i, time.perf_counter() - start)))
            await asyncio.sleep(rng.expovariate(rate))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


def _run_probe(base_url: str, wl: Workload, pairs: list[SloPair], rate: float) -> Probe:
    requests, wall = asyncio.run(_probe(base_url, wl, rate, pairs))
    probe = Probe(rate, requests, wall)
    print(f"  {rate:.3f} rps: " + ", ".join(f"{p.name} {probe.attainment(p):.2f}" for p in pairs)
          + f" ({wall:.1f} s, {probe.lost} lost)", file=sys.stderr)
    return probe


# -- pdserve roles ------------------------------------------------------------------------------

def _admin(base_url: str, body: dict[str, str] | None = None) -> dict[str, Any]:
    root = base_url.removesuffix("/v1")
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{root}/admin/roles", data=data, method="POST" if body else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def set_roles(base_url: str, roles: tuple[str, ...], timeout_s: float = 60.0) -> None:
    """Sets the engines (the one started as prefill first) to `roles` and waits until every
    engine states its role."""
    engines = sorted((e["engine_id"] for e in _admin(base_url)["engines"]),
                     key=lambda engine_id: (not engine_id.startswith("prefill"), engine_id))
    if len(engines) != len(roles):
        raise RuntimeError(f"{len(engines)} engines, {len(roles)} roles asked")
    want = dict(zip(engines, roles, strict=True))
    current = {e["engine_id"]: e["role"] for e in _admin(base_url)["engines"]}
    for engine_id, role in want.items():
        if current[engine_id] != role:
            _admin(base_url, {"engine_id": engine_id, "role": role, "reason": "bench: start of a probe"})
    deadline = time.monotonic() + timeout_s
    while {e["engine_id"]: e["role"] for e in _admin(base_url)["engines"]} != want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"roles not {want} within {timeout_s} s")
        time.sleep(0.2)


def role_timeline(base_url: str, start_wall: float, end_wall: float, roles: dict[str, str]) -> dict[str, Any]:
    """The roles at the probe's start and every change within it (offsets in s from its start)."""
    changes = [c for c in _admin(base_url)["changes"] if start_wall <= c["at"] <= end_wall]
    return {"start": roles, "changes": [{"t_s": round(c["at"] - start_wall, 2), "engine_id": c["engine_id"],
                                          "old": c["old"], "new": c["new"], "source": c["source"]} for c in changes],
            "planner_changes": sum(c["source"] == "planner" for c in changes)}


def _roles_now(base_url: str) -> dict[str, str]:
    return {e["engine_id"]: e["role"] for e in _admin(base_url)["engines"]}


def _pdserve_probe(base_url: str, wl: Workload, pairs: list[SloPair], roles: tuple[str, ...]) -> Callable[[float], Probe]:
    def run(rate: float) -> Probe:
        set_roles(base_url, roles)
        start_roles, start_wall = _roles_now(base_url), time.time()
        probe = _run_probe(base_url, wl, pairs, rate)
        time.sleep(0.3)  # the last heartbeat's role reaches the change log
        probe.extra["roles"] = timeline = role_timeline(base_url, start_wall, time.time(), start_roles)
        probe.role_changes = int(timeline["planner_changes"])
        probe.extra["start_roles"] = sorted(start_roles.values())
        probe.extra["arrivals"] = [[round(r.arrival_s, 2), r.phase, [r.good(p) for p in pairs]] for r in probe.requests]
        return probe
    return run


@contextlib.contextmanager
def _pdserve_cluster(name: str, args: argparse.Namespace, scheduler_args: list[str]) -> Iterator[str]:
    # `--engine vllm` runs the pdserve systems on vLLM engines (their roles change in place too,
    # decision 0047); the default is pdserve's own engine.
    with started_cluster(name, args, num_prefill=1, num_decode=1,
                         scheduler_args=[*ALWAYS_REMOTE, *scheduler_args]) as cluster:
        asyncio.run(_probe(cluster.http_url, _warm_up_kinds(), 50.0, [parse_slo_pair("w=ttft:1e9,tpot:1e9")]))
        yield cluster.http_url


def _warm_up_kinds() -> Workload:
    wl = _warm_up()
    return Workload(wl.prompts, wl.max_tokens, ["warm_up"] * len(wl.prompts))


# -- the systems --------------------------------------------------------------------------------

SearchFn = Callable[[Callable[[float], Probe], list[SloPair]], list[Probe]]


def run_statics(args: argparse.Namespace, wl: Workload, pairs: list[SloPair], find: SearchFn,
                names: list[str]) -> dict[str, dict[str, list[Probe]]]:
    """Both static splits on one cluster (roles set in place), both pairs from each search's probes."""
    out: dict[str, dict[str, list[Probe]]] = {}
    with _pdserve_cluster("static", args, []) as url:
        for name in names:
            print(f"[{name}] roles {STATIC[name]}", file=sys.stderr)
            probes = find(_pdserve_probe(url, wl, pairs, STATIC[name]), pairs)
            out[name] = {p.name: probes for p in pairs}
    return out


def run_planner(args: argparse.Namespace, wl: Workload, pair: SloPair, find: SearchFn) -> list[Probe]:
    """A 1P1D cluster whose planner plans for `pair`; roles back to 1P1D before each probe."""
    targets = ["--planner", "on", *(x for kv in PLANNER_ARGS.items() for x in kv),
               "--slo-ttft-ms", str(pair.slo.ttft_ms), "--slo-itl-ms", str(pair.slo.tpot_ms)]
    with _pdserve_cluster(f"planner_{pair.name}", args, targets) as url:
        print(f"[planner_{pair.name}] planner on, targets {pair.slo}", file=sys.stderr)
        return find(_pdserve_probe(url, wl, [pair], START_ROLES), [pair])


def run_vllm(args: argparse.Namespace, wl: Workload, pairs: list[SloPair], find: SearchFn) -> list[Probe]:
    from bench.vllm_compare import start_vllm

    share = cpu_share(args, 1)
    server = start_vllm("vllm_colocated", args, list(share.cpus), None, Path(args.out) / "logs")
    try:
        server.wait_ready()
        url = f"{server.url}/v1"
        asyncio.run(_probe(url, _warm_up_kinds(), 50.0, [parse_slo_pair("w=ttft:1e9,tpot:1e9")]))
        return find(lambda rate: _run_probe(url, wl, pairs, rate), pairs)
    finally:
        server.stop()


# -- the run ------------------------------------------------------------------------------------

def _parse(args: argparse.Namespace) -> tuple[list[SloPair], float, float, list[str]]:
    pairs = [parse_slo_pair(t) for t in (args.slo_pair or DEFAULT_SLO_PAIRS)]
    if len({p.name for p in pairs}) != len(pairs):
        raise ValueError("--slo-pair: names must differ")
    lo, sep, hi = args.rate_range.partition(":")
    try:
        low, high = float(lo), float(hi)
    except ValueError:
        raise ValueError(f"--rate-range must be LOW:HIGH requests/s, got {args.rate_range!r}") from None
    if not sep or not 0 < low < high:
        raise ValueError(f"--rate-range must be LOW:HIGH with 0 < LOW < HIGH, got {args.rate_range!r}")
    if args.probes < 1:
        raise ValueError(f"--probes must be >= 1, got {args.probes}")
    systems = [s.strip() for s in args.planner_systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - {"vllm_colocated", "planner", *STATIC})
    if unknown or not systems:
        raise ValueError(f"--planner-systems: unknown or none: {unknown}")
    if args.target:
        raise ValueError("--compare-planner starts its own systems; it takes no --target")
    return pairs, low, high, systems


def run_compare_planner(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    pairs, low, high, systems = _parse(args)
    # float32 unless asked: the reference host's CPU has no native bfloat16 (decision 0040's
    # measurements), where bfloat16 is several times slower for both engines.
    args.workload, args.dtype = "phased", args.dtype or "float32"
    wl = build_workload(args, vocab)
    pin(cpu_share(args, 2))
    find: SearchFn = lambda run, ps: search(run, ps, low, high, args.probes)  # noqa: E731
    report: dict[str, Any] = {
        "slo_pairs": {p.name: {"ttft_ms": p.slo.ttft_ms, "tpot_ms": p.slo.tpot_ms} for p in pairs},
        "planner_settings": {k.lstrip("-").replace("-", "_"): float(v) for k, v in PLANNER_ARGS.items()},
        "search": {"rate_range_rps": [low, high], "probes": args.probes, "requests_per_probe": len(wl.prompts)},
        "baseline_first": getattr(args, "baseline_first", True), "absent": {}}
    found: dict[str, dict[str, list[Probe]]] = {}  # system -> pair -> probes
    for step in _steps(args, wl, pairs, systems, find, report):
        try:
            _merge(found, step())
        except Exception as e:  # noqa: BLE001 - one system failing must not lose the others' figures
            traceback.print_exc()
            report["absent"][getattr(step, "name", "?")] = f"failed: {type(e).__name__}: {e}"
            report["failed"] = True
    report.update(summarize(found, pairs))
    return report


def _steps(args: argparse.Namespace, wl: Workload, pairs: list[SloPair], systems: list[str], find: SearchFn,
           report: dict[str, Any]) -> list[Callable[[], dict[str, dict[str, list[Probe]]]]]:
    """The systems to measure, in this run's order (reversed when pdserve goes first)."""
    steps: list[Any] = []
    if "vllm_colocated" in systems:
        from bench.vllm_compare import vllm_available

        missing = vllm_available()
        if missing:
            report["absent"]["vllm_colocated"] = missing
        else:
            steps.append(_named("vllm_colocated", lambda: _each_pair("vllm_colocated", pairs,
                                                                    run_vllm(args, wl, pairs, find))))
    statics = [s for s in STATIC if s in systems]
    if statics:
        order = statics if report["baseline_first"] else statics[::-1]
        steps.append(_named("static", lambda: run_statics(args, wl, pairs, find, order)))
    if "planner" in systems:
        for pair in pairs:
            steps.append(_named(f"planner_{pair.name}", functools.partial(_planner_step, args, wl, pair, find)))
    return steps if report["baseline_first"] else steps[::-1]


def _planner_step(args: argparse.Namespace, wl: Workload, pair: SloPair,
                  find: SearchFn) -> dict[str, dict[str, list[Probe]]]:
    return {"planner": {pair.name: run_planner(args, wl, pair, find)}}


def _named(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    fn.name = name  # type: ignore[attr-defined]
    return fn


def _each_pair(system: str, pairs: list[SloPair], probes: list[Probe]) -> dict[str, dict[str, list[Probe]]]:
    return {system: {p.name: probes for p in pairs}}


def _merge(found: dict[str, dict[str, list[Probe]]], new: dict[str, dict[str, list[Probe]]]) -> None:
    for system, by_pair in new.items():
        found.setdefault(system, {}).update(by_pair)


def summarize(found: dict[str, dict[str, list[Probe]]], pairs: list[SloPair]) -> dict[str, Any]:
    """goodput_rps[pair][system][overall | phase], the planner's ratios, role changes, lost requests."""
    phases = ("overall", *PHASES)
    gp: dict[str, dict[str, dict[str, float]]] = {}
    curves: dict[str, dict[str, Any]] = {}
    for pair in pairs:
        for system, by_pair in found.items():
            if pair.name in by_pair:
                probes = by_pair[pair.name]
                gp.setdefault(pair.name, {})[system] = {ph: goodput(probes, pair, None if ph == "overall" else ph)
                                                        for ph in phases}
                curves.setdefault(pair.name, {})[system] = curve(probes, pair, PHASES)
    # True where no probe failed: the goodput is only a lower bound (the range was too low).
    censored = {pair: {system: all(p["attainment"] >= ATTAINMENT for p in c) for system, c in by_system.items()}
                for pair, by_system in curves.items()}
    out: dict[str, Any] = {"goodput_rps": gp, "goodput_is_lower_bound": censored, "attainment_curves": curves}
    for key in ("planner_vs_best_static", "planner_vs_worst_static", "planner_vs_vllm_colocated"):
        out[key] = {pair: {ph: _versus(key, systems, ph) for ph in phases} for pair, systems in gp.items()}
    out["role_changes"] = {pair: sum(p.role_changes for p in probes)
                           for pair, probes in found.get("planner", {}).items()}
    lost = {system: sum(p.lost for p in {id(p): p for ps in by_pair.values() for p in ps}.values())
            for system, by_pair in found.items()}
    out["requests_lost"] = {**lost, "total": sum(lost.values())}
    by_name = {p.name: p for p in pairs}
    out["timelines"] = {pair: _timeline(probes, by_name[pair]) for pair, probes in found.get("planner", {}).items()}
    return out


def _versus(key: str, systems: dict[str, dict[str, float]], phase: str) -> float | None:
    if "planner" not in systems:
        return None
    statics = [systems[s][phase] for s in STATIC if s in systems]
    if key == "planner_vs_vllm_colocated":
        other = systems["vllm_colocated"][phase] if "vllm_colocated" in systems else None
    else:
        other = (max if key == "planner_vs_best_static" else min)(statics) if statics else None
    return ratio(systems["planner"][phase], other)


def _timeline(probes: list[Probe], pair: SloPair) -> dict[str, Any]:
    """The planner probe the plot shows: the highest rate that met the goal, else the lowest."""
    shown = max(probes, key=lambda p: p.rate_rps if p.attainment(pair) >= ATTAINMENT else -p.rate_rps)
    return {"rate_rps": shown.rate_rps, "wall_s": round(shown.wall_s, 2), **shown.extra}


def run(args: argparse.Namespace) -> int:
    """The whole comparison: compare_planner.json and .svg in --out; exit 1 if a system failed."""
    from bench.roles_svg import write_svg
    from bench.serve import _vocab

    _parse(args)  # bad settings fail before anything starts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"workload": {k: getattr(args, k) for k in ("num_requests", "prompt_len", "output_len", "short_len",
                                                         "seed", "dtype")}}
    report.update(run_compare_planner(args, _vocab(args)))
    report["workload"].update(workload="phased", dtype=args.dtype)
    (out / "compare_planner.json").write_text(json.dumps(report, indent=2))
    write_svg(report["timelines"], out / "compare_planner.svg",
              f"bench serve --compare-planner: {report['workload']['num_requests']} requests per probe, phased")
    print(json.dumps(report) if args.json else json.dumps({k: report[k] for k in (
        "goodput_rps", "planner_vs_best_static", "planner_vs_worst_static", "planner_vs_vllm_colocated",
        "role_changes", "requests_lost", "absent")}, indent=2))
    return 1 if report.get("failed") else 0
