"""Scheduler-side half of the `ucx` connector (lives with the engine's batch scheduler, rank 0).

It turns what the engine service decides — pull this request's KV, pin that request's blocks
for readers, cancel — into `UcxConnectorMetadata` carried by the next step plan, so every rank
of the engine (each in its own process) applies the same commands to its own
`UcxWorkerConnector` before that step's forward.

Pinning is automatic: when a PREFILL_ONLY request finishes (not aborted), `request_finished`
queues a send of its prompt blocks, so the pin reaches every rank in the step right after the
one that sampled the first token — before the service hands the descriptor out.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from connectors.base import KVConnectorMetadata, SchedulerConnector
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

    def is_empty(self) -> bool:
        return not (self.sends or self.pulls or self.cancels)


class UcxSchedulerConnector(SchedulerConnector):
    """Queues data-plane commands until the next step plan (thread-safe queueing)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._lock = threading.Lock()
        self._pending = UcxConnectorMetadata()

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

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, step: Any) -> UcxConnectorMetadata:
        with self._lock:
            meta, self._pending = self._pending, UcxConnectorMetadata()
        return meta

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        from engine.request import RequestMode

        if request.mode is RequestMode.PREFILL_ONLY and request.finish_reason != "abort":
            num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
            with self._lock:
                self._pending.sends.append(SendCommand(request.request_id, list(block_ids[:num_prompt_blocks])))
            return True, None
        return False, None

    def take_events(self) -> list[Any]:
        return []
