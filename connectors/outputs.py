"""What a worker-side connector reports each step, and how reports from several ranks fold.

Torch-free plain data. `KVConnectorOutput` keeps vLLM's field names (`vllm/v1/outputs.py`) and
adds `failed_recving`: request ids whose load failed on this rank. A failed id counts as
finished on that rank whether or not it is also listed in `finished_recving` (vLLM reports a
failed load only as finished + invalid blocks; pdserve names the failure).

Events are plain `KVCacheEvent` values (no `KVConnectorKVEvents` container with a worker
count): the rank that sent them is known to the aggregator, which counts distinct ranks against
the engine's fixed expected rank set (`connectors/aggregator.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Self

from connectors.kv_events import KVCacheEvent


class KVConnectorWorkerMetadata:
    """Connector-defined data a worker sends back to the scheduler side each step.

    Contract: `aggregate(other)` folds another rank's metadata of the same type into a new
    or updated value and returns it; it must be associative so ranks can arrive in any order.
    """

    def aggregate(self, other: Self) -> Self:
        raise NotImplementedError(f"{type(self).__name__}.aggregate")


@dataclass(slots=True)
class KVConnectorStats:
    """Transfer telemetry of one interval: named series of observations.

    `data[name]` is a list of numbers (durations in seconds, bytes, counts of 1 per failure);
    `aggregate` concatenates series, `reduce` summarizes them. Subclasses may add fields but
    must keep `aggregate` associative and `reduce` a pure function of the data.
    """

    data: dict[str, list[float]] = field(default_factory=dict)

    def record(self, name: str, value: float) -> None:
        self.data.setdefault(name, []).append(value)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Folds `other` into self (in place) and returns self. Types must match."""
        if type(other) is not type(self):
            raise TypeError(f"cannot aggregate {type(other).__name__} into {type(self).__name__}")
        for name, values in other.data.items():
            self.data.setdefault(name, []).extend(values)
        return self

    def reduce(self) -> dict[str, float]:
        """Per series: `<name>_count`, `<name>_sum`, `<name>_mean` and `<name>_max`."""
        out: dict[str, float] = {}
        for name, values in self.data.items():
            if not values:
                continue
            total = float(sum(values))
            out[f"{name}_count"] = float(len(values))
            out[f"{name}_sum"] = total
            out[f"{name}_mean"] = total / len(values)
            out[f"{name}_max"] = float(max(values))
        return out

    def clone_and_reset(self) -> KVConnectorStats:
        """Returns the current interval and starts a new one (what a worker sends per step)."""
        snapshot = type(self)(data=self.data)
        self.data = {}
        return snapshot


def _ids(values: Iterable[str] | None) -> frozenset[str]:
    return frozenset(values) if values else frozenset()


@dataclass(slots=True)
class KVConnectorOutput:
    """One rank's connector report for one step.

    - `finished_sending`: ids whose async send/save finished on this rank (the prefill side may
      free their blocks once every expected rank reported them).
    - `finished_recving`: ids whose async load finished on this rank, failed loads included.
    - `failed_recving`: ids whose load failed on this rank (pdserve addition); counted as
      finished on this rank too.
    - `invalid_block_ids`: local block ids that failed to load. For an async load they are
      reported no later than the report in which the request appears in `finished_recving` /
      `failed_recving`, as in vLLM.
    - `kv_cache_events`: worker-side events (e.g. the CPU offload tier), in order.
    - `expected_finished_count`: 0 = no change; > 0 sets how many distinct ranks must report an
      id seen for the first time from now on.
    """

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    kv_connector_stats: KVConnectorStats | None = None
    kv_cache_events: tuple[KVCacheEvent, ...] = ()
    kv_connector_worker_meta: KVConnectorWorkerMetadata | None = None
    expected_finished_count: int = 0

    def __post_init__(self) -> None:
        if self.expected_finished_count < 0:
            raise ValueError(f"expected_finished_count must be >= 0, got {self.expected_finished_count}")
        # Accept any iterable at construction; store immutable sets.
        self.finished_sending = _ids(self.finished_sending)
        self.finished_recving = _ids(self.finished_recving)
        self.failed_recving = _ids(self.failed_recving)
        self.invalid_block_ids = frozenset(self.invalid_block_ids)
        self.kv_cache_events = tuple(self.kv_cache_events)

    def is_empty(self) -> bool:
        """True when every field except `expected_finished_count` is empty."""
        return not (self.finished_sending or self.finished_recving or self.failed_recving
                    or self.invalid_block_ids or self.kv_cache_events
                    or (self.kv_connector_stats is not None and not self.kv_connector_stats.is_empty())
                    or self.kv_connector_worker_meta is not None)


@dataclass(frozen=True, slots=True)
class TransferResults:
    """What `WorkerConnector.get_transfer_results()` returns for this step (may be empty)."""

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
