"""PlannerLoop over a real registry, Control servicer and path costs: a load that shifts from
long prompts to long outputs moves roles in the expected direction within the dwell, a steady
load does not flap, advise changes nothing; RoleAdmin logs every change with its reason."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from services.scheduler.control import ControlServicer
from services.scheduler.load_window import ArrivedRequest, FinishedRequest, LoadWindow
from services.scheduler.path_costs import PathCosts
from services.scheduler.planner import PlannerConfig, RolePlanner
from services.scheduler.registry import EngineRegistry, LoadInfo, RankHello, Role
from services.scheduler.roles import PlannerLoop, RoleAdmin, register_metrics

INTERVAL_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def cluster(clock: Clock, roles: dict[str, Role]) -> tuple[EngineRegistry, ControlServicer, RoleAdmin]:
    registry = EngineRegistry(block_size=16, hash_seed="0", heartbeat_timeout_s=1e9, clock=clock)
    for i, (engine_id, role) in enumerate(roles.items()):
        registry.register(RankHello(engine_id, role, 11 + i, 0, 1, "abc", f"127.0.0.1:{9000 + i}"))
    control = ControlServicer(registry)
    return registry, control, RoleAdmin(control)


def engine_applies(registry: EngineRegistry, control: ControlServicer, engine_id: str, role: str, epoch: int) -> None:
    """What rank 0's next heartbeat does on every replica (ControlServicer._on_heartbeat)."""
    engine = registry.engine(engine_id)
    assert engine is not None
    old = registry.follow_role(engine_id, Role(role), epoch)
    assert old is not None
    for hook in control.on_role_changed:
        hook(engine, old)


def feed(window: LoadWindow, clock: Clock, rps: float, prompt: int, output: int, seconds: float,
         finish: bool = True) -> None:
    """Requests arriving at `rps` over the last `seconds`, told to the window as the Generation
    servicer does: at admission, and (`finish`) when done, a second later."""
    for k in range(int(rps * seconds)):
        at = clock.t - seconds + k / rps
        window.arrived(ArrivedRequest(at - 1, prompt, 0, output))
        if finish:
            window.finished(FinishedRequest(at, at - 1, prompt, 0, output, 0.5, 0.05, max_tokens=output))


def loop_for(clock: Clock, admin: RoleAdmin, mode: str = "on") -> tuple[PlannerLoop, LoadWindow]:
    window = LoadWindow(30.0, clock=clock)
    planner = RolePlanner(PlannerConfig(ttft_target_s=1.0, itl_target_s=0.1, min_dwell_s=20.0), clock=clock)
    costs = PathCosts()
    return PlannerLoop(mode, planner, window, admin, costs, interval_s=INTERVAL_S), window


def run(loop: PlannerLoop, window: LoadWindow, clock: Clock, registry: EngineRegistry, control: ControlServicer,
        phase: tuple[float, int, int], seconds: float, finish: bool = True) -> list[tuple[float, str, str]]:
    """Ticks every interval for `seconds` under one load; returns (time, engine, new role)."""
    moves = []
    start = clock.t
    while clock.t - start < seconds:
        clock.t += INTERVAL_S
        feed(window, clock, phase[0], phase[1], phase[2], INTERVAL_S, finish)
        for engine in registry.engines.values():
            registry.update_load(engine.engine_id, LoadInfo(num_running=4), False)
        decision = loop.tick()
        if decision is not None and decision.move is not None and loop.mode == "on":
            engine = registry.engine(decision.move.engine_id)
            assert engine is not None
            engine_applies(registry, control, engine.engine_id, decision.move.new, engine.role_epoch + 1)
            moves.append((clock.t - start, decision.move.engine_id, decision.move.new))
    return moves


LONG_PROMPTS = (2.0, 1500, 8)
LONG_OUTPUTS = (2.0, 48, 300)


def roles_of(registry: EngineRegistry) -> dict[str, str]:
    return {e.engine_id: str(e.role) for e in registry.engines.values()}


def test_shift_from_long_prompts_to_long_outputs_moves_roles_each_way() -> None:
    clock = Clock()
    registry, control, admin = cluster(clock, {"e0": Role.DECODE, "e1": Role.MIXED})
    loop, window = loop_for(clock, admin)
    first = run(loop, window, clock, registry, control, LONG_PROMPTS, 60)
    assert first and first[0][2] == "prefill" and first[0][0] <= 2 * INTERVAL_S, first
    assert sorted(roles_of(registry).values()) == ["decode", "prefill"]
    second = run(loop, window, clock, registry, control, LONG_OUTPUTS, 90)
    # The window (30 s) turns over and the dwell (20 s) has passed: the prefill engine decodes.
    assert second and second[0][2] in ("decode", "mixed") and second[0][0] <= 40, second
    assert "prefill" not in roles_of(registry).values()
    log = admin.changes()
    assert [c["source"] for c in log] == ["planner"] * len(log) and all("predicts goodput" in c["reason"] for c in log)


def test_a_shift_is_read_from_arrivals_before_any_of_its_requests_finishes() -> None:
    """Long answers take minutes to finish; the planner acts on them as they arrive. The window
    (30 s) still holds the long prompts' finished requests, which no longer count as load."""
    clock = Clock()
    registry, control, admin = cluster(clock, {"e0": Role.DECODE, "e1": Role.MIXED})
    loop, window = loop_for(clock, admin)
    run(loop, window, clock, registry, control, LONG_PROMPTS, 60)
    assert sorted(roles_of(registry).values()) == ["decode", "prefill"]
    moves = run(loop, window, clock, registry, control, LONG_OUTPUTS, 60, finish=False)
    stats = window.stats()
    assert (stats.mean_prompt_tokens, stats.mean_output_tokens) == (LONG_OUTPUTS[1], LONG_OUTPUTS[2])
    # The dwell (20 s) after the last move bounds the reaction, not the answers' length.
    assert moves and moves[0][2] in ("decode", "mixed") and moves[0][0] <= 25, moves


def test_steady_load_does_not_flap() -> None:
    clock = Clock()
    registry, control, admin = cluster(clock, {"e0": Role.PREFILL, "e1": Role.DECODE})
    loop, window = loop_for(clock, admin)
    moves = run(loop, window, clock, registry, control, LONG_PROMPTS, 600)
    assert len(moves) <= 1, moves


def test_advise_exports_and_changes_nothing() -> None:
    clock = Clock()
    registry, control, admin = cluster(clock, {"e0": Role.DECODE, "e1": Role.MIXED})
    loop, window = loop_for(clock, admin, mode="advise")
    prometheus = CollectorRegistry()
    register_metrics(prometheus, admin, loop)
    run(loop, window, clock, registry, control, LONG_PROMPTS, 30)
    assert roles_of(registry) == {"e0": "decode", "e1": "mixed"}
    text = generate_latest(prometheus).decode()
    assert 'pdserve_planner_desired_engines{role="prefill"} 1.0' in text
    assert 'pdserve_engine_role{engine_id="e1",role="mixed"} 1.0' in text
    assert "pdserve_planner_predicted_goodput_rps" in text


def test_operator_change_is_logged_with_its_reason() -> None:
    clock = Clock()
    registry, control, admin = cluster(clock, {"e0": Role.PREFILL, "e1": Role.DECODE})
    assert admin.set_role("e0", "mixed", "night traffic") == 1
    engine_applies(registry, control, "e0", "mixed", 1)
    assert [(c["engine_id"], c["old"], c["new"], c["source"], c["reason"]) for c in admin.changes()] == [
        ("e0", "prefill", "mixed", "operator", "night traffic")]
    engine = registry.engine("e0")
    assert engine is not None and engine.epoch == 11 and engine.role_epoch == 1


def test_a_change_another_replica_made_restarts_the_dwell() -> None:
    clock = Clock()
    registry, control, admin = cluster(clock, {"e0": Role.DECODE, "e1": Role.MIXED})
    loop, window = loop_for(clock, admin)
    # Another replica's planner moved e1 (this replica only hears the engine's heartbeat).
    engine_applies(registry, control, "e1", "prefill", 1)
    assert admin.changes()[-1]["source"] == "engine"
    moves = run(loop, window, clock, registry, control, LONG_OUTPUTS, 15)
    assert moves == []  # within the dwell (20 s) of the change it saw
