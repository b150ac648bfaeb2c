"""EngineViews keeps views between requests: after any sequence of changes to what a view shows,
its answer equals building every view afresh (a new EngineViews)."""

import random

import pytest

from services.scheduler.admission import Admission
from services.scheduler.engine_views import EngineViews
from services.scheduler.path_costs import PathCosts
from services.scheduler.registry import EngineRegistry, LoadInfo, RankHello, RankId, Role


def _hello(engine_id: str, role: Role, tp_rank: int, epoch: int = 1) -> RankHello:
    return RankHello(engine_id, role, epoch, tp_rank, 2, "abc", "127.0.0.1:9000")


def _cluster() -> tuple[EngineRegistry, Admission, PathCosts]:
    reg = EngineRegistry(block_size=16, hash_seed="0", heartbeat_timeout_s=5.0, clock=lambda: 0.0)
    for i in range(4):
        for role, prefix in ((Role.PREFILL, "p"), (Role.DECODE, "d")):
            for tp in range(2):
                reg.register(_hello(f"{prefix}{i}", role, tp))
    return reg, Admission(2), PathCosts()


def _change(rng: random.Random, reg: EngineRegistry, admission: Admission, costs: PathCosts,
            tickets: dict[str, list[int]]) -> None:
    engine_id = rng.choice(sorted(reg.engines))
    what = rng.randrange(9)
    if what == 0:
        admission.try_acquire(engine_id)
    elif what == 1 and admission.inflight(engine_id):
        admission.release(engine_id)
    elif what == 2:
        reg.update_load(engine_id, LoadInfo(rng.randrange(3), rng.randrange(3), rng.choice([0.0, 0.5])), False)
    elif what == 3:
        tickets.setdefault(engine_id, []).append(costs.add_backlog(engine_id, rng.randrange(1, 64)))
    elif what == 4 and tickets.get(engine_id):
        costs.settle_backlog(engine_id, tickets[engine_id].pop(0), rng.choice([None, 0.1]))
    elif what == 5:
        costs.add_itl_target(engine_id, rng.choice([0.01, 0.02]))
    elif what == 6:
        costs.remove_itl_target(engine_id, rng.choice([0.01, 0.02]))
    elif what == 7:
        reg.update_load(engine_id, reg.engines[engine_id].load, rng.random() < 0.3)  # draining toggles
    else:  # a new epoch (fences the old one), half registered: not routable until both ranks are
        engine = reg.engines[engine_id]
        reg.register(_hello(engine_id, engine.role, 0, engine.epoch + 1))
        if rng.random() < 0.7:
            reg.register(_hello(engine_id, engine.role, 1, engine.epoch + 1))


@pytest.mark.parametrize("seed", range(5))
def test_kept_views_equal_fresh_ones_after_any_changes(seed: int) -> None:
    rng = random.Random(seed)
    reg, admission, costs = _cluster()
    kept = EngineViews(reg, admission, costs)
    tickets: dict[str, list[int]] = {}
    for _ in range(300):
        _change(rng, reg, admission, costs, tickets)
        exclude = frozenset(rng.sample(sorted(reg.engines), rng.randrange(2)))
        for role in (Role.PREFILL, Role.DECODE):
            assert kept.views(role, exclude) == EngineViews(reg, admission, costs).views(role, exclude)


def test_unchanged_engines_keep_their_view_and_a_changed_one_is_rebuilt() -> None:
    reg, admission, costs = _cluster()
    views = EngineViews(reg, admission, costs)
    first = views.views(Role.DECODE)
    admission.try_acquire("d1")
    second = views.views(Role.DECODE)
    assert [a is b for a, b in zip(first, second, strict=True)] == [True, False, True, True]
    assert second[1].num_inflight == 1 and second[1].load_score == 1.0
    admission.try_acquire("d1")  # the bound (2): no room, left out
    assert [v.engine_id for v in views.views(Role.DECODE)] == ["d0", "d2", "d3"]
    reg.disconnect(RankId("d2", 1), reg.engines["d2"].ranks[RankId("d2", 1)].conn_id)
    assert [v.engine_id for v in views.views(Role.DECODE)] == ["d0", "d3"]
