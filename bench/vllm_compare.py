"""`pdserve bench serve --compare vllm`: one workload against vLLM and pdserve, side by side.

Systems (each started fresh, measured, stopped, one after another, on the same pinned cores with
the same total of compute threads):
- `vllm_colocated`: one vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`),
  all threads (`VLLM_CPU_OMP_THREADS_BIND` = every core).
- `vllm_pd_nixl`: vLLM's own 1P1D: two servers with `NixlConnector` (`kv_role` kv_producer and
  kv_consumer, `kv_buffer_device` cpu), half the cores each, behind a proxy speaking the protocol of the toy
  proxy vLLM's NixlConnector documentation uses (bench/vllm_pd_proxy.py: prefill with
  `max_tokens` 1 and `do_remote_decode`, then the decode server streams).
- `pdserve`: a pdserve 1P1D cluster with its own engine, every request on the remote path
  (`--path-policy remote`: prefill engine, KV pull, decode engine, as vLLM's 1P1D).
- `pdserve_vllm`: the same cluster with vLLM engines (`--engine vllm`), where the engine
  service's `vllm` backend can run here (`services.engine.registry.check_backend`); otherwise
  reported under `absent` with the reason. vLLM's KV registered in place (zero-copy).
- `pdserve_vllm_staging`: `pdserve_vllm` with `--kv-staging host`, the explicit fallback that
  copies every block through a host mirror: the baseline of the zero-copy path.
A system that fails is reported under `absent` as `failed: …` (the others' figures are kept)
and the command exits 1. Both pdserve systems report `kv_bytes_registered` and
`kv_mirror_bytes` (every engine rank's /metrics, summed: what the data plane registered, and the
mirror's bytes, 0 when in place) and `kv_staging`.

`--vllm-arg KEY=VALUE` goes to every vLLM engine of every system: the servers get it as the
flag `--key-with-dashes VALUE` (`true` alone as `--key`, `false` as `--no-key`), pdserve's vLLM
engines as their `--vllm-arg`, so every vLLM system runs with the same engine settings.

Workload: bench serve's (token-id prompts, lengths, concurrency, greedy, `ignore_eos`). One
client drives every system: bench serve's async httpx client streaming the OpenAI
`/v1/completions` (vLLM's server, the proxy, pdserve's HTTP API), after the same warm-up; token
times are the arrival times of the streamed chunks (with `return_token_ids` a chunk's token
count is exact), so TTFT is the first streamed token received, for every system. Each system's
report has `cpu`: the cores every process and thread of the benchmark used during its workload
(bench/thread_cpu.py); `vllm_pd_nixl` adds `proxy`, its per-request legs. With `--repeat`
(bench/repeats.py) every other run measures the systems in reverse order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.serve import (
    ALWAYS_REMOTE,
    CpuShare,
    Workload,
    _drive_http,
    build_workload,
    cpu_share,
    pin,
    started_cluster,
    warm_up_workload,
)
from bench.thread_cpu import ThreadCpu
from bench.workload import percentiles
from services.local_cluster import free_port

SYSTEMS = ("vllm_colocated", "vllm_pd_nixl", "pdserve", "pdserve_vllm", "pdserve_vllm_staging")
METRICS = ("wall_s", "tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p99_ms", "threads")
# Beside the METRICS: the first inter-token gap (prefill -> decode hand-off) and the rest.
EXTRA_METRICS = ("itl_first_p50_ms", "itl_first_p99_ms", "itl_rest_p99_ms")
KV_METRICS = ("kv_bytes_registered", "kv_mirror_bytes")  # pdserve's systems only
TOKENS_KEY = "_token_ids"  # a measured system's tokens per request, taken out before the report
# Greedy tokens are compared within an engine family: pdserve's own engine computes with other
# kernels than vLLM's, so in bfloat16 a near-tie may fall the other way there without either being wrong.
FAMILY = {"vllm_colocated": "vllm", "vllm_pd_nixl": "vllm", "pdserve_vllm": "vllm", "pdserve_vllm_staging": "vllm",
          "pdserve": "native"}
START_TIMEOUT_S = 1200.0  # ~26 s on a quiet 2-core machine; over 10 min at load average 20+


@dataclass(slots=True)
class Timing:
    """One request as the client saw it."""

    start: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def summarize(timings: list[Timing], wall_s: float, threads: int) -> dict[str, Any]:
    """The issue's per-system figures from client-side timings."""
    ttft = [(t.token_times[0] - t.start) * 1000 for t in timings if t.token_times]
    gaps = [[(b - a) * 1000 for a, b in zip(t.token_times, t.token_times[1:], strict=False)] for t in timings]
    itl = [g for request in gaps for g in request]
    tokens = sum(len(t.token_times) for t in timings)
    p_ttft, p_itl = percentiles(ttft), percentiles(itl)
    # The first gap is where a disaggregated system hands the request from prefill to decode
    # (pdserve streams the prefill engine's first token at once); the rest are decode steps.
    p_first = percentiles([request[0] for request in gaps if request])
    p_rest = percentiles([g for request in gaps for g in request[1:]])
    return {"wall_s": round(wall_s, 2), "tok_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
            "ttft_p50_ms": p_ttft["p50"], "ttft_p90_ms": p_ttft["p90"],
            "itl_p50_ms": p_itl["p50"], "itl_p99_ms": p_itl["p99"], "threads": threads,
            "itl_first_p50_ms": p_first["p50"], "itl_first_p99_ms": p_first["p99"],
            "itl_rest_p99_ms": p_rest["p99"]}


# -- the vLLM OpenAI server -------------------------------------------------------------------

def vllm_available() -> str:
    """'' when vLLM imports here, else why not."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vLLM not importable from {sys.executable} ({e}); run from .venv-vllm (make install-vllm)"
    return ""


@dataclass(slots=True)
class VllmServer:
    """One `vllm.entrypoints.openai.api_server` process on 127.0.0.1."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server {self.name} exited with {self.proc.returncode}; "
                                   f"log: {self.log_path}\n{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server {self.name} not ready within {timeout} s; log: {self.log_path}")

    def stop(self) -> None:
        """Stops the server and its engine-core and worker processes (its process group)."""
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:  # the leader left: make sure its children did too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            break


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_vllm(name: str, args: argparse.Namespace, cores: list[int], kv_transfer: dict[str, Any] | None,
               log_dir: Path) -> VllmServer:
    port = free_port("127.0.0.1")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--seed", "0",
            "--max-model-len", str(_max_model_len(args)), "--served-model-name", "bench"]
    if kv_transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer)]
    argv += server_flags(getattr(args, "vllm_arg", []))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port("127.0.0.1")), "VLLM_LOGGING_LEVEL": "WARNING"}
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    print(f"[{name}] vLLM server on port {port}, cores {cores} (log {log_path})", file=sys.stderr)
    return VllmServer(name, port, proc, log_path)


def server_flags(vllm_arg: list[str]) -> list[str]:
    """`--vllm-arg KEY=VALUE` items as the vLLM server's command-line flags (module docstring).

    Raises ValueError for a malformed item or a name the benchmark sets itself (model, dtype...).
    """
    from services.common.config import check_vllm_args, parse_vllm_args

    args = parse_vllm_args(list(vllm_arg))
    check_vllm_args(args)
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        else:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


def _max_model_len(args: argparse.Namespace) -> int:
    hi_prompt = int(args.prompt_len.partition(":")[2] or args.prompt_len)
    hi_out = int(args.output_len.partition(":")[2] or args.output_len)
    return max(256, 1 << (hi_prompt + hi_out).bit_length())


def drive(base_url: str, wl: Workload, concurrency: int) -> tuple[list[Timing], float]:
    """The one client of every system: bench serve's async httpx client streaming
    `/v1/completions` (token ids in and out, greedy, `ignore_eos`), closed loop at
    `concurrency`. A request's token times are the arrival of the chunks that carry them, from
    the request's start, so TTFT is the first streamed token received, for every system."""
    results, wall = asyncio.run(_drive_http(base_url, wl, concurrency, 0.0))
    for r, n in zip(results, wl.max_tokens, strict=True):
        if len(r.token_times_s) != n:
            raise RuntimeError(f"asked for {n} tokens, streamed {len(r.token_times_s)}")
    return [Timing(0.0, list(r.token_times_s), list(r.token_ids)) for r in results], wall


def warm_up(base_url: str) -> None:
    """The same warm-up for every system (bench serve's): two 24-token prompts, 2 tokens each."""
    asyncio.run(_drive_http(base_url, warm_up_workload(), 2, 0.0))


def measure(base_url: str, wl: Workload, concurrency: int, threads: int) -> dict[str, Any]:
    """Warm-up, then the workload, with the CPU every process of the benchmark used meanwhile."""
    warm_up(base_url)
    cpu0 = ThreadCpu.sample()
    timings, wall = drive(base_url, wl, concurrency)
    return {**summarize(timings, wall, threads), "cpu": ThreadCpu.sample().since(cpu0, wall),
            TOKENS_KEY: [t.token_ids for t in timings]}


def run_vllm_colocated(args: argparse.Namespace, wl: Workload, share: CpuShare, log_dir: Path) -> dict[str, Any]:
    server = start_vllm("vllm_colocated", args, list(share.cpus), None, log_dir)
    try:
        server.wait_ready()
        return measure(f"{server.url}/v1", wl, args.concurrency, share.total_threads)
    finally:
        server.stop()


def run_vllm_pd(args: argparse.Namespace, wl: Workload, share: CpuShare, log_dir: Path) -> dict[str, Any]:
    """vLLM's 1P1D as its NixlConnector documentation sets it up: two servers with
    `NixlConnector` (`kv_role` kv_producer / kv_consumer; `kv_buffer_device` cpu, the CPU
    platform's), half the cores each, behind the toy proxy's protocol (bench/vllm_pd_proxy.py)."""
    # vLLM 0.32 deprecates kv_both for NixlConnector: kv_producer on prefill, kv_consumer on decode.
    kv = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    half = len(share.cpus) // 2
    servers = [start_vllm("vllm_prefill", args, list(share.cpus[:half]), {**kv, "kv_role": "kv_producer"}, log_dir),
               start_vllm("vllm_decode", args, list(share.cpus[half:]), {**kv, "kv_role": "kv_consumer"}, log_dir)]
    proxy: VllmServer | None = None
    try:
        for s in servers:
            s.wait_ready()
        proxy = start_proxy(servers[0].url, servers[1].url, log_dir)
        proxy.wait_ready(60.0)
        out = measure(f"{proxy.url}/v1", wl, args.concurrency, share.total_threads)
        out["proxy"] = proxy_legs(proxy.url, len(wl.prompts))
        return out
    finally:
        for s in [*([proxy] if proxy else []), *servers]:
            s.stop()


def start_proxy(prefill_url: str, decode_url: str, log_dir: Path) -> VllmServer:
    port = free_port("127.0.0.1")
    log_path = log_dir / "vllm_pd_proxy.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bench.vllm_pd_proxy", "--port", str(port),
                                 "--prefill", prefill_url, "--decode", decode_url],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return VllmServer("vllm_pd_proxy", port, proc, log_path)


def proxy_legs(url: str, n: int) -> dict[str, Any]:
    """p50/p90 of the proxy's per-request legs over the workload's last `n` requests (ms from
    the request's arrival): the prefill server's answer, the decode server's first byte."""
    with urllib.request.urlopen(f"{url}/proxy_stats", timeout=10) as resp:
        legs = json.loads(resp.read())[-n:]
    return {key: percentiles([e[key] for e in legs if key in e])
            for key in ("prefill_ms", "decode_first_byte_ms", "done_ms")}


def _prefix_cache_counts(url: str) -> tuple[float, float]:
    """vLLM's cumulative prefix-cache (hits, queries) in tokens, from its /metrics."""
    hits = queries = 0.0
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("vllm:prefix_cache_hits_total"):
                hits += float(value)
            elif name.startswith("vllm:prefix_cache_queries_total"):
                queries += float(value)
    return hits, queries


def run_vllm_phases(args: argparse.Namespace, wl: Workload, share: CpuShare, log_dir: Path) -> dict[str, Any]:
    """The workload's prefill-only and decode-only times on one 1P1D engine's share of the cores.

    One vLLM server on half the cores (what each side of a 1P1D split gets) runs the workload
    twice at the same concurrency: once with `max_tokens` 1 (prefill only: every prompt computed,
    cold cache), then in full, when vLLM's prefix cache holds every prompt's full blocks (decode
    only, less each prompt's last partial block; the measured cache hit share says how much).
    With perfect pipelining a 1P1D split of the cores takes at best max(prefill, decode), and
    colocated on all the cores at best (prefill + decode) / 2 (perfect scaling over twice the
    cores), so `disagg_vs_colocated_bound` = (prefill + decode) / (2 max(prefill, decode)) bounds
    a disaggregated system's throughput relative to a colocated one on these cores.
    """
    cores = list(share.cpus[:max(1, len(share.cpus) // 2)])
    server = start_vllm("vllm_phases", args, cores, None, log_dir)
    try:
        server.wait_ready()
        warm_up(f"{server.url}/v1")
        _, prefill_s = drive(f"{server.url}/v1", Workload(wl.prompts, [1] * len(wl.prompts)), args.concurrency)
        hits0, queries0 = _prefix_cache_counts(server.url)
        _, decode_s = drive(f"{server.url}/v1", wl, args.concurrency)
        hits1, queries1 = _prefix_cache_counts(server.url)
    finally:
        server.stop()
    return {"cores": len(cores), "prefill_only_s": round(prefill_s, 2), "decode_only_s": round(decode_s, 2),
            "decode_pass_prefix_hit_rate": round((hits1 - hits0) / max(queries1 - queries0, 1.0), 3),
            "disagg_vs_colocated_bound": round((prefill_s + decode_s) / (2 * max(prefill_s, decode_s)), 3)}


# -- pdserve ------------------------------------------------------------------------------------

def pdserve_vllm_engine_available() -> str:
    """'' when the engine service's `vllm` backend can run here, else why not."""
    from services.engine.registry import BackendUnavailable, check_backend

    try:
        check_backend("vllm")
    except BackendUnavailable as e:
        return f"pdserve with vLLM engines unavailable: {e}"
    return ""


def run_pdserve(args: argparse.Namespace, wl: Workload, share: CpuShare, engine: str,
                kv_staging: str = "none") -> dict[str, Any]:
    """pdserve 1P1D with `engine` (native | vllm) behind its scheduler (bench serve's cluster),
    every request on the remote path (prefill engine -> KV pull -> decode engine, as vLLM's
    1P1D), driven over its OpenAI HTTP API by the same client as the vLLM systems; with the
    KV bytes its engines registered (`engine_kv_bytes`)."""
    mode_args = argparse.Namespace(**{**vars(args), "engine": engine})
    name = "pdserve" if engine == "native" else "pdserve_vllm" + ("_staging" if kv_staging != "none" else "")
    engine_args = ["--kv-staging", kv_staging] if kv_staging != "none" else []
    with started_cluster(name, mode_args, num_prefill=1, scheduler_args=ALWAYS_REMOTE,
                         engine_args=engine_args) as cluster:
        out = measure(cluster.http_url, wl, args.concurrency, share.total_threads)
        return {**out, **engine_kv_bytes(cluster), "kv_staging": kv_staging}


KV_BYTES_METRICS = {"pdserve_engine_kv_bytes_registered": "kv_bytes_registered",
                    "pdserve_engine_kv_mirror_bytes": "kv_mirror_bytes"}


def engine_kv_bytes(cluster: Any) -> dict[str, int]:
    """`kv_bytes_registered` and `kv_mirror_bytes`: the sums over every engine rank's /metrics
    (rank r of an engine serves them on its metrics port + r). Raises RuntimeError when no rank
    exports them: a figure the report claims must have been read."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = dict.fromkeys(KV_BYTES_METRICS.values(), 0.0)
    found = 0
    for name in cluster.engine_names:
        base = cluster.components[name].metrics_port
        for rank in range(engine_tp(cluster, name)):
            url = f"http://127.0.0.1:{base + rank}/metrics"
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in KV_BYTES_METRICS:
                        sums[KV_BYTES_METRICS[sample.name]] += sample.value
                        found += 1
    if not found:
        raise RuntimeError("no engine rank exports pdserve_engine_kv_bytes_registered")
    return {key: int(value) for key, value in sums.items()}


def engine_tp(cluster: Any, name: str) -> int:
    spec = cluster.spec
    tp = spec.prefill_tp if name.startswith("prefill") else spec.decode_tp
    return tp or spec.tp


# -- the run ------------------------------------------------------------------------------------

def run_compare(args: argparse.Namespace) -> int:
    if args.target:
        raise ValueError("--compare vllm starts its own systems; it takes no --target")
    server_flags(args.vllm_arg)  # a bad --vllm-arg fails here, before any system starts
    unknown = sorted(set(args.systems.split(",")) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"--systems: unknown {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    from bench.serve import _vocab

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.dtype = args.dtype or "bfloat16"  # one dtype for every system; vLLM's default for the demo model
    wl = build_workload(args, _vocab(args))
    colocated, disaggregated = cpu_share(args, 1), cpu_share(args, 2)
    pin(colocated)
    report: dict[str, Any] = {"systems": {}, "absent": {}, "workload": {k: getattr(args, k) for k in (
        "num_requests", "concurrency", "prompt_len", "output_len", "seed", "dtype")},
        "threads": {}}
    no_vllm, no_engine = vllm_available(), pdserve_vllm_engine_available()
    plans = [("vllm_colocated", no_vllm, colocated, lambda: run_vllm_colocated(args, wl, colocated, out / "logs")),
             ("vllm_pd_nixl", no_vllm, disaggregated, lambda: run_vllm_pd(args, wl, disaggregated, out / "logs")),
             ("pdserve", "", disaggregated, lambda: run_pdserve(args, wl, disaggregated, "native")),
             ("pdserve_vllm", no_engine, disaggregated, lambda: run_pdserve(args, wl, disaggregated, "vllm")),
             ("pdserve_vllm_staging", no_engine, disaggregated,
              lambda: run_pdserve(args, wl, disaggregated, "vllm", kv_staging="host"))]
    # SIGTERM (timeout, CI) unwinds like Ctrl-C, so every started server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report["baseline_first"] = getattr(args, "baseline_first", True)
    references: dict[str, tuple[str, list[list[int]]]] = {}  # family -> (reference system, its tokens)
    for name, missing, share, measure in plans if report["baseline_first"] else plans[::-1]:
        if name not in args.systems.split(","):
            continue
        if missing:
            report["absent"][name] = missing
            print(f"[{name}] absent: {missing}", file=sys.stderr)
            continue
        try:
            report["systems"][name] = measure()
        except Exception as e:  # noqa: BLE001 - one system failing must not lose the others' figures
            traceback.print_exc()
            report["absent"][name] = f"failed: {type(e).__name__}: {e}"
            report["failed"] = True
            continue
        report["threads"][name] = share.describe()
        judge_tokens(report, name, report["systems"][name].pop(TOKENS_KEY), references)
        print(f"[{name}] {report['systems'][name]}", file=sys.stderr)
        (out / "serve_compare.json").write_text(json.dumps(report, indent=2))  # long runs keep what they have
    if args.phases and not no_vllm:
        try:
            report["phases"] = run_vllm_phases(args, wl, disaggregated, out / "logs")
            print(f"[vllm_phases] {report['phases']}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - the systems' figures stand without it
            traceback.print_exc()
            report["absent"]["vllm_phases"] = f"failed: {type(e).__name__}: {e}"
            report["failed"] = True
    report["ratios"] = ratios(report["systems"])
    (out / "serve_compare.json").write_text(json.dumps(report, indent=2))
    if report["systems"]:
        plot(report, out / "serve_compare.png")
    print(json.dumps(report) if args.json else table(report))
    return 1 if report.get("failed") else 0


def token_difference(tokens: list[list[int]], reference: list[list[int]]) -> str | None:
    """None when every request's greedy tokens are the reference's; else how many differ and where
    the first one does."""
    differing = [i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b]
    if not differing:
        return None
    i = differing[0]
    at = next((j for j, (a, b) in enumerate(zip(tokens[i], reference[i], strict=False)) if a != b),
              min(len(tokens[i]), len(reference[i])))
    return f"{len(differing)} of {len(tokens)} requests differ (first: request {i} at token {at})"


def judge_tokens(report: dict[str, Any], name: str, tokens: list[list[int]],
                 references: dict[str, tuple[str, list[list[int]]]]) -> None:
    """Sets the system's `identical` (and `reference`): the first system measured of its engine
    family is that family's reference run; a later one whose greedy tokens differ from it is
    flagged under `not_identical` and fails the command (its timings are of other work)."""
    family = FAMILY[name]
    if family not in references:
        references[family] = (name, tokens)
        report["systems"][name].update(identical=True, reference=name)
        return
    reference, expected = references[family]
    difference = token_difference(tokens, expected)
    report["systems"][name].update(identical=difference is None, reference=reference)
    if difference is not None:
        report.setdefault("not_identical", {})[name] = f"{difference} against {reference}"
        report["failed"] = True
        print(f"[{name}] NOT IDENTICAL to {reference}: {difference}", file=sys.stderr)


RATIO_PAIRS = [(p, v) for p in ("pdserve", "pdserve_vllm") for v in ("vllm_colocated", "vllm_pd_nixl")] + [
    ("pdserve_vllm", "pdserve_vllm_staging")]


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each pdserve system against each vLLM system measured, and zero-copy against the staging
    copy: throughput (> 1: the first faster), TTFT p50 and ITL p99 (< 1: the first sooner)."""
    out: dict[str, float] = {}
    for p, v in RATIO_PAIRS:
        if p not in systems or v not in systems:
            continue
        for key, name in (("tok_s", "tok_s"), ("ttft_p50_ms", "ttft_p50"), ("itl_p99_ms", "itl_p99")):
            if systems[v].get(key):
                out[f"{p}_over_{v}_{name}_ratio"] = round(systems[p][key] / systems[v][key], 3)
    return out


def table(report: dict[str, Any]) -> str:
    columns = METRICS + ("identical",) + EXTRA_METRICS + KV_METRICS
    head = f"{'system':<16}" + "".join(f"{m:>17}" for m in columns)
    rows = [f"{name:<16}" + "".join(f"{r.get(m, ''):>17}" for m in columns) for name, r in report["systems"].items()]
    absent = [f"{name:<16} absent: {why}" for name, why in report["absent"].items()]
    absent += [f"{name:<16} NOT IDENTICAL: {why}" for name, why in report.get("not_identical", {}).items()]
    threads = [f"  {name}: {desc}" for name, desc in report["threads"].items()]
    phases = [f"phases (vLLM on {p['cores']} core(s)): prefill only {p['prefill_only_s']} s, decode only "
              f"{p['decode_only_s']} s (prefix hit rate {p['decode_pass_prefix_hit_rate']}); a 1P1D split's "
              f"throughput is at most {p['disagg_vs_colocated_bound']}x colocated's"
              for p in ([report["phases"]] if "phases" in report else [])]
    return "\n".join([head, *rows, *absent, "threads (same pinned cores for every system):", *threads, *phases])


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["systems"])
    panels = [("TTFT (ms, log)", {"ttft_p50_ms": "p50", "ttft_p90_ms": "p90"}),
              ("ITL (ms, log)", {"itl_p50_ms": "p50", "itl_p99_ms": "p99", "itl_rest_p99_ms": "p99 after 1st gap"}),
              ("throughput (tok/s)", {"tok_s": ""}), ("wall time (s, log)", {"wall_s": ""})]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 3.8))
    for ax, (title, keys) in zip(axes, panels, strict=True):
        width = 0.8 / len(keys)
        for j, (key, label) in enumerate(keys.items()):
            ax.bar([i + j * width for i in range(len(names))], [report["systems"][n].get(key, 0) for n in names],
                   width, label=label or None)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=20, fontsize=8)
        ax.set_title(title)
        if "log" in title:
            ax.set_yscale("log")
        if len(keys) > 1:
            ax.legend(fontsize=7)
    w = report["workload"]
    fig.suptitle(f"bench serve --compare vllm: {w['num_requests']} requests, prompts {w['prompt_len']}, "
                 f"outputs {w['output_len']}, concurrency {w['concurrency']}, {w['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
