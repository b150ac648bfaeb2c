"""`RemoteKVWaits` / `PrefillLeases` (exactly one outcome per request) and the routing of the
scheduler's control messages to a backend's verdict handler."""

from connectors.kv_verdicts import KVVerdict, PrefillLeases, RemoteKVWaits
from services.engine.control_client import KVFailed, KVReady, ReleaseBlocks, Welcome
from services.engine.verdicts import route_control_message


def test_a_wait_ends_once_by_verdict_or_deadline() -> None:
    waits = RemoteKVWaits()
    waits.expect("a", deadline=10.0)
    waits.expect("b", deadline=20.0)
    assert waits.settle("a") is True
    assert waits.settle("a") is False  # a second verdict is a no-op
    assert waits.expire(now=15.0) == []  # a was settled; b not due
    assert waits.expire(now=20.0) == [KVVerdict("b", ok=False)]
    assert waits.settle("b") is False and len(waits) == 0


def test_discarded_wait_never_expires() -> None:
    waits = RemoteKVWaits()
    waits.expect("a", deadline=1.0)
    waits.discard("a")
    assert waits.expire(now=5.0) == [] and len(waits) == 0


def test_lease_ends_once_by_release_or_expiry() -> None:
    leases = PrefillLeases()
    leases.pin("a", until=5.0)
    leases.pin("b", until=5.0)
    assert leases.unpin("a") is True and leases.unpin("a") is False
    assert leases.expire(now=4.9) == []
    assert leases.expire(now=5.0) == ["b"]
    assert leases.expire(now=9.0) == [] and len(leases) == 0


class _Recorder:
    def __init__(self) -> None:
        self.verdicts: list[KVVerdict] = []
        self.released: list[str] = []

    def on_kv_verdict(self, verdict: KVVerdict) -> None:
        self.verdicts.append(verdict)

    def on_release_blocks(self, request_id: str) -> None:
        self.released.append(request_id)


def test_control_messages_reach_the_handler_as_verdicts() -> None:
    handler = _Recorder()
    route_control_message(KVReady("r1"), handler)
    route_control_message(KVFailed("r2", "pull timed out", [3, 4]), handler)
    route_control_message(ReleaseBlocks("r3"), handler)
    route_control_message(Welcome([], [], 0, 1.0, "s"), handler)  # not a verdict: ignored
    assert handler.verdicts == [KVVerdict("r1", ok=True), KVVerdict("r2", ok=False, invalid_block_ids=frozenset({3, 4}))]
    assert handler.released == ["r3"]
