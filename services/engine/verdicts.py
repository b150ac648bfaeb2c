"""The scheduler's verdicts, as they reach an engine backend from rank 0's control stream.

Rank 0's `RankAgent` hands every scheduler message for the engine to one inbox;
`route_control_message` turns KVReady / KVFailed into a `KVVerdict` and ReleaseBlocks into a
release (and a lost scheduler replica into releases of its requests), for any backend that implements `VerdictHandler`. The waits and leases those verdicts
settle are `connectors.kv_verdicts` (shared state, no engine).
"""

from __future__ import annotations

from typing import Protocol

from connectors.kv_verdicts import KVVerdict
from services.engine.control_client import (
    ControlMessage,
    KVFailed,
    KVReady,
    ReleaseBlocks,
    SchedulerLost,
    SetRole,
)


class VerdictHandler(Protocol):
    """Called on the control-client thread: hand the work to the engine's own thread."""

    def on_kv_verdict(self, verdict: KVVerdict) -> None: ...

    def on_release_blocks(self, request_id: str) -> None: ...

    def on_scheduler_lost(self, scheduler_id: str) -> None:
        """Release what is held for the requests of a scheduler replica that is gone."""

    def on_set_role(self, msg: SetRole) -> None:
        """Serve another role from now on (services.engine.role_state)."""


def route_control_message(msg: ControlMessage, handler: VerdictHandler) -> None:
    """Dispatches one scheduler message; messages that are not verdicts are ignored."""
    if isinstance(msg, KVReady):
        handler.on_kv_verdict(KVVerdict(msg.request_id, ok=True))
    elif isinstance(msg, KVFailed):
        handler.on_kv_verdict(KVVerdict(msg.request_id, ok=False, invalid_block_ids=frozenset(msg.invalid_block_ids)))
    elif isinstance(msg, ReleaseBlocks):
        handler.on_release_blocks(msg.request_id)
    elif isinstance(msg, SchedulerLost):
        handler.on_scheduler_lost(msg.scheduler_id)
    elif isinstance(msg, SetRole):
        handler.on_set_role(msg)
