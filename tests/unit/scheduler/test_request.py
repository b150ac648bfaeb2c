import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from services.scheduler.lifecycle import EngineRef, LifecycleError, ReleaseCause, RequestState
from services.scheduler.request_table import RequestTable
from services.scheduler.validation import ValidRequest

P = EngineRef("p0", 1)
D = EngineRef("d0", 2)


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def valid(num_prompt_tokens: int, output_token_ids: list[int] | None = None) -> ValidRequest:
    return ValidRequest(list(range(num_prompt_tokens)), gen_pb.SamplingParams(), 16, output_token_ids or [])


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_disaggregated_path_and_single_release() -> None:
    released: list[tuple[str, bool]] = []
    t = RequestTable(Clock(), on_release=lambda cause, first: released.append((cause, first)))
    r = t.admit("r1", valid(40), timeout_s=5, client_id="client-1")
    assert (r.client_id, r.num_prompt_tokens, r.deadline) == ("client-1", 40, 15.0)
    r.start_prefill(P)
    r.prefill_done(lease_expires=40.0, num_cached_tokens=16)
    assert (r.prefill_engine_id, r.num_cached_tokens, r.path_name) == ("p0", 16, "disaggregated")
    r.start_decode(D)
    assert r.state == RequestState.TRANSFERRING
    assert r.stream([7], now=1.0) == 0 and r.state == RequestState.DECODING
    assert r.stream([8, 9, 10], now=2.0) == 1
    assert (r.output_token_ids, r.first_token_at, r.last_token_at) == ([7, 8, 9, 10], 1.0, 2.0)
    assert r.release_prefill(ReleaseCause.TRANSFERRED)
    assert not r.release_prefill(ReleaseCause.ABORT)
    assert not r.release_prefill(ReleaseCause.LEASE_EXPIRED)
    r.finish(RequestState.FINISHED, "stop")
    r.finish(RequestState.ABORTED, "cancelled")  # later causes are no-ops
    assert r.state == RequestState.FINISHED
    assert t.release_outcomes == {"transferred": 1}
    assert t.release_noops == {"abort": 1, "lease_expired": 1}
    assert released == [("transferred", True), ("abort", False), ("lease_expired", False)]
    assert t.outcomes == {"finished:stop": 1}
    assert t.owns(r)
    t.remove(r)
    assert not t.owns(r) and t.leaks() == [] and len(t) == 0


def test_abort_first_releases_and_later_transfer_is_a_noop() -> None:
    t = RequestTable(Clock())
    r = t.admit("r1", valid(40), 5)
    r.start_prefill(P)
    r.prefill_done(None, 0)
    r.finish(RequestState.ABORTED, "cancelled")
    assert r.release_prefill(ReleaseCause.ABORT)
    assert not r.release_prefill(ReleaseCause.TRANSFERRED)
    with pytest.raises(LifecycleError, match='aborted -> decoding is not allowed'):
        r.start_decode(D)


def test_prefill_failure_recompute_and_retry() -> None:
    t = RequestTable(Clock())
    r = t.admit("r1", valid(40), 5)
    r.prefill_failed("p9", retry=True)  # failed before its leg opened: only remembered
    assert r.state == RequestState.QUEUED and r.failed_prefill_engines == {"p9"}
    r.start_prefill(P)
    r.prefill_failed("p0", retry=True)
    assert r.state == RequestState.QUEUED and r.failed_prefill_engines == {"p0", "p9"} and r.prefill is None
    r.start_prefill(EngineRef("p1", 3))
    r.prefill_failed("p1", retry=False)
    assert r.state == RequestState.DECODING and r.num_prefill_attempts == 2
    assert not r.release_prefill(ReleaseCause.ABORT)  # nothing was pinned
    r.start_decode(D)
    assert r.decode == D and r.path_name == "decode_only"
    assert r.engines_sent_to() == {"p0", "p1", "p9", "d0"}


def test_decode_only_and_migration_keep_the_stream_index() -> None:
    t = RequestTable(Clock())
    r = t.admit("r1", valid(4), 5)
    r.start_decode(D)
    assert r.state == RequestState.DECODING
    r.stream([1, 2, 3, 4, 5], now=1.0)
    with pytest.raises(LifecycleError, match="use migrate"):
        r.start_decode(EngineRef("d1", 4))
    r.migrate(EngineRef("d1", 4))
    assert r.num_migrations == 1 and r.failed_decode_engines == {"d0"}
    assert r.stream([6, 7], now=2.0) == 5


def test_a_resumed_request_streams_after_the_tokens_it_brought() -> None:
    t = RequestTable(Clock())
    r = t.admit("r1", valid(4, [5, 6, 7]), 5)
    assert r.num_streamed_tokens == 3
    r.start_decode(D)
    assert r.stream([8], now=1.0) == 3 and r.output_token_ids == [5, 6, 7, 8]


def test_engine_down_cancels_only_the_leg_on_that_engine() -> None:
    t = RequestTable(Clock())
    r = t.admit("r1", valid(4), 5)
    r.start_prefill(P)
    r.call = FakeCall()
    assert r.on_leg(P) and not r.on_leg(D)
    r.cancel_leg("engine p0 down")
    assert r.call.cancelled and r.engine_failed == "engine p0 down"


def test_deadline_lease_and_engine_queries() -> None:
    clock = Clock()
    t = RequestTable(clock)
    a = t.admit("a", valid(1), 1.0)
    b = t.admit("b", valid(1), 3.0)
    b.start_prefill(P)
    b.prefill_done(lease_expires=12.0, num_cached_tokens=0)
    with pytest.raises(ValueError, match="already in flight"):
        t.admit("a", valid(1), 1.0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        t.admit("c", valid(1), 0.0)
    assert len(t) == 2
    clock.now = 11.5
    assert [r.request_id for r in t.expired()] == ["a"]
    assert t.remaining(b) == pytest.approx(1.5)
    assert t.lease_expired() == []
    clock.now = 12.0
    assert [r.request_id for r in t.lease_expired()] == ["b"]
    assert [r.request_id for r in t.on_engine("p0", 1)] == ["b"]
    assert t.on_engine("p0", 2) == []
    with pytest.raises(LifecycleError, match='remove while queued'):
        t.remove(a)
    assert sorted(t.leaks()) == ["a: queued", "b: prefilling"]
