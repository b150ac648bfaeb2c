"""The connector records the UCX transport of every pull (bytes by transport, per peer) and
counts and logs a fallback below `expected_transports`: a decode connector over a transport
that ends each pull with the transport it was told to report."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from connectors.ucx.config import UcxConnectorConfig
from connectors.ucx.handshake import KVTransferDescriptor, PeerKey
from connectors.ucx.transport import KVTransport, PullOp, PullResult, TransportListener
from connectors.ucx.worker import UcxWorkerConnector


class ReportingTransport(KVTransport):
    """Ends each pull, when told, with every segment delivered over `transport`."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.ops: list[PullOp] = []
        self.listener: TransportListener | None = None

    @property
    def worker_address(self) -> bytes:
        return b"fake-address"

    def start(self, listener: TransportListener) -> None:
        self.listener = listener

    def add_peer(self, key: PeerKey, address: bytes) -> None: ...

    def remove_peer(self, key: PeerKey) -> None: ...

    def pull(self, op: PullOp) -> None:
        self.ops.append(op)

    def abandon(self, xfer_id: int) -> None: ...

    def renew(self, peer: PeerKey, request_ids: list[str]) -> None: ...

    def shutdown(self) -> None: ...

    def finish_all(self) -> None:
        assert self.listener is not None
        ops, self.ops = self.ops, []
        for op in ops:
            nbytes = sum(s.num_blocks for s in op.segments) * BLOCK_NBYTES
            self.listener.on_pull_finished(PullResult(op.xfer_id, True, None, op.segments, nbytes, 0.001,
                                                      self.transport))


SHAPE = (32, 2, 2, 2, 4, 8)  # blocks, heads, layers, K/V, block size, head dim
BLOCK_NBYTES = 2 * 2 * 2 * 4 * 8 * 4


def connector(engine_id: str, transport: ReportingTransport, expected: str = "") -> UcxWorkerConnector:
    c = UcxWorkerConnector(engine_id=engine_id, epoch=3, tp_rank=0, tp_size=1, num_kv_heads=2,
                           compatibility_hash="h", config=UcxConnectorConfig(expected_transports=expected))
    c.register_kv_caches(torch.zeros(SHAPE), transport=transport)
    return c


def pull(decode: UcxWorkerConnector, request_id: str) -> None:
    decode.start_pull(request_id, KVTransferDescriptor("prefill-0", 3, request_id, (1, 2, 3), 12, 1, 4, 2), [4, 5, 6])


@pytest.fixture
def pair() -> Any:
    prefill = connector("prefill-0", ReportingTransport(""))
    wire = ReportingTransport("tcp")
    decode = connector("decode-0", wire, expected="rdma")
    decode.add_peer(prefill.get_handshake_metadata())
    yield decode, wire
    decode.shutdown()
    prefill.shutdown()


def test_every_pull_over_a_slower_transport_is_counted_and_logged_once(pair: Any, caplog: Any) -> None:
    decode, wire = pair
    assert decode.peer_transports() == {PeerKey("prefill-0", 3, 0): ""}  # before any pull
    with caplog.at_level(logging.WARNING, logger="connectors.ucx.pull_side"):
        for i in range(3):
            pull(decode, f"r{i}")
            wire.finish_all()
    assert decode.get_transfer_results().finished_recving == {"r0", "r1", "r2"}
    stats = decode.get_kv_connector_stats()
    assert stats is not None
    row = stats.pairs[("prefill-0", "decode-0")]
    assert row.bytes_by_transport == {"tcp": 3 * 3 * BLOCK_NBYTES}
    assert row.fallbacks == {("rdma", "tcp"): 3}
    warnings = [r.getMessage() for r in caplog.records if "slower than the expected" in r.getMessage()]
    assert len(warnings) == 1
    assert "prefill-0 rank 0 to decode-0 rank 0" in warnings[0] and "tcp" in warnings[0] and "rdma" in warnings[0]
    assert decode.peer_transports() == {PeerKey("prefill-0", 3, 0): "tcp"}


def test_the_expected_transport_is_no_fallback(pair: Any) -> None:
    decode, wire = pair
    wire.transport = "rc_mlx5"
    pull(decode, "r0")
    wire.finish_all()
    stats = decode.get_kv_connector_stats()
    assert stats is not None
    row = stats.pairs[("prefill-0", "decode-0")]
    assert row.bytes_by_transport == {"rc_mlx5": 3 * BLOCK_NBYTES} and row.fallbacks == {}


def test_a_bad_expected_transport_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="unknown transport 'ethernet'"):
        UcxWorkerConnector(engine_id="d", epoch=1, tp_rank=0, tp_size=1, num_kv_heads=2, compatibility_hash="h",
                           config=UcxConnectorConfig(expected_transports="ethernet"))
