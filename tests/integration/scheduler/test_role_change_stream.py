"""Role change over the real control stream: SetRole reaches every rank of the engine with the
peers its new role reads from, the scheduler routes by the new role only once rank 0's heartbeat
states it, the incarnation epoch stays, and a reconnecting rank's Hello carries the new role."""

from __future__ import annotations

import asyncio

from scheduler_harness import ControlHarness, Inbox, eventually, hello

from services.engine.control_client import PeerUpdate, SetRole
from services.scheduler.registry import Role


async def test_prefill_engine_becomes_decode_in_place(harness: ControlHarness) -> None:
    p0 = await harness.connect(hello("p0", "prefill", epoch=101))
    p1 = await harness.connect(hello("p1", "prefill", epoch=102))
    d0 = await harness.connect(hello("d0", "decode", epoch=103))
    servicer, registry = harness.servicer, harness.servicer.registry  # type: ignore[union-attr]
    assert servicer is not None
    assert servicer.set_role("p0", Role.DECODE, "test: long outputs") == 1
    inbox = Inbox(p0)
    await eventually(lambda: bool(inbox.of(SetRole)))
    (ask,) = inbox.of(SetRole)
    assert (ask.role, ask.role_epoch, ask.reason) == ("decode", 1, "test: long outputs")
    # With it, the prefill peers a decode engine reads from (p1, not itself).
    def after_ask() -> list[str]:
        inbox.of(PeerUpdate)
        start = next(i for i, m in enumerate(inbox.items) if isinstance(m, SetRole))
        return [p.rank.engine_id for m in inbox.items[start:] if isinstance(m, PeerUpdate) for p in m.joined]

    await eventually(lambda: bool(after_ask()))
    assert after_ask() == ["p1"]
    engine = registry.engine("p0")
    assert engine.role == Role.PREFILL  # not routed as decode until the engine says so
    p0.set_role("decode", 1)  # what the rank agent does on SetRole
    await eventually(lambda: registry.engine("p0").role == Role.DECODE)
    assert registry.engine("p0").epoch == 101 and registry.engine("p0").role_epoch == 1
    assert [e.engine_id for e in registry.routable(Role.DECODE)] == ["p0", "d0"]
    assert [e.engine_id for e in registry.routable(Role.PREFILL)] == ["p1"]
    assert servicer.counters["role_changes"] == 1
    # Back to prefill: decode engines are sent its ranks again (stale endpoints are harmless).
    d_inbox = Inbox(d0)
    d_inbox.of(PeerUpdate)
    servicer.set_role("p0", Role.PREFILL, "test: long prompts")
    await eventually(lambda: any(p.rank.engine_id == "p0" for u in d_inbox.of(PeerUpdate) for p in u.joined))
    p0.set_role("prefill", 2)
    await eventually(lambda: registry.engine("p0").role == Role.PREFILL)
    del p1


async def test_a_reconnecting_rank_states_its_role(harness: ControlHarness) -> None:
    m0 = await harness.connect(hello("m0", "decode", epoch=201))
    registry = harness.servicer.registry  # type: ignore[union-attr]
    m0.set_role("mixed", 1)
    await eventually(lambda: registry.engine("m0").role == Role.MIXED)
    await asyncio.to_thread(m0.close)
    again = harness.client(m0.hello)  # same epoch: a reconnect, with the Hello's current role
    await asyncio.to_thread(again.start, 10.0)
    engine = registry.engine("m0")
    assert engine.epoch == 201 and engine.role == Role.MIXED and engine.role_epoch == 1
