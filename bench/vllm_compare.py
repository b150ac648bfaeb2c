"""`pdserve bench serve --compare vllm`: one workload against vLLM and pdserve, side by side.

Systems (each started fresh, measured, stopped, one after another, on the same pinned cores with
the same total of compute threads):
- `vllm_colocated`: one vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`),
  all threads (`VLLM_CPU_OMP_THREADS_BIND` = every core).
- `vllm_pd_nixl`: vLLM's own 1P1D: two servers with `NixlConnector` (`kv_role` kv_both,
  `kv_buffer_device` cpu), half the cores each; per request the client (the role of vLLM's
  toy proxy) sends the prompt to the prefill server with `max_tokens` 1 and
  `kv_transfer_params {"do_remote_decode": true}`, then streams from the decode server with
  the `kv_transfer_params` the prefill returned. TTFT counts from the prefill call.
- `pdserve`: a pdserve 1P1D cluster with its own engine (bench serve's disaggregated mode).
- `pdserve_vllm`: the same cluster with vLLM engines (`--engine vllm`), where the engine
  service's `vllm` backend can run here (`services.engine.registry.check_backend`); otherwise
  reported under `absent` with the reason. A system that fails is reported under `absent` as
  `failed: …` (the others' figures are kept) and the command exits 1.

`--vllm-arg KEY=VALUE` goes to every vLLM engine of every system: the servers get it as the
flag `--key-with-dashes VALUE` (`true` alone as `--key`, `false` as `--no-key`), pdserve's vLLM
engines as their `--vllm-arg`, so every vLLM system runs with the same engine settings.

Workload: bench serve's (token-id prompts, lengths, concurrency, greedy, `ignore_eos`). vLLM is
driven through its streaming `/v1/completions`; token times are the arrival times of the
streamed chunks (with `return_token_ids` a chunk's token count is exact).
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

from bench.serve import CpuShare, Workload, build_workload, cpu_share, pin, run_mode_results
from bench.workload import percentiles
from services.local_cluster import free_port

SYSTEMS = ("vllm_colocated", "vllm_pd_nixl", "pdserve", "pdserve_vllm")
METRICS = ("wall_s", "tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p99_ms", "threads")
# Beside the METRICS: the first inter-token gap (prefill -> decode hand-off) and the rest.
EXTRA_METRICS = ("itl_first_p50_ms", "itl_first_p99_ms", "itl_rest_p99_ms")
START_TIMEOUT_S = 1200.0  # ~26 s on a quiet 2-core machine; over 10 min at load average 20+


@dataclass(slots=True)
class Timing:
    """One request as the client saw it."""

    start: float
    token_times: list[float] = field(default_factory=list)


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


def _post(url: str, body: dict[str, Any], timeout: float = 600.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def stream_completion(url: str, prompt: list[int], max_tokens: int, timing: Timing,
                      kv_transfer_params: dict[str, Any] | None = None) -> None:
    """Streams one greedy completion, appending each token's arrival time to `timing`."""
    body: dict[str, Any] = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    with _post(f"{url}/v1/completions", body) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            for choice in json.loads(line[5:]).get("choices", []):
                ids = choice.get("token_ids")
                n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
                timing.token_times.extend([now] * n)
    if len(timing.token_times) != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, streamed {len(timing.token_times)}")


def remote_prefill(url: str, prompt: list[int]) -> dict[str, Any]:
    """vLLM's P/D first leg: the prefill server computes the prompt and returns where its KV is."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True}}
    with _post(f"{url}/v1/completions", body) as resp:
        params = json.loads(resp.read()).get("kv_transfer_params")
    if not params:
        raise RuntimeError("the prefill server returned no kv_transfer_params (is NixlConnector configured?)")
    return dict(params)


def drive_vllm(wl: Workload, concurrency: int, prefill_url: str | None, decode_url: str) -> tuple[list[Timing], float]:
    """Closed loop at `concurrency`; with `prefill_url` each request goes P then D."""
    def one(i: int) -> Timing:
        timing = Timing(time.perf_counter())
        params = remote_prefill(prefill_url, wl.prompts[i]) if prefill_url else None
        stream_completion(decode_url, wl.prompts[i], wl.max_tokens[i], timing, params)
        print(f"\r  request {i + 1}/{len(wl.prompts)}", end="", file=sys.stderr, flush=True)
        return timing

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        timings = list(pool.map(one, range(len(wl.prompts))))
    print(file=sys.stderr)
    return timings, time.perf_counter() - start


def _warm_up(prefill_url: str | None, decode_url: str) -> None:
    warm = Workload([[100 + i for i in range(24)]], [2])
    drive_vllm(warm, 1, prefill_url, decode_url)


def run_vllm_colocated(args: argparse.Namespace, wl: Workload, share: CpuShare, log_dir: Path) -> dict[str, Any]:
    server = start_vllm("vllm_colocated", args, list(share.cpus), None, log_dir)
    try:
        server.wait_ready()
        _warm_up(None, server.url)
        timings, wall = drive_vllm(wl, args.concurrency, None, server.url)
    finally:
        server.stop()
    return summarize(timings, wall, share.total_threads)


def run_vllm_pd(args: argparse.Namespace, wl: Workload, share: CpuShare, log_dir: Path) -> dict[str, Any]:
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    half = len(share.cpus) // 2
    servers = [start_vllm("vllm_prefill", args, list(share.cpus[:half]), kv, log_dir),
               start_vllm("vllm_decode", args, list(share.cpus[half:]), kv, log_dir)]
    try:
        for s in servers:
            s.wait_ready()
        _warm_up(servers[0].url, servers[1].url)
        timings, wall = drive_vllm(wl, args.concurrency, servers[0].url, servers[1].url)
    finally:
        for s in servers:
            s.stop()
    return summarize(timings, wall, share.total_threads)


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
        _warm_up(None, server.url)
        _, prefill_s = drive_vllm(Workload(wl.prompts, [1] * len(wl.prompts)), args.concurrency, None, server.url)
        hits0, queries0 = _prefix_cache_counts(server.url)
        _, decode_s = drive_vllm(wl, args.concurrency, None, server.url)
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


def run_pdserve(args: argparse.Namespace, wl: Workload, share: CpuShare, engine: str) -> dict[str, Any]:
    """pdserve 1P1D with `engine` (native | vllm) behind its scheduler (bench serve's cluster)."""
    mode_args = argparse.Namespace(**{**vars(args), "engine": engine})
    results, wall, _ = run_mode_results("pdserve" if engine == "native" else "pdserve_vllm", mode_args, wl,
                                        num_prefill=1)
    # The client's token times count from the request's start.
    return summarize([Timing(0.0, list(r.token_times_s)) for r in results], wall, share.total_threads)


# -- the run ------------------------------------------------------------------------------------

def run_compare(args: argparse.Namespace) -> int:
    if args.target:
        raise ValueError("--compare vllm starts its own systems; it takes no --target")
    server_flags(args.vllm_arg)  # a bad --vllm-arg fails here, before any system starts
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
    no_vllm = vllm_available()
    plans = [("vllm_colocated", no_vllm, colocated, lambda: run_vllm_colocated(args, wl, colocated, out / "logs")),
             ("vllm_pd_nixl", no_vllm, disaggregated, lambda: run_vllm_pd(args, wl, disaggregated, out / "logs")),
             ("pdserve", "", disaggregated, lambda: run_pdserve(args, wl, disaggregated, "native")),
             ("pdserve_vllm", pdserve_vllm_engine_available(), disaggregated,
              lambda: run_pdserve(args, wl, disaggregated, "vllm"))]
    # SIGTERM (timeout, CI) unwinds like Ctrl-C, so every started server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for name, missing, share, measure in plans:
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
    (out / "serve_compare.json").write_text(json.dumps(report, indent=2))
    if report["systems"]:
        plot(report, out / "serve_compare.png")
    print(json.dumps(report) if args.json else table(report))
    return 1 if report.get("failed") else 0


def table(report: dict[str, Any]) -> str:
    columns = METRICS + EXTRA_METRICS
    head = f"{'system':<16}" + "".join(f"{m:>17}" for m in columns)
    rows = [f"{name:<16}" + "".join(f"{r.get(m, ''):>17}" for m in columns) for name, r in report["systems"].items()]
    absent = [f"{name:<16} absent: {why}" for name, why in report["absent"].items()]
    threads = [f"  {name}: {desc}" for name, desc in report["threads"].items()]
    phases = [f"phases (vLLM on {p['cores']} core(s)): prefill only {p['prefill_only_s']} s, decode only "
              f"{p['decode_only_s']} s (prefix hit rate {p['decode_pass_prefix_hit_rate']}); a 1P1D split's "
              f"throughput is at most {p['disagg_vs_colocated_bound']}x colocated's"
              for p in [report["phases"]] if "phases" in report]
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
