"""The NIXL transport's prepared descriptor lists: READs built from block indices land the right
bytes, and writers joining and leaving leave no prepared list behind (real NIXL agents and UCX
workers in one process, no engine; about 3 s)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import numpy as np
import pytest

from connectors.ucx.handshake import PeerKey
from connectors.ucx.nixl_transport import NixlTransport, nixl_importable
from connectors.ucx.transport import HeadGeometry, PullOp, PullRequest, PullResult, Segment

pytestmark = pytest.mark.skipif(not nixl_importable(), reason="nixl-cu12 not installed")

GEOMETRY = HeadGeometry(4, 256)  # blocks of 4 heads x 256 bytes on both sides
BLOCKS = 16


class _Listener:
    """Accepts every pull (writer side) and queues pull results (reader side)."""

    def __init__(self) -> None:
        self.results: queue.Queue[PullResult] = queue.Queue()

    def on_pull_finished(self, result: PullResult) -> None:
        self.results.put(result)

    def on_pull_request(self, request: PullRequest) -> str | None:
        return None

    def on_reader_done(self, request_id: str, reader: PeerKey, ok: bool) -> None:
        pass

    def on_renew(self, request_ids: list[str], reader: PeerKey) -> None:
        pass


def _transport(region: np.ndarray, key: PeerKey) -> tuple[NixlTransport, _Listener]:
    transport = NixlTransport(region, GEOMETRY.block_nbytes, key, geometry=GEOMETRY)
    listener = _Listener()
    transport.start(listener)
    return transport, listener


def _wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_writers_joining_and_leaving_leave_no_prepared_list_and_every_read_lands() -> None:
    reader_region = np.zeros(BLOCKS * GEOMETRY.block_nbytes, dtype=np.uint8)
    reader, listener = _transport(reader_region, PeerKey("decode", 1, 0))
    rng = np.random.default_rng(3)
    try:
        for i in range(10):
            region = rng.integers(0, 256, BLOCKS * GEOMETRY.block_nbytes, dtype=np.uint8)
            key = PeerKey(f"prefill-{i}", 1, 0)
            writer, _ = _transport(region, key)
            try:
                reader.add_peer(key, writer.worker_address)
                # Whole blocks 3-5 and 9 -> local 0-2 and 7; then heads 2-3 of blocks 10, 12 -> local
                # heads 0-1 of blocks 4, 5 (two segments, one head range: one prepared list a side).
                whole = (Segment(3, 0, 3), Segment(9, 7, 1))
                split = (Segment(10, 4, 1, 2, 0, 2), Segment(12, 5, 1, 2, 0, 2))
                for n, segments in enumerate((whole, split)):
                    reader.pull(PullOp(2 * i + n, key, f"r{i}", segments, 10.0))
                    result = listener.results.get(timeout=10)
                    assert (result.ok, result.reason, result.done_segments) == (True, None, segments)
                blk = GEOMETRY.block_nbytes
                for remote, local in ((3, 0), (4, 1), (5, 2), (9, 7)):
                    assert (reader_region[local * blk:(local + 1) * blk] == region[remote * blk:(remote + 1) * blk]).all()
                half = blk // 2
                for remote, local in ((10, 4), (12, 5)):
                    assert (reader_region[local * blk:local * blk + half] == region[remote * blk + half:(remote + 1) * blk]).all()
                assert result.num_bytes == 2 * half
                assert reader.prepared_lists == 4  # 2 head ranges x 2 sides
                reader.remove_peer(key)
                assert _wait_until(lambda: reader.prepared_lists == 2), reader.prepared_lists
            finally:
                writer.shutdown()
        assert reader.prepared_lists == 2  # this region's, one per head range
    finally:
        reader.shutdown()
    assert reader.prepared_lists == 0


def test_a_read_past_the_writers_region_fails_before_anything_is_posted() -> None:
    reader_region = np.zeros(BLOCKS * GEOMETRY.block_nbytes, dtype=np.uint8)
    reader, listener = _transport(reader_region, PeerKey("decode", 1, 0))
    small = np.ones(4 * GEOMETRY.block_nbytes, dtype=np.uint8)  # a writer of 4 blocks only
    writer, _ = _transport(small, PeerKey("prefill", 1, 0))
    try:
        reader.add_peer(PeerKey("prefill", 1, 0), writer.worker_address)
        reader.pull(PullOp(1, PeerKey("prefill", 1, 0), "r", (Segment(2, 0, 3),), 10.0))
        result = listener.results.get(timeout=10)
        assert (result.ok, result.reason, result.done_segments, result.num_bytes) == (False, "out_of_range", (), 0)
        assert not reader_region.any()
    finally:
        writer.shutdown()
        reader.shutdown()
