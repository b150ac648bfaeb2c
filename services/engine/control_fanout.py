"""`ControlFanout`: one rank's control streams to every scheduler replica.

Every replica is active and keeps a complete view of the engines (registry, aggregator, prefix
index, event plane), so every rank keeps one `ControlClient` per replica and says everything to
each: Hello, heartbeats (rank 0's with the load), KV events. A request belongs to the replica
that accepted it; that replica names itself in the engines' request id (`<id>@<scheduler id>`,
see `owner_of`), and only its stream carries the request's transfer results
(finished_sending / finished_recving / failed_recving). The scheduler's messages for a request
(KVReady / KVFailed / ReleaseBlocks) come from its owner alone, so they reach the rank's
callback exactly as with one scheduler.

    fanout = ControlFanout("10.0.0.1:50052,dns:pdserve-scheduler-control:50052", hello,
                           on_message=handle)
    fanout.start()                 # blocks until the first replica welcomed this rank
    fanout.report(StepReport(...))  # to every replica (transfer results: their owner only)

Contracts:
- The `--scheduler` setting (services.common.scheduler_targets) is a comma list and/or
  `dns:NAME:PORT`; dns names are resolved again every `resolve_interval_s`, and a replica that
  appears is joined (a new client, its own seqs and Welcome) without restarting the engine. A
  resolved address that disappears is dropped once its stream is down.
- A replica whose stream stays down for `loss_timeout_s` (the scheduler's heartbeat timeout by
  default) is lost: `on_message` gets one `SchedulerLost(scheduler_id)`, on which the engine
  releases every block it holds for that replica's requests (`owner_of`). A replica that comes
  back with a new scheduler id (restarted) makes the old id lost at once.
- `welcome` is the first live replica's Welcome; `report` of merged ranks (`merged_event_ranks`
  / `merged_transfer_ranks`) goes to every replica that accepts it and is counted in
  `num_refused` for one that does not (its view misses them, as for a silent rank).
- `report` numbers the report (`StepReport.position`: 1, 2, 3 ..., the same at every replica)
  and queues it to exactly the replicas joined before it; a replica joined later learns the
  position it starts from (`Hello.first_position`), so a restarted replica knows which reports
  it must take from a peer's snapshot.
- `poll()` drains the messages of every replica (only when no `on_message` is given).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from services.common.request_owner import owner_of
from services.common.scheduler_targets import (
    Resolver,
    parse_scheduler_targets,
    resolve_targets,
    system_resolver,
)
from services.common.security import ChannelSecurity
from services.engine.control_client import (
    ControlClient,
    ControlHello,
    ControlMessage,
    ControlRefusedError,
    EngineLoad,
    SchedulerLost,
    StepReport,
    Welcome,
)

logger = logging.getLogger(__name__)

DEFAULT_LOSS_TIMEOUT_S = 5.0  # the scheduler's default heartbeat_timeout_s
DEFAULT_RESOLVE_INTERVAL_S = 5.0
MONITOR_INTERVAL_S = 0.1


def for_replica(report: StepReport, scheduler_id: str | None) -> StepReport:
    """The report as replica `scheduler_id` gets it: transfer results of requests it does not
    own left out (invalid block ids go with the failed pulls; merged transfer ranks with
    what is left). None (not welcomed yet): the whole report."""
    if scheduler_id is None or not (report.finished_sending or report.finished_recving or report.failed_recving):
        return report

    def mine(ids: list[str]) -> list[str]:
        return [r for r in ids if owner_of(r) in (None, scheduler_id)]

    sending, recving, failed = mine(report.finished_sending), mine(report.finished_recving), mine(report.failed_recving)
    if (sending, recving, failed) == (report.finished_sending, report.finished_recving, report.failed_recving):
        return report
    return dataclasses.replace(report, finished_sending=sending, finished_recving=recving, failed_recving=failed,
                               invalid_block_ids=report.invalid_block_ids if failed else [],
                               merged_transfer_ranks=report.merged_transfer_ranks if (sending or recving or failed)
                               else ())


@dataclasses.dataclass(slots=True)
class _Replica:
    client: ControlClient
    down_since: float | None = None
    scheduler_id: str | None = None  # of the last Welcome
    from_dns: bool = False


class ControlFanout:
    """A rank's control streams to every scheduler replica (see the module docstring); the
    same calls as `ControlClient`."""

    def __init__(self, scheduler: str, hello: ControlHello, *,
                 on_message: Callable[[ControlMessage], None] | None = None,
                 security: ChannelSecurity | None = None, loss_timeout_s: float = DEFAULT_LOSS_TIMEOUT_S,
                 resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S, resolver: Resolver = system_resolver,
                 client_factory: Callable[..., ControlClient] = ControlClient) -> None:
        self.targets = parse_scheduler_targets(scheduler)
        self.hello = hello
        self.on_message = on_message
        self.security = security
        self.loss_timeout_s = loss_timeout_s
        self.resolve_interval_s = resolve_interval_s
        self.resolver = resolver
        self.client_factory = client_factory
        self.num_refused = 0
        self.lost: list[str] = []  # scheduler ids declared lost, oldest first
        self._replicas: dict[str, _Replica] = {}
        self._lock = threading.Lock()
        self._load: tuple[EngineLoad | None, bool] = (None, False)
        self._closed = threading.Event()
        self._resolved_at = float("-inf")
        self._position = 0  # of the last report (StepReport.position)
        self._monitor: threading.Thread | None = None

    # -- the ControlClient calls ----------------------------------------------------------------

    def start(self, timeout: float | None = 30.0) -> Welcome:
        """Connects to every replica named now and blocks until one welcomed this rank. Raises
        ControlRefusedError when every replica refused it, TimeoutError when none welcomed it
        in time (the streams keep trying), ConnectionAbortedError when closed meanwhile (an
        engine stopped before its scheduler answered)."""
        self._refresh(time.monotonic())
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._monitor_main, name="control-fanout", daemon=True)
            self._monitor.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            welcome = self.welcome
            if welcome is not None:
                return welcome
            if self._closed.is_set():
                raise ConnectionAbortedError("closed before any scheduler replica welcomed this rank")
            clients = self.clients
            errors = [c.error for c in clients if c.error is not None]
            if clients and len(errors) == len(clients):
                raise errors[0]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no Welcome from any scheduler replica ({', '.join(self._replicas)}) "
                                   f"within {timeout} s")
            time.sleep(0.01)

    def report(self, report: StepReport) -> int:
        """Numbers the report (sets its `position`) and queues it on every replica's stream (see
        the module docstring); returns the number of replicas it was queued for."""
        with self._lock:
            self._position += 1
            report.position = self._position
            replicas = list(self._replicas.values())
        queued = 0
        for replica in replicas:
            try:
                replica.client.report(for_replica(report, replica.scheduler_id))
                queued += 1
            except ValueError as e:
                self.num_refused += 1
                logger.debug("report not sent to %s: %s", replica.client.target, e)
        return queued

    def poll(self) -> list[ControlMessage]:
        return [m for r in self._snapshot() for m in r.client.poll()]

    def set_load(self, load: EngineLoad | None, draining: bool = False) -> None:
        self._load = (load, draining)
        for r in self._snapshot():
            r.client.set_load(load, draining)

    def set_role(self, role: str, role_epoch: int) -> None:
        """Every replica's stream states the new role (heartbeats, later Hellos)."""
        self.hello = dataclasses.replace(self.hello, identity=dataclasses.replace(self.hello.identity, role=role),
                                         role_epoch=role_epoch)
        for r in self._snapshot():
            r.client.set_role(role, role_epoch)

    def heartbeat_now(self) -> None:
        for r in self._snapshot():
            r.client.heartbeat_now()

    @property
    def welcome(self) -> Welcome | None:
        for r in self._snapshot():
            if r.client.connected and r.client.welcome is not None:
                return r.client.welcome
        return None

    @property
    def connected(self) -> bool:
        return any(r.client.connected for r in self._snapshot())

    @property
    def clients(self) -> list[ControlClient]:
        return [r.client for r in self._snapshot()]

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout)
        for r in self._snapshot():
            r.client.close(timeout)

    # -- replicas -------------------------------------------------------------------------------

    def _snapshot(self) -> list[_Replica]:
        with self._lock:
            return list(self._replicas.values())

    def _monitor_main(self) -> None:
        while not self._closed.wait(MONITOR_INTERVAL_S):
            try:
                now = time.monotonic()
                if now - self._resolved_at >= self.resolve_interval_s:
                    self._refresh(now)
                self._check_losses(now)
            except Exception:  # keep watching: one bad resolution must not stop loss detection
                logger.exception("watching the scheduler replicas failed")

    def _refresh(self, now: float) -> None:
        """Joins replicas named now; drops dns-named ones gone from DNS whose stream is down."""
        self._resolved_at = now
        fixed = {t.address for t in self.targets if not t.dns}
        addresses = resolve_targets(self.targets, self.resolver)
        for address in addresses:
            if address not in self._replicas:
                self._join(address, from_dns=address not in fixed)
        with self._lock:
            gone = [a for a, r in self._replicas.items() if r.from_dns and a not in addresses
                    and not r.client.connected]
            dropped = [self._replicas.pop(a) for a in gone]
        for replica in dropped:
            logger.info("scheduler replica %s left DNS; closing its stream", replica.client.target)
            replica.client.close(0.5)

    def _join(self, address: str, *, from_dns: bool) -> None:
        client = self.client_factory(address, self.hello, on_message=self._on_message(address),
                                     security=self.security)
        load, draining = self._load
        client.set_load(load, draining)
        with self._lock:
            # Every report numbered after this reaches the new stream (see `report`).
            client.next_position = self._position + 1
            self._replicas[address] = _Replica(client, from_dns=from_dns)
        logger.info("rank %s: control stream to scheduler replica %s", self.hello.identity.tp_rank, address)
        try:
            client.start(timeout=0)
        except (TimeoutError, ControlRefusedError):
            pass  # it keeps trying; a refusal shows in client.error

    def _on_message(self, address: str) -> Callable[[ControlMessage], None]:
        def handle(msg: ControlMessage) -> None:
            if isinstance(msg, Welcome):
                self._welcomed(address, msg.scheduler_id)
            if self.on_message is not None:
                self.on_message(msg)
        return handle

    def _welcomed(self, address: str, scheduler_id: str) -> None:
        with self._lock:
            replica = self._replicas.get(address)
            if replica is None:
                return
            previous, replica.scheduler_id, replica.down_since = replica.scheduler_id, scheduler_id, None
        if previous is not None and previous != scheduler_id:
            self._declare_lost(previous, f"replica {address} restarted as {scheduler_id}")

    def _check_losses(self, now: float) -> None:
        for replica in self._snapshot():
            if replica.client.connected:
                replica.down_since = None
                continue
            if replica.down_since is None:
                replica.down_since = now
            elif now - replica.down_since >= self.loss_timeout_s and replica.scheduler_id is not None:
                self._declare_lost(replica.scheduler_id, f"replica {replica.client.target} silent for "
                                                         f"{now - replica.down_since:.1f} s")

    def _declare_lost(self, scheduler_id: str, why: str) -> None:
        if scheduler_id in self.lost:
            return
        self.lost.append(scheduler_id)
        del self.lost[:-64]
        logger.warning("scheduler %s lost (%s): releasing what this engine holds for its requests", scheduler_id, why)
        if self.on_message is not None:
            try:
                self.on_message(SchedulerLost(scheduler_id))
            except Exception:
                logger.exception("control message callback failed")
