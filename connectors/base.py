"""The KV-connector API, split by role, with vLLM's method names and contracts.

A connector has two halves that live in different places:

- `SchedulerConnector` runs next to the engine's batch scheduler (rank 0's process). It decides
  what to load and save, builds one opaque `KVConnectorMetadata` per step, and absorbs the
  aggregated worker output.
- `WorkerConnector` runs on every rank, next to that rank's KV cache tensor. It executes the
  step's metadata (loads before the forward pass, saves after), and reports per step what
  finished through `get_transfer_results` and friends; the engine packs those into one
  `KVConnectorOutput` per rank (`collect_output`) that goes to the aggregator.

Per engine step the engine calls, in this order:

    scheduler side: get_num_new_matched_tokens / update_state_after_alloc (while scheduling),
                    build_connector_meta(step)            -> meta (sent to every rank)
    every rank:     start_load_kv(meta); forward (wait_for_layer_load / save_kv_layer per
                    layer when the connector is layer-wise); wait_for_save();
                    collect_output(worker, finished_req_ids) -> KVConnectorOutput
    rank 0:         aggregate the ranks' outputs (connectors/aggregator.py), then
                    scheduler side update_connector_output(aggregated); take_events()
    at finish:      request_finished(request, block_ids) exactly once, before blocks are freed

The core is torch-free: KV tensors are typed `Any` here and touched only by implementations.
Implementations register under a name (`register_connector`) and are built by name
(`create_scheduler_connector` / `create_worker_connector`).
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from connectors.kv_events import KVCacheEvent
from connectors.outputs import (
    KVConnectorOutput,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    TransferResults,
)

logger = logging.getLogger(__name__)


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """Opaque per-step data from the scheduler side to every worker side.

    Must be picklable (it crosses to the TP rank processes). Implementations subclass it.
    """


@dataclass(frozen=True, slots=True)
class EmptyConnectorMetadata(KVConnectorMetadata):
    """Metadata of a step in which the connector has nothing for the workers."""


class ConnectorRequest(Protocol):
    """What a connector may read from the engine's request (engine/request.py `Request`)."""

    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes]

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def keeps_blocks_for_readers(self) -> bool:
        """Finished, and its prompt blocks stay pinned for remote readers (a prefill-only request
        that was not aborted): `request_finished` may then hand them to the data plane."""
        ...


HandshakeKey = tuple[int, int]
"""(pp_rank, tp_rank) of the rank a piece of handshake metadata belongs to."""


class SchedulerConnector(ABC):
    """Scheduler-side half. Synchronous; called only from the engine loop thread."""

    role = KVConnectorRole.SCHEDULER

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` (the local prefix-cache hit) this connector can
        load, and whether the load is asynchronous.

        Contract: no side effects, may be called repeatedly for the same request. `None` means
        "not known yet, ask again next step". The bool is False whenever the count is 0. An
        async load parks the request until its id appears in `finished_recving`.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """Called after blocks were allocated for `request`, before its `num_computed_tokens`
        counts the local hit or the external tokens. `block_ids` are all of its blocks in
        order; the num_external_tokens / block_size blocks right after the locally cached ones
        are this connector's to fill (in this step's `start_load_kv` for a synchronous load).
        For async loads it may be called twice (the second time with `num_external_tokens` 0).
        The engine then counts the external tokens as computed."""

    @abstractmethod
    def build_connector_meta(self, step: Any) -> KVConnectorMetadata:
        """Metadata for every worker for this step (`step` is the engine's step plan, which the
        connector must not modify). Resets the connector's per-step state."""

    def on_new_request(self, request: ConnectorRequest) -> None:  # noqa: B027
        """Called once when the engine admits `request` (before any other call about it)."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """Absorbs the aggregated output of all ranks for this step (finished sets, worker
        events already aggregated per ARCHITECTURE §3, worker metadata folded)."""

    def request_finished(self, request: ConnectorRequest,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called exactly once when `request` finishes, before its blocks are freed.

        Returns (delay_free, kv_transfer_params). `delay_free` True means the engine keeps the
        blocks until the request id appears in an aggregated `finished_sending`. The params
        travel back to the caller (e.g. the transfer descriptor)."""
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Events collected since the last call (drained)."""
        return ()

    def set_xfer_handshake_metadata(self, metadata: Mapping[HandshakeKey, bytes]) -> None:  # noqa: B027
        """Receives every rank's `get_handshake_metadata()`, keyed by (pp_rank, tp_rank)."""

    def get_finished_count(self) -> int | None:
        """How many distinct ranks must report an id finished; None = every expected rank."""
        return None

    def requires_kv_delivery(self, request: ConnectorRequest) -> bool:
        """True when this request's KV must be delivered by the connector before it may run
        (e.g. a decode request whose prompt KV comes from a prefill engine)."""
        return False

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler-side stats for the last interval, or None."""
        return None

    def reset_cache(self) -> bool | None:
        """Drops the connector's own cache. None = not supported."""
        return None

    def shutdown(self) -> None:  # noqa: B027
        """Releases resources. Idempotent."""


class WorkerConnector(ABC):
    """Worker-side half: one per rank, next to that rank's `kv_cache` tensor.

    The KV layout is contracts.md's: one tensor `[num_blocks, num_layers, 2, heads_local,
    block_size, head_dim]` per rank, so block b is the contiguous region `kv_cache[b]`.
    """

    role = KVConnectorRole.WORKER

    def register_kv_caches(self, kv_cache: Any, spec: Any) -> None:  # noqa: B027
        """Registers this rank's KV cache tensor and the engine's `kv_cache_spec` (num_blocks,
        block_size, block_nbytes, layout). Called once, before the first step."""

    def handle_preemptions(self, meta: KVConnectorMetadata) -> None:  # noqa: B027
        """Handles preempted requests or evicted blocks before they are overwritten; called
        before `start_load_kv` in the same step."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Binds this step's metadata and starts its loads (possibly asynchronously). Called
        before the forward pass on every rank."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Blocks until layer `layer_idx`'s KV of this step's synchronous loads is in place."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, kv_layer: Any) -> None:
        """Starts saving one layer's KV for this step (layer-wise connectors)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Blocks until this step's synchronous saves are done; called after the forward pass.
        Unbinds the step's metadata."""

    def get_transfer_results(self, finished_req_ids: frozenset[str] = frozenset()) -> TransferResults:
        """Ids whose async transfer finished (or failed) on this rank since the last call.

        `finished_req_ids` are requests the engine finished this step. A sending id is only
        reported after it was passed here (in this call or an earlier one)."""
        return TransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids that failed to load since the last call (drained). For an async
        load they are reported no later than the call that reports the request failed."""
        return set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Stats for the last interval (then reset), or None."""
        return None

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        """This rank's worker-side KV events since the last call (drained)."""
        return []

    def get_handshake_metadata(self) -> bytes | None:
        """Serialized out-of-band handshake metadata of this rank, or None."""
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Connector-defined data for the scheduler side for this step, or None."""
        return None

    def shutdown(self) -> None:  # noqa: B027
        """Releases resources. Idempotent."""


def collect_output(worker: WorkerConnector,
                   finished_req_ids: frozenset[str] = frozenset()) -> KVConnectorOutput:
    """Packs one rank's per-step report, in vLLM's order: transfer results, load errors,
    stats, events, worker metadata."""
    results = worker.get_transfer_results(finished_req_ids)
    return KVConnectorOutput(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        failed_recving=results.failed_recving,
        invalid_block_ids=frozenset(worker.get_block_ids_with_load_errors()),
        kv_connector_stats=worker.get_kv_connector_stats(),
        kv_cache_events=tuple(worker.get_kv_connector_kv_cache_events()),
        kv_connector_worker_meta=worker.build_connector_worker_meta(),
    )


SchedulerFactory = Callable[..., SchedulerConnector]
WorkerFactory = Callable[..., WorkerConnector]

_REGISTRY: dict[str, tuple[SchedulerFactory, WorkerFactory]] = {}


def register_connector(name: str, scheduler: SchedulerFactory, worker: WorkerFactory) -> None:
    """Registers a connector's two halves under `name`. A duplicate name raises KeyError."""
    if not name:
        raise ValueError("connector name must be non-empty")
    if name in _REGISTRY:
        raise KeyError(f"connector {name!r} is already registered")
    _REGISTRY[name] = (scheduler, worker)


def registered_connectors() -> list[str]:
    """Names of the registered connectors, built-ins that import cleanly included."""
    for name in _BUILTIN_MODULES:
        try:
            _load_builtin(name)
        except ImportError as e:  # e.g. UCX libraries missing on this machine
            logger.debug("connector %r unavailable: %s", name, e)
    return sorted(_REGISTRY)


def _lookup(name: str) -> tuple[SchedulerFactory, WorkerFactory]:
    _load_builtin(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown KV connector {name!r}; registered: {sorted(_REGISTRY)}") from None


def create_scheduler_connector(name: str, **kwargs: Any) -> SchedulerConnector:
    """Builds the scheduler side of connector `name` with implementation-defined kwargs."""
    return _lookup(name)[0](**kwargs)


def create_worker_connector(name: str, **kwargs: Any) -> WorkerConnector:
    """Builds the worker side of connector `name` with implementation-defined kwargs."""
    return _lookup(name)[1](**kwargs)


# Built-in connectors register themselves when their module is imported; only the module of a
# requested name is imported (the ucx one pulls in UCX).
_BUILTIN_MODULES = {"offload": "connectors.offload", "multi": "connectors.multi", "ucx": "connectors.ucx"}


def _load_builtin(name: str) -> None:
    module = _BUILTIN_MODULES.get(name)
    if module is not None and name not in _REGISTRY:
        import importlib

        importlib.import_module(module)
