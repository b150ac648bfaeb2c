import pytest

from services.scheduler.lifecycle import EngineRef
from services.scheduler.registry import RankId
from services.scheduler.transfers import OutcomeKind, RankReport, TransferTracker

P = EngineRef("p", 1)
D = EngineRef("d", 2)
PR = [RankId("p", 0), RankId("p", 1)]
DR = [RankId("d", 0), RankId("d", 1)]


def tracker() -> TransferTracker:
    t = TransferTracker(clock=lambda: 0.0)
    t.start("r", P, PR, D, DR)
    return t


def recv(rank: int, *ids: str, epoch: int = 2) -> RankReport:
    return RankReport(RankId("d", rank), epoch, finished_recving=ids)


def test_ready_only_when_every_decode_rank_reported_even_across_steps() -> None:
    t = tracker()
    assert t.on_report(recv(0, "r")) == []
    assert t.on_report(recv(0, "r")) == []  # a repeat from the same rank does not count twice
    assert t.num_pending_reports() == 3
    out = t.on_report(recv(1, "r"))
    assert [(o.kind, o.engine) for o in out] == [(OutcomeKind.KV_READY, D), (OutcomeKind.RELEASE, P)]
    assert t.transfers == {}
    assert t.on_report(recv(1, "r")) == [] and t.ignored["unknown_request"] == 1


def test_failure_unions_invalid_blocks_and_releases_once() -> None:
    t = tracker()
    t.on_report(RankReport(DR[0], 2, failed_recving=("r",), finished_recving=("r",), invalid_block_ids=(3, 4)))
    out = t.on_report(RankReport(DR[1], 2, failed_recving=("r",), invalid_block_ids=(4, 5)))
    assert out[0].kind == OutcomeKind.KV_FAILED and out[0].invalid_block_ids == (3, 4, 5)
    assert out[1].kind == OutcomeKind.RELEASE and out[1].failed
    assert t.transfers == {}


def test_prefill_side_finished_sending_releases_before_decode_is_done() -> None:
    t = tracker()
    t.on_report(RankReport(PR[0], 1, finished_sending=("r",)))
    out = t.on_report(RankReport(PR[1], 1, finished_sending=("r",)))
    assert [o.kind for o in out] == [OutcomeKind.RELEASE]
    t.on_report(recv(0, "r"))
    assert [o.kind for o in t.on_report(recv(1, "r"))] == [OutcomeKind.KV_READY]
    assert t.transfers == {}


def test_reports_from_wrong_epoch_or_rank_are_ignored() -> None:
    t = tracker()
    assert t.on_report(recv(0, "r", epoch=99)) == []
    assert t.on_report(RankReport(RankId("d", 5), 2, finished_recving=("r",))) == []
    assert t.on_report(RankReport(RankId("x", 0), 2, finished_recving=("r",))) == []
    assert t.ignored["unexpected_rank"] == 3
    assert t.num_pending_reports() == 4


def test_dead_prefill_engine_fails_the_decode_side() -> None:
    t = tracker()
    t.on_report(recv(0, "r"))
    out = t.fail_engine(P, "prefill engine gone")
    assert [o.kind for o in out] == [OutcomeKind.KV_FAILED]
    assert out[0].reason == "prefill engine gone" and t.transfers == {}


def test_dead_decode_engine_releases_the_prefill_blocks() -> None:
    t = tracker()
    out = t.fail_engine(D, "decode engine gone")
    assert [(o.kind, o.engine) for o in out] == [(OutcomeKind.RELEASE, P)]
    assert t.transfers == {}


def test_duplicate_start_and_cancel() -> None:
    t = tracker()
    with pytest.raises(ValueError):
        t.start("r", P, PR, D, DR)
    assert t.cancel("r") is not None and t.cancel("r") is None
