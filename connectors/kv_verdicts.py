"""`RemoteKVWaits` and `PrefillLeases`: the engine side of the scheduler's verdicts on KV.

The pdserve scheduler, which sees every rank's transfer reports, decides the fate of KV blocks:

- on a decode engine, a remote-KV request waits until the scheduler says every rank received
  its blocks (KVReady) or some failed (KVFailed: recompute those blocks locally). If no verdict
  arrives by the request's deadline the engine recomputes on its own (`RemoteKVWaits`);
- on a prefill engine, a finished prefill keeps its blocks pinned until the scheduler says every
  reader finished (ReleaseBlocks), a Release / Abort arrives, or the lease runs out
  (`PrefillLeases`).

Whichever comes first settles the request; the rest are no-ops. Both classes are plain state
with a lock (any thread may call them), torch-free and independent of the engine, so every
engine backend (pdserve's own, vLLM) shares them; the caller applies what they return.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KVVerdict:
    """The scheduler's verdict on one request's KV pull (or the engine's own, at the deadline)."""

    request_id: str
    ok: bool
    invalid_block_ids: frozenset[int] = field(default_factory=frozenset)


class RemoteKVWaits:
    """Requests waiting for a KV verdict, each with a monotonic deadline.

    Contract: for a request passed to `expect`, exactly one of `settle` (returning True) or
    `expire` (returning it) happens, unless `discard` comes first; later verdicts are ignored.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadlines: dict[str, float] = {}

    def expect(self, request_id: str, deadline: float) -> None:
        with self._lock:
            self._deadlines[request_id] = deadline

    def settle(self, request_id: str) -> bool:
        """True for the first verdict on a waiting request; False if it was already settled,
        expired, discarded or never waited (the caller still forwards it: see native backend)."""
        with self._lock:
            return self._deadlines.pop(request_id, None) is not None

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._deadlines.pop(request_id, None)

    def expire(self, now: float) -> list[KVVerdict]:
        """Removes and returns (as failed verdicts) every wait whose deadline passed."""
        with self._lock:
            due = [r for r, d in self._deadlines.items() if d <= now]
            for rid in due:
                del self._deadlines[rid]
        return [KVVerdict(rid, ok=False) for rid in due]

    def __len__(self) -> int:
        return len(self._deadlines)


class PrefillLeases:
    """Finished prefills whose blocks stay pinned for readers until released or expired."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}

    def pin(self, request_id: str, until: float) -> None:
        with self._lock:
            self._until[request_id] = until

    def unpin(self, request_id: str) -> bool:
        """Ends the lease; True if there was one."""
        with self._lock:
            return self._until.pop(request_id, None) is not None

    def pinned(self) -> list[str]:
        """The request ids pinned now."""
        with self._lock:
            return list(self._until)

    def expire(self, now: float) -> list[str]:
        """Removes and returns the request ids whose lease ran out."""
        with self._lock:
            due = [r for r, u in self._until.items() if u <= now]
            for rid in due:
                del self._until[rid]
        return due

    def __len__(self) -> int:
        return len(self._until)
