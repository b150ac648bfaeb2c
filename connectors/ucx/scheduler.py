"""Scheduler-side half of the `ucx` connector (lives with the engine's batch scheduler, rank 0).

It turns what the engine service decides — pull this request's KV, pin that request's blocks
for readers, cancel — into `UcxConnectorMetadata` carried by the next step plan, so every rank
of the engine (each in its own process) applies the same commands to its own
`UcxWorkerConnector` before that step's forward.

Pinning is automatic: when a PREFILL_ONLY request finishes (not aborted), `request_finished`
queues a send of its prompt blocks, so the pin reaches every rank in the step right after the
one that sampled the first token — before the service hands the descriptor out.

With `offload` (the scheduler side of the CPU tier, e.g. `connectors.offload.OffloadScheduler`)
the connector also speaks for that tier: prefix matches, allocation, new/finished requests and
`reset_cache` are delegated to it, and its per-step metadata rides in
`UcxConnectorMetadata.offload` (every rank's `RankAgent` hands it to its offload worker). The
tier's loads are synchronous and never a UCX transfer, so the two never conflict. Tokens a
request got from the tier are kept per request for the service (`pop_external_tokens`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from connectors.base import ConnectorRequest, KVConnectorMetadata, SchedulerConnector
from connectors.ucx.handshake import KVTransferDescriptor


@dataclass(slots=True)
class PullCommand:
    request_id: str
    descriptor: KVTransferDescriptor
    local_block_ids: list[int]
    # W3C trace context of the request's decode span (services.common.tracing.inject_carrier),
    # so every rank's kv_transfer span joins the request's trace; None when tracing is off.
    trace_carrier: dict[str, str] | None = None


@dataclass(slots=True)
class SendCommand:
    request_id: str
    block_ids: list[int]


@dataclass(slots=True)
class UcxConnectorMetadata(KVConnectorMetadata):
    """Data-plane commands of one step, applied by every rank in this order: sends, pulls, cancels."""

    sends: list[SendCommand] = field(default_factory=list)
    pulls: list[PullCommand] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    offload: KVConnectorMetadata | None = None  # the CPU tier's commands of this step, if any

    def is_empty(self) -> bool:
        offload_empty = self.offload is None or bool(getattr(self.offload, "is_empty", lambda: False)())
        return not (self.sends or self.pulls or self.cancels) and offload_empty


class UcxSchedulerConnector(SchedulerConnector):
    """Queues data-plane commands until the next step plan (thread-safe queueing)."""

    def __init__(self, block_size: int, offload: SchedulerConnector | None = None) -> None:
        self.block_size = block_size
        self.offload = offload
        self._lock = threading.Lock()
        self._pending = UcxConnectorMetadata()
        self._external_tokens: dict[str, int] = {}  # request id -> tokens loaded from the tier

    def queue_pull(self, request_id: str, descriptor: KVTransferDescriptor, local_block_ids: Sequence[int],
                   trace_carrier: Mapping[str, str] | None = None) -> None:
        command = PullCommand(request_id, descriptor, list(local_block_ids),
                              dict(trace_carrier) if trace_carrier else None)
        with self._lock:
            self._pending.pulls.append(command)

    def queue_cancel(self, request_id: str) -> None:
        with self._lock:
            self._pending.cancels.append(request_id)

    def has_pending(self) -> bool:
        with self._lock:
            return not self._pending.is_empty()

    # -- SchedulerConnector ---------------------------------------------------------------------

    def pop_external_tokens(self, request_id: str) -> int:
        """Tokens of `request_id`'s prompt loaded from the offload tier (0 if none); forgets them.
        The service calls it once per request (any thread)."""
        with self._lock:
            return self._external_tokens.pop(request_id, 0)

    def on_new_request(self, request: Any) -> None:
        if self.offload is not None:
            on_new = getattr(self.offload, "on_new_request", None)
            if callable(on_new):
                on_new(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.offload is None:
            return 0, False
        return self.offload.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        if self.offload is None:
            return
        self.offload.update_state_after_alloc(request, block_ids, num_external_tokens)
        if num_external_tokens:
            with self._lock:
                self._external_tokens[request.request_id] = num_external_tokens

    def build_connector_meta(self, step: Any) -> UcxConnectorMetadata:
        offload = self.offload.build_connector_meta(step) if self.offload is not None else None
        with self._lock:
            meta, self._pending = self._pending, UcxConnectorMetadata()
        if offload is not None and not bool(getattr(offload, "is_empty", lambda: False)()):
            meta.offload = offload
        return meta

    def request_finished(self, request: ConnectorRequest,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.offload is not None:
            self.offload.request_finished(request, block_ids)
        if request.keeps_blocks_for_readers:
            num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
            with self._lock:
                self._pending.sends.append(SendCommand(request.request_id, list(block_ids[:num_prompt_blocks])))
            return True, None
        return False, None

    def take_events(self) -> list[Any]:
        return list(self.offload.take_events()) if self.offload is not None else []

    def reset_cache(self) -> bool | None:
        return self.offload.reset_cache() if self.offload is not None else None
