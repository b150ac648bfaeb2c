import pytest

from services.scheduler.admission import Admission


def test_bounded_per_engine_and_release_frees_a_slot() -> None:
    a = Admission(2)
    assert a.try_acquire("e") and a.try_acquire("e")
    assert not a.try_acquire("e") and a.rejected == 1
    assert a.try_acquire("f")  # other engines have their own bound
    a.release("e")
    assert a.has_room("e") and a.try_acquire("e")
    assert a.total() == 3


def test_double_release_and_bad_bound_are_refused() -> None:
    a = Admission(1)
    with pytest.raises(ValueError, match="no in-flight slot"):
        a.release("e")
    assert a.total() == 0
    with pytest.raises(ValueError, match='max_inflight_per_engine must be >= 1, got 0'):
        Admission(0)
