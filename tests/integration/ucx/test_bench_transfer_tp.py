"""Smoke test of `pdserve bench transfer --prefill-tp 2 --decode-tp 1 --kv-transport both` at
tiny sizes, two paired rounds, ranks pinned by role (about 20 s: ten rank processes, five per
transport); `--pin-cores` parsing and refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.cli import add_arguments, run
from bench.transfer_tp import parse_pin_cores, round_order
from connectors.ucx.nixl_transport import nixl_importable


def _args(tmp_path: Path, *extra: str) -> object:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["transfer", "--prefill-tp", "2", "--decode-tp", "1", "--num-layers", "2",
                              "--sizes", "1,3", "--iters", "2", "--json", "--out", str(tmp_path), *extra])


def test_hetero_and_equal_pulls_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    both = nixl_importable()  # each transport's pairings in one run (nine rank processes)
    # Pinned by role (the run checks every rank's affinity against its role's cores).
    cores = sorted(os.sched_getaffinity(0))
    pin = f"decode:{cores[0]},prefill:{cores[-1]}"
    assert run(_args(tmp_path, "--kv-transport", "both" if both else "ucx-tag", "--pin-cores", pin)) == 0  # type: ignore[arg-type]
    out = json.loads(capsys.readouterr().out)
    summaries = out if both else {"ucx-tag": out}
    for transport, summary in summaries.items():
        name = "transfer_tp2to1" + ("_nixl" if transport == "nixl" else "")
        assert summary == json.loads((tmp_path / f"{name}.json").read_text())
        assert summary["kv_transport"] == transport
        assert summary["pin_cores"] == {"decode": [cores[0]], "prefill": [cores[-1]]}
        assert [r["blocks"] for r in summary["rows"]] == [1, 3] and summary["iters"] == 2
        for row in summary["rows"]:
            assert row["bytes_per_decode_rank"] == row["blocks"] * summary["decode_rank_block_nbytes"]
            assert row["gbps_per_decode_rank"]["hetero"] > 0 and row["gbps_per_decode_rank"]["equal"] > 0
            # The ratio is the median of the paired rounds' ratios, inside their IQR.
            ratios, (q1, q3) = row["paired_ratios"], row["ratio_iqr"]
            assert len(ratios) == 2 and all(r > 0 for r in ratios)
            assert row["ratio_hetero_vs_equal"] == pytest.approx(sum(ratios) / 2)
            assert min(ratios) <= q1 <= row["ratio_hetero_vs_equal"] <= q3 <= max(ratios)
        assert summary["min_ratio_hetero_vs_equal"] > 0


def test_rounds_alternate_the_pairings_order_keeping_each_pair_adjacent() -> None:
    order = ["hetero/ucx-tag", "equal/ucx-tag", "hetero/nixl", "equal/nixl"]
    assert round_order(order, 0) == order and round_order(order, 2) == order
    assert round_order(order, 1) == ["equal/nixl", "hetero/nixl", "equal/ucx-tag", "hetero/ucx-tag"]


def test_too_few_iterations_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--iters must be >= 1, got -1"):
        run(_args(tmp_path, "--iters", "-1"))  # type: ignore[arg-type]


def test_unmappable_pairing_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tp=2 does not divide num_key_value_heads=3"):
        run(_args(tmp_path, "--kv-heads", "3"))  # type: ignore[arg-type]


def test_pin_cores_spec_is_parsed_per_role() -> None:
    assert parse_pin_cores("none", {0, 1}) == {}
    assert parse_pin_cores("auto", {0, 1}) == {"decode": (0,), "prefill": (1,)}
    assert parse_pin_cores("auto", {2, 3, 5, 7, 8}) == {"decode": (2, 3), "prefill": (5, 7, 8)}
    assert parse_pin_cores("auto", {3}) == {}  # one core: nothing to split
    assert parse_pin_cores("decode:0,prefill:1-3", {0, 1, 2, 3}) == {"decode": (0,), "prefill": (1, 2, 3)}
    assert parse_pin_cores(" prefill:1 ", {0, 1}) == {"prefill": (1,)}


@pytest.mark.parametrize("spec, reason", [
    ("gpu:0", "'gpu:0' is not decode:CPUS or prefill:CPUS"),
    ("", r"'' is not decode:CPUS or prefill:CPUS \(or auto, none\)"),
    ("decode", "'decode' is not decode:CPUS or prefill:CPUS"),
    ("decode:0,decode:1", "decode given twice"),
    ("decode:x", "'x' is not N or N-M"),
    ("decode:3-1", "'3-1' is not a range of cores"),
    ("prefill:1-2", r"core\(s\) \[2\] of prefill not available to this process \(available: \[0, 1\]\)"),
])
def test_bad_pin_cores_are_refused_with_the_reason(spec: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_pin_cores(spec, {0, 1})
