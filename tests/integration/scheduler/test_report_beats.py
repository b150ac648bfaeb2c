"""Rank 0's heartbeat riding on its report messages (`RankMessage.beat`, Welcome
`accepts_report_beats`): a real Control server, real ControlClients and raw streams over loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from scheduler_harness import ControlHarness, eventually, exchange, hello

from pdserve.v1 import control_pb2 as pb
from services.engine.control_client import ControlClient, EngineLoad, StepReport
from services.scheduler.lifecycle import EngineRef

INTERVAL_S = 0.05  # the harness's heartbeat interval


@pytest.fixture
async def harness() -> AsyncIterator[ControlHarness]:
    h = ControlHarness(timeout_s=0.3)  # six heartbeat intervals
    await h.start()
    try:
        yield h
    finally:
        for c in h.clients:
            await asyncio.to_thread(c.close)
        await h.stop()


async def _report_for(client: ControlClient, seconds: float, every_s: float) -> int:
    """Reports every `every_s` for `seconds`, a new load (num_running 1, 2, ...) before each;
    returns the last load's num_running."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        client.set_load(EngineLoad(num_running=n, num_waiting=0, kv_usage=0.1, num_free_blocks=10))
        client.report(StepReport())
        await asyncio.sleep(every_s)
    return n


async def test_a_reporting_rank_0_sends_its_load_on_its_reports_and_stays_alive(harness: ControlHarness) -> None:
    servicer = harness.servicer
    assert servicer is not None
    down: list[EngineRef] = []
    servicer.on_engine_down.append(lambda ref, reason: down.append(ref))
    client = await harness.connect(hello("d0", "decode"))
    assert client.welcome is not None and client.welcome.accepts_report_beats
    engine = servicer.registry.engines["d0"]
    await eventually(lambda: servicer.counters["heartbeats"] >= 1)  # its first beat, before any report
    beats_before = servicer.counters["heartbeats"]
    last = await _report_for(client, 1.0, INTERVAL_S / 5)  # 1 s: three heartbeat timeouts
    riding = servicer.counters["report_beats"]
    assert riding >= 0.5 / INTERVAL_S  # about one per half interval (fewer on a slowed host)
    # Beats of their own only where the reports paused for an interval (a slowed host).
    assert servicer.counters["heartbeats"] - beats_before <= riding / 4
    assert not down and engine.healthy and engine.routable
    await eventually(lambda: engine.load.num_running == last)


async def test_rank_0_of_an_older_scheduler_beats_in_messages_of_its_own(harness: ControlHarness) -> None:
    servicer = harness.servicer
    assert servicer is not None
    servicer.accepts_report_beats = False  # a scheduler before RankMessage.beat
    client = await harness.connect(hello("d0", "decode"))
    assert client.welcome is not None and not client.welcome.accepts_report_beats
    engine = servicer.registry.engines["d0"]
    last = await _report_for(client, 0.5, INTERVAL_S / 5)
    await eventually(lambda: engine.load.num_running == last)
    assert servicer.counters["report_beats"] == 0
    assert servicer.counters["heartbeats"] >= 3


async def test_heartbeat_now_rides_on_the_next_report(harness: ControlHarness) -> None:
    servicer = harness.servicer
    assert servicer is not None
    client = await harness.connect(hello("d0", "decode"))
    engine = servicer.registry.engines["d0"]
    client.set_load(EngineLoad(num_running=0, num_waiting=0, kv_usage=0.0, num_free_blocks=10), draining=True)
    client.report(StepReport())
    client.heartbeat_now()
    await eventually(lambda: engine.draining)
    assert not engine.routable


async def test_a_beat_on_a_raw_report_is_applied_after_its_reports(harness: ControlHarness) -> None:
    servicer = harness.servicer
    assert servicer is not None
    h = hello("d0", "decode")
    identity = pb.RankIdentity(engine_id="d0", role=pb.ROLE_DECODE, epoch=h.identity.epoch, tp_rank=0, tp_size=1)
    first = pb.RankMessage(hello=pb.Hello(rank=identity, compatibility_hash=h.compatibility_hash, protocol_version=1,
                                          engine_address=h.engine_address, hash_seed="0", block_size=16))
    beat = pb.Heartbeat(load=pb.EngineLoad(num_running=7, kv_usage=0.25), draining=True)
    batch = pb.RankMessage(reports=pb.ReportBatch(reports=[pb.StepReport(seq=1), pb.StepReport(seq=2)]), beat=beat)
    got = await exchange(harness.port, [first, batch, pb.RankMessage(report=pb.StepReport(seq=3))], hold=0.2)
    assert got[0].welcome.accepts_report_beats
    engine = servicer.registry.engines["d0"]
    assert (engine.load.num_running, engine.load.kv_usage, engine.draining) == (7, 0.25, True)
    assert servicer.counters["report_beats"] == 1 and servicer.counters["heartbeats"] == 0
    assert next(iter(engine.ranks.values())).last_applied_seq == 3
