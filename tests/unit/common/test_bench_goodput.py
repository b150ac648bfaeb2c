"""bench/goodput.py: vLLM's --goodput syntax, TPOT, attainment and the rate sweep."""

from __future__ import annotations

import pytest

from bench.goodput import GoodputSlo, goodput_rps, is_good, parse_goodput, sweep, tpot_ms
from services.client import GenerationResult


def result(ttft_s: float, e2e_s: float, tokens: int) -> GenerationResult:
    return GenerationResult("r", ttft_s=ttft_s, e2e_s=e2e_s, generated_tokens=tokens)


def test_parse_vllm_syntax() -> None:
    assert parse_goodput(["ttft:500", "tpot:50"]) == GoodputSlo(500.0, 50.0, None)
    with pytest.raises(ValueError, match="METRIC:MS"):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match="must be > 0"):
        parse_goodput(["ttft:0"])


def test_good_means_every_listed_slo() -> None:
    slo = GoodputSlo(ttft_ms=500, tpot_ms=50)
    assert tpot_ms(result(0.2, 1.2, 21)) == pytest.approx(50.0)
    assert is_good(result(0.2, 1.2, 21), slo)
    assert not is_good(result(0.6, 1.2, 21), slo)  # TTFT
    assert not is_good(result(0.2, 2.2, 21), slo)  # TPOT
    assert is_good(result(0.2, 9.0, 1), slo)  # one token: TPOT 0


def test_sweep_finds_the_highest_rate_at_90_percent() -> None:
    def run_at(rate: float) -> tuple[list[GenerationResult], float]:
        slow = 0.1 * rate  # TTFT grows with the rate
        return [result(slow + 0.01 * i, slow + 1.0, 11) for i in range(10)], 10.0

    curve = sweep(run_at, [1, 2, 4, 6, 8, 10], GoodputSlo(ttft_ms=500))
    assert [p.rate_rps for p in curve][:3] == [1, 2, 4]
    assert goodput_rps(curve) == 4  # at 6 rps TTFT starts at 0.6 s
    assert len(curve) == 5  # stopped after two rates below the goal


def test_phased_workload_goes_prefill_heavy_then_decode_heavy_then_mixed() -> None:
    import argparse

    from bench.serve import build_workload

    args = argparse.Namespace(workload="phased", num_requests=30, prompt_len="64:512", output_len="16:32",
                              short_len="8:32", seed=0, prefix_len=384, num_prefixes=4, short_fraction=0.5)
    wl = build_workload(args, 49152)
    assert wl.kinds == ["prefill_heavy"] * 10 + ["decode_heavy"] * 10 + ["mixed"] * 10
    assert all(len(p) >= 288 and o == 16 for p, o in zip(wl.prompts[:10], wl.max_tokens[:10], strict=True))
    assert all(len(p) <= 32 and o == 128 for p, o in zip(wl.prompts[10:20], wl.max_tokens[10:20], strict=True))
