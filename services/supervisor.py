"""`Supervisor`: restarts a local cluster's dead components, as a kubelet restarts a pod's
containers — one component's death is not the cluster's.

A component that exits is restarted after a backoff that doubles with each restart (from
`initial_backoff_s` up to `max_backoff_s`, Kubernetes' CrashLoopBackOff shape) and returns to
the initial backoff once it has stayed up for `reset_after_s`. An engine restarts with the same
engine id and ports; the scheduler sees it register again (a new epoch) and routes to it once
it serves. `poll()` is driven by its owner's loop (`pdserve up`); the clock is injectable.

A component that exited because a port it was given is taken (`EXIT_PORT_IN_USE`) is not
restarted: it would fail the same way forever. It is listed in `failed`, and the owner decides
(`pdserve up` stops and says which port).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from services.common.bound_ports import EXIT_PORT_IN_USE

logger = logging.getLogger(__name__)


class Restartable(Protocol):
    """What the supervisor needs of a cluster (`LocalCluster` is one)."""

    def component_names(self) -> list[str]: ...

    def exit_status(self, name: str) -> int | None:
        """None while the component runs, else its exit status."""

    def restart(self, name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    reset_after_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 < initial_backoff_s <= max_backoff_s")
        if self.reset_after_s <= 0:
            raise ValueError("reset_after_s must be > 0")


@dataclass(slots=True)
class _Track:
    backoff_s: float
    started_at: float
    restart_at: float | None = None  # set while dead: when the restart is due
    restarts: int = 0


@dataclass(slots=True)
class Supervisor:
    cluster: Restartable
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    clock: Callable[[], float] = time.monotonic
    _tracks: dict[str, _Track] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)  # name -> exit status of a component not restarted

    def restarts(self, name: str) -> int:
        track = self._tracks.get(name)
        return track.restarts if track is not None else 0

    def poll(self) -> list[str]:
        """Restarts every dead component whose backoff has passed; returns their names."""
        now = self.clock()
        restarted = []
        for name in self.cluster.component_names():
            track = self._tracks.setdefault(name, _Track(self.policy.initial_backoff_s, now))
            status = self.cluster.exit_status(name)
            if status is None:
                if now - track.started_at >= self.policy.reset_after_s:
                    track.backoff_s = self.policy.initial_backoff_s
                continue
            if status == EXIT_PORT_IN_USE:
                if name not in self.failed:
                    logger.error("%s exited: a port it was given is in use (see its log); not restarting it", name)
                    self.failed[name] = status
                continue
            if track.restart_at is None:
                track.restart_at = now + track.backoff_s
                logger.warning("%s exited with status %d; restarting it in %.0f s", name, status, track.backoff_s)
            if now >= track.restart_at:
                self.cluster.restart(name)
                track.restarts += 1
                track.started_at, track.restart_at = now, None
                track.backoff_s = min(2 * track.backoff_s, self.policy.max_backoff_s)
                restarted.append(name)
                logger.warning("restarted %s (restart %d)", name, track.restarts)
        return restarted
