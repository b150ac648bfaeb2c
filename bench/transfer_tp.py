"""`pdserve bench transfer --prefill-tp P --decode-tp D`: KV pulls across TP sizes.

Two pairings of the same model and blocks, side by side in one run, samples interleaved:

- `hetero` — a prefill engine of P rank processes and a decode engine of D: every decode rank
  pulls its KV heads from the prefill ranks holding them (`connectors.head_map`), through the
  UCX worker connector, straight into its blocks (a head range moves as one message per block,
  the NHL2BD layout keeping a block's heads contiguous; whole runs when the ranks' heads coincide);
- `equal` — the equal-TP pull of the same bytes: a prefill engine of D ranks and a decode
  engine of D, rank to rank, whole blocks (what the connector does without heterogeneity).

Both pairings run on one KV transport (`--kv-transport`: ucx-tag or nixl), or with `both` each
transport's two pairings run, all four interleaved (hetero / equal per transport; the ratio is
always within one transport). Each decode rank receives the same bytes in every pairing (its
heads of every block). A sample starts every decode rank's pulls at once and times each rank
from its first `start_pull` to its last `finished_recving`; GB/s per decode rank is its bytes
over its time.

A round takes one sample of every pairing, back to back, in the listed order on even rounds
and reversed on odd ones (ABBA: neither pairing always goes first), `--iters` rounds per size
after one warm-up. The GB/s columns are the mean over ranks of the median of the rounds. The
ratio is paired: per round, hetero / equal of that round's two samples (each the mean of its
ranks' GB/s), and the row shows the median of these ratios with their interquartile range
(goal: median >= 0.9). Pairing the samples takes out the host's drift (other load, frequency)
that a ratio of two separately taken medians keeps. Each sample starts once the ranks of the
one before have gone idle (`SETTLE_S`), so that no pairing is measured beside another's
polling ranks.

`--pin-cores` places every rank of a role on its cores (each rank process sets its own
affinity before it starts any thread), identically in both pairings: the decode ranks, whose
pulls are timed, then get the same CPU share whether P or D prefill ranks serve them. The
default, `auto`, gives decode the first half of this process's cores and prefill the rest
(`decode:0,prefill:1` on two cores); `none` leaves placement to the OS (docs/architecture.md,
"Core placement in the TP benchmark", says why pinned is the default).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from connectors.head_map import mapping_problem, num_local_heads, read_plan, readers_of

PAIRINGS = ("hetero", "equal")
# Pause after each sample, longer than a pinned writer's polling window (the connector's
# _EXPECT_PULL_S, 20 ms) and a reader's spin after its last completion (~3 ms): the next
# sample, of another pairing, then runs beside idle ranks instead of the last one's pollers
# (4 polling writers after a 4 -> 1 sample slowed the equal sample after it).
SETTLE_S = 0.03
TRANSPORTS = ("ucx-tag", "nixl")


@dataclass(frozen=True, slots=True)
class TpShape:
    """The model's KV geometry (fp32) and the blocks each rank allocates."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int

    def rank_block_nbytes(self, tp: int) -> int:
        return self.num_layers * 2 * num_local_heads(tp, self.kv_heads) * self.block_size * self.head_dim * 4


@dataclass(frozen=True, slots=True)
class RankSpec:
    role: str  # "prefill" or "decode"
    engine_id: str
    tp_rank: int
    tp_size: int
    peer_tp: int  # the other engine's TP size
    shape: TpShape
    kv_transport: str = "ucx-tag"
    cpus: tuple[int, ...] = ()  # the cores this rank runs on; () leaves it to the OS


def parse_pin_cores(text: str, available: set[int]) -> dict[str, tuple[int, ...]]:
    """`--pin-cores` as {role: cores}: `none` is unpinned ({}); `auto` gives the decode ranks
    the first half of `available` (this process's allowed cores, rounded down, at least one)
    and the prefill ranks the rest, unpinned with fewer than two cores; else
    `ROLE:CPUS[,ROLE:CPUS]` with CPUS `N` or `N-M`. Raises ValueError naming the problem: an
    unknown or repeated role, a malformed range, or a core outside `available`."""
    if text.strip() == "none":
        return {}
    if text.strip() == "auto":
        ordered = sorted(available)
        half = max(1, len(ordered) // 2)
        return {"decode": tuple(ordered[:half]), "prefill": tuple(ordered[half:])} if len(ordered) > 1 else {}
    out: dict[str, tuple[int, ...]] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        role, sep, spec = item.partition(":")
        if role not in ("decode", "prefill") or not sep:
            raise ValueError(f"--pin-cores: {item!r} is not decode:CPUS or prefill:CPUS")
        if role in out:
            raise ValueError(f"--pin-cores: {role} given twice")
        first, _, last = spec.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"--pin-cores: {spec!r} is not N or N-M") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"--pin-cores: {spec!r} is not a range of cores")
        cores = tuple(range(lo, hi + 1))
        missing = sorted(set(cores) - available)
        if missing:
            raise ValueError(f"--pin-cores: core(s) {missing} of {role} not available to this process "
                             f"(available: {sorted(available)})")
        out[role] = cores
    if not out:
        raise ValueError(f"--pin-cores: {text!r} is not decode:CPUS or prefill:CPUS (or auto, none)")
    return out


def check(prefill_tp: int, decode_tp: int, kv_heads: int) -> None:
    """Raises ValueError (with the reason) unless the pairing and its equal-TP baseline map."""
    if prefill_tp < 1 or decode_tp < 1:
        raise ValueError(f"--prefill-tp and --decode-tp must be >= 1, got {prefill_tp}, {decode_tp}")
    for p, d in ((prefill_tp, decode_tp), (decode_tp, decode_tp)):
        problem = mapping_problem(p, d, kv_heads)
        if problem is not None:
            raise ValueError(f"prefill tp {p} -> decode tp {d} with {kv_heads} KV heads: {problem} "
                             "(choose --kv-heads accordingly)")


def run(args: argparse.Namespace, sizes: list[int]) -> int:
    """Called by `bench.transfer.run` when --prefill-tp or --decode-tp is given."""
    p, d = args.prefill_tp or 1, args.decode_tp or 1
    kv_heads = args.kv_heads
    check(p, d, kv_heads)
    choice = getattr(args, "kv_transport", "ucx-tag")
    transports = TRANSPORTS if choice == "both" else (choice,)
    shape = TpShape(args.num_layers, kv_heads, args.head_dim, args.block_size, max(sizes))
    _log(args, f"prefill tp {p} -> decode tp {d}, {kv_heads} KV heads; equal-TP baseline tp {d} -> tp {d}; "
               f"transport {', '.join(transports)} ...")
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    pin = parse_pin_cores(getattr(args, "pin_cores", "auto"), set(os.sched_getaffinity(0)))
    if pin:
        _log(args, "cores: " + ", ".join(f"{role} {list(cores)}" for role, cores in pin.items()))
    samples = _measure(shape, p, d, sizes, args.iters, transports, pin)
    rank_bytes = shape.rank_block_nbytes(d)
    summaries = {t: _summary(samples, t, shape, p, d, sizes, args.iters) | {"pin_cores": pin}
                 for t in transports}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for t, summary in summaries.items():
        name = f"transfer_tp{p}to{d}" + ("" if t == "ucx-tag" else f"_{t.replace('-', '_')}")
        (out / f"{name}.json").write_text(json.dumps(summary, indent=2))
        plot(summary, out / f"{name}.png")
    if args.json:
        print(json.dumps(summaries[transports[0]] if len(transports) == 1 else summaries))
        return 0
    for t, summary in summaries.items():
        print(f"KV pull prefill tp {p} -> decode tp {d} vs tp {d} -> tp {d} on {t}, GB/s per decode rank "
              f"(median of {args.iters}, mean over {d} rank(s)); ratio: median of {args.iters} paired rounds (IQR); "
              + ("cores " + ", ".join(f"{role} {list(c)}" for role, c in pin.items()) if pin else "unpinned"))
        print(f"{'blocks':>7} {'MiB/rank':>9} {'hetero':>8} {'equal':>8} {'ratio':>6} {'IQR':>11}")
        for r in summary["rows"]:
            g, (q1, q3) = r["gbps_per_decode_rank"], r["ratio_iqr"]
            print(f"{r['blocks']:>7} {r['bytes_per_decode_rank'] / 2**20:9.1f} {g['hetero']:8.2f} "
                  f"{g['equal']:8.2f} {r['ratio_hetero_vs_equal']:5.2f}x {q1:5.2f}-{q3:4.2f}")
        print(f"min_ratio_hetero_vs_equal ({t}): {summary['min_ratio_hetero_vs_equal']:.2f}")
    print(f"wrote {out}/transfer_tp{p}to{d}*.json ({rank_bytes} bytes per decode-rank block)")
    return 0


Samples = dict[str, dict[int, list[list[float]]]]  # pairing -> blocks -> rounds -> seconds per decode rank


def _summary(samples: Samples, transport: str, shape: TpShape, p: int, d: int, sizes: list[int],
             iters: int) -> dict[str, Any]:
    """One transport's rows: GB/s per pairing (mean over ranks of each rank's median) and the
    paired ratio (median and IQR over rounds of hetero / equal, each the mean of its ranks)."""
    rank_bytes = shape.rank_block_nbytes(d)
    rows: list[dict[str, Any]] = []
    for n in sizes:
        rounds = {k: samples[f"{k}/{transport}"][n] for k in PAIRINGS}
        gbps = {k: statistics.mean(n * rank_bytes / statistics.median(r[rank] for r in rounds[k]) / 1e9
                                   for rank in range(d)) for k in PAIRINGS}
        ratios = [statistics.mean(n * rank_bytes / s for s in hetero) / statistics.mean(n * rank_bytes / s for s in equal)
                  for hetero, equal in zip(rounds["hetero"], rounds["equal"], strict=True)]
        q1, median, q3 = _quartiles(ratios)
        rows.append({"blocks": n, "bytes_per_decode_rank": n * rank_bytes, "gbps_per_decode_rank": gbps,
                     "ratio_hetero_vs_equal": median, "ratio_iqr": [q1, q3], "paired_ratios": ratios})
    return {"prefill_tp": p, "decode_tp": d, "kv_heads": shape.kv_heads, "kv_transport": transport, "iters": iters,
            "decode_rank_block_nbytes": rank_bytes, "rows": rows,
            "min_ratio_hetero_vs_equal": min(r["ratio_hetero_vs_equal"] for r in rows)}


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile), linearly interpolated; one value is all three."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def plot(summary: dict[str, Any], path: Path) -> None:
    """Bars of GB/s per decode rank, hetero vs equal, per size, each pair labelled with its
    paired ratio (median, IQR)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (key, label) in enumerate((("hetero", f"tp {summary['prefill_tp']} -> {summary['decode_tp']}"),
                                      ("equal", f"tp {summary['decode_tp']} -> {summary['decode_tp']}"))):
        ax.bar([j + i * 0.4 for j in range(len(rows))], [r["gbps_per_decode_rank"][key] for r in rows], 0.4,
               label=label)
    for j, r in enumerate(rows):
        q1, q3 = r.get("ratio_iqr", (r["ratio_hetero_vs_equal"],) * 2)
        top = max(r["gbps_per_decode_rank"].values())
        ax.annotate(f"{r['ratio_hetero_vs_equal']:.2f}x\n({q1:.2f}-{q3:.2f})", (j + 0.2, top), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks([j + 0.2 for j in range(len(rows))], [f"{r['blocks']} blk" for r in rows])
    ax.margins(y=0.2)
    ax.set_ylabel("GB/s per decode rank")
    pin = summary.get("pin_cores") or {}
    ax.set_title(f"KV pull across TP sizes on {summary.get('kv_transport', 'ucx-tag')} "
                 f"({summary['kv_heads']} KV heads" + "".join(f", {r} cores {list(c)}" for r, c in pin.items()) + ")",
                 fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _log(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


# -- orchestration ------------------------------------------------------------------------------

class _Pairing:
    """The rank processes of one pairing: P prefill ranks and D decode ranks."""

    def __init__(self, name: str, prefill_tp: int, decode_tp: int, shape: TpShape, kv_transport: str,
                 pin: dict[str, tuple[int, ...]] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.prefill: list[tuple[Connection, Any]] = []
        self.decode: list[tuple[Connection, Any]] = []
        for role, tp, peer_tp, out in (("prefill", prefill_tp, decode_tp, self.prefill),
                                       ("decode", decode_tp, prefill_tp, self.decode)):
            for rank in range(tp):
                conn, child = ctx.Pipe()
                spec = RankSpec(role, f"{name.replace('/', '-')}-{role}", rank, tp, peer_tp, shape, kv_transport,
                                (pin or {}).get(role, ()))
                proc = ctx.Process(target=_rank_main, args=(child, spec), daemon=True)
                proc.start()
                out.append((conn, proc))

    def connect(self) -> None:
        for role, ranks in (("prefill", self.prefill), ("decode", self.decode)):
            for conn, _ in ranks:
                cores, wanted = _call(conn, "cores")
                if wanted and cores != wanted:
                    raise RuntimeError(f"a {role} rank runs on cores {cores}, not the {wanted} it was pinned to")
        metas = [_call(conn, "meta") for conn, _ in self.prefill]
        for conn, _ in self.decode:
            _call(conn, "peers", metas)

    def sample(self, blocks: int, tag: str) -> list[float]:
        for conn, _ in self.prefill:
            conn.send(("pin", (tag, blocks)))
        for conn, _ in self.prefill:
            _expect(conn)
        for conn, _ in self.decode:
            conn.send(("pull", (tag, blocks)))
        seconds = [float(_expect(conn)) for conn, _ in self.decode]
        for conn, _ in self.prefill:
            _call(conn, "released", tag)
        return seconds

    def close(self) -> None:
        for conn, proc in self.prefill + self.decode:
            try:
                conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _measure(shape: TpShape, p: int, d: int, sizes: list[int], iters: int,
             transports: tuple[str, ...] = ("ucx-tag",), pin: dict[str, tuple[int, ...]] | None = None) -> Samples:
    """Per pairing ("hetero/<transport>", "equal/<transport>") and size: every round's seconds
    per decode rank (rounds in ABBA order, see the module docstring)."""
    pairings: dict[str, _Pairing] = {}
    try:
        for t in transports:
            pairings[f"hetero/{t}"] = _Pairing(f"hetero/{t}", p, d, shape, t, pin)
            pairings[f"equal/{t}"] = _Pairing(f"equal/{t}", d, d, shape, t, pin)
        for pairing in pairings.values():
            pairing.connect()
        out: Samples = {k: {} for k in pairings}
        order = list(pairings)
        for n in sizes:
            for k in pairings:
                out[k][n] = []
            for i in range(iters + 1):
                for k in round_order(order, i):
                    seconds = pairings[k].sample(n, f"{n}-{i}")
                    time.sleep(SETTLE_S)
                    if i:
                        out[k][n].append(seconds)
            print(f"  {n} blocks: " + ", ".join(f"{k} {statistics.median(max(s) for s in out[k][n]) * 1e3:.1f} ms"
                                                for k in pairings), file=sys.stderr, flush=True)
        return out
    finally:
        for pairing in pairings.values():
            pairing.close()


def round_order(pairings: list[str], round_index: int) -> list[str]:
    """The order the pairings sample in round `round_index`: as listed on even rounds, reversed
    on odd ones (ABBA), so that each hetero / equal pair stays adjacent and neither goes first
    every time."""
    return pairings if round_index % 2 == 0 else pairings[::-1]


def _call(conn: Connection, command: str, *args: Any) -> Any:
    conn.send((command, args))
    return _expect(conn)


def _expect(conn: Connection, timeout: float = 300.0) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError("benchmark rank process did not answer")
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(value)
    return value


# -- one rank process -----------------------------------------------------------------------------

def _rank_main(conn: Connection, spec: RankSpec) -> None:
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)  # before torch and UCX start threads, which inherit it
    import torch

    sys.stdout.flush()
    os.dup2(2, 1)  # UCX logs to stdout, which belongs to the parent's table
    torch.set_num_threads(1)
    from connectors.ucx.config import UcxConnectorConfig
    from connectors.ucx.handshake import KVTransferDescriptor
    from connectors.ucx.worker import UcxWorkerConnector

    s = spec.shape
    kv = torch.empty(s.num_blocks, num_local_heads(spec.tp_size, s.kv_heads), s.num_layers, 2, s.block_size,
                     s.head_dim)
    kv.uniform_(generator=torch.Generator().manual_seed(1 + spec.tp_rank)) if spec.role == "prefill" else kv.zero_()
    # A generous timeout: the benchmark measures slow pulls instead of failing them.
    c = UcxWorkerConnector(engine_id=spec.engine_id, epoch=1, tp_rank=spec.tp_rank, tp_size=spec.tp_size,
                           num_kv_heads=s.kv_heads, compatibility_hash="bench-tp", kv_cache=kv,
                           config=UcxConnectorConfig(transfer_timeout_s=120.0, lease_s=300.0,
                                                     kv_transport=spec.kv_transport))
    prefill_id = spec.engine_id.replace("decode", "prefill")

    def peers(metas: list[bytes]) -> None:
        for read in read_plan(spec.tp_rank, spec.tp_size, spec.peer_tp, s.kv_heads):
            c.add_peer(metas[read.src_rank])

    def pin(tag: str, blocks: int) -> None:
        readers = readers_of(spec.tp_rank, spec.tp_size, spec.peer_tp, s.kv_heads)
        c.expect_send(tag, list(range(blocks)), num_readers=readers)

    def pull(tag: str, blocks: int) -> float:
        ids = tuple(range(blocks))
        d = KVTransferDescriptor(prefill_id, 1, tag, ids, blocks * s.block_size, spec.peer_tp, s.block_size,
                                 s.kv_heads)
        t0 = time.perf_counter()
        c.start_pull(tag, d, list(ids))
        while True:
            c.wait_for_results(1.0)
            r = c.get_transfer_results()
            if r.failed_recving:
                raise RuntimeError(f"pull failed: {c.take_failure_reasons()}")
            if tag in r.finished_recving:
                return time.perf_counter() - t0

    def released(tag: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if tag in c.get_transfer_results().finished_sending:
                return
            c.wait_for_results(0.05)
        raise RuntimeError(f"{spec.engine_id} rank {spec.tp_rank}: {tag} not released")

    def cores() -> tuple[list[int], list[int]]:
        return sorted(os.sched_getaffinity(0)), list(spec.cpus)

    handlers: dict[str, Callable[..., Any]] = {"meta": c.get_handshake_metadata, "peers": peers, "pin": pin,
                                               "pull": pull, "released": released, "cores": cores}
    while True:
        command, args = conn.recv()
        if command == "stop":
            break
        try:
            conn.send(("ok", handlers[command](*args)))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))
    c.shutdown()
