"""A peer fetch's pin on pdserve's engine (decision 0049): a cache operation, not a forward pass.

`pin_for_peer` runs on the engine-loop thread between two steps (`EngineLoop.call`): the
prompt's longest cached prefix of full blocks is pinned under the request's id as a PINNED
request — as a finished PREFILL_ONLY request is, so `release`, `abort`, lease expiry and the
leak checks end it as they end a prefill's pin — and every rank pins those blocks for the
reader's TP (the send the connector queues in `request_finished`) by a command-only flush, at
once, before the descriptor can leave. Nothing is scheduled or computed: on a busy engine the
pin waits only for the step under way. Offload-tier hits are not loaded back for it (a load is
a step's work): the reader computes what the device cache no longer holds.
"""

from __future__ import annotations

from typing import Any

from engine.llm_engine import LLMEngine
from services.engine.backend import DuplicateRequest


def pin_for_peer(engine: LLMEngine, connector: Any, request_id: str, prompt_token_ids: list[int],
                 reader_tp_size: int) -> tuple[int, list[int]]:
    """Pins what is cached of the prompt's full blocks for a reader of `reader_tp_size` ranks
    (0: this engine's TP); returns the tokens pinned (blocks x block size, never more than the
    prompt) and the blocks. (0, []) with nothing changed when the prompt's first block is not
    cached. DuplicateRequest when the id runs or is pinned here; ValueError on bad input."""
    if request_id in engine.batch_scheduler.requests:
        raise DuplicateRequest(f"request {request_id} is already running or pinned here")
    connector.set_reader_tp(request_id, reader_tp_size)
    try:
        num_tokens = engine.pin_cached_prefix(request_id, prompt_token_ids)
    finally:
        if request_id not in engine.batch_scheduler.pinned:
            connector.set_reader_tp(request_id, 0)  # nothing pinned: the reader's TP is forgotten
    if not num_tokens:
        return 0, []
    engine.flush_commands()  # every rank pins for the reader now: the descriptor never leaves before
    return num_tokens, engine.get_block_ids(request_id)
