import pytest

from services.scheduler.lifecycle import EngineRef
from services.scheduler.transfers import OutcomeKind, TransferTracker

P = EngineRef("p", 1)
D = EngineRef("d", 2)


def tracker() -> TransferTracker:
    t = TransferTracker(clock=lambda: 0.0)
    t.start("r", P, D)
    return t


def test_ready_then_release_once() -> None:
    t = tracker()
    out = t.on_recving(D, "r")
    assert [(o.kind, o.engine) for o in out] == [(OutcomeKind.KV_READY, D), (OutcomeKind.RELEASE, P)]
    assert t.transfers == {}
    assert t.on_recving(D, "r") == [] and t.on_sending(P, "r") == []
    assert t.ignored["unknown_request"] == 2


def test_failure_carries_invalid_blocks_and_releases() -> None:
    t = tracker()
    out = t.on_recving(D, "r", failed=True, invalid_block_ids=[5, 3])
    assert out[0].kind == OutcomeKind.KV_FAILED and out[0].invalid_block_ids == (3, 5)
    assert out[1].kind == OutcomeKind.RELEASE and out[1].failed
    assert t.transfers == {}


def test_prefill_side_finished_sending_releases_before_decode_is_done() -> None:
    t = tracker()
    assert [o.kind for o in t.on_sending(P, "r")] == [OutcomeKind.RELEASE]
    assert t.on_sending(P, "r") == []
    assert [o.kind for o in t.on_recving(D, "r")] == [OutcomeKind.KV_READY]
    assert t.transfers == {}


def test_facts_from_another_engine_or_epoch_are_ignored() -> None:
    t = tracker()
    assert t.on_recving(EngineRef("d", 99), "r") == []
    assert t.on_recving(P, "r") == []
    assert t.on_sending(D, "r") == []
    assert t.ignored["wrong_engine"] == 3 and t.num_pending() == 1


def test_dead_prefill_engine_fails_the_decode_side_without_release() -> None:
    t = tracker()
    out = t.fail_engine(P, "prefill engine gone")
    assert [o.kind for o in out] == [OutcomeKind.KV_FAILED]
    assert out[0].reason == "prefill engine gone" and out[0].invalid_block_ids == ()
    assert t.transfers == {}


def test_dead_decode_engine_releases_the_prefill_blocks() -> None:
    t = tracker()
    out = t.fail_engine(D, "decode engine gone")
    assert [(o.kind, o.engine) for o in out] == [(OutcomeKind.RELEASE, P)]
    assert t.transfers == {}


def test_duplicate_start_and_cancel() -> None:
    t = tracker()
    with pytest.raises(ValueError, match="transfer for 'r' already tracked"):
        t.start("r", P, D)
    assert t.cancel("r") is not None and t.cancel("r") is None
