"""EngineRole: compare-and-set role generations, admission by leg, the grace period."""

from __future__ import annotations

import pytest

from services.engine.role_state import EngineRole


def test_change_needs_the_next_generation() -> None:
    t = [0.0]
    role = EngineRole("prefill", grace_s=5, clock=lambda: t[0])
    assert role.apply("decode", 2) is None and role.role == "prefill"
    change = role.apply("decode", 1, "operator")
    assert change is not None and (change.old, change.new, change.reason) == ("prefill", "decode", "operator")
    assert role.apply("decode", 1) is None  # repeated: nothing changes
    assert role.role_epoch == 1


def test_admission_by_leg_with_grace_for_the_old_role() -> None:
    t = [0.0]
    role = EngineRole("prefill", grace_s=5, clock=lambda: t[0])
    assert role.admits("prefill") and not role.admits("decode")
    role.apply("mixed", 1)
    assert role.admits("decode") and role.admits("prefill")  # old role's calls still in flight
    t[0] = 6.0
    assert role.admits("decode") and not role.admits("prefill")


def test_unknown_role_refused() -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        EngineRole("both")
    assert EngineRole("decode").apply("both", 1) is None
