"""Transfer tracking: request-level outcomes of KV transfers, on top of the per-rank aggregator.

Pure and synchronous. `connectors.aggregator.KVOutputAggregator` counts the per-rank reports of
each engine and says when an engine as a whole finished receiving (or sending) a request id;
this tracker knows which prefill and decode engine (and epoch) each request's transfer joins and
turns those engine-level facts into outcomes, each produced exactly once per transfer:

- `KV_READY`  — the decode engine finished receiving and no rank failed;
- `KV_FAILED` — the decode engine finished receiving with a failure (or the prefill engine
  died first); carries the invalid block ids (empty = recompute every block not received);
- `RELEASE`   — every reader finished with the prefill engine's blocks: the decode engine
  finished receiving (success or failure) or the prefill engine finished sending, whichever
  comes first.

A transfer is forgotten once it produced both its decode outcome and its release, or on
`cancel`. Facts for unknown requests, or from an engine (or epoch) that is not part of the
request's transfer, are ignored and counted in `ignored`.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.scheduler.lifecycle import EngineRef


class OutcomeKind(enum.StrEnum):
    KV_READY = "kv_ready"
    KV_FAILED = "kv_failed"
    RELEASE = "release"


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    kind: OutcomeKind
    request_id: str
    # The engine the outcome is sent to (decode engine for KV_*, prefill engine for RELEASE).
    engine: EngineRef
    reason: str = ""
    invalid_block_ids: tuple[int, ...] = ()
    failed: bool = False


@dataclass(slots=True)
class Transfer:
    request_id: str
    prefill: EngineRef
    decode: EngineRef
    started_at: float
    failed: bool = False
    failure_reason: str = ""
    invalid_block_ids: frozenset[int] = frozenset()
    decode_outcome: bool = False
    released: bool = False


class TransferTracker:
    """In-flight KV transfers (see the module docstring for the contracts)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.transfers: dict[str, Transfer] = {}
        self.ignored: Counter[str] = Counter()

    def start(self, request_id: str, prefill: EngineRef, decode: EngineRef) -> Transfer:
        if request_id in self.transfers:
            raise ValueError(f"transfer for {request_id!r} already tracked")
        transfer = Transfer(request_id, prefill, decode, self.clock())
        self.transfers[request_id] = transfer
        return transfer

    def cancel(self, request_id: str) -> Transfer | None:
        """Forgets a transfer (request ended); the caller releases the prefill blocks itself."""
        return self.transfers.pop(request_id, None)

    def _lookup(self, request_id: str, engine: EngineRef, side: str) -> Transfer | None:
        transfer = self.transfers.get(request_id)
        if transfer is None:
            self.ignored["unknown_request"] += 1
            return None
        if engine != (transfer.decode if side == "decode" else transfer.prefill):
            self.ignored["wrong_engine"] += 1
            return None
        return transfer

    def on_recving(self, engine: EngineRef, request_id: str, failed: bool = False,
                   invalid_block_ids: Iterable[int] = ()) -> list[TransferOutcome]:
        """Every expected rank of decode `engine` finished receiving `request_id`."""
        out: list[TransferOutcome] = []
        transfer = self._lookup(request_id, engine, "decode")
        if transfer is not None and not transfer.decode_outcome:
            transfer.failed = failed
            transfer.invalid_block_ids = frozenset(invalid_block_ids)
            transfer.failure_reason = "a decode rank failed to receive" if failed else ""
            transfer.decode_outcome = True
            self._emit_decode(transfer, out)
            self._settle(transfer, out)
        return out

    def on_sending(self, engine: EngineRef, request_id: str) -> list[TransferOutcome]:
        """Every expected rank of prefill `engine` finished sending `request_id`."""
        out: list[TransferOutcome] = []
        transfer = self._lookup(request_id, engine, "prefill")
        if transfer is not None and not transfer.released:
            transfer.released = True
            out.append(TransferOutcome(OutcomeKind.RELEASE, request_id, transfer.prefill))
            self._settle(transfer, out)
        return out

    def _emit_decode(self, transfer: Transfer, out: list[TransferOutcome]) -> None:
        if transfer.failed:
            out.append(TransferOutcome(OutcomeKind.KV_FAILED, transfer.request_id, transfer.decode,
                                       transfer.failure_reason, tuple(sorted(transfer.invalid_block_ids)), True))
        else:
            out.append(TransferOutcome(OutcomeKind.KV_READY, transfer.request_id, transfer.decode))

    def _settle(self, transfer: Transfer, out: list[TransferOutcome]) -> None:
        if transfer.decode_outcome and not transfer.released:
            transfer.released = True
            out.append(TransferOutcome(OutcomeKind.RELEASE, transfer.request_id, transfer.prefill,
                                       failed=transfer.failed))
        if transfer.decode_outcome and transfer.released:
            self.transfers.pop(transfer.request_id, None)

    def fail_engine(self, engine: EngineRef, reason: str) -> list[TransferOutcome]:
        """An engine's epoch died or was fenced: every transfer touching it ends now. Transfers
        from it as prefill fail on the decode side (decode recomputes; the blocks died with the
        engine, no release); transfers to it as decode release the prefill blocks (no reader is
        left)."""
        out: list[TransferOutcome] = []
        for transfer in list(self.transfers.values()):
            if engine == transfer.prefill:
                transfer.released = True
                if not transfer.decode_outcome:
                    transfer.failed, transfer.failure_reason, transfer.decode_outcome = True, reason, True
                    self._emit_decode(transfer, out)
                self._settle(transfer, out)
            elif engine == transfer.decode:
                transfer.decode_outcome = True
                self._settle(transfer, out)
        return out

    def num_pending(self) -> int:
        return len(self.transfers)

    def oldest_pending_age(self) -> float | None:
        if not self.transfers:
            return None
        return self.clock() - min(t.started_at for t in self.transfers.values())
