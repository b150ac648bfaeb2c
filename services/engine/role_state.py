"""An engine's current role, as its Engine API admits work (docs/decisions/0044).

Plain state, no gRPC, no engine: rank 0's control thread applies the scheduler's SetRole here,
the Engine servicer asks `admits` for every Prefill / Decode call.

Contracts:
- A change applies only when its role generation is the current one + 1 (a compare-and-set:
  of two schedulers asking at once, one wins; a repeated or stale SetRole changes nothing).
- A prefill engine admits Prefill; a decode or mixed engine admits Decode (a mixed engine is a
  decode engine the scheduler also sends its own prompts to: decode-local).
- For `grace_s` after a change the old role's calls are still admitted: the scheduler routes by
  the role it last heard in a heartbeat, so calls it sent before hearing the change are served,
  not refused. Work admitted under the old role always runs to its end (nothing here stops it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")
DEFAULT_GRACE_S = 10.0


def _leg(role: str) -> str:
    return "prefill" if role == "prefill" else "decode"


@dataclass(slots=True)
class RoleChange:
    old: str
    new: str
    role_epoch: int
    reason: str
    at: float


@dataclass(slots=True)
class EngineRole:
    role: str
    role_epoch: int = 0
    grace_s: float = DEFAULT_GRACE_S
    clock: Callable[[], float] = time.monotonic
    previous: str | None = None
    changed_at: float = float("-inf")
    changes: list[RoleChange] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")

    def apply(self, role: str, role_epoch: int, reason: str = "") -> RoleChange | None:
        """Takes `role` when `role_epoch` is the next generation; returns the change, or None."""
        if role not in ROLES or role_epoch != self.role_epoch + 1:
            return None
        change = RoleChange(self.role, role, role_epoch, reason, self.clock())
        self.previous, self.role, self.role_epoch, self.changed_at = self.role, role, role_epoch, change.at
        self.changes.append(change)
        return change

    def take(self, engine_id: str, role: str, role_epoch: int, reason: str = "") -> RoleChange | None:
        """`apply`, logging the change taken (every backend's record of it)."""
        change = self.apply(role, role_epoch, reason)
        if change is not None:
            logger.info("engine %s: role %s -> %s (role epoch %d): %s", engine_id, change.old, change.new,
                        change.role_epoch, change.reason or "no reason given")
        return change

    def admits(self, leg: str) -> bool:
        """Whether a call of `leg` ("prefill" or "decode") is taken now."""
        if _leg(self.role) == leg:
            return True
        return self.previous is not None and _leg(self.previous) == leg and \
            self.clock() - self.changed_at < self.grace_s
