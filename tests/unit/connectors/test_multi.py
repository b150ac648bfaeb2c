"""MultiConnector: vLLM's load/save/finish semantics, plus forwarding every child's worker events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from connectors import base
from connectors.aggregator import KVOutputAggregator
from connectors.base import (
    EmptyConnectorMetadata,
    KVConnectorMetadata,
    SchedulerConnector,
    WorkerConnector,
    collect_output,
    create_scheduler_connector,
    create_worker_connector,
)
from connectors.kv_events import MEDIUM_CPU, MEDIUM_CPU_OFFLOAD, BlockStored, KVCacheEvent
from connectors.multi import (
    MultiConnectorMetadata,
    MultiSchedulerConnector,
    MultiWorkerConnector,
)
from connectors.outputs import TransferResults


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)


class Sched(SchedulerConnector):
    def __init__(self, match: int | None = 0, delay: bool = False, params: dict[str, Any] | None = None,
                 events: tuple[KVCacheEvent, ...] = ()) -> None:
        self.match, self.delay, self.params, self.events = match, delay, params, list(events)
        self.allocs: list[tuple[str, list[int], int]] = []
        self.outputs: list[Any] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.match, bool(self.match)

    def update_state_after_alloc(self, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, step: Any) -> KVConnectorMetadata:
        return EmptyConnectorMetadata()

    def update_connector_output(self, output: Any) -> None:
        self.outputs.append(output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.delay, self.params

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


class Worker(WorkerConnector):
    def __init__(self, events: list[KVCacheEvent] | None = None, sending: frozenset[str] = frozenset()) -> None:
        self.events = events or []
        self.sending = sending
        self.loaded: list[KVConnectorMetadata] = []

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        self.loaded.append(meta)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, kv_layer: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_transfer_results(self, finished_req_ids: frozenset[str] = frozenset()) -> TransferResults:
        sending, self.sending = self.sending, frozenset()
        return TransferResults(finished_sending=sending)

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


def stored(h: int, medium: str) -> BlockStored:
    return BlockStored((h,), None, (), 0, medium=medium)


def test_worker_events_of_both_children_reach_the_scheduler_side() -> None:
    """vLLM drops worker events under MultiConnector; pdserve forwards every child's."""
    sched = MultiSchedulerConnector([Sched(events=(stored(9, "GPU"),)), Sched()])
    agg = KVOutputAggregator()
    agg.register_engine("e", 1, [0, 1])
    workers = [MultiWorkerConnector([Worker([stored(1, MEDIUM_CPU)]), Worker([stored(2, MEDIUM_CPU_OFFLOAD)])])
               for _ in range(2)]
    result = agg.add_reports("e", 1, {rank: collect_output(w) for rank, w in enumerate(workers)})
    sched.update_connector_output(result.to_output())
    assert list(sched.take_events()) == [stored(9, "GPU"), stored(1, MEDIUM_CPU), stored(2, MEDIUM_CPU_OFFLOAD)]
    assert list(sched.take_events()) == []
    # Children's scheduler sides get the output, without the worker events.
    assert all(c.outputs[0].kv_cache_events == () for c in sched.children)  # type: ignore[attr-defined]


def test_first_child_with_a_match_loads() -> None:
    a, b, c = Sched(match=0), Sched(match=32), Sched(match=48)
    multi = MultiSchedulerConnector([a, b, c])
    req = Req("r")
    assert multi.get_num_new_matched_tokens(req, 0) == (32, True)
    multi.update_state_after_alloc(req, [4, 5], 32)
    assert b.allocs == [("r", [4, 5], 32)] and a.allocs == c.allocs == [("r", [], 0)]
    assert MultiSchedulerConnector([Sched(match=16), Sched(match=None)]).get_num_new_matched_tokens(req, 0) == (
        None, False)
    assert MultiSchedulerConnector([Sched(), Sched()]).get_num_new_matched_tokens(req, 0) == (0, False)


def test_request_finished_params_and_async_save_countdown() -> None:
    multi = MultiSchedulerConnector([Sched(delay=True, params={"x": 1}), Sched(delay=True)])
    assert multi.request_finished(Req("r"), [1]) == (True, {"x": 1})
    meta = multi.build_connector_meta(None)
    assert isinstance(meta, MultiConnectorMetadata) and meta.extra_async_saves == {"r": 1}
    w1, w2 = Worker(sending=frozenset({"r"})), Worker()
    worker = MultiWorkerConnector([w1, w2])
    worker.start_load_kv(meta)
    assert worker.get_transfer_results().finished_sending == frozenset()  # one of two children
    w2.sending = frozenset({"r"})
    assert worker.get_transfer_results().finished_sending == {"r"}
    with pytest.raises(RuntimeError, match="more than one"):
        MultiSchedulerConnector([Sched(params={}), Sched(params={})]).request_finished(Req("q"), [])
    with pytest.raises(TypeError, match='MultiConnector expects MultiConnectorMetadata with 2 entries'):
        worker.start_load_kv(EmptyConnectorMetadata())


def test_built_by_name_from_child_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    base.register_connector("toy", Sched, Worker)
    sched = create_scheduler_connector("multi", connectors=[{"name": "toy", "kwargs": {"match": 16}},
                                                           {"name": "toy"}])
    worker = create_worker_connector("multi", connectors=[{"name": "toy"}])
    assert isinstance(sched, MultiSchedulerConnector) and isinstance(worker, MultiWorkerConnector)
    assert sched.get_num_new_matched_tokens(Req("r"), 0) == (16, True)
    with pytest.raises(ValueError, match="name"):
        create_scheduler_connector("multi", connectors=[{}])
