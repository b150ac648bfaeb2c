"""EventPlane assembly from the scheduler config."""

import pytest

from services.common.config import SchedulerConfig
from services.scheduler.events.plane import EventPlane
from services.scheduler.lifecycle import EngineRef
from services.scheduler.prefix_index import InMemoryPrefixIndex


def test_from_config_and_bad_settings() -> None:
    plane = EventPlane.from_config(SchedulerConfig(event_ring_size=7, subscriber_buffer=3,
                                                   medium_weights="GPU=2", prefix_index_max_entries=5))
    assert plane.republisher.ring_size == 7 and plane.republisher.subscriber_buffer == 3
    assert plane.zmq is None and isinstance(plane.index, InMemoryPrefixIndex)
    assert plane.routing_policy().medium_weights["GPU"] == 2.0
    with pytest.raises(ValueError, match="medium_weights"):
        EventPlane.from_config(SchedulerConfig(medium_weights="GPU=fast"))
    with pytest.raises(ValueError, match="zmq_replay_endpoint"):
        EventPlane.from_config(SchedulerConfig(zmq_replay_endpoint="tcp://127.0.0.1:5558"))


def test_engine_up_retires_the_old_epoch_and_never_raises() -> None:
    plane = EventPlane.from_config(SchedulerConfig())
    plane.engine_up(EngineRef("p0", 1))
    plane.engine_up(EngineRef("p0", 2))
    assert plane.republisher.epoch_of("p0") == 2
    plane.engine_up(EngineRef("p0", 1))  # a dead epoch: logged, not raised
    assert plane.republisher.epoch_of("p0") == 2


def test_dead_epochs_are_remembered_newest_first() -> None:
    idx = InMemoryPrefixIndex(max_dead_epochs=3)
    for epoch in range(1, 11):
        idx.begin_epoch("p0", epoch)
    assert [idx.is_dead_epoch("p0", e) for e in (6, 7, 8, 9, 10)] == [False, True, True, True, False]
