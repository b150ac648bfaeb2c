"""`--repeat N` for every benchmark that compares pdserve against a baseline.

A benchmark's `run(args)` measures both sides once and, with `--json`, prints one JSON object.
`run_repeated` calls it N times with `args.baseline_first` alternating True, False, True, … so
the sides run interleaved ABBA (baseline, pdserve | pdserve, baseline | baseline, pdserve …):
a machine that slows down or speeds up during the runs charges both sides alike. A benchmark
that orders its sides by `args.baseline_first` says so by putting `"baseline_first"` in its
report; one that interleaves its own samples (transfer, the HTTP passes) is repeated whole.

The combined report:
- every numeric leaf is the median of that leaf over the runs, a boolean leaf true only if it was
  in every run (non-numeric leaves, and lists
  whose length differs between runs, are the first run's), so readers of a single run's keys
  read medians;
- `repeat`: `n`, `orders` (each run's side order), `load_average` before and after, and
  `summary`: for every ratio (a key with the word "ratio" or "speedup") and every headline key the
  benchmark names, `{"median", "min", "max", "runs": [per-run values]}`;
- `runs`: each run's own report.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from typing import Any

# A ratio key: "ratio" or "speedup" as a word of the snake_case name ("duration" is not one).
RATIO = re.compile(r"(^|_)(ratio|speedup)(_|$)")


def abba_orders(n: int) -> list[bool]:
    """`baseline_first` for each of `n` runs: True, False, True, … (sides B A | A B | B A …)."""
    if n < 1:
        raise ValueError(f"--repeat must be >= 1, got {n}")
    return [i % 2 == 0 for i in range(n)]


def spread(values: Iterable[float | None]) -> dict[str, Any]:
    """Median and min–max of the values that were measured (None: absent in that run), with
    every run's value in order."""
    runs = list(values)
    got = [float(v) for v in runs if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "runs": runs}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "runs": runs}


def _numeric(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def flatten(report: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts as dotted paths (lists are not entered)."""
    out: dict[str, float] = {}
    if isinstance(report, dict):
        for k, v in report.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if _numeric(v):
                out[path] = float(v)
            elif isinstance(v, dict):
                out |= flatten(v, path)
    return out


def median_report(reports: list[Any]) -> Any:
    """The element-wise median of reports of one shape (see the module docstring)."""
    first = reports[0]
    if isinstance(first, dict):
        keys = list(first) + [k for r in reports[1:] if isinstance(r, dict) for k in r if k not in first]
        return {k: median_report([r.get(k) for r in reports if isinstance(r, dict) and k in r]) for k in keys}
    if isinstance(first, list) and all(isinstance(r, list) and len(r) == len(first) for r in reports):
        return [median_report([r[i] for r in reports]) for i in range(len(first))]
    if _numeric(first) and all(_numeric(r) for r in reports):
        m = statistics.median(reports)
        return int(m) if all(isinstance(r, int) for r in reports) and m == int(m) else m
    if isinstance(first, bool) and all(isinstance(r, bool) for r in reports):
        return all(reports)  # a flag such as `identical` holds over the runs only if it held in each
    return first


def summarize(reports: list[dict[str, Any]], headline: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """`spread` of every ratio key and every `headline` dotted path found in any run."""
    flat = [flatten(r) for r in reports]
    keys: list[str] = []
    for f in flat:
        for k in f:
            leaf = k.rsplit(".", 1)[-1]
            if k not in keys and (k in headline or RATIO.search(leaf)):
                keys.append(k)
    return {k: spread(f.get(k) for f in flat) for k in keys}


def combine(reports: list[dict[str, Any]], orders: list[bool], headline: tuple[str, ...] = (),
            load: tuple[Any, Any] = (None, None)) -> dict[str, Any]:
    combined = median_report(reports)
    combined["repeat"] = {
        "n": len(reports),
        "orders": [("baseline,pdserve" if r.get("baseline_first", b) else "pdserve,baseline")
                   if "baseline_first" in r else "its own interleaving" for r, b in zip(reports, orders, strict=True)],
        "load_average": {"before": load[0], "after": load[1]},
        "summary": summarize(reports, headline),
    }
    combined["runs"] = reports
    return combined


def _one_run(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> dict[str, Any]:
    """One run of the benchmark with --json, its printed JSON object parsed."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = run(args)
    out = buf.getvalue()
    if code:
        sys.stdout.write(out)
        raise RuntimeError(f"a repeated run exited with {code}")
    try:
        return dict(json.loads(out[out.index("{"):]))
    except ValueError:
        raise RuntimeError(f"a repeated run printed no JSON object: {out[-500:]!r}") from None


def run_repeated(run: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                 headline: tuple[str, ...] = ()) -> int:
    """`run` `args.repeat` times, sides in ABBA order; prints the combined report (--json) or a
    table of every summarized key: median, min–max, the runs."""
    orders = abba_orders(args.repeat)
    want_json = args.json
    args.json = True
    load0 = os.getloadavg()
    reports = []
    for i, baseline_first in enumerate(orders):
        args.baseline_first = baseline_first
        print(f"repeat {i + 1}/{len(orders)}: {'baseline first' if baseline_first else 'pdserve first'}",
              file=sys.stderr, flush=True)
        reports.append(_one_run(run, args))
    args.json = want_json
    combined = combine(reports, orders, headline, (load0, os.getloadavg()))
    if want_json:
        print(json.dumps(combined))
    else:
        print(format_table(combined["repeat"]))
    return 0


def format_table(repeat: dict[str, Any]) -> str:
    lines = [f"{repeat['n']} runs, sides in order: {' | '.join(repeat['orders'])}; load average "
             f"{_load(repeat['load_average']['before'])} -> {_load(repeat['load_average']['after'])}",
             f"  {'':50s} {'median':>10s} {'min – max':>21s}  runs"]
    for key, s in repeat["summary"].items():
        if s["median"] is None:
            continue
        runs = ", ".join("—" if v is None else f"{v:.3g}" for v in s["runs"])
        lines.append(f"  {key:50s} {s['median']:10.3g} {s['min']:10.3g} – {s['max']:<8.3g}  {runs}")
    return "\n".join(lines)


def _load(load: Any) -> str:
    return "?" if not load else f"{load[0]:.2f}"
