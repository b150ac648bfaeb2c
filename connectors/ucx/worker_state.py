"""`WorkerState`: what the reader and writer sides of the `ucx` worker connector share.

`UcxWorkerConnector` (connectors/ucx/worker.py, one per rank process) is both sides at once:
`PullSide` (connectors/ucx/pull_side.py: a decode rank reading a request's KV from prefill
ranks) and `ServeSide` (connectors/ucx/serve_side.py: a prefill rank pinning blocks and
serving pulls of them). Both build on this state: the rank's identity and config, one lock
(with a condition for `wait_for_results`; methods that expect it held are named `*_locked`),
the transport (None before `register_kv_caches` and after `shutdown`), the handshake metadata,
the results and stats not yet drained, and the host staging pool, whose slots either side
frees: a returned run may let the reader's queued pulls or the writer's waiting serves go.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from connectors.ucx.config import UcxConnectorConfig
from connectors.ucx.handshake import PeerKey, UcxHandshakeMetadata
from connectors.ucx.transfer_stats import UcxTransferStats
from connectors.ucx.transport import KVTransport


@dataclass(slots=True)
class PendingResults:
    """Request ids that ended since the last drain (`get_transfer_results`)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class WorkerState:
    """The state both sides share; see the module docstring."""

    def __init__(self, *, key: PeerKey, tp_size: int, num_kv_heads: int, compatibility_hash: str,
                 config: UcxConnectorConfig) -> None:
        self.config = config
        self.key = key
        self.tp_size = tp_size
        self.num_kv_heads = num_kv_heads
        self.compatibility_hash = compatibility_hash
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._transport: KVTransport | None = None
        self._metadata: UcxHandshakeMetadata | None = None
        self._results = PendingResults()
        self._stats = UcxTransferStats()
        self._staging: Any = None  # HostStaging when config.kv_staging == "host"

    @property
    def handshake_metadata(self) -> UcxHandshakeMetadata:
        if self._metadata is None:
            raise RuntimeError("register_kv_caches() first")
        return self._metadata

    def _require_transport(self) -> KVTransport:
        if self._transport is None:
            raise RuntimeError("register_kv_caches() first (or the connector is shut down)")
        return self._transport

    def _dispatch_locked(self) -> None:
        """Reader: sends queued pulls while the window and the staging pool have room (`PullSide`)."""
        raise NotImplementedError

    def _dispatch_serves_locked(self) -> None:
        """Writer, host staging: copies pulls waiting for slots into free runs (`ServeSide`)."""
        raise NotImplementedError

    def _free_slots_locked(self, owner: tuple[Any, ...]) -> None:
        if self._staging is not None and self._staging.pool.free(owner) is not None:
            self._dispatch_locked()  # queued pulls may fit now
            self._dispatch_serves_locked()  # ... and pulls waiting to be served

    def _free_slots_later(self, owner: tuple[Any, ...]) -> None:
        """Frees `owner`'s slots once the copies queued so far ran (one may still use them)."""
        def free() -> None:
            with self._lock:
                self._free_slots_locked(owner)

        assert self._staging is not None
        self._staging.later(free)
