"""Engine roles in the scheduler: operator changes, the role planner's loop, their metrics.

`RoleAdmin` is what the admin endpoint and the planner call: it asks the engine for a role
through the Control servicer (SetRole), and keeps a bounded log of every change asked for, with
its source and reason. `PlannerLoop` runs the pure `RolePlanner` on a timer from the load window
and the live path-cost fits: `advise` exports what it would do, `on` also does it (one engine
per decision). Metrics: pdserve_engine_role{engine_id,role} (1 for the role an engine serves,
0 for the others), pdserve_planner_desired_engines{role}, pdserve_planner_predicted_goodput_rps
{split="current"|"desired"}, pdserve_planner_observed_goodput_rps.

Scheduler replicas (docs/decisions/0044): the engine is the source of truth for its role and
states it in every heartbeat to every replica, so replicas that did not ask follow, and every
change seen restarts each planner's dwell. Run one replica with `on` and the others with
`advise`; should two acting planners ask one engine at once, its compare-and-set on the role
generation lets one win (two may still move two different engines within one heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry

from services.common.metrics import PlannerReading, RoleMetrics
from services.scheduler.control import ControlServicer
from services.scheduler.load_window import LoadWindow
from services.scheduler.path_costs import PathCosts
from services.scheduler.planner import ROLES, EngineRoleView, PlanDecision, PlannerInputs, RolePlanner
from services.scheduler.registry import EngineState, Role

logger = logging.getLogger(__name__)
PLANNER_MODES = ("off", "advise", "on")


@dataclass(frozen=True, slots=True)
class RoleChangeEntry:
    at: float  # wall clock
    engine_id: str
    old: str
    new: str
    role_epoch: int
    source: str  # "operator", "planner" or "engine" (a change another replica asked for)
    reason: str


class RoleAdmin:
    """Role changes by hand or by the planner (see the module docstring)."""

    def __init__(self, control: ControlServicer, max_log: int = 256) -> None:
        self.control = control
        self.registry = control.registry
        self.log: deque[RoleChangeEntry] = deque(maxlen=max_log)
        self._asked: dict[str, tuple[str, str]] = {}  # engine id -> (source, reason) of a pending ask
        # Told of every change an engine reports, whoever asked (the planner restarts its dwell).
        self.listeners: list[Callable[[RoleChangeEntry], None]] = []
        control.on_role_changed.append(self._changed)

    def set_role(self, engine_id: str, role: str, reason: str, source: str = "operator") -> int:
        """Asks `engine_id` to serve `role`; returns the role generation asked for. Raises
        KeyError (unknown engine) or ValueError (bad role, engine unhealthy or already there)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        role_epoch = self.control.set_role(engine_id, Role(role), reason)
        self._asked[engine_id] = (source, reason)
        return role_epoch

    def _changed(self, engine: EngineState, old: Role) -> None:
        source, reason = self._asked.pop(engine.engine_id, ("engine", "asked by another scheduler replica"))
        entry = RoleChangeEntry(time.time(), engine.engine_id, str(old), str(engine.role), engine.role_epoch,
                                source, reason)
        self.log.append(entry)
        logger.info("role change: engine %s %s -> %s (role epoch %d) by %s: %s", entry.engine_id, entry.old,
                    entry.new, entry.role_epoch, source, reason)
        for listener in self.listeners:
            listener(entry)

    def engines(self) -> list[dict[str, object]]:
        return [{"engine_id": e.engine_id, "role": str(e.role), "role_epoch": e.role_epoch, "epoch": e.epoch,
                 "routable": e.routable} for e in sorted(self.registry.engines.values(), key=lambda e: e.engine_id)]

    def changes(self) -> list[dict[str, object]]:
        return [asdict(c) for c in self.log]


class PlannerLoop:
    """Runs the planner every `interval_s` (see the module docstring)."""

    def __init__(self, mode: str, planner: RolePlanner, window: LoadWindow, admin: RoleAdmin, costs: PathCosts,
                 interval_s: float = 5.0) -> None:
        if mode not in PLANNER_MODES:
            raise ValueError(f"planner must be one of {', '.join(PLANNER_MODES)}, got {mode!r}")
        self.mode, self.planner, self.window, self.admin, self.costs = mode, planner, window, admin, costs
        self.interval_s = interval_s
        self.decisions: deque[PlanDecision] = deque(maxlen=64)
        self._task: asyncio.Task[None] | None = None
        admin.listeners.append(self._changed)

    def _changed(self, entry: RoleChangeEntry) -> None:
        """Any role change (an operator's, another replica's planner) restarts the dwell, so
        replicas that plan at once do not stack moves and a hand-set role is not undone at once."""
        self.planner.last_change_at = self.planner.clock()

    def start(self) -> None:
        if self.mode != "off":
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a planning error must not end the loop
                logger.exception("role planner tick failed")

    def inputs(self) -> PlannerInputs | None:
        """What the planner reads now; None when nothing finished in the window."""
        stats = self.window.stats()
        engines = [e for e in self.admin.registry.engines.values() if e.healthy]
        if stats.num_requests == 0 or not engines:
            return None
        fixed = self.costs.prefill_s(0)
        per_token = max(1e-7, (self.costs.prefill_s(1000) - fixed) / 1000)
        step_s, per_seq_s = self._decode_step([e for e in engines if e.role.side == Role.DECODE])
        views = [EngineRoleView(e.engine_id, str(e.role), e.load.num_running + e.load.num_waiting) for e in engines]
        return PlannerInputs(views, stats.arrival_rps, stats.mean_prompt_tokens, stats.mean_output_tokens,
                             stats.prefix_hit_rate, fixed, per_token, step_s, per_seq_s,
                             stats.ttft_target_s, stats.itl_target_s)

    def _decode_step(self, decoding: list[EngineState]) -> tuple[float, float]:
        """(step with one sequence, what each further one adds): a forward pass of one token
        (the prefill fit) as the first, and the rest of each engine's measured step charged to the
        sequences it was running (its load), averaged over the decoding engines."""
        base = self.costs.prefill_s(1)
        slopes = [max(0.0, self.costs.step_s(e.engine_id) - base) / e.load.num_running
                  for e in decoding if e.load.num_running > 0]
        return base, sum(slopes) / len(slopes) if slopes else 0.0

    def tick(self) -> PlanDecision | None:
        x = self.inputs()
        if x is None:
            return None
        decision = self.planner.plan(x)
        self.decisions.append(decision)
        observed = self.planner.observe(self.window.stats().goodput_rps)
        if observed is not None:
            logger.info("planner: after %s -> %s of %s, goodput observed %.2f rps (predicted %.2f, before %.2f)",
                        observed.move.old, observed.move.new, observed.move.engine_id, observed.observed_rps or 0.0,
                        observed.predicted_new_rps, observed.predicted_old_rps)
        if decision.move is None:
            return decision
        logger.info("planner (%s): %s", self.mode, decision.reason)
        if self.mode == "on":
            try:
                self.admin.set_role(decision.move.engine_id, decision.move.new, decision.reason, source="planner")
                self.planner.record(decision, x)
            except (KeyError, ValueError) as e:
                logger.warning("planner: could not move %s: %s", decision.move.engine_id, e)
        return decision


def register_metrics(prometheus: CollectorRegistry, admin: RoleAdmin, loop: PlannerLoop | None) -> None:
    """pdserve_engine_role and the planner's gauges (services.common.metrics.RoleMetrics)."""

    def roles() -> list[tuple[str, str]]:
        return [(e.engine_id, str(e.role)) for e in list(admin.registry.engines.values())]

    def plan() -> PlannerReading | None:
        decision = loop.planner.last if loop is not None else None
        if loop is None or decision is None:
            return None
        return PlannerReading({r: decision.desired.count(r) for r in ROLES}, decision.predicted_current_rps,
                              decision.predicted_desired_rps, loop.window.stats().goodput_rps)

    RoleMetrics(prometheus).track(roles, plan, ROLES)
