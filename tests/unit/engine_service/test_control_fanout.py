"""`ControlFanout` and what it reads: the `--scheduler` setting, request owners, per-replica
reports, replicas joined by DNS, lost replicas. Fake `ControlClient`s stand in for the streams
(the real ones run against real schedulers in tests/e2e/test_scheduler_replicas.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from pdserve.v1 import control_pb2 as pb
from services.common.request_owner import owned_id, owner_of
from services.common.scheduler_targets import SchedulerTarget, parse_scheduler_targets, resolve_targets
from services.engine.control_client import (
    ControlClient,
    ControlHello,
    ControlMessage,
    RankIdentity,
    SchedulerLost,
    StepReport,
    Welcome,
)
from services.engine.control_fanout import ControlFanout, for_replica

HELLO = ControlHello(RankIdentity("p0", "prefill", 1, 0, 1), "compat", "127.0.0.1:1")


def _welcome(scheduler_id: str) -> Welcome:
    return Welcome([], [], 0, 1.0, scheduler_id)


class FakeClient:
    """A ControlClient's surface; `welcome_as` / `drop` play the scheduler's side."""

    def __init__(self, target: str, hello: ControlHello, *, on_message: Any = None, security: Any = None) -> None:
        self.target, self.on_message = target, on_message
        self.welcome: Welcome | None = None
        self.connected = False
        self.error = None
        self.reports: list[StepReport] = []
        self.closed = False

    def start(self, timeout: float | None = None) -> Welcome:
        raise TimeoutError

    def welcome_as(self, scheduler_id: str) -> None:
        self.welcome, self.connected = _welcome(scheduler_id), True
        self.on_message(self.welcome)

    def drop(self) -> None:
        self.connected = False

    def report(self, report: StepReport) -> int:
        self.reports.append(report)
        return len(self.reports)

    def set_load(self, load: Any, draining: bool = False) -> None: ...

    def poll(self) -> list[ControlMessage]:
        return []

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True


def _fanout(spec: str, seen: list[ControlMessage], dns: dict[str, list[str]] | None = None,
            **kwargs: Any) -> tuple[ControlFanout, dict[str, FakeClient]]:
    clients: dict[str, FakeClient] = {}

    def factory(target: str, hello: ControlHello, **kw: Any) -> FakeClient:
        clients[target] = FakeClient(target, hello, **kw)
        return clients[target]

    fanout = ControlFanout(spec, HELLO, on_message=seen.append, client_factory=factory,
                           resolver=lambda host, port: list((dns or {}).get(host, [])), **kwargs)
    return fanout, clients


def test_scheduler_setting_forms_and_refusals() -> None:
    assert parse_scheduler_targets("a:1, b:2,a:1") == [SchedulerTarget("a", 1), SchedulerTarget("b", 2)]
    assert parse_scheduler_targets("dns:svc.ns:50052") == [SchedulerTarget("svc.ns", 50052, dns=True)]
    assert parse_scheduler_targets("[::1]:5") == [SchedulerTarget("::1", 5)]
    for bad in ("", "a", "a:b", "dns:svc", "a:0", "a:70000", ",,"):
        with pytest.raises(ValueError, match="scheduler"):
            parse_scheduler_targets(bad)
    targets = parse_scheduler_targets("x:1,dns:svc:7")
    assert resolve_targets(targets, lambda h, p: ["10.0.0.2", "10.0.0.1"]) == ["x:1", "10.0.0.2:7", "10.0.0.1:7"]
    assert resolve_targets(targets, lambda h, p: []) == ["x:1"]


def test_request_owner_is_read_from_the_engine_side_id() -> None:
    assert owner_of(owned_id("client.abc123", "5f3e")) == "5f3e"
    assert owner_of(owned_id("a@b.c", "s1")) == "s1"
    assert owner_of("client.abc123") is None
    assert owner_of("user@example.com") is None  # a '.' after the '@': not a scheduler id
    assert owner_of("@s1") is None


def test_transfer_results_go_to_their_owner_only_events_to_every_replica() -> None:
    report = StepReport(finished_sending=["r1@A", "r2@B"], finished_recving=["r3@B", "r4"],
                        failed_recving=["r5@B"], invalid_block_ids=[7], merged_transfer_ranks=(1,))
    a = for_replica(report, "A")
    assert (a.finished_sending, a.finished_recving, a.failed_recving) == (["r1@A"], ["r4"], [])
    assert a.invalid_block_ids == [] and a.merged_transfer_ranks == (1,)
    b = for_replica(report, "B")
    assert (b.finished_sending, b.finished_recving, b.failed_recving) == (["r2@B"], ["r3@B", "r4"], ["r5@B"])
    assert b.invalid_block_ids == [7]
    c = for_replica(StepReport(finished_sending=["r1@A"], merged_transfer_ranks=(1,)), "C")
    assert c.finished_sending == [] and c.merged_transfer_ranks == ()  # nothing left to merge
    assert for_replica(report, None) is report  # not welcomed yet: everything


def test_reports_reach_every_replica_and_start_waits_for_the_first_welcome() -> None:
    seen: list[ControlMessage] = []
    fanout, clients = _fanout("h:1,h:2", seen)
    with pytest.raises(TimeoutError, match="no Welcome"):
        fanout.start(timeout=0.05)
    clients["h:2"].welcome_as("B")
    assert fanout.start(timeout=1).scheduler_id == "B"
    clients["h:1"].welcome_as("A")
    fanout.report(StepReport(finished_recving=["x@A"]))
    assert clients["h:1"].reports[-1].finished_recving == ["x@A"]
    assert clients["h:2"].reports[-1].finished_recving == []
    assert [type(m) for m in seen] == [Welcome, Welcome]
    fanout.close()


def test_a_replica_that_appears_in_dns_is_joined_and_one_that_dies_is_lost() -> None:
    seen: list[ControlMessage] = []
    dns = {"svc": ["10.0.0.1"]}
    fanout, clients = _fanout("dns:svc:50052", seen, dns, resolve_interval_s=0.05, loss_timeout_s=0.2)
    _connect(fanout)
    clients["10.0.0.1:50052"].welcome_as("A")
    dns["svc"] = ["10.0.0.1", "10.0.0.2"]
    _until(lambda: "10.0.0.2:50052" in clients)
    clients["10.0.0.2:50052"].welcome_as("B")
    clients["10.0.0.1:50052"].drop()
    _until(lambda: any(isinstance(m, SchedulerLost) for m in seen))
    assert [m for m in seen if isinstance(m, SchedulerLost)] == [SchedulerLost("A")]
    dns["svc"] = ["10.0.0.2"]  # gone from DNS and down: its stream is closed
    _until(lambda: clients["10.0.0.1:50052"].closed)
    assert [c.target for c in fanout.clients] == ["10.0.0.2:50052"]
    time.sleep(0.3)
    assert len([m for m in seen if isinstance(m, SchedulerLost)]) == 1  # once
    fanout.close()


def test_reports_are_numbered_alike_for_every_replica_and_a_late_one_learns_where_it_starts() -> None:
    seen: list[ControlMessage] = []
    dns = {"svc": ["10.0.0.1"]}
    fanout, clients = _fanout("dns:svc:50052", seen, dns, resolve_interval_s=0.05)
    _connect(fanout)
    clients["10.0.0.1:50052"].welcome_as("A")
    fanout.report(StepReport(finished_sending=["r1@A"]))
    fanout.report(StepReport())
    dns["svc"] = ["10.0.0.1", "10.0.0.2"]
    _until(lambda: "10.0.0.2:50052" in clients)
    late = clients["10.0.0.2:50052"]
    assert late.next_position == 3  # set by the fan-out: its Hello.first_position
    late.welcome_as("B")
    fanout.report(StepReport(finished_sending=["r2@A"]))
    assert [r.position for r in clients["10.0.0.1:50052"].reports] == [1, 2, 3]
    assert [r.position for r in late.reports] == [3]  # the transfer result left out, the position kept
    assert late.reports[0].finished_sending == []
    fanout.close()


def test_a_replica_back_under_a_new_id_makes_the_old_one_lost_at_once() -> None:
    seen: list[ControlMessage] = []
    fanout, clients = _fanout("h:1", seen, loss_timeout_s=60)
    _connect(fanout)
    clients["h:1"].welcome_as("A")
    clients["h:1"].drop()
    clients["h:1"].welcome_as("A2")  # restarted within the loss timeout
    assert [m for m in seen if isinstance(m, SchedulerLost)] == [SchedulerLost("A")]
    fanout.close()


def test_a_client_with_a_callback_keeps_no_inbox() -> None:
    got: list[ControlMessage] = []
    with_callback = ControlClient("127.0.0.1:1", HELLO, on_message=got.append)
    polled = ControlClient("127.0.0.1:1", HELLO)
    for _ in range(1000):
        msg = pb.SchedulerMessage(release=pb.ReleaseBlocks(request_id="r"))
        with_callback._on_incoming(msg)
        polled._on_incoming(msg)
    assert len(got) == 1000 and with_callback.poll() == []
    assert len(polled.poll()) == 1000 and polled.poll() == []


def _connect(fanout: ControlFanout) -> None:
    """Starts the streams (no replica has welcomed the rank yet)."""
    with pytest.raises(TimeoutError, match="no Welcome"):
        fanout.start(timeout=0.01)


def _until(condition: Any, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
