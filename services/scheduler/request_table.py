"""`RequestTable`: the owner of every live `Request` of this scheduler replica, by the id the
engines see; pure and synchronous, with an injectable clock.

Contracts:
- `admit` creates a QUEUED request whose deadline is the timeout from now; a duplicate live id
  or a timeout <= 0 raises ValueError and changes nothing.
- `remove` forgets a terminal request; a table with no live requests is empty (`leaks()` lists
  what is left, for the after-test leak check).
- The sweeps (`expired`, `lease_expired`, `on_engine`) list live requests; they change nothing.
- `outcomes`, `release_outcomes`, `release_noops` count over every request the table admitted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator

from services.scheduler.lifecycle import EngineRef, LifecycleError, ReleaseCause
from services.scheduler.request import Request, RequestOutcomes
from services.scheduler.validation import ValidRequest


class RequestTable:
    """Every live request (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_release: Callable[[ReleaseCause, bool], None] | None = None) -> None:
        """`on_release(cause, first)` is told of every release of pinned prefill blocks."""
        self.clock = clock
        self.counters = RequestOutcomes(on_release)
        self.requests: dict[str, Request] = {}

    @property
    def outcomes(self) -> Counter[str]:
        return self.counters.outcomes

    @property
    def release_outcomes(self) -> Counter[str]:
        return self.counters.release_outcomes

    @property
    def release_noops(self) -> Counter[str]:
        return self.counters.release_noops

    def admit(self, request_id: str, valid: ValidRequest, timeout_s: float, *, client_id: str = "",
              arrived: float | None = None) -> Request:
        """A new QUEUED request (see the module docstring for the errors)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if timeout_s <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout_s}")
        request = Request(request_id, client_id or request_id, valid, self.clock() + timeout_s,
                          time.monotonic() if arrived is None else arrived, self.counters)
        self.requests[request_id] = request
        return request

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def owns(self, request: Request) -> bool:
        """Whether `request` is live here (False once removed)."""
        return self.requests.get(request.request_id) is request

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self.requests.values()))

    def __len__(self) -> int:
        return len(self.requests)

    def remove(self, request: Request) -> None:
        """Forgets a terminal request."""
        if not request.done:
            raise LifecycleError(f"request {request.request_id}: remove while {request.state}")
        self.requests.pop(request.request_id, None)

    def remaining(self, request: Request) -> float:
        """Seconds to the request's deadline (<= 0: past it)."""
        return request.deadline - self.clock()

    # -- sweeps --------------------------------------------------------------------------------

    def expired(self) -> list[Request]:
        now = self.clock()
        return [r for r in self.requests.values() if not r.done and now >= r.deadline]

    def lease_expired(self) -> list[Request]:
        now = self.clock()
        return [r for r in self.requests.values() if r.lease_expired(now)]

    def on_engine(self, engine_id: str, epoch: int) -> list[Request]:
        """Live requests with a leg on (engine_id, epoch)."""
        ref = EngineRef(engine_id, epoch)
        return [r for r in self.requests.values() if not r.done and ref in (r.prefill, r.decode)]

    def leaks(self) -> list[str]:
        return [f"{r.request_id}: {r.state}" for r in self.requests.values()]
