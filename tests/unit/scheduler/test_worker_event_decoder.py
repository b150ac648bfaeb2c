"""WorkerEventDecoder: one decode per distinct worker-event payload per engine, bounded."""

from __future__ import annotations

import pytest

from connectors.kv_events import (
    MEDIUM_CPU_OFFLOAD,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    event_from_proto,
    event_to_proto,
)
from pdserve.v1 import control_pb2 as pb
from pdserve.v1 import kv_events_pb2
from services.scheduler.control_convert import WorkerEventDecoder, output_from_proto, worker_events_key

EVENTS = (
    BlockStored((11, 12), 10, tuple(range(32)), 16, lora_id=3, medium=MEDIUM_CPU_OFFLOAD,
                extra_keys=(("a", 1), None), group_idx=0),
    BlockRemoved((7,), medium=MEDIUM_CPU_OFFLOAD),
    AllBlocksCleared(MEDIUM_CPU_OFFLOAD),
)


def report(seq: int, events: tuple[object, ...] = EVENTS, **fields: object) -> pb.StepReport:
    return pb.StepReport(seq=seq, worker_events=[event_to_proto(e) for e in events], **fields)  # type: ignore[arg-type]


def test_decodes_like_event_from_proto_once_per_engine_step() -> None:
    decoder = WorkerEventDecoder()
    rank_reports = [report(5 + r, finished_sending=[f"req-{r}"]) for r in range(4)]
    decoded = [decoder.decode("e", 1, 4, m) for m in rank_reports]
    expected = tuple(event_from_proto(e) for e in rank_reports[0].worker_events)
    assert expected == EVENTS
    assert all(d == expected for d in decoded)
    assert (decoder.misses, decoder.hits) == (1, 3)
    assert len(decoder) == 0  # every expected rank took its copy


def test_output_from_proto_with_decoded_events_equals_plain_conversion() -> None:
    m = report(3, finished_recving=["r"], failed_recving=["r"], invalid_block_ids=[4])
    assert output_from_proto(m, WorkerEventDecoder().decode("e", 1, 2, m)) == output_from_proto(m)


def test_key_ignores_everything_but_worker_events() -> None:
    a = report(1, finished_sending=["x"], worker_metadata=b"m",
               engine_events=kv_events_pb2.EventBatch(events=[event_to_proto(AllBlocksCleared())]))
    assert worker_events_key(a) == worker_events_key(report(9))
    assert worker_events_key(a) != worker_events_key(report(1, EVENTS[:2]))
    assert worker_events_key(pb.StepReport(seq=1, finished_sending=["x"])) == b""
    assert a.seq == 1 and list(a.finished_sending) == ["x"]  # the report itself is untouched


def test_engines_and_epochs_do_not_share_entries() -> None:
    decoder = WorkerEventDecoder()
    for engine, epoch in (("e", 1), ("f", 1), ("e", 2)):
        decoder.decode(engine, epoch, 8, report(1))
    assert (decoder.misses, decoder.hits, len(decoder)) == (3, 0, 3)


def test_no_events_and_single_rank_engines_cache_nothing() -> None:
    decoder = WorkerEventDecoder()
    assert decoder.decode("e", 1, 8, pb.StepReport(seq=1)) == ()
    assert decoder.decode("e", 1, 1, report(1)) == EVENTS
    assert len(decoder) == 0


def test_malformed_event_raises_and_caches_nothing() -> None:
    decoder = WorkerEventDecoder()
    bad = pb.StepReport(seq=1, worker_events=[kv_events_pb2.KVEvent()])
    for _ in range(2):
        with pytest.raises(ValueError, match="no event set"):
            decoder.decode("e", 1, 8, bad)
    assert len(decoder) == 0 and decoder.hits == 0


def test_bounded_oldest_dropped_first() -> None:
    decoder = WorkerEventDecoder(max_entries=2)
    steps = [report(1, (BlockStored((h,), None, (), 16),)) for h in range(3)]
    for m in steps:
        decoder.decode("e", 1, 8, m)
    assert len(decoder) == 2
    decoder.decode("e", 1, 8, steps[0])  # evicted: decoded again
    assert (decoder.misses, decoder.hits) == (4, 0)
    decoder.decode("e", 1, 8, steps[2])
    assert decoder.hits == 1


def test_byte_bound_and_disabled_cache() -> None:
    m = report(1)
    small = WorkerEventDecoder(max_bytes=len(worker_events_key(m)) - 1)
    off = WorkerEventDecoder(max_entries=0)
    for decoder in (small, off):
        for _ in range(3):
            assert decoder.decode("e", 1, 8, m) == EVENTS
        assert (len(decoder), decoder.hits, decoder.misses) == (0, 0, 3)
