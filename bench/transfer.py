"""`pdserve bench transfer`: the UCX connector against raw ucxx, NIXL, gRPC and memcpy.

The same KV bytes move five ways, side by side in one run, each between two fresh processes
(memcpy: one process): (a) `pdserve` — the UCX worker connector, engine KV tensor to engine KV
tensor (`start_pull` → `finished_recving`); (b) `ucxx` — raw ucxx tagged send/receive of the
same bytes on pdserve's transport and progress policy: SysV shared memory (`UCX_TLS=^cma`),
endpoints from worker addresses with error handling off, TAG + WAKEUP features, and progress
that polls `progress_once` and yields the CPU (`sched_yield`) between empty polls, as
pdserve's progress thread does while a transfer is live; (c) `nixl` — NIXL READ over its UCX backend with error handling off (what
vLLM, Dynamo and llm-d use); (d) `grpc` — a gRPC server stream of the same bytes in 4 MiB
chunks; (e) `memcpy` — a single-thread copy in one process (the local limit).

A second like-for-like pair runs on CMA: `pdserve-cma` is (a) with `--ucx-tls all` (UCX picks
CMA) and `ucxx-cma` is (b) with `UCX_TLS=all`, same polling; a third on NIXL: `pdserve-nixl` is
(a) with `--kv-transport nixl` against (c). Ratios compare each baseline with the pdserve run
on its transport (`compared_with`: `ucxx` with `pdserve`, `ucxx-cma` with `pdserve-cma`,
`nixl` with `pdserve-nixl` where that runs, else with `pdserve`); gRPC with pdserve's default
configuration (SysV shared memory, see docs/architecture.md).

With `--hosts 2` every writer runs in host a and every reader in host b of bench/two_hosts.py
(network namespaces joined by a veth link, each process in its own IPC, PID, mount and UTS
namespace), so UCX goes over TCP on that link for all of pdserve (both transports), raw ucxx and NIXL; the
report names the transport each reader's endpoint used (connectors/ucx/ep_info.py).

With `--kv-staging host` both pdserve sides bounce the KV through their host staging pool
(connectors/ucx/host_staging.py): `pdserve` with a pool as large as the cache (every pull fits
at once) against `pdserve-pool` with `--kv-staging-blocks` slots (default a third of the
largest request), whose larger pulls move in chunk pulls through it; the ratio is
pdserve-pool / pdserve.

Cases: one request of 1, 16, 256 and 1024 blocks, and 32 requests of 16 blocks concurrently.
Each timing is the median of `--iters` runs after one warm-up (with the fastest and slowest), measured on the reader from the
request to the last byte (a control round trip included for every method but memcpy). All
methods' processes live for the whole run and their samples are interleaved, so load drift on a
shared machine affects them alike.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

METHODS = ("pdserve", "pdserve-cma", "pdserve-nixl", "ucxx", "ucxx-cma", "nixl", "grpc", "memcpy", "pdserve-pool")
DEFAULT_METHODS = METHODS[:-1]
STAGING_METHODS = ("pdserve", "pdserve-pool")  # what --kv-staging host runs
BASELINES = {"ucxx": "min_ratio_vs_ucxx", "ucxx-cma": "min_ratio_cma_vs_ucxx_cma", "nixl": "min_ratio_vs_nixl",
             "grpc": "min_ratio_vs_grpc"}
# Which pdserve run each baseline is compared with: the one on the same transport (nixl with
# pdserve-nixl when that runs too, else with pdserve; see `compared_with`).
COMPARED_WITH = {"ucxx-cma": "pdserve-cma", "nixl": "pdserve-nixl"}
TRANSPORTS = {"pdserve": "SysV shared memory (UCX_TLS=^cma)", "ucxx": "SysV shared memory (UCX_TLS=^cma)",
              "pdserve-cma": "CMA (UCX_TLS=all)", "ucxx-cma": "CMA (UCX_TLS=all)",
              "pdserve-nixl": "pdserve --kv-transport nixl (NIXL's UCX backend)",
              "nixl": "NIXL's UCX backend, UCX's default transports", "grpc": "TCP loopback", "memcpy": "one process",
              "pdserve-pool": "pdserve --kv-staging host through a pool of --kv-staging-blocks slots (^cma)"}
HOSTS_METHODS = ("pdserve", "pdserve-nixl", "ucxx", "nixl")  # what --hosts 2 runs (each side in its own host)
CHUNK = 4 << 20
DEFAULT_SIZES = "1,16,256,1024"
# Throughput, not failure detection, is measured: a loaded machine may take seconds per pull.
BENCH_TIMEOUT_S = 120.0
NIXL_SAMPLE_TIMEOUT_S = 30.0
_HOSTS_ENV = "PDSERVE_BENCH_HOSTS"  # set to 2 in the processes of a --hosts 2 run


@dataclass(frozen=True, slots=True)
class Case:
    label: str
    request_blocks: tuple[int, ...]  # blocks per concurrent request

    @property
    def num_blocks(self) -> int:
        return sum(self.request_blocks)

    def runs(self) -> list[tuple[int, int]]:
        """(first block, number of blocks) per request; requests lie back to back."""
        out, start = [], 0
        for n in self.request_blocks:
            out.append((start, n))
            start += n
        return out


@dataclass(slots=True)
class Shape:
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    kv_staging: str = "none"  # of the pdserve methods (pdserve-pool: always host)
    staging_blocks: int = 0  # pdserve-pool's pool

    @property
    def block_nbytes(self) -> int:
        return self.num_layers * 2 * self.kv_heads * self.block_size * self.head_dim * 4

    def tensor(self, seed: int = 0) -> Any:
        import torch

        kv = torch.empty(self.num_blocks, self.kv_heads, self.num_layers, 2, self.block_size, self.head_dim)
        if seed:
            kv.uniform_(generator=torch.Generator().manual_seed(seed))
        else:
            kv.zero_()
        return kv


@dataclass(slots=True)
class Row:
    case: str
    num_blocks: int
    num_bytes: int
    gbps: dict[str, float | None] = field(default_factory=dict)  # median
    ratios: dict[str, float | None] = field(default_factory=dict)
    gbps_min: dict[str, float | None] = field(default_factory=dict)  # slowest sample
    gbps_max: dict[str, float | None] = field(default_factory=dict)  # fastest sample


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", default="bench-results", help="directory for transfer.json and transfer.png")
    parser.add_argument("--iters", type=int, default=0,
                        help="timed runs per case and method (median; default 5, 21 with --prefill-tp/--decode-tp, "
                             "whose ratio is the median of paired samples)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="blocks of the single-request cases")
    parser.add_argument("--hosts", type=int, default=1, choices=(1, 2),
                        help="2: each writer in host a and each reader in host b of bench/two_hosts.py (network "
                             "namespaces joined by a veth link; UCX over TCP), methods " + ",".join(HOSTS_METHODS)
                        + " by default; needs root")
    parser.add_argument("--concurrent", type=int, default=32, help="requests of the concurrent case (0: none)")
    parser.add_argument("--concurrent-blocks", type=int, default=16, help="blocks per concurrent request")
    # Default block: the demo model's (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64), 16 tokens, fp32.
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=0,
                        help="KV heads of the model (default 3, the demo model's; 4 with --prefill-tp/--decode-tp)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-tp", type=int, default=0,
                        help="heterogeneous TP: pull from a prefill engine of this many ranks into --decode-tp "
                             "ranks, against the equal-TP pull of the same bytes (bench/transfer_tp.py); "
                             "--sizes defaults to 16,64,256 there")
    parser.add_argument("--decode-tp", type=int, default=0, help="decode ranks of the heterogeneous-TP pairing")
    parser.add_argument("--kv-transport", default="ucx-tag", choices=("ucx-tag", "nixl", "both"),
                        help="with --prefill-tp/--decode-tp: pdserve's KV transport of both pairings (ucx-tag: "
                             "tagged messages; nixl: one NIXL READ per pull), or both (each transport's hetero "
                             "and equal pairings, all four interleaved in one run)")
    parser.add_argument("--kv-staging", default="none", choices=("none", "host"),
                        help="host: both pdserve sides bounce KV through their host staging pool; runs pdserve "
                             "(a pool as large as the cache) against pdserve-pool (--kv-staging-blocks slots)")
    parser.add_argument("--kv-staging-blocks", type=int, default=0,
                        help="with --kv-staging host: pdserve-pool's slots (default a third of the largest request)")
    parser.add_argument("--pin-cores", default="auto",
                        help="with --prefill-tp/--decode-tp: CPU cores per role, alike in the hetero and the equal "
                             "pairing (a host where each side has its own): ROLE:CPUS[,ROLE:CPUS] with CPUS N or "
                             "N-M (e.g. decode:0,prefill:1); auto (default): decode ranks on the first half of the "
                             "allowed cores, prefill ranks on the rest; none: unpinned, the OS places every rank")


def run(args: argparse.Namespace) -> int:
    if args.prefill_tp or args.decode_tp:
        from bench import transfer_tp

        args.kv_heads = args.kv_heads or 4
        args.iters = args.iters or 21
        sizes = _int_list("16,64,256" if args.sizes == DEFAULT_SIZES else args.sizes)
        return transfer_tp.run(args, sizes)
    args.kv_heads = args.kv_heads or 3
    args.iters = args.iters or 5
    if args.hosts == 2 and args.methods == ",".join(DEFAULT_METHODS):
        args.methods = ",".join(HOSTS_METHODS)
    if args.kv_staging == "host" and args.methods == ",".join(DEFAULT_METHODS):
        args.methods = ",".join(STAGING_METHODS)
    if args.kv_staging == "host" and args.hosts == 2:
        raise ValueError("--kv-staging host runs on one host (--hosts 1)")
    cases = [Case(str(n), (n,)) for n in _int_list(args.sizes)]
    if args.concurrent:
        cases.append(Case(f"{args.concurrent}x{args.concurrent_blocks}", (args.concurrent_blocks,) * args.concurrent))
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown or "pdserve" not in methods or args.iters < 1:
        raise ValueError(f"--methods must include pdserve and name only {METHODS}; --iters >= 1")
    if args.hosts == 2 and set(methods) - set(HOSTS_METHODS):
        raise ValueError(f"--hosts 2 runs only {', '.join(HOSTS_METHODS)}")
    if "pdserve-pool" in methods and args.kv_staging != "host":
        raise ValueError("pdserve-pool runs with --kv-staging host")
    largest = max(max(c.request_blocks) for c in cases)
    if args.kv_staging_blocks < 0:
        raise ValueError(f"--kv-staging-blocks must be >= 0, got {args.kv_staging_blocks}")
    shape = Shape(args.num_layers, args.kv_heads, args.head_dim, args.block_size,
                  max(c.num_blocks for c in cases), args.kv_staging,
                  args.kv_staging_blocks or max(1, largest // 3))
    _log(args, f"starting {', '.join(methods)} (block {shape.block_nbytes} bytes) ...")
    if args.hosts == 2:
        from bench.two_hosts import TwoHosts, unavailable

        problem = unavailable()
        if problem is not None:
            print(f"bench transfer --hosts 2: two namespaced hosts cannot be made here: {problem}", file=sys.stderr)
            return 2
        signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the namespaces are removed on SIGTERM too
        with TwoHosts() as hosts:
            samples, used = _measure(methods, shape, cases, args.iters, hosts)
    else:
        samples, used = _measure(methods, shape, cases, args.iters)
    rows = _rows(cases, shape, methods, samples)
    summary = _summary(rows, shape, args)
    summary["transports_used"] = used
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps(summary, indent=2))
    title = ("KV transfer between two namespaced hosts over a veth link (median, min-max)" if args.hosts == 2
             else "KV transfer between two processes (memcpy: one process)")
    _plot(rows, methods, out / "transfer.png", title)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_table(rows, methods, summary, out)
    return 0


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"--sizes must list positive block counts, got {text!r}")
    return values


def _log(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def _rows(cases: list[Case], shape: Shape, methods: list[str],
          samples: dict[str, dict[str, list[float]]]) -> list[Row]:
    rows = []
    for case in cases:
        nbytes = case.num_blocks * shape.block_nbytes
        row = Row(case.label, case.num_blocks, nbytes)
        for m in methods:
            seconds = samples.get(m, {}).get(case.label) or []
            row.gbps[m] = nbytes / statistics.median(seconds) / 1e9 if seconds else None
            row.gbps_min[m] = nbytes / max(seconds) / 1e9 if seconds else None
            row.gbps_max[m] = nbytes / min(seconds) / 1e9 if seconds else None
        pairs = compared_with(methods)
        for m in methods:
            if not m.startswith("pdserve"):
                ours, theirs = row.gbps.get(pairs.get(m, "pdserve")), row.gbps[m]
                row.ratios[m] = ours / theirs if ours and theirs else None
        if "pdserve-pool" in methods:  # the small pool against the pool every pull fits
            pool, full = row.gbps["pdserve-pool"], row.gbps.get("pdserve")
            row.ratios["pdserve-pool"] = pool / full if pool and full else None
        rows.append(row)
    return rows


def compared_with(methods: list[str]) -> dict[str, str]:
    """Baseline -> the pdserve run it is compared with in this run: the one on its transport
    where that one runs, else `pdserve`."""
    return {m: run if run in methods else "pdserve" for m, run in COMPARED_WITH.items()}


def _summary(rows: list[Row], shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    transports = {m: TRANSPORTS[m] for m in rows[0].gbps} if rows else {}
    if args.hosts == 2:
        transports = {m: "host a -> host b over the veth link (UCX_NET_DEVICES=pdv0)" for m in transports}
    summary: dict[str, Any] = {
        "block_nbytes": shape.block_nbytes, "iters": args.iters, "hosts": args.hosts,
        "kv_staging": shape.kv_staging,
        "staging_pools": ({"pdserve": shape.num_blocks, "pdserve-pool": shape.staging_blocks}
                          if shape.kv_staging == "host" else {}),
        "transports": transports,
        "compared_with": {m: compared_with(list(rows[0].gbps) if rows else []).get(m, "pdserve") for m in BASELINES},
        "rows": [{"case": r.case, "num_blocks": r.num_blocks, "num_bytes": r.num_bytes, "gbps": r.gbps,
                  "gbps_min": r.gbps_min, "gbps_max": r.gbps_max, "ratio_vs": r.ratios} for r in rows],
    }
    if shape.kv_staging == "host":  # the small pool's worst case against the pool every pull fits
        pool_ratios = [r.ratios.get("pdserve-pool") for r in rows]
        summary["min_ratio_pool_vs_full"] = (min(x for x in pool_ratios if x is not None)
                                             if pool_ratios and None not in pool_ratios else None)
    for method, key in BASELINES.items():
        ratios = [r.ratios.get(method) for r in rows if r.num_blocks >= 16]
        known = [x for x in ratios if x is not None]
        summary[key] = min(known) if known and len(known) == len(ratios) else None
    return summary


def _print_table(rows: list[Row], methods: list[str], summary: dict[str, Any], out: Path) -> None:
    print(f"KV transfer, block = {summary['block_nbytes']} bytes, GB/s (median of {summary['iters']}), "
          f"{summary['hosts']} host(s)")
    for m in methods:
        used = summary["transports_used"].get(m)
        print(f"  {m:>11}: {summary['transports'].get(m, TRANSPORTS[m])}" + (f"; UCX used {used}" if used else ""))
    pairs = compared_with(methods)
    baselines = [m for m in methods if not m.startswith("pdserve")]
    print(f"{'case':>8} {'MiB':>8} " + " ".join(f"{m:>11}" for m in methods) + "   ratio vs "
          + " / ".join(f"{m} ({pairs.get(m, 'pdserve')})" for m in baselines))
    for r in rows:
        cells = " ".join(f"{r.gbps[m]:11.2f}" if r.gbps[m] else f"{'-':>11}" for m in methods)
        ratios = " ".join(f"{r.ratios[m]:.2f}x" if r.ratios[m] else "-" for m in baselines)
        print(f"{r.case:>8} {r.num_bytes / 2**20:8.1f} {cells}   {ratios}")
    if "pdserve-pool" in methods:
        print("pdserve-pool / pdserve: " + ", ".join(
            f"{r.case} {r.ratios['pdserve-pool']:.2f}x" if r.ratios.get("pdserve-pool") else f"{r.case} -"
            for r in rows) + f" (pools {summary['staging_pools']} blocks)")
    for key in BASELINES.values():
        value = summary[key]
        print(f"{key}: {value:.2f}" if value is not None else f"{key}: n/a")
    print(f"wrote {out / 'transfer.json'} and {out / 'transfer.png'}")


def _plot(rows: list[Row], methods: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(rows))]
        med = [r.gbps[m] or 0.0 for r in rows]
        low = [med[j] - (r.gbps_min.get(m) or med[j]) for j, r in enumerate(rows)]
        high = [(r.gbps_max.get(m) or med[j]) - med[j] for j, r in enumerate(rows)]
        ax.bar(xs, med, width, label=m, yerr=[low, high], capsize=2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [f"{r.case} blk" for r in rows])
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- orchestration ------------------------------------------------------------------------------

def _measure(methods: list[str], shape: Shape, cases: list[Case], iters: int,
             hosts: Any = None) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    """Seconds of every sample by method and case, and the UCX transport each method's reader
    reported. Interleaves the methods sample by sample, so drifting load on a shared machine hits
    all of them alike; each sample is one (case, method) run, the first of each case a warm-up.
    With `hosts` (bench/two_hosts.py TwoHosts) writers run in host a, readers in host b."""
    runners: dict[str, _Runner] = {}
    try:
        for m in methods:
            runners[m] = _Runner(m, shape, hosts)
        for m in list(runners):
            try:
                runners[m].connect()
            except _MethodUnavailable as e:
                print(f"{m}: unavailable ({e})", file=sys.stderr)
                runners.pop(m).close()
        samples: dict[str, dict[str, list[float]]] = {m: {c.label: [] for c in cases} for m in runners}
        failed: dict[str, str] = {}
        for case in cases:
            for i in range(iters + 1):
                for m, runner in list(runners.items()):
                    try:
                        seconds = runner.sample(case, f"{case.label}-{i}")
                    except (RuntimeError, TimeoutError) as e:
                        if m == "pdserve":
                            raise
                        print(f"{m}: failed, dropped from the run ({e})", file=sys.stderr)
                        failed[m] = f"failed: {e}"
                        runners.pop(m).close()
                        samples.pop(m)
                        continue
                    if i:
                        samples[m][case.label].append(seconds)
        used = {m: runner.transport() for m, runner in runners.items()}
        return samples, {**{m: t for m, t in used.items() if t}, **failed}
    finally:
        for runner in runners.values():
            runner.close()


class _Runner:
    """The processes of one method: a writer and a reader (memcpy: one process)."""

    def __init__(self, method: str, shape: Shape, hosts: Any = None) -> None:
        ctx = mp.get_context("spawn")
        mains = _PAIRS[method] if method != "memcpy" else (None, _memcpy_main)
        self.procs: list[tuple[Connection, Any]] = []
        for role, main in enumerate(mains):
            if main is None:
                continue
            if hosts is not None:
                self.procs.append(_spawn_in_host(hosts.a if role == 0 else hosts.b, method, role, shape,
                                                 hosts.ucx_env))
                continue
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=main, args=(child, shape), daemon=True)
            proc.start()
            self.procs.append((conn, proc))

    def transport(self) -> str | None:
        """The UCX transport the reader's endpoint used (None where the method cannot say)."""
        conn = self.procs[-1][0]
        conn.send(("transport", None, ""))
        used: str | None = _expect(conn)
        return used

    def connect(self) -> None:
        if len(self.procs) == 1:
            _expect(self.procs[0][0])
            return
        (w, _), (r, _) = self.procs
        r.send(_expect(w))  # the writer's address / metadata / port
        w.send(_expect(r))  # the reader's address (or None)
        _expect(w)
        _expect(r)

    def sample(self, case: Case, tag: str) -> float:
        if len(self.procs) == 1:
            self.procs[0][0].send(("run", case, tag))
            seconds: float = _expect(self.procs[0][0])
            return seconds
        (w, _), (r, _) = self.procs
        w.send(("prepare", case, tag))
        _expect(w)
        r.send(("run", case, tag))
        seconds = _expect(r)
        w.send(("finish", case, tag))
        _expect(w)
        return seconds

    def close(self) -> None:
        # Every process of the method is told to stop before any is waited for: a writer
        # leaving closes its UCX endpoint, which waits on the reader's side (a reader still
        # blocked on its next command held the writer until the join below timed out).
        for conn, _ in self.procs:
            try:
                conn.send(("stop", None, ""))
            except (BrokenPipeError, OSError):
                pass
        for _, proc in self.procs:
            if isinstance(proc, subprocess.Popen):
                # A process in a host: its samples are in; one still closing UCX endpoints to a
                # peer already gone (ucxx waits on the close) is ended with its namespace's init.
                try:
                    proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                continue
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join()


class _MethodUnavailable(RuntimeError):
    pass


def _spawn_in_host(host: Any, method: str, role: int, shape: Shape,
                   env: dict[str, str]) -> tuple[Connection, subprocess.Popen[bytes]]:
    """One side of `method` as a process in `host` (bench/two_hosts.py), talked to over a
    socket pair inherited across the namespaces."""
    parent, child = socket.socketpair()
    fd = child.fileno()
    argv = [sys.executable, "-m", "bench.transfer", "--child", method, str(role), str(fd),
            json.dumps([shape.num_layers, shape.kv_heads, shape.head_dim, shape.block_size, shape.num_blocks])]
    proc = subprocess.Popen(host.command(argv), env={**os.environ, **env, "UCX_WARN_UNUSED_ENV_VARS": "n",
                                                     _HOSTS_ENV: "2"},
                            pass_fds=(fd,), start_new_session=True)
    child.close()
    return Connection(parent.detach()), proc


def _child_main(argv: list[str]) -> None:
    """`python -m bench.transfer --child METHOD ROLE FD SHAPE`: one side of a method in a host."""
    method, role, fd, shape = argv[0], int(argv[1]), int(argv[2]), Shape(*json.loads(argv[3]))
    main = _PAIRS[method][role]
    main(Connection(fd), shape)


def _expect(conn: Connection, timeout: float = 300.0) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError("benchmark process did not answer")
    status, value = conn.recv()
    if status == "unavailable":
        raise _MethodUnavailable(value)
    if status != "ok":
        raise RuntimeError(value)
    return value


def _serve(conn: Connection, handlers: dict[str, Callable[[Case, str], Any]]) -> None:
    """A child's command loop: ("prepare" | "run" | "finish", case, tag) until "stop"."""
    while True:
        command, case, tag = conn.recv()
        if command == "stop":
            return
        try:
            handler = handlers.get(command)
            conn.send(("ok", handler(case, tag) if handler else None))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))


def _child_setup() -> None:
    import os

    import torch

    # Children report through their pipe; UCX and NIXL log to stdout, which belongs to the
    # parent's table or JSON object.
    sys.stdout.flush()
    os.dup2(2, 1)
    torch.set_num_threads(1)


# -- (a) pdserve UCX connector -------------------------------------------------------------------

def _pdserve_connector(conn: Connection, shape: Shape, role: str, ucx_tls: str, kv_transport: str,
                       pool: bool = False) -> Any:
    """The connector of one side, or None (told to the parent) where its transport is not installed.
    With `shape.kv_staging` host: staged through a pool as large as the cache, or with `pool`
    through `shape.staging_blocks` slots."""
    from connectors.ucx.config import UcxConnectorConfig
    from connectors.ucx.worker import UcxWorkerConnector

    writer = role == "prefill"
    staging = "host" if pool else shape.kv_staging
    try:
        return UcxWorkerConnector(engine_id=f"bench-{role}", epoch=1 if writer else 2, tp_rank=0, tp_size=1,
                                  num_kv_heads=shape.kv_heads, compatibility_hash="bench",
                                  kv_cache=shape.tensor(seed=1 if writer else 0),
                                  config=UcxConnectorConfig(ucx_tls=ucx_tls, transfer_timeout_s=BENCH_TIMEOUT_S,
                                                            kv_transport=kv_transport, kv_staging=staging,
                                                            kv_staging_blocks=(shape.staging_blocks if pool
                                                                               else shape.num_blocks)))
    except RuntimeError as e:  # NixlUnavailable
        conn.send(("unavailable", str(e)))
        return None


def _pdserve_writer(conn: Connection, shape: Shape, ucx_tls: str = "", kv_transport: str = "ucx-tag",
                    pool: bool = False) -> None:
    _child_setup()
    c = _pdserve_connector(conn, shape, "prefill", ucx_tls, kv_transport, pool)
    if c is None:
        return
    conn.send(("ok", c.get_handshake_metadata()))
    conn.recv()
    conn.send(("ok", None))

    def prepare(case: Case, tag: str) -> None:
        for i, (start, n) in enumerate(case.runs()):
            c.expect_send(f"{tag}-{i}", list(range(start, start + n)))

    def finish(case: Case, tag: str) -> None:
        want = {f"{tag}-{i}" for i in range(len(case.request_blocks))}
        deadline = time.monotonic() + 60
        while want and time.monotonic() < deadline:
            c.wait_for_results(0.05)
            want -= c.get_transfer_results().finished_sending
        if want:
            raise RuntimeError(f"finished_sending missing for {sorted(want)[:3]}")

    _serve(conn, {"prepare": prepare, "finish": finish})
    c.shutdown()


def _pdserve_reader(conn: Connection, shape: Shape, ucx_tls: str = "", kv_transport: str = "ucx-tag",
                    pool: bool = False) -> None:
    _child_setup()
    from connectors.ucx.handshake import KVTransferDescriptor

    c = _pdserve_connector(conn, shape, "decode", ucx_tls, kv_transport, pool)
    if c is None:
        return
    c.add_peer(conn.recv())
    conn.send(("ok", None))
    conn.send(("ok", None))

    def run(case: Case, tag: str) -> float:
        t0 = time.perf_counter()
        want = set()
        for i, (start, n) in enumerate(case.runs()):
            ids = tuple(range(start, start + n))
            d = KVTransferDescriptor("bench-prefill", 1, f"{tag}-{i}", ids, n * shape.block_size, 1,
                                     shape.block_size, shape.kv_heads)
            c.start_pull(f"{tag}-{i}", d, list(ids))
            want.add(f"{tag}-{i}")
        while want:
            c.wait_for_results(1.0)
            r = c.get_transfer_results()
            if r.failed_recving:
                raise RuntimeError(f"pull failed: {c.take_failure_reasons()}")
            want -= r.finished_recving
        return time.perf_counter() - t0

    def transport(case: Case, tag: str) -> str:
        return "+".join(sorted(set(c.peer_transports().values())))

    _serve(conn, {"run": run, "transport": transport})
    c.shutdown()


# -- (b) raw ucxx tagged messages ---------------------------------------------------------------

def _ucxx_worker(tls: str) -> tuple[Any, Any, Any]:
    """A worker configured as pdserve's transport configures its own (context options, features,
    progress mode); only the transport list differs between the two pairs."""
    import os

    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array

    from connectors.ucx.config import UcxConnectorConfig

    ctx = ucx_api.UCXContext(config_dict=UcxConnectorConfig(ucx_tls=tls).ucx_options(),
                             feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    worker = ucx_api.UCXWorker(ctx)
    worker.init_blocking_progress_mode()
    return ucx_api, Array, worker


def _ucxx_wait(worker: Any, requests: list[Any]) -> None:
    """pdserve's policy while a transfer is live: poll, and yield the CPU after an empty poll."""
    import os

    while not all(r.completed for r in requests):
        if worker.progress_once():
            worker.progress()
        else:
            os.sched_yield()
    for r in requests:
        r.check_error()


def _ucxx_writer(conn: Connection, shape: Shape, tls: str = "^cma") -> None:
    _child_setup()
    ucx_api, Array, worker = _ucxx_worker(tls)
    region = shape.tensor(seed=1).view(-1).view(__import__("torch").uint8).numpy()
    conn.send(("ok", bytes(worker.address.tobytes())))
    reader_address = conn.recv()
    ep = ucx_api.UCXEndpoint.create_from_worker_address(
        worker, ucx_api.UCXAddress.create_from_buffer(reader_address), False)
    conn.send(("ok", None))
    import numpy as np

    go = np.zeros(1, dtype=np.uint64)

    def prepare(case: Case, tag: str) -> None:
        conn.send(("ok", None))  # answer early: the reader's "go" message starts the sends
        _ucxx_wait(worker, [worker.tag_recv(Array(go), ucx_api.UCXXTag(1))])
        sends = []
        for i, (start, n) in enumerate(case.runs()):
            view = region[start * shape.block_nbytes:(start + n) * shape.block_nbytes]
            sends.append(ep.tag_send(Array(view), ucx_api.UCXXTag(100 + i)))
        _ucxx_wait(worker, sends)

    while True:
        command, case, tag = conn.recv()
        if command == "stop":
            return
        if command == "prepare":
            prepare(case, tag)
        else:
            conn.send(("ok", None))


def _ucxx_reader(conn: Connection, shape: Shape, tls: str = "^cma") -> None:
    _child_setup()
    ucx_api, Array, worker = _ucxx_worker(tls)
    import numpy as np

    region = shape.tensor().view(-1).view(__import__("torch").uint8).numpy()
    writer_address = conn.recv()
    ep = ucx_api.UCXEndpoint.create_from_worker_address(
        worker, ucx_api.UCXAddress.create_from_buffer(writer_address), False)
    conn.send(("ok", bytes(worker.address.tobytes())))
    conn.send(("ok", None))
    go = np.ones(1, dtype=np.uint64)

    def run(case: Case, tag: str) -> float:
        t0 = time.perf_counter()
        recvs = []
        for i, (start, n) in enumerate(case.runs()):
            view = region[start * shape.block_nbytes:(start + n) * shape.block_nbytes]
            recvs.append(worker.tag_recv(Array(view), ucx_api.UCXXTag(100 + i)))
        _ucxx_wait(worker, [ep.tag_send(Array(go), ucx_api.UCXXTag(1))])
        _ucxx_wait(worker, recvs)
        return time.perf_counter() - t0

    def transport(case: Case, tag: str) -> str:
        from connectors.ucx.ep_info import EndpointInfo

        return EndpointInfo().transport(ep.handle)

    _serve(conn, {"run": run, "transport": transport})


# -- (c) NIXL READ --------------------------------------------------------------------------------

def _nixl_agent(name: str, progress_thread: bool = False) -> Any:
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise _MethodUnavailable(f"nixl-cu12 not installed: {e}") from None
    # No progress thread on one host: the reader polls its transfers, CMA reads need no writer
    # CPU, and a spinning thread would steal CPU from the other methods measured in the same
    # run. Across hosts over TCP a READ is served by the writer's UCX worker, which only a
    # progress thread drives while the writer waits for commands (`progress_thread`).
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def _nixl_writer(conn: Connection, shape: Shape) -> None:
    _child_setup()
    try:
        agent = _nixl_agent("bench-writer", progress_thread=os.environ.get(_HOSTS_ENV) == "2")
    except _MethodUnavailable as e:
        conn.send(("unavailable", str(e)))
        return
    kv = shape.tensor(seed=1)
    agent.register_memory(kv)
    conn.send(("ok", (agent.get_agent_metadata(), kv.data_ptr())))
    conn.recv()
    conn.send(("ok", None))
    _serve(conn, {})


def _nixl_reader(conn: Connection, shape: Shape) -> None:
    _child_setup()
    try:
        agent = _nixl_agent("bench-reader")
    except _MethodUnavailable as e:
        conn.send(("unavailable", str(e)))
        return
    kv = shape.tensor()
    agent.register_memory(kv)
    metadata, remote_base = conn.recv()
    remote_name = agent.add_remote_agent(metadata)
    conn.send(("ok", None))
    conn.send(("ok", None))
    local_base, bn = kv.data_ptr(), shape.block_nbytes

    def run(case: Case, tag: str) -> float:
        t0 = time.perf_counter()
        handles = []
        for start, n in case.runs():
            local = agent.get_xfer_descs([(local_base + start * bn, n * bn, 0)], "DRAM")
            remote = agent.get_xfer_descs([(remote_base + start * bn, n * bn, 0)], "DRAM")
            handle = agent.initialize_xfer("READ", local, remote, remote_name, tag.encode())
            if agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL transfer failed to post")
            handles.append(handle)
        pending = list(handles)
        while pending:
            if time.perf_counter() - t0 > NIXL_SAMPLE_TIMEOUT_S:
                raise TimeoutError(f"NIXL READ not done in {NIXL_SAMPLE_TIMEOUT_S:.0f}s")
            states = [agent.check_xfer_state(h) for h in pending]
            if "ERR" in states:
                raise RuntimeError("NIXL transfer failed")
            pending = [h for h, s in zip(pending, states, strict=True) if s != "DONE"]
        elapsed = time.perf_counter() - t0
        for h in handles:
            agent.release_xfer_handle(h)
        return elapsed

    _serve(conn, {"run": run})


# -- (d) gRPC streaming ----------------------------------------------------------------------------

def _grpc_writer(conn: Connection, shape: Shape) -> None:
    _child_setup()
    from concurrent import futures

    import grpc
    import torch

    region = shape.tensor(seed=1).view(-1).view(torch.uint8).numpy()

    def pull(request: bytes, context: Any) -> Any:
        start, n = json.loads(request)
        lo, hi = start * shape.block_nbytes, (start + n) * shape.block_nbytes
        for offset in range(lo, hi, CHUNK):
            yield region[offset:min(offset + CHUNK, hi)].tobytes()

    handler = grpc.method_handlers_generic_handler("bench.Transfer", {
        "Pull": grpc.unary_stream_rpc_method_handler(pull, request_deserializer=None, response_serializer=None)})
    options = [("grpc.max_send_message_length", 2 * CHUNK), ("grpc.max_receive_message_length", 2 * CHUNK)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(("ok", port))
    conn.recv()
    conn.send(("ok", None))
    _serve(conn, {})
    server.stop(grace=None)


def _grpc_reader(conn: Connection, shape: Shape) -> None:
    _child_setup()
    from concurrent import futures

    import grpc
    import numpy as np
    import torch

    region = shape.tensor().view(-1).view(torch.uint8).numpy()
    port = conn.recv()
    options = [("grpc.max_receive_message_length", 2 * CHUNK)]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
    pull = channel.unary_stream("/bench.Transfer/Pull", request_serializer=None, response_deserializer=None)
    conn.send(("ok", None))
    conn.send(("ok", None))
    pool = futures.ThreadPoolExecutor(max_workers=32)

    def fetch(start: int, n: int) -> None:
        offset = start * shape.block_nbytes
        for chunk in pull(json.dumps([start, n]).encode()):
            region[offset:offset + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            offset += len(chunk)

    def run(case: Case, tag: str) -> float:
        t0 = time.perf_counter()
        for f in [pool.submit(fetch, start, n) for start, n in case.runs()]:
            f.result()
        return time.perf_counter() - t0

    _serve(conn, {"run": run})
    channel.close()


# -- (e) memcpy --------------------------------------------------------------------------------------

def _memcpy_main(conn: Connection, shape: Shape) -> None:
    _child_setup()
    src, dst = shape.tensor(seed=1), shape.tensor()
    conn.send(("ok", None))

    def run(case: Case, tag: str) -> float:
        t0 = time.perf_counter()
        for start, n in case.runs():
            dst[start:start + n].copy_(src[start:start + n])
        return time.perf_counter() - t0

    _serve(conn, {"run": run})


_PAIRS: dict[str, tuple[Callable[[Connection, Shape], None], Callable[[Connection, Shape], None]]] = {
    "pdserve": (_pdserve_writer, _pdserve_reader),
    # The connector over UCX's own transport choice (CMA on one host): faster under CPU
    # contention, but a writer dying mid-read aborts the reader (see docs/architecture.md).
    "pdserve-cma": (functools.partial(_pdserve_writer, ucx_tls="all"), functools.partial(_pdserve_reader, ucx_tls="all")),
    "pdserve-nixl": (functools.partial(_pdserve_writer, kv_transport="nixl"),
                     functools.partial(_pdserve_reader, kv_transport="nixl")),
    "ucxx": (_ucxx_writer, _ucxx_reader),
    "ucxx-cma": (functools.partial(_ucxx_writer, tls="all"), functools.partial(_ucxx_reader, tls="all")),
    "nixl": (_nixl_writer, _nixl_reader),
    "grpc": (_grpc_writer, _grpc_reader),
    "pdserve-pool": (functools.partial(_pdserve_writer, pool=True), functools.partial(_pdserve_reader, pool=True)),
}


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child_main(sys.argv[2:])
