"""Where the scheduler hands KV events: the republisher / prefix index of the KV-event plane.

The Control servicer calls `publish` with
- rank 0's engine-level batches (`StepReport.engine_events`), as they arrive, in order;
- worker-side events once aggregated across the engine's expected ranks;
- a batch holding one `AllBlocksCleared()` (medium None: every medium) for an epoch that was
  fenced by a newer one or declared dead, so its index entries go.

Contract for implementations: `publish` is called from the scheduler's event loop thread, must
not block, and must not keep references to the batch it may later mutate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from connectors.compact_events import CompactEvents
from connectors.kv_events import KVCacheEvent, KVEventBatch


@dataclass(slots=True)
class ProtoBackedBatch(KVEventBatch):
    """A batch whose events are exactly `proto_events` (a sequence of `pdserve.v1.KVEvent`, e.g.
    the `worker_events` of the StepReport they were decoded from), in order, or exactly
    `events_wire` (a serialized `pdserve.v1.EventBatch` with only `events` set, e.g. a report's
    `packed_worker_events`). Consumers that speak protobuf copy those messages or bytes instead
    of converting every event again; everyone else sees a plain `KVEventBatch`. Whoever builds
    one guarantees the equality."""

    proto_events: Any = None
    events_wire: bytes | None = None


class CompactBatch(ProtoBackedBatch):
    """A batch of a step's BlockStored (and BlockRemoved: `compact.kinds`) events of one medium
    received in compact form (`connectors.compact_events.CompactEvents`): `events_wire` for
    gRPC, `compact.msgpack_events` for ZMQ, `compact.hashes` for the prefix index. `events` is
    decoded from `events_wire` only when someone reads it (a replay, a filtered subscriber, a
    test); the event plane's hot path uses `compact` and `num_events` instead."""

    __slots__ = ("_decoded", "compact")

    def __init__(self, ts: float, compact: CompactEvents, data_parallel_rank: int | None = None) -> None:
        self.ts = ts
        self.data_parallel_rank = data_parallel_rank
        self.proto_events = None
        self.events_wire = compact.events_wire
        self.compact = compact
        self._decoded: list[KVCacheEvent] | None = None

    @property  # type: ignore[override]
    def events(self) -> list[KVCacheEvent]:
        if self._decoded is None:
            self._decoded = self.compact.events()
        return self._decoded

    @events.setter
    def events(self, value: list[KVCacheEvent]) -> None:
        raise AttributeError("a CompactBatch's events are fixed by its compact form")

    @property
    def num_events(self) -> int:
        return self.compact.num_events


@runtime_checkable
class EventSink(Protocol):
    def publish(self, engine_id: str, epoch: int, batch: KVEventBatch) -> None: ...


class NullEventSink:
    """Drops every batch (the default until the event plane is wired in); counts them."""

    def __init__(self) -> None:
        self.num_batches = 0

    def publish(self, engine_id: str, epoch: int, batch: KVEventBatch) -> None:
        self.num_batches += 1


class RecordingEventSink:
    """Keeps every batch in order; for tests and `pdserve bench`."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, int, KVEventBatch]] = []

    def publish(self, engine_id: str, epoch: int, batch: KVEventBatch) -> None:
        self.batches.append((engine_id, epoch, batch))
