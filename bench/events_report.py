"""The report of `pdserve bench events`: the text summary of one run and the plot of saved runs.

`print_summary` prints a run's result (the JSON object `run` builds: one entry per section,
the baseline's name, the ratios at equal offered rates) as the text table; `plot_results`
draws saved `--json` results against their offered rate (p99, the share of events lost, the
scheduler's CPU per event), one line per pdserve variant (`_variant`) and per baseline.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _variant(result: dict[str, Any]) -> str:
    """A saved result's pdserve variant, as a legend label: event source, encoding, removals."""
    p = result.get("pdserve") or {}
    label = f"{p.get('event_source', 'worker')} events, {p.get('report_encoding', 'packed')}"
    config = result.get("config") or {}
    share = config.get("removed_share") or 0
    label = f"{label}, {share:.0%} removed" if share else label
    return label + _subscribers_label(result)


def _subscribers_label(result: dict[str, Any]) -> str:
    """How the run's ZMQ subscribers decoded (saved runs from before the option decoded fully)."""
    return ", subscribers read heads" if (result.get("config") or {}).get("subscriber_decode") == "head" else ""


def plot_results(results: list[dict[str, Any]], path: str) -> None:
    """Draws saved `--json` results against their offered rate (several runs of a variant at
    one rate: a line through their median and a dot per run): p99 (pdserve per variant and
    vLLM's publisher, issue 18's 50 ms goal dotted), the share of events lost, and the
    scheduler's CPU per event. Results without a pdserve section are skipped; ValueError when
    none has one."""
    import matplotlib

    runs = [r for r in results if r.get("pdserve")]
    if not runs:
        raise ValueError("--from-json: no result holds a pdserve section")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for r in runs:
        series.setdefault(_variant(r), []).append((r["config"]["rate"] / 1000, r["pdserve"]))
    baselines: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for r in runs:
        if r.get("vllm"):
            baselines.setdefault(_subscribers_label(r), []).append((r["config"]["rate"] / 1000, r["vllm"]))
    subscribers = runs[0]["config"].get("subscribers", 4)

    def lost_share(side: dict[str, Any]) -> float:
        return 100 * side["lost"] / max(1, side.get("offered_events", side["published_events"]) * subscribers)

    panels: list[tuple[str, Callable[[dict[str, Any]], float]]] = [
        ("p99 publish → subscriber (ms)", lambda side: side["p99_ms"]),
        ("events lost (% of deliveries)", lost_share),
        ("scheduler CPU per event (µs)", lambda side: side["scheduler_cpu_us_per_event"])]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for i, (ax, (title, value)) in enumerate(zip(axes, panels, strict=True)):
        for label, points in sorted(series.items()):
            # Several runs at one rate: the line goes through their median, each run a dot.
            by_rate: dict[float, list[float]] = {}
            for x, side in points:
                by_rate.setdefault(x, []).append(value(side))
            rates = sorted(by_rate)
            line, = ax.plot(rates, [statistics.median(by_rate[x]) for x in rates], marker="o", label=label)
            if any(len(v) > 1 for v in by_rate.values()):
                ax.scatter([x for x in rates for _ in by_rate[x]], [y for x in rates for y in by_rate[x]],
                           s=10, alpha=0.5, color=line.get_color())
        for j, (subs, baseline) in enumerate(sorted(baselines.items()) if i < 2 else ()):
            base_by_rate: dict[float, list[float]] = {}
            for x, side in baseline:
                base_by_rate.setdefault(x, []).append(value(side))
            base_rates = sorted(base_by_rate)
            ax.plot(base_rates, [statistics.median(base_by_rate[x]) for x in base_rates], marker="s",
                    color="black" if not j else "dimgrey", linestyle="--" if not j else ":",
                    label=f"{runs[0].get('baseline') or 'vLLM publisher'} alone{subs}")
        if i == 0:
            ax.set_yscale("log")
            ax.axhline(50.0, color="grey", linestyle=":", linewidth=1)
            ax.annotate("goal p99 50 ms", (min(x for x, _ in series[min(series)]), 50.0), fontsize=6,
                        color="grey", va="bottom")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("offered events/s (thousands)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def print_summary(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The run's `result` as text, one line per section that ran."""
    pdserve, per_rank, direct = result["pdserve"], result["pdserve_decode_per_rank"], result["event_plane_direct"]
    baseline, baseline_direct, overload = result["vllm"], result["vllm_at_direct_rate"], result["overload"]
    removed = f" ({args.removed_share:.0%} BlockRemoved)" if args.removed_share else ""
    print(f"KV-event plane, {args.engines} engines x tp {args.tp}, {args.batch_events}-event batches{removed}, "
          f"{args.subscribers} ZMQ subscribers on each side"
          + (f" + {args.grpc_subscribers} gRPC on pdserve's (not like for like)" if args.grpc_subscribers else "")
          + f"; every side stops when each subscriber holds every offered event or {args.drain_s:g} s after pacing")
    label = "vLLM ZmqEventPublisher" if result["baseline"] and result["baseline"].startswith("vllm") \
        else "vLLM-style re-implementation"
    if result["baseline"]:
        print(f"  baseline: {result['baseline']}; load average {os.getloadavg()[0]:.1f}")
    for name, r in ((f"pdserve end to end, paced {args.rate:.0f}/s", pdserve),
                    ("  same, decoding every rank's copy (old path)", per_rank),
                    (f"{label}, paced {args.rate:.0f}/s", baseline),
                    (f"pdserve event plane alone, paced {args.direct_rate:.0f}/s", direct),
                    (f"{label}, paced {args.direct_rate:.0f}/s", baseline_direct)):
        if r is None:
            continue
        cpu = r.get("scheduler_cpu_us_per_event")
        print(f"  {name:45s} {r['events_per_s']:10.0f} events/s  p50 {r['p50_ms']:7.2f} ms  "
              f"p99 {r['p99_ms']:7.2f} ms  lost {r['lost']}" + (f"  scheduler CPU {cpu:.1f} us/event" if cpu else ""))
    if pdserve:
        print(f"  rank-side events (x tp): {pdserve['rank_events_per_s']:.0f}/s through {args.engines * args.tp} "
              f"control streams")
    if result["cpu_per_event_ratio_vs_decode_per_rank"]:
        print(f"  scheduler CPU per event, old path / new path: {result['cpu_per_event_ratio_vs_decode_per_rank']:.2f}x")
    if overload:
        o = overload
        print(f"  overload: {o['events_per_s']:.0f} events/s unpaced; stalled subscriber held at most "
              f"{o['stalled_max_buffered_batches']} batches (buffer {o['subscriber_buffer']}), resynced "
              f"{o['stalled_resyncs']}x, told: {o['stalled_told_resync']}; RSS {o['rss_before_mib']:.0f} -> "
              f"{o['rss_after_mib']:.0f} MiB (current VmRSS)")
    for key in ("p99_ratio_vs_vllm", "delivered_ratio_vs_vllm", "direct_p99_ratio_vs_vllm",
                "direct_delivered_ratio_vs_vllm"):
        if result[key] is not None:
            print(f"  {key}: {result[key]:.2f}x (equal offered rates)")
