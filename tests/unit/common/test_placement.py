"""`plan_placement`: every role/TP/GPU-count combination is either placed by the rules of
services/placement.py or refused with its reason; a few shapes pinned exactly."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from services.placement import DEFAULT_KV_SHARE, PlacementError, PlacementPlan, plan_placement

GPU_COUNTS = (1, 2, 3, 4, 8)
TP_SIZES = (1, 2, 4, 8)
ENGINE_COUNTS = ((0, 1), (1, 1), (2, 1), (1, 2), (2, 3))  # (prefill, decode)


def _expected_refusal(gpus: int, num_prefill: int, num_decode: int, prefill_tp: int, decode_tp: int,
                      share: bool) -> str | None:
    """The rules, restated: which reason (a fragment of it) the plan must give, or None."""
    if num_prefill and prefill_tp > gpus:
        return f"prefill tp {prefill_tp} needs {prefill_tp} GPUs (one per rank), {gpus} available"
    if decode_tp > gpus:
        return f"decode tp {decode_tp} needs {decode_tp} GPUs (one per rank), {gpus} available"
    total = num_prefill * prefill_tp + num_decode * decode_tp
    if total > gpus and not share:
        return f"= {total} ranks need {total} GPUs, {gpus} available: drop --exclusive-gpus"
    return None


def _check_plan(plan: PlacementPlan, gpus: int, num_prefill: int, num_decode: int, prefill_tp: int,
                decode_tp: int, share: bool) -> None:
    names = [f"prefill-{i}" for i in range(num_prefill)] + [f"decode-{i}" for i in range(num_decode)]
    assert [e.name for e in plan.engines] == names
    load: Counter[int] = Counter()
    for e in plan.engines:
        tp = prefill_tp if e.role == "prefill" else decode_tp
        assert len(e.gpus) == tp and len(set(e.gpus)) == tp, e  # one distinct GPU per rank
        assert all(0 <= g < gpus for g in e.gpus)
        load.update(e.gpus)
    counts = [load[g] for g in range(gpus)]
    if not share:
        assert max(counts) == 1
    assert max(counts) - min(counts) <= 1  # balanced: round-robin
    for e in plan.engines:
        assert e.memory_fraction == pytest.approx(DEFAULT_KV_SHARE / max(load[g] for g in e.gpus))
    for g in range(gpus):  # the KV shares on one GPU add up to at most the KV share
        on_gpu = sum(e.memory_fraction for e in plan.engines for x in e.gpus if x == g)
        assert on_gpu <= DEFAULT_KV_SHARE + 1e-9


@pytest.mark.parametrize("gpus,prefill_tp,decode_tp", list(itertools.product(GPU_COUNTS, TP_SIZES, TP_SIZES)))
def test_every_shape_is_placed_by_the_rules_or_refused_with_its_reason(gpus: int, prefill_tp: int,
                                                                        decode_tp: int) -> None:
    for (num_prefill, num_decode), share in itertools.product(ENGINE_COUNTS, (False, True)):
        reason = _expected_refusal(gpus, num_prefill, num_decode, prefill_tp, decode_tp, share)
        args = (gpus, num_prefill, num_decode, prefill_tp, decode_tp)
        if reason is not None:
            with pytest.raises(PlacementError, match=re.escape(reason)):
                plan_placement(*args, share_gpus=share)
            continue
        plan = plan_placement(*args, share_gpus=share)
        _check_plan(plan, *args, share)
        if not share:  # asking for a split that is not needed changes nothing
            assert plan_placement(*args, share_gpus=True) == plan


def test_each_role_places_by_its_own_tp_on_consecutive_gpus() -> None:
    plan = plan_placement(4, 1, 1, 2, 1)
    assert plan.engine_devices() == ["0,1", "2"] and plan.memory_fractions() == [0.5, 0.5]
    assert plan.render() == ["engine       rank  gpu  kv-share",
                             "prefill-0       0    0  0.5000",
                             "prefill-0       1    1  0.5000",
                             "decode-0        0    2  0.5000",
                             "unused GPU(s): 3"]
    assert plan_placement(8, 2, 2, 1, 2).engine_devices() == ["0", "1", "2,3", "4,5"]


def test_shared_gpus_split_the_kv_share_by_the_busiest_gpu_of_each_engine() -> None:
    one = plan_placement(1, 1, 1, 1, 1, share_gpus=True)
    assert one.engine_devices() == ["0", "0"] and one.memory_fractions() == [0.25, 0.25]
    # GPU 0 carries rank 0 of the prefill engine and the decode engine; GPU 1 only prefill rank 1.
    mixed = plan_placement(2, 1, 1, 2, 1, share_gpus=True)
    assert mixed.engine_devices() == ["0,1", "0"] and mixed.memory_fractions() == [0.25, 0.25]
    wrap = plan_placement(3, 2, 1, 2, 1, share_gpus=True)
    assert wrap.engine_devices() == ["0,1", "2,0", "1"]
    assert wrap.ranks_on(0) == [("prefill-0", 0), ("prefill-1", 1)]
    explicit = plan_placement(1, 1, 1, 1, 1, share_gpus=True, memory_fraction=0.3)
    assert explicit.memory_fractions() == [0.3, 0.3]


def test_refusals_name_the_reason() -> None:
    with pytest.raises(PlacementError, match=r"no GPU to place engines on \(0 GPUs\)"):
        plan_placement(0, 1, 1, 1, 1)
    with pytest.raises(PlacementError, match="GPUs cannot be shared within one engine"):
        plan_placement(2, 1, 1, 4, 1, share_gpus=True)
    with pytest.raises(PlacementError, match=r"1 prefill x tp 2 \+ 1 decode x tp 1 = 3 ranks need 3 GPUs, 2 available"):
        plan_placement(2, 1, 1, 2, 1)
    with pytest.raises(PlacementError, match=r"--gpu-memory-fraction 0.6 times 2 ranks on GPU 0 must stay below 1"):
        plan_placement(1, 1, 1, 1, 1, share_gpus=True, memory_fraction=0.6)
    with pytest.raises(PlacementError, match=r"--gpu-memory-fraction must be in \[0, 1\), got 1.5"):
        plan_placement(4, 1, 1, 1, 1, memory_fraction=1.5)
    with pytest.raises(PlacementError, match="need at least 0 prefill and 1 decode engine, got 1 and 0"):
        plan_placement(4, 1, 0, 1, 1)
    with pytest.raises(PlacementError, match="TP sizes must be >= 1, got prefill 0, decode 1"):
        plan_placement(4, 1, 1, 0, 1)


def test_a_role_without_engines_does_not_constrain_the_gpus() -> None:
    plan = plan_placement(1, 0, 1, 8, 1)  # no prefill engine: its tp 8 asks for nothing
    assert plan.engine_devices() == ["0"]
