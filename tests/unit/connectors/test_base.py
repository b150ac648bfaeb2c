"""Connector API: output packing, stats folding, and the registry."""

from __future__ import annotations

from typing import Any

import pytest

from connectors import base
from connectors.base import (
    EmptyConnectorMetadata,
    KVConnectorMetadata,
    SchedulerConnector,
    WorkerConnector,
    collect_output,
    create_scheduler_connector,
    create_worker_connector,
    register_connector,
)
from connectors.kv_events import MEDIUM_CPU, BlockRemoved
from connectors.outputs import KVConnectorOutput, KVConnectorStats, TransferResults


class _Sched(SchedulerConnector):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, step: Any) -> KVConnectorMetadata:
        return EmptyConnectorMetadata()


class _Worker(WorkerConnector):
    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        pass

    def wait_for_layer_load(self, layer_idx: int) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, kv_layer: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_transfer_results(self, finished_req_ids: frozenset[str] = frozenset()) -> TransferResults:
        return TransferResults(frozenset({"s"}), frozenset({"r", "f"}), frozenset({"f"}))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return {7}

    def get_kv_connector_kv_cache_events(self) -> list[Any]:
        return [BlockRemoved((1,), MEDIUM_CPU)]


def test_collect_output_packs_every_field() -> None:
    out = collect_output(_Worker())
    assert out.finished_sending == {"s"} and out.finished_recving == {"r", "f"}
    assert out.failed_recving == {"f"} and out.invalid_block_ids == {7}
    assert out.kv_cache_events == (BlockRemoved((1,), MEDIUM_CPU),)
    assert not out.is_empty()
    assert KVConnectorOutput(expected_finished_count=3).is_empty()


def test_output_rejects_negative_expected_count() -> None:
    with pytest.raises(ValueError, match="expected_finished_count"):
        KVConnectorOutput(expected_finished_count=-1)


def test_stats_aggregate_and_reduce() -> None:
    a, b = KVConnectorStats(), KVConnectorStats()
    a.record("transfer_seconds", 1.0)
    b.record("transfer_seconds", 3.0)
    b.record("num_failed_transfers", 1)
    assert a.aggregate(b) is a
    r = a.reduce()
    assert r["transfer_seconds_count"] == 2 and r["transfer_seconds_mean"] == 2.0
    assert r["num_failed_transfers_sum"] == 1
    snap = a.clone_and_reset()
    assert a.is_empty() and not snap.is_empty()

    class Other(KVConnectorStats):
        pass

    with pytest.raises(TypeError, match='cannot aggregate Other into KVConnectorStats'):
        a.aggregate(Other())


def test_registry_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register_connector("toy", _Sched, _Worker)
    assert isinstance(create_scheduler_connector("toy"), _Sched)
    w = create_worker_connector("toy", tag="x")
    assert isinstance(w, _Worker) and w.tag == "x"
    with pytest.raises(KeyError, match="connector 'toy' is already registered"):
        register_connector("toy", _Sched, _Worker)
    with pytest.raises(ValueError, match="unknown KV connector 'nope'"):
        create_scheduler_connector("nope")
