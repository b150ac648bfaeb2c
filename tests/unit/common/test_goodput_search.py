"""The goodput search of `bench serve --compare-planner` (bench/goodput_search.py) on synthetic
probes: bisection without a scan, probes shared by the SLO pairs, per-phase goodput, and the SVG."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bench.goodput_search import Probe, ProbeRequest, goodput, parse_slo_pair, ratio, search
from bench.roles_svg import write_svg

TTFT_TIGHT = parse_slo_pair("ttft_tight=ttft:500,tpot:200")
ITL_TIGHT = parse_slo_pair("itl_tight=ttft:5000,tpot:50")


def system(rate: float) -> Probe:
    """TTFT grows with the rate (0.5 s at 1 rps); TPOT with it too (50 ms at 2 rps); the decode
    phase's requests are slower to a first token (2x)."""
    requests = []
    for i in range(10):
        phase = ("prefill_heavy", "decode_heavy")[i % 2]
        ttft = 0.5 * rate * (2 if phase == "decode_heavy" else 1)
        requests.append(ProbeRequest(phase, i / rate, 8, ttft, 25.0 * rate, 8))
    return Probe(rate, requests, 10 / rate)


def test_search_bisects_each_pair_and_shares_probes() -> None:
    seen: list[float] = []

    def run(rate: float) -> Probe:
        seen.append(rate)
        return system(rate)

    probes = search(run, [TTFT_TIGHT, ITL_TIGHT], 0.25, 4.0, 6)
    assert seen[0] == 1.0 and len(seen) == len(set(seen)) <= 6  # the geometric middle first, no repeats
    # ttft_tight passes while every request's TTFT <= 0.5 s: rate <= 0.5 (decode-phase TTFT is 2x).
    assert 0.35 <= goodput(probes, TTFT_TIGHT) <= 0.5
    assert 1.4 <= goodput(probes, ITL_TIGHT) <= 2.0  # TPOT <= 50 ms: rate <= 2
    # per phase: prefill-heavy meets TTFT 0.5 s up to 1 rps, from the same probes
    assert goodput(probes, TTFT_TIGHT, "prefill_heavy") == 1.0
    assert goodput(probes, TTFT_TIGHT, "decode_heavy") == goodput(probes, TTFT_TIGHT)


def test_lost_or_short_requests_are_never_good() -> None:
    good = ProbeRequest("mixed", 0.0, 4, 0.1, 10.0, 4)
    assert good.good(TTFT_TIGHT)
    assert not ProbeRequest("mixed", 0.0, 4, 0.1, 10.0, 3).good(TTFT_TIGHT)
    assert not ProbeRequest("mixed", 0.0, 4, 0.1, 10.0, 4, lost=True).good(TTFT_TIGHT)
    assert not ProbeRequest("mixed", 0.0, 4).good(TTFT_TIGHT)  # cut off: no first token
    assert goodput([Probe(1.0, [ProbeRequest("mixed", 0.0, 4)], 1.0)], TTFT_TIGHT) == 0.0
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None and ratio(3.0, 2.0) == 1.5


@pytest.mark.parametrize("text", ["ttft:1", "x=ttft:1", "x=tpot:1", "x=ttft:1,tpot:1,e2el:3", "=ttft:1,tpot:1",
                                  "x=ttft:-1,tpot:1"])
def test_bad_slo_pairs_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"--slo-pair: .* (is not NAME=|must set exactly)|must be > 0 ms"):
        parse_slo_pair(text)


def test_deadline_is_the_latest_a_good_request_can_end() -> None:
    assert TTFT_TIGHT.deadline_s(11) == pytest.approx(0.5 + 10 * 0.2)
    with pytest.raises(ValueError, match="0 < low < high"):
        search(system, [TTFT_TIGHT], 2.0, 1.0, 3)


def test_roles_svg_draws_every_role_segment(tmp_path: Path) -> None:
    timeline = {"rate_rps": 1.0, "wall_s": 12.0,
                "roles": {"start": {"d-0": "decode", "p-0": "prefill"}, "planner_changes": 1,
                          "changes": [{"t_s": 5.0, "engine_id": "p-0", "old": "prefill", "new": "mixed",
                                       "source": "planner"}]},
                "arrivals": [[0.5, "prefill_heavy", [True]], [6.0, "decode_heavy", [False]], [9.0, "mixed", [True]]]}
    write_svg({"itl_tight": timeline}, tmp_path / "t.svg", "test")
    root = ET.parse(tmp_path / "t.svg").getroot()
    fills = [r.get("fill") for r in root.iter("{http://www.w3.org/2000/svg}rect")]
    assert fills.count("#d95f02") == 1 and fills.count("#7570b3") == 1 and fills.count("#1b9e77") == 1
    assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))) == 1


def test_a_goodput_no_probe_failed_is_flagged_a_lower_bound() -> None:
    from bench.compare_planner import summarize

    probes = search(system, [TTFT_TIGHT], 0.1, 0.4, 2)  # every rate here meets ttft_tight
    failing = search(system, [TTFT_TIGHT], 0.25, 4.0, 3)
    out = summarize({"static_1p1d": {"ttft_tight": probes}, "planner": {"ttft_tight": failing}}, [TTFT_TIGHT])
    assert out["goodput_is_lower_bound"]["ttft_tight"] == {"static_1p1d": True, "planner": False}
    assert out["planner_vs_best_static"]["ttft_tight"]["overall"] == ratio(goodput(failing, TTFT_TIGHT),
                                                                           goodput(probes, TTFT_TIGHT))
