"""Transfer tracking: when has every decode rank received a request's KV, and every reader
finished with the prefill engine's blocks?

Pure and synchronous. Per request, the expected rank sets of both engines are fixed when the
transfer starts (from the registry). Each rank counts at most once per request; a repeated
report changes nothing. Outcomes, each produced exactly once per transfer:

- `KV_READY`  — every expected decode rank reported finished_recving and none failed;
- `KV_FAILED` — every expected decode rank reported, and at least one failed (failed_recving,
  or an engine of the transfer died); carries the union of the failing reports' invalid block
  ids (a report's invalid ids are attributed to every request that failed in that report);
- `RELEASE`   — every reader finished: all decode ranks reported (success or failure) or all
  prefill ranks reported finished_sending, whichever comes first.

A transfer is forgotten once it produced both its decode outcome and its release, or on
`cancel`. Reports for unknown requests, or from ranks outside a transfer's expected sets, are
ignored and counted in `ignored`.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.scheduler.lifecycle import EngineRef
from services.scheduler.registry import RankId


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
    prefill_ranks: frozenset[RankId]
    decode_ranks: frozenset[RankId]
    started_at: float
    recved: set[RankId] = field(default_factory=set)
    failed: set[RankId] = field(default_factory=set)
    sent: set[RankId] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    failure_reason: str = ""
    decode_outcome: bool = False
    released: bool = False

    def num_pending_reports(self) -> int:
        pending = 0 if self.decode_outcome else len(self.decode_ranks - self.recved - self.failed)
        return pending + (0 if self.released else len(self.prefill_ranks - self.sent))


@dataclass(frozen=True, slots=True)
class RankReport:
    """The transfer part of one rank's StepReport."""

    rank: RankId
    epoch: int
    finished_sending: tuple[str, ...] = ()
    finished_recving: tuple[str, ...] = ()
    failed_recving: tuple[str, ...] = ()
    invalid_block_ids: tuple[int, ...] = ()


class TransferTracker:
    """In-flight KV transfers (see the module docstring for the contracts)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.transfers: dict[str, Transfer] = {}
        self.ignored: Counter[str] = Counter()

    def start(self, request_id: str, prefill: EngineRef, prefill_ranks: Iterable[RankId], decode: EngineRef,
              decode_ranks: Iterable[RankId]) -> Transfer:
        if request_id in self.transfers:
            raise ValueError(f"transfer for {request_id!r} already tracked")
        transfer = Transfer(request_id, prefill, decode, frozenset(prefill_ranks), frozenset(decode_ranks),
                            self.clock())
        if not transfer.prefill_ranks or not transfer.decode_ranks:
            raise ValueError("a transfer needs at least one prefill and one decode rank")
        self.transfers[request_id] = transfer
        return transfer

    def cancel(self, request_id: str) -> Transfer | None:
        """Forgets a transfer (request ended); the caller releases the prefill blocks itself."""
        return self.transfers.pop(request_id, None)

    def on_report(self, report: RankReport) -> list[TransferOutcome]:
        outcomes: list[TransferOutcome] = []
        failed_here = set(report.failed_recving)
        for request_id in failed_here:
            self._apply(report, request_id, "failed", outcomes)
        for request_id in report.finished_recving:
            if request_id not in failed_here:
                self._apply(report, request_id, "recved", outcomes)
        for request_id in report.finished_sending:
            self._apply(report, request_id, "sent", outcomes)
        return outcomes

    def _apply(self, report: RankReport, request_id: str, what: str, out: list[TransferOutcome]) -> None:
        transfer = self.transfers.get(request_id)
        if transfer is None:
            self.ignored["unknown_request"] += 1
            return
        side = transfer.prefill if what == "sent" else transfer.decode
        ranks = transfer.prefill_ranks if what == "sent" else transfer.decode_ranks
        if report.rank not in ranks or report.epoch != side.epoch:
            self.ignored["unexpected_rank"] += 1
            return
        if what == "sent":
            transfer.sent.add(report.rank)
        elif report.rank not in transfer.recved | transfer.failed:
            (transfer.failed if what == "failed" else transfer.recved).add(report.rank)
            if what == "failed":
                transfer.invalid_block_ids.update(report.invalid_block_ids)
                transfer.failure_reason = transfer.failure_reason or f"rank {report.rank.tp_rank} failed to receive"
        self._settle(transfer, out)

    def _settle(self, transfer: Transfer, out: list[TransferOutcome]) -> None:
        decode_all = transfer.recved | transfer.failed >= transfer.decode_ranks
        if decode_all and not transfer.decode_outcome:
            transfer.decode_outcome = True
            if transfer.failed:
                out.append(TransferOutcome(OutcomeKind.KV_FAILED, transfer.request_id, transfer.decode,
                                           transfer.failure_reason, tuple(sorted(transfer.invalid_block_ids)), True))
            else:
                out.append(TransferOutcome(OutcomeKind.KV_READY, transfer.request_id, transfer.decode))
        if not transfer.released and (transfer.decode_outcome or transfer.sent >= transfer.prefill_ranks):
            transfer.released = True
            out.append(TransferOutcome(OutcomeKind.RELEASE, transfer.request_id, transfer.prefill,
                                       failed=bool(transfer.failed)))
        if transfer.decode_outcome and transfer.released:
            del self.transfers[transfer.request_id]

    def fail_engine(self, engine: EngineRef, reason: str) -> list[TransferOutcome]:
        """An engine's epoch died or was fenced: every transfer touching it ends now. Transfers
        from it as prefill fail on the decode side (decode recomputes); transfers to it as decode
        release the prefill blocks (no reader is left)."""
        out: list[TransferOutcome] = []
        for transfer in list(self.transfers.values()):
            if engine == transfer.prefill and not transfer.decode_outcome:
                transfer.failed |= transfer.decode_ranks - transfer.recved
                transfer.failure_reason = reason
                transfer.released = True  # the blocks died with the engine
                self._settle(transfer, out)
            elif engine == transfer.decode:
                transfer.decode_outcome = True
                self._settle(transfer, out)
            elif engine == transfer.prefill:
                transfer.released = True
                self._settle(transfer, out)
        return out

    def num_pending_reports(self) -> int:
        return sum(t.num_pending_reports() for t in self.transfers.values())

    def oldest_pending_age(self) -> float | None:
        if not self.transfers:
            return None
        return self.clock() - min(t.started_at for t in self.transfers.values())
