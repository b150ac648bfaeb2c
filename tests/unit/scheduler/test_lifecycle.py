import pytest

from services.scheduler.lifecycle import (
    EngineRef,
    LifecycleError,
    ReleaseCause,
    RequestState,
    RequestTable,
)

P = EngineRef("p0", 1)
D = EngineRef("d0", 2)


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_disaggregated_path_and_single_release() -> None:
    t = RequestTable(Clock())
    r = t.admit("r1", 40, timeout_s=5)
    t.start_prefill(r, P)
    t.prefill_done(r, lease_expires=40.0)
    t.start_decode(r, D)
    assert r.state == RequestState.TRANSFERRING
    assert t.tokens_streamed(r, 1) == 0 and r.state == RequestState.DECODING
    assert t.tokens_streamed(r, 3) == 1
    assert t.release_prefill(r, ReleaseCause.TRANSFERRED)
    assert not t.release_prefill(r, ReleaseCause.ABORT)
    assert not t.release_prefill(r, ReleaseCause.LEASE_EXPIRED)
    t.finish(r, RequestState.FINISHED, "stop")
    t.finish(r, RequestState.ABORTED, "cancelled")  # later causes are no-ops
    assert r.state == RequestState.FINISHED
    assert t.release_outcomes == {"transferred": 1}
    assert t.release_noops == {"abort": 1, "lease_expired": 1}
    assert t.outcomes == {"finished:stop": 1}
    t.remove(r)
    assert t.leaks() == []


def test_abort_first_releases_and_later_transfer_is_a_noop() -> None:
    t = RequestTable(Clock())
    r = t.admit("r1", 40, 5)
    t.start_prefill(r, P)
    t.prefill_done(r, None)
    t.finish(r, RequestState.ABORTED, "cancelled")
    assert t.release_prefill(r, ReleaseCause.ABORT)
    assert not t.release_prefill(r, ReleaseCause.TRANSFERRED)
    with pytest.raises(LifecycleError, match='aborted -> decoding is not allowed'):
        t.start_decode(r, D)


def test_prefill_failure_recompute_and_retry() -> None:
    t = RequestTable(Clock())
    r = t.admit("r1", 40, 5)
    t.start_prefill(r, P)
    t.prefill_failed(r, retry=True)
    assert r.state == RequestState.QUEUED and r.failed_prefill_engines == {"p0"}
    t.start_prefill(r, EngineRef("p1", 3))
    t.prefill_failed(r, retry=False)
    assert r.state == RequestState.DECODING and r.num_prefill_attempts == 2
    assert not t.release_prefill(r, ReleaseCause.ABORT)  # nothing was pinned
    t.start_decode(r, D)
    assert r.decode == D


def test_decode_only_and_migration_keep_the_stream_index() -> None:
    t = RequestTable(Clock())
    r = t.admit("r1", 4, 5)
    t.start_decode(r, D)
    assert r.state == RequestState.DECODING
    t.tokens_streamed(r, 5)
    with pytest.raises(LifecycleError, match="use migrate"):
        t.start_decode(r, EngineRef("d1", 4))
    t.migrate(r, EngineRef("d1", 4))
    assert r.num_migrations == 1 and r.failed_decode_engines == {"d0"}
    assert t.tokens_streamed(r, 2) == 5


def test_deadline_lease_and_engine_queries() -> None:
    clock = Clock()
    t = RequestTable(clock)
    a = t.admit("a", 1, 1.0)
    b = t.admit("b", 1, 3.0)
    t.start_prefill(b, P)
    t.prefill_done(b, lease_expires=12.0)
    with pytest.raises(ValueError, match="already in flight"):
        t.admit("a", 1, 1.0)
    clock.now = 11.5
    assert [r.request_id for r in t.expired()] == ["a"]
    assert t.lease_expired() == []
    clock.now = 12.0
    assert [r.request_id for r in t.lease_expired()] == ["b"]
    assert [r.request_id for r in t.on_engine("p0", 1)] == ["b"]
    assert t.on_engine("p0", 2) == []
    with pytest.raises(LifecycleError, match='remove while queued'):
        t.remove(a)
    assert sorted(t.leaks()) == ["a: queued", "b: prefilling"]
