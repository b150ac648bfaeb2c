import dataclasses

import pytest

from services.scheduler.registry import (
    EngineRegistry,
    LoadInfo,
    RankHello,
    RankId,
    RegistrationError,
    RegistrationErrorKind,
    Role,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hello(engine_id: str = "p0", tp_rank: int = 0, tp_size: int = 2, epoch: int = 7, **kw: object) -> RankHello:
    base = dict(engine_id=engine_id, role=Role.PREFILL, epoch=epoch, tp_rank=tp_rank, tp_size=tp_size,
                compatibility_hash="abc", engine_address="127.0.0.1:9000", handshake_metadata=b"ucx")
    base.update(kw)
    return RankHello(**base)  # type: ignore[arg-type]


def registry(clock: Clock | None = None, **kw: object) -> EngineRegistry:
    return EngineRegistry(block_size=16, hash_seed="0", heartbeat_timeout_s=5.0, clock=clock or Clock(), **kw)  # type: ignore[arg-type]


def test_engine_is_routable_only_when_every_expected_rank_registered() -> None:
    reg = registry()
    r0 = reg.register(hello(tp_rank=0))
    assert r0.new_rank and r0.fenced_epoch is None
    engine = reg.engine("p0")
    assert engine is not None and engine.expected_ranks() == [RankId("p0", 0), RankId("p0", 1)]
    assert not engine.complete and reg.routable(Role.PREFILL) == []
    reg.register(hello(tp_rank=1))
    assert engine.complete and [e.engine_id for e in reg.routable(Role.PREFILL)] == ["p0"]
    assert reg.routable(Role.DECODE) == []


def test_new_epoch_fences_the_old_one() -> None:
    reg = registry()
    reg.register(hello(tp_rank=0))
    reg.register(hello(tp_rank=1))
    r = reg.register(hello(tp_rank=0, epoch=8))
    assert r.fenced_epoch == 7 and set(r.fenced_ranks) == {RankId("p0", 0), RankId("p0", 1)}
    engine = reg.engine("p0")
    assert engine is not None and engine.epoch == 8 and list(engine.ranks) == [RankId("p0", 0)]
    assert reg.engine("p0", epoch=7) is None
    with pytest.raises(RegistrationError, match="fenced") as e:
        reg.register(hello(tp_rank=1, epoch=7))
    assert e.value.kind == RegistrationErrorKind.INCOMPATIBLE
    assert list(engine.ranks) == [RankId("p0", 0)]


@pytest.mark.parametrize("change, kind, match", [
    (dict(compatibility_hash="zzz"), RegistrationErrorKind.INCOMPATIBLE, "compatibility hash"),
    (dict(hash_seed="42"), RegistrationErrorKind.INCOMPATIBLE, "hash seed"),
    (dict(block_size=32), RegistrationErrorKind.INCOMPATIBLE, "block_size"),
    (dict(protocol_version=99), RegistrationErrorKind.INCOMPATIBLE, "protocol version"),
    (dict(engine_id=""), RegistrationErrorKind.INVALID, "engine_id"),
    (dict(epoch=0), RegistrationErrorKind.INVALID, "epoch"),
    (dict(tp_rank=2), RegistrationErrorKind.INVALID, "outside"),
    (dict(tp_size=0, tp_rank=0), RegistrationErrorKind.INVALID, "tp_size"),
    (dict(engine_address="nowhere"), RegistrationErrorKind.INVALID, "engine_address"),
    (dict(handshake_metadata=b"x" * (2 << 20)), RegistrationErrorKind.INVALID, "handshake_metadata"),
    (dict(tp_size=4, tp_rank=1), RegistrationErrorKind.INVALID, "registered as"),
])
def test_refused_hello_has_a_reason_and_changes_nothing(change: dict, kind: RegistrationErrorKind,
                                                          match: str) -> None:
    reg = registry()
    reg.register(hello(engine_id="p0", tp_rank=0))
    other = dict(engine_id="p1", tp_rank=0)
    if "registered as" in match:
        other = dict(engine_id="p0")
    before = {k: (e.epoch, dict(e.ranks)) for k, e in reg.engines.items()}
    with pytest.raises(RegistrationError, match=match) as e:
        reg.register(hello(**{**other, **change}))
    assert e.value.kind == kind
    assert {k: (e.epoch, dict(e.ranks)) for k, e in reg.engines.items()} == before


def test_compatibility_hash_is_pinned_by_config() -> None:
    reg = registry(compatibility_hash="cfg")
    with pytest.raises(RegistrationError, match="cluster's cfg"):
        reg.register(hello())
    reg.register(hello(compatibility_hash="cfg"))


def test_heartbeat_timeout_declares_ranks_dead_and_touch_revives() -> None:
    clock = Clock()
    reg = registry(clock)
    r0 = reg.register(hello(tp_rank=0))
    r1 = reg.register(hello(tp_rank=1))
    clock.now += 4
    assert reg.touch(RankId("p0", 0), r0.rank.conn_id)
    clock.now += 2
    assert reg.expire() == [RankId("p0", 1)]
    assert reg.expire() == []  # declared once
    assert reg.routable(Role.PREFILL) == []
    assert reg.touch(RankId("p0", 1), r1.rank.conn_id)
    assert [e.engine_id for e in reg.routable(Role.PREFILL)] == ["p0"]


def test_multirank_cpu_engines_get_their_own_heartbeat_timeout() -> None:
    """A CPU engine of two ranks is judged on multirank_cpu_heartbeat_timeout_s; a one-rank CPU
    engine, a multi-rank GPU engine and one whose Hello states no device on the base timeout."""
    clock = Clock()
    reg = registry(clock, multirank_cpu_heartbeat_timeout_s=20.0)
    for rank in (0, 1):
        reg.register(hello("cpu2", tp_rank=rank, device_kind="cpu"))
        reg.register(hello("gpu2", tp_rank=rank, device_kind="cuda"))
        reg.register(hello("unknown2", tp_rank=rank))
    reg.register(hello("cpu1", tp_rank=0, tp_size=1, device_kind="cpu"))
    timeouts = {e.engine_id: reg.heartbeat_timeout(e) for e in reg.engines.values()}
    assert timeouts == {"cpu2": 20.0, "gpu2": 5.0, "unknown2": 5.0, "cpu1": 5.0}
    clock.now += 6
    assert {r.engine_id for r in reg.expire()} == {"gpu2", "unknown2", "cpu1"}
    clock.now += 13.5
    assert reg.expire() == []  # 19.5 s: within the multi-rank CPU timeout
    clock.now += 1
    assert reg.expire() == [RankId("cpu2", 0), RankId("cpu2", 1)]
    assert reg.max_heartbeat_timeout_s == 20.0
    assert registry(multirank_cpu_heartbeat_timeout_s=0.0).max_heartbeat_timeout_s == 5.0  # 0: the base timeout
    with pytest.raises(ValueError, match="multirank_cpu_heartbeat_timeout_s"):
        registry(multirank_cpu_heartbeat_timeout_s=-1.0)


def test_reconnect_keeps_applied_seq_and_stale_stream_is_ignored() -> None:
    reg = registry()
    old = reg.register(hello(tp_rank=0, tp_size=1))
    rid = RankId("p0", 0)
    assert reg.accept_seq(rid, old.rank.conn_id, 1) and reg.accept_seq(rid, old.rank.conn_id, 2)
    assert not reg.accept_seq(rid, old.rank.conn_id, 2)  # duplicate
    new = reg.register(hello(tp_rank=0, tp_size=1, last_sent_seq=3))
    assert not new.new_rank and new.rank.last_applied_seq == 2
    assert not reg.accept_seq(rid, old.rank.conn_id, 3)  # the replaced stream is stale
    assert not reg.disconnect(rid, old.rank.conn_id)
    assert reg.accept_seq(rid, new.rank.conn_id, 3)
    assert reg.disconnect(rid, new.rank.conn_id)
    assert reg.routable(Role.PREFILL) == []


def test_load_and_draining_affect_routability() -> None:
    reg = registry()
    reg.register(hello(tp_size=1))
    reg.update_load("p0", LoadInfo(num_running=3, kv_usage=0.5), draining=True)
    engine = reg.engine("p0")
    assert engine is not None and engine.load.num_running == 3
    assert engine.healthy and not engine.routable
    removed = reg.remove_engine("p0")
    assert removed is not None and reg.engines == {}
    with pytest.raises(RegistrationError, match="fenced"):
        reg.register(dataclasses.replace(hello(tp_size=1)))


def test_engine_learns_the_models_kv_heads_from_the_handshake_metadata() -> None:
    from connectors.ucx.handshake import KVRegionLayout, UcxHandshakeMetadata

    region = KVRegionLayout(num_blocks=4, block_nbytes=2 * 2 * 1 * 16 * 8 * 4, num_layers=2, block_size=16,
                            head_dim=8, num_kv_heads=2, head_start=1, head_end=2, dtype="float32")
    meta = UcxHandshakeMetadata("p0", 7, 1, 2, "abc", b"addr", region).encode()
    reg = registry()
    reg.register(hello(tp_rank=0))  # unreadable metadata: unknown
    engine = reg.engine("p0")
    assert engine is not None and engine.num_kv_heads == 0
    reg.register(hello(tp_rank=1, handshake_metadata=meta))
    assert engine.num_kv_heads == 2


@pytest.mark.parametrize("mine, theirs, match", [
    (dict(dtype="bfloat16", device_kind="cpu"), dict(dtype="float32", device_kind="cpu"),
     r"dtype bfloat16 != float32 of engine p0: every engine of a cluster must run one dtype"),
    (dict(dtype="bfloat16", device_kind="cuda"), dict(dtype="bfloat16", device_kind="cpu"),
     r"device_kind cuda != cpu of engine p0"),
    (dict(), dict(dtype="float32"), r"model, dtype, device kind, KV layout"),  # an older engine states neither
])
def test_a_dtype_or_device_mismatch_is_refused_naming_it(mine: dict, theirs: dict, match: str) -> None:
    reg = registry()
    reg.register(hello(engine_id="p0", tp_rank=0, tp_size=1, **theirs))
    with pytest.raises(RegistrationError, match=match) as e:
        reg.register(hello(engine_id="d0", role=Role.DECODE, tp_rank=0, tp_size=1, compatibility_hash="other", **mine))
    assert e.value.kind == RegistrationErrorKind.INCOMPATIBLE
    assert reg.engine("d0") is None


def test_routable_is_kept_only_until_the_registry_changes() -> None:
    """`routable` is cached between changes; after every kind of change it equals a fresh scan."""
    clock = Clock()
    reg = registry(clock)

    def check(*want: str) -> None:
        fresh = [e.engine_id for e in reg.engines.values() if e.role == Role.PREFILL and e.routable]
        got = [e.engine_id for e in reg.routable(Role.PREFILL)]
        assert got == fresh == list(want)

    a0 = reg.register(hello("p0", tp_rank=0))
    check()
    a1 = reg.register(hello("p0", tp_rank=1))
    check("p0")
    reg.routable(Role.PREFILL).clear()  # a copy: the cached answer is not the caller's list
    check("p0")
    b0 = reg.register(hello("p1", tp_size=1))
    check("p0", "p1")
    reg.update_load("p1", LoadInfo(num_running=1), draining=True)
    check("p0")
    reg.update_load("p1", LoadInfo(num_running=1), draining=False)
    check("p0", "p1")
    assert reg.disconnect(RankId("p0", 1), a1.rank.conn_id)
    check("p1")
    reg.register(hello("p0", tp_rank=1))  # the rank reconnects
    check("p0", "p1")
    clock.now += 6
    assert reg.touch(RankId("p0", 0), a0.rank.conn_id)
    assert reg.expire() == [RankId("p0", 1), RankId("p1", 0)]
    check()
    assert reg.touch(RankId("p1", 0), b0.rank.conn_id)
    check("p1")
    reg.register(hello("p1", tp_size=1, epoch=8))  # a new epoch fences the old one
    check("p1")
    assert reg.remove_engine("p1") is not None
    check()


def test_role_follows_the_engine_and_keeps_the_epoch() -> None:
    reg = registry()
    reg.register(hello("e0", tp_size=1))
    reg.register(hello("e1", tp_size=1, role=Role.DECODE))
    version = reg.version
    assert reg.follow_role("e0", Role.MIXED, 1) == Role.PREFILL
    assert reg.version != version
    engine = reg.engine("e0", 7)
    assert engine is not None and engine.role == Role.MIXED and engine.role_epoch == 1  # same incarnation
    assert reg.follow_role("e0", Role.PREFILL, 1) is None  # not newer: ignored
    assert [e.engine_id for e in reg.routable(Role.DECODE)] == ["e0", "e1"]  # mixed engines decode
    assert [e.engine_id for e in reg.routable(Role.MIXED)] == ["e0"]
    assert reg.routable(Role.PREFILL) == []


def test_a_reconnecting_rank_states_its_current_role() -> None:
    reg = registry()
    reg.register(hello("e0", tp_size=1))
    reg.register(hello("e0", tp_size=1, role=Role.DECODE, role_epoch=2))  # same epoch, role changed meanwhile
    engine = reg.engine("e0")
    assert engine is not None and engine.role == Role.DECODE and engine.role_epoch == 2


@pytest.mark.parametrize("vllm", [False, True])
def test_engine_knows_from_its_kv_layout_whether_it_is_pdserves_engine(vllm: bool) -> None:
    """Decision 0049: the peer-fetch policy predicts a pin by the holder's kind of engine."""
    from connectors.kv_layout import LAYOUT_PREFIX, VLLM_LAYOUTS
    from connectors.ucx.handshake import KV_LAYOUT, KVRegionLayout, UcxHandshakeMetadata

    layout = LAYOUT_PREFIX + sorted(VLLM_LAYOUTS)[0] if vllm else KV_LAYOUT
    region = KVRegionLayout(num_blocks=4, block_nbytes=2 * 2 * 1 * 16 * 8 * 4, num_layers=2, block_size=16,
                            head_dim=8, num_kv_heads=2, head_start=1, head_end=2, dtype="float32", layout=layout)
    reg = registry()
    reg.register(hello(tp_rank=0))  # unreadable metadata: unknown, not pdserve's
    engine = reg.engine("p0")
    assert engine is not None and engine.native_engine is False
    reg.register(hello(tp_rank=1, handshake_metadata=UcxHandshakeMetadata("p0", 7, 1, 2, "abc", b"addr",
                                                                          region).encode()))
    assert engine.native_engine is (not vllm)
