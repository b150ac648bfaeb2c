"""RolePlanner: direction of changes under shifting load, hysteresis and dwell (no flapping)."""

from __future__ import annotations

from services.scheduler.planner import (
    EngineRoleView,
    PlannerConfig,
    PlannerInputs,
    RolePlanner,
    Split,
    splits,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def engines(*roles: str) -> list[EngineRoleView]:
    return [EngineRoleView(f"e{i}", r) for i, r in enumerate(roles)]


def long_prompts(roles: list[EngineRoleView]) -> PlannerInputs:
    return PlannerInputs(roles, arrival_rps=2.0, mean_prompt_tokens=1500, mean_output_tokens=16, step_s=0.02,
                         step_per_seq_s=0.001)


def long_outputs(roles: list[EngineRoleView]) -> PlannerInputs:
    return PlannerInputs(roles, arrival_rps=2.0, mean_prompt_tokens=64, mean_output_tokens=300, step_s=0.02,
                         step_per_seq_s=0.001)


def apply(roles: list[EngineRoleView], engine_id: str, new: str) -> list[EngineRoleView]:
    return [EngineRoleView(e.engine_id, new if e.engine_id == engine_id else e.role) for e in roles]


def test_splits_cover_every_role_assignment_with_a_decoder() -> None:
    assert Split(2, 0, 0) not in splits(2)
    assert set(splits(2)) == {Split(0, 0, 2), Split(0, 1, 1), Split(0, 2, 0), Split(1, 0, 1), Split(1, 1, 0)}


def test_long_prompts_want_a_prefill_engine_long_outputs_do_not() -> None:
    clock = Clock()
    planner = RolePlanner(PlannerConfig(min_dwell_s=10), clock=clock)
    roles = engines("decode", "mixed")
    d = planner.plan(long_prompts(roles))
    assert d.move is not None and (d.move.old, d.move.new) == ("mixed", "prefill")
    assert d.predicted_desired_rps > d.predicted_current_rps * 1.1
    planner.record(d, long_prompts(roles))
    roles = apply(roles, d.move.engine_id, d.move.new)
    clock.t += 30
    d = planner.plan(long_outputs(roles))
    assert d.move is not None and d.move.old == "prefill" and d.move.new in ("mixed", "decode")
    assert "predicts goodput" in d.reason


def test_more_prefill_engines_under_long_prompts_on_four_engines() -> None:
    planner = RolePlanner(PlannerConfig(min_dwell_s=0), clock=Clock())
    roles = engines("prefill", "decode", "decode", "decode")
    x = PlannerInputs(roles, arrival_rps=4, mean_prompt_tokens=2000, mean_output_tokens=16, step_s=0.02,
                      step_per_seq_s=0.002)
    d = planner.plan(x)
    assert d.desired.prefill > 1 and d.move is not None and d.move.new == "prefill"


def test_steady_load_does_not_flap() -> None:
    clock = Clock()
    planner = RolePlanner(PlannerConfig(min_dwell_s=20), clock=clock)
    roles = engines("decode", "mixed")
    moves = []
    for _ in range(60):  # ten minutes of decisions every 10 s, one steady load
        d = planner.plan(long_prompts(roles))
        if d.move is not None:
            planner.record(d, long_prompts(roles))
            moves.append(d.move)
            roles = apply(roles, d.move.engine_id, d.move.new)
        clock.t += 10
    assert len(moves) == 1  # one move to the best split, then it holds


def test_dwell_holds_a_second_change() -> None:
    clock = Clock()
    planner = RolePlanner(PlannerConfig(min_dwell_s=60), clock=clock)
    roles = engines("decode", "mixed")
    d = planner.plan(long_prompts(roles))
    planner.record(d, long_prompts(roles))
    assert d.move is not None
    roles = apply(roles, d.move.engine_id, d.move.new)
    clock.t += 5
    held = planner.plan(long_outputs(roles))
    assert held.move is None and "dwell" in held.reason
    assert planner.observe(1.0) is None  # too early to judge the change
    clock.t += 60
    assert planner.observe(1.5) is not None and planner.history[-1].observed_rps == 1.5


def test_hysteresis_holds_when_the_gain_is_small() -> None:
    planner = RolePlanner(PlannerConfig(hysteresis=10.0, min_dwell_s=0), clock=Clock())
    d = planner.plan(long_prompts(engines("decode", "mixed")))
    assert d.move is None and "hysteresis" in d.reason


def test_request_targets_replace_the_configured_ones() -> None:
    planner = RolePlanner(PlannerConfig(ttft_target_s=1.0, itl_target_s=0.1))
    x = long_prompts(engines("prefill", "decode"))
    loose = planner.predict(Split(1, 1, 0), x)
    tight = planner.predict(Split(1, 1, 0), PlannerInputs(**{**_fields(x), "ttft_target_s": 0.3}))
    assert tight < loose


def _fields(x: PlannerInputs) -> dict[str, object]:
    return {name: getattr(x, name) for name in x.__dataclass_fields__}
