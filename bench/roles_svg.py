"""The planner's roles over time against the offered load and the attainment, as a plain SVG
(no plotting package: the CPU lock has none). Input: `bench serve --compare-planner`'s
`timelines` (per SLO pair, one planner probe: its roles at the start and every change, and each
request's arrival offset, phase and whether it was good). One panel per pair, three rows on one
time axis: each engine's role; requests arriving per bin, coloured by phase; the share of the
bin's requests that met both SLOs, with the 90 % goal dashed."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

ROLE_COLOURS = {"prefill": "#d95f02", "decode": "#1b9e77", "mixed": "#7570b3"}
PHASE_COLOURS = {"prefill_heavy": "#fdae6b", "decode_heavy": "#74c476", "mixed": "#bdbdbd"}
WIDTH, LEFT, RIGHT = 900, 110, 20
PANEL_H = 250
BIN_S = 2.0


def write_svg(timelines: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    parts = [f'<text x="{LEFT}" y="20" font-size="14">{escape(title)}</text>']
    for i, (pair, tl) in enumerate(sorted(timelines.items())):
        parts += _panel(pair, tl, 35 + i * PANEL_H)
    height = 45 + len(timelines) * PANEL_H
    path.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
                    f'font-family="sans-serif" font-size="11">\n<rect width="100%" height="100%" fill="white"/>\n'
                    + "\n".join(parts) + "\n</svg>\n")


def _panel(pair: str, tl: dict[str, Any], top: float) -> list[str]:
    arrivals = tl.get("arrivals", [])
    wall = max([float(tl.get("wall_s", 1.0))] + [a[0] + BIN_S for a in arrivals])
    x = lambda t: LEFT + (WIDTH - LEFT - RIGHT) * t / wall  # noqa: E731
    out = [f'<text x="{LEFT}" y="{top + 12}" font-size="12">planner, SLO pair {escape(pair)}: '
           f'{tl.get("rate_rps")} rps offered, {tl.get("roles", {}).get("planner_changes", 0)} role changes</text>']
    y = top + 22
    out += _roles(tl.get("roles", {}), wall, x, y)
    y += 18 * max(1, len(tl.get("roles", {}).get("start", {}))) + 10
    out += _load(arrivals, wall, x, y, 70)
    out += _attainment(arrivals, wall, x, y + 85, 60)
    ticks = range(0, int(wall) + 1, max(1, int(wall) // 10))
    axis_y = y + 155
    out += [f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">{t}</text>' for t in ticks]
    out.append(f'<text x="{WIDTH - RIGHT}" y="{axis_y + 12}" text-anchor="end">seconds from the probe\'s start</text>')
    return out


def _roles(roles: dict[str, Any], wall: float, x: Any, top: float) -> list[str]:
    out = []
    for row, (engine, role) in enumerate(sorted(roles.get("start", {}).items())):
        y, t0 = top + 18 * row, 0.0
        out.append(f'<text x="{LEFT - 6}" y="{y + 12}" text-anchor="end">{escape(engine)}</text>')
        for change in [c for c in roles.get("changes", []) if c["engine_id"] == engine] + [None]:
            t1 = wall if change is None else float(change["t_s"])
            out.append(f'<rect x="{x(t0):.1f}" y="{y}" width="{max(0.5, x(t1) - x(t0)):.1f}" height="15" '
                       f'fill="{ROLE_COLOURS.get(role, "#999")}"><title>{escape(role)}</title></rect>')
            if change is not None:
                t0, role = t1, change["new"]
    legend = " ".join(f'<tspan fill="{c}">■ {r}</tspan>' for r, c in ROLE_COLOURS.items())
    out.append(f'<text x="{WIDTH - RIGHT}" y="{top - 2}" text-anchor="end">{legend}</text>')
    return out


def _bins(arrivals: list[list[Any]], wall: float) -> list[list[list[Any]]]:
    bins: list[list[list[Any]]] = [[] for _ in range(int(wall // BIN_S) + 1)]
    for a in arrivals:
        bins[min(len(bins) - 1, int(a[0] // BIN_S))].append(a)
    return bins


def _load(arrivals: list[list[Any]], wall: float, x: Any, top: float, height: float) -> list[str]:
    bins = _bins(arrivals, wall)
    peak = max([len(b) for b in bins] + [1]) / BIN_S
    out = [f'<text x="{LEFT - 6}" y="{top + height / 2}" text-anchor="end">offered req/s</text>',
           f'<text x="{LEFT - 6}" y="{top + 8}" text-anchor="end" fill="#666">{peak:.1f}</text>']
    for i, b in enumerate(bins):
        y = top + height
        for phase in PHASE_COLOURS:
            h = height * sum(a[1] == phase for a in b) / BIN_S / peak
            if h:
                y -= h
                out.append(f'<rect x="{x(i * BIN_S):.1f}" y="{y:.1f}" width="{x(BIN_S) - x(0) - 1:.1f}" '
                           f'height="{h:.1f}" fill="{PHASE_COLOURS[phase]}"/>')
    legend = " ".join(f'<tspan fill="{c}">■ {p}</tspan>' for p, c in PHASE_COLOURS.items())
    out.append(f'<text x="{WIDTH - RIGHT}" y="{top + 8}" text-anchor="end">{legend}</text>')
    return out


def _attainment(arrivals: list[list[Any]], wall: float, x: Any, top: float, height: float) -> list[str]:
    goal = top + height * 0.1
    out = [f'<text x="{LEFT - 6}" y="{top + height / 2}" text-anchor="end">attainment</text>',
           f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{goal:.1f}" y2="{goal:.1f}" stroke="#999" '
           f'stroke-dasharray="4 3"/>',
           f'<text x="{LEFT - 6}" y="{goal + 4:.1f}" text-anchor="end" fill="#666">90 %</text>']
    points = [f"{x((i + 0.5) * BIN_S):.1f},{top + height * (1 - sum(all(a[2]) for a in b) / len(b)):.1f}"
              for i, b in enumerate(_bins(arrivals, wall)) if b]
    if points:
        out.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="#2171b5" stroke-width="2"/>')
    return out
