"""MultiConnector: several connectors behind one, with vLLM's semantics (reference spec §3.1).

- Loading: `get_num_new_matched_tokens` is None when any child says None; otherwise the first
  child (in order) with a match > 0 loads the request, and only it gets the real
  `update_state_after_alloc` (the others get no blocks and 0 tokens).
- Saving and every worker call go to every child.
- `request_finished`: every child is called; blocks are held when any child holds them; at
  most one child may return transfer params (RuntimeError otherwise). When k > 1 children save
  asynchronously, the workers hold back `finished_sending` until all k reported it.
- Unlike vLLM, the worker-side KV events of every child are forwarded: the worker side chains
  them, and the scheduler side's `take_events` yields them (after the children's own scheduler
  events). The children's scheduler sides do not see worker events.
- Stats are keyed by child class name; worker metadata is a tuple with one entry per child.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Self

from connectors.base import (
    ConnectorRequest,
    HandshakeKey,
    KVConnectorMetadata,
    SchedulerConnector,
    WorkerConnector,
    create_scheduler_connector,
    create_worker_connector,
    register_connector,
)
from connectors.kv_events import KVCacheEvent
from connectors.outputs import (
    KVConnectorOutput,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    TransferResults,
)


@dataclass(frozen=True, slots=True)
class MultiConnectorMetadata(KVConnectorMetadata):
    metadata: tuple[KVConnectorMetadata, ...]
    # request id -> how many extra children save it asynchronously (k - 1)
    extra_async_saves: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class MultiKVConnectorStats(KVConnectorStats):
    """Stats of every child, keyed by the child's class name (`data` stays empty)."""

    children: dict[str, KVConnectorStats] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return all(s.is_empty() for s in self.children.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, MultiKVConnectorStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into MultiKVConnectorStats")
        for name, stats in other.children.items():
            mine = self.children.get(name)
            self.children[name] = stats if mine is None else mine.aggregate(stats)
        return self

    def reduce(self) -> dict[str, float]:
        return {f"{name}.{k}": v for name, s in self.children.items() for k, v in s.reduce().items()}

    def clone_and_reset(self) -> KVConnectorStats:
        snapshot = MultiKVConnectorStats(children=self.children)
        self.children = {}
        return snapshot


@dataclass(frozen=True, slots=True)
class MultiWorkerMetadata(KVConnectorWorkerMetadata):
    metadata: tuple[KVConnectorWorkerMetadata | None, ...]

    def aggregate(self, other: Self) -> Self:
        if len(other.metadata) != len(self.metadata):
            raise ValueError("MultiWorkerMetadata of different lengths")
        merged = tuple(b if a is None else a if b is None else a.aggregate(b)
                       for a, b in zip(self.metadata, other.metadata, strict=True))
        return type(self)(merged)


def _multi_stats(children: Sequence[Any], stats: Iterable[KVConnectorStats | None]) -> KVConnectorStats | None:
    by_name = {type(c).__name__: s for c, s in zip(children, stats, strict=True) if s is not None}
    return MultiKVConnectorStats(children=by_name) if by_name else None


class MultiSchedulerConnector(SchedulerConnector):
    def __init__(self, children: Sequence[SchedulerConnector]) -> None:
        if not children:
            raise ValueError("MultiConnector needs at least one child connector")
        self.children = list(children)
        self._loader: dict[str, int] = {}
        self._extra_async_saves: dict[str, int] = {}
        self._worker_events: list[KVCacheEvent] = []

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        results = [c.get_num_new_matched_tokens(request, num_computed_tokens) for c in self.children]
        if any(n is None for n, _ in results):
            return None, False
        for i, (n, is_async) in enumerate(results):
            if n:
                self._loader[request.request_id] = i
                return n, is_async
        self._loader.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        loader = self._loader.get(request.request_id)
        for i, child in enumerate(self.children):
            if i == loader:
                child.update_state_after_alloc(request, block_ids, num_external_tokens)
            else:
                child.update_state_after_alloc(request, [], 0)

    def build_connector_meta(self, step: Any) -> KVConnectorMetadata:
        meta = MultiConnectorMetadata(tuple(c.build_connector_meta(step) for c in self.children),
                                      self._extra_async_saves)
        self._extra_async_saves = {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._worker_events.extend(output.kv_cache_events)
        metas: tuple[KVConnectorWorkerMetadata | None, ...] = (None,) * len(self.children)
        if isinstance(output.kv_connector_worker_meta, MultiWorkerMetadata):
            metas = output.kv_connector_worker_meta.metadata
        stats: dict[str, KVConnectorStats] = {}
        if isinstance(output.kv_connector_stats, MultiKVConnectorStats):
            stats = output.kv_connector_stats.children
        for child, meta in zip(self.children, metas, strict=True):
            child.update_connector_output(replace(
                output, kv_cache_events=(), kv_connector_worker_meta=meta,
                kv_connector_stats=stats.get(type(child).__name__)))

    def request_finished(self, request: ConnectorRequest,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        self._loader.pop(request.request_id, None)
        params: dict[str, Any] | None = None
        num_async = 0
        for child in self.children:
            delay, child_params = child.request_finished(request, block_ids)
            num_async += int(delay)
            if child_params is not None:
                if params is not None:
                    raise RuntimeError(f"request {request.request_id}: more than one connector "
                                       "returned kv_transfer_params")
                params = child_params
        if num_async > 1:
            self._extra_async_saves[request.request_id] = num_async - 1
        return num_async > 0, params

    def take_events(self) -> Iterable[KVCacheEvent]:
        events = [e for c in self.children for e in c.take_events()]
        events.extend(self._worker_events)
        self._worker_events = []
        return events

    def set_xfer_handshake_metadata(self, metadata: Mapping[HandshakeKey, bytes]) -> None:
        for child in self.children:
            child.set_xfer_handshake_metadata(metadata)

    def requires_kv_delivery(self, request: ConnectorRequest) -> bool:
        return any(c.requires_kv_delivery(request) for c in self.children)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return _multi_stats(self.children, (c.get_kv_connector_stats() for c in self.children))

    def reset_cache(self) -> bool | None:
        results = [c.reset_cache() for c in self.children]
        return all(r is not False for r in results)

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()


class MultiWorkerConnector(WorkerConnector):
    def __init__(self, children: Sequence[WorkerConnector]) -> None:
        if not children:
            raise ValueError("MultiConnector needs at least one child connector")
        self.children = list(children)
        self._extra_async_saves: dict[str, int] = {}

    def _split(self, meta: KVConnectorMetadata) -> MultiConnectorMetadata:
        if not isinstance(meta, MultiConnectorMetadata) or len(meta.metadata) != len(self.children):
            raise TypeError(f"MultiConnector expects MultiConnectorMetadata with {len(self.children)} "
                            f"entries, got {type(meta).__name__}")
        return meta

    def register_kv_caches(self, kv_cache: Any, spec: Any) -> None:
        for child in self.children:
            child.register_kv_caches(kv_cache, spec)

    def handle_preemptions(self, meta: KVConnectorMetadata) -> None:
        for child, m in zip(self.children, self._split(meta).metadata, strict=True):
            child.handle_preemptions(m)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        multi = self._split(meta)
        self._extra_async_saves.update(multi.extra_async_saves)
        for child, m in zip(self.children, multi.metadata, strict=True):
            child.start_load_kv(m)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        for child in self.children:
            child.wait_for_layer_load(layer_idx)

    def save_kv_layer(self, layer_idx: int, kv_layer: Any) -> None:
        for child in self.children:
            child.save_kv_layer(layer_idx, kv_layer)

    def wait_for_save(self) -> None:
        for child in self.children:
            child.wait_for_save()

    def get_transfer_results(self, finished_req_ids: frozenset[str] = frozenset()) -> TransferResults:
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        for child in self.children:
            results = child.get_transfer_results(finished_req_ids)
            recving |= results.finished_recving
            failed |= results.failed_recving
            for request_id in results.finished_sending:
                extra = self._extra_async_saves.get(request_id, 0)
                if extra == 0:
                    sending.add(request_id)
                elif extra == 1:
                    del self._extra_async_saves[request_id]
                else:
                    self._extra_async_saves[request_id] = extra - 1
        return TransferResults(frozenset(sending), frozenset(recving), frozenset(failed))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(c.get_block_ids_with_load_errors() for c in self.children))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return _multi_stats(self.children, (c.get_kv_connector_stats() for c in self.children))

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        return [e for c in self.children for e in c.get_kv_connector_kv_cache_events()]

    def get_handshake_metadata(self) -> bytes | None:
        for child in self.children:
            meta = child.get_handshake_metadata()
            if meta is not None:
                return meta
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        metas = tuple(c.build_connector_worker_meta() for c in self.children)
        return None if all(m is None for m in metas) else MultiWorkerMetadata(metas)

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()


def _child_specs(connectors: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    specs = []
    for spec in connectors:
        if "name" not in spec:
            raise ValueError(f"each MultiConnector child needs a 'name', got {dict(spec)}")
        specs.append((str(spec["name"]), dict(spec.get("kwargs", {}))))
    return specs


def _scheduler_factory(connectors: Sequence[Mapping[str, Any]]) -> MultiSchedulerConnector:
    return MultiSchedulerConnector([create_scheduler_connector(n, **kw) for n, kw in _child_specs(connectors)])


def _worker_factory(connectors: Sequence[Mapping[str, Any]]) -> MultiWorkerConnector:
    return MultiWorkerConnector([create_worker_connector(n, **kw) for n, kw in _child_specs(connectors)])


register_connector("multi", _scheduler_factory, _worker_factory)
