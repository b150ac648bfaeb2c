"""The scheduler process's GC settings after start-up (services/scheduler/main.py)."""

import gc

from services.scheduler.main import GC_YOUNG_THRESHOLD, settle_gc


def test_settle_gc_freezes_start_up_state_and_raises_only_the_young_threshold() -> None:
    before = gc.get_threshold()
    try:
        settle_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
