"""Head-range segments: their pieces on both sides, and a pull that ends before its pieces are
laid out (one in-process UCX worker; about a second)."""

from __future__ import annotations

import threading

import numpy as np

from connectors.ucx.handshake import PeerKey
from connectors.ucx.transport import HeadGeometry, PullOp, PullResult, Segment, num_pieces, pieces


def test_pieces_of_a_head_range_line_up_on_both_sides() -> None:
    # Writer holds 1 head, reader 2 (2 -> 1 gather): head 0 of the writer is head 1 of the reader.
    writer, reader = HeadGeometry(2, 1, 64), HeadGeometry(2, 2, 64)
    seg = Segment(remote_block=3, local_block=5, num_blocks=2, remote_head=0, local_head=1, num_heads=1)
    src, dst = pieces(seg, writer, remote=True), pieces(seg, reader, remote=False)
    assert len(src) == len(dst) == num_pieces(seg, 2) == 2 * 2 * 2
    assert [n for _, n in src] == [n for _, n in dst] == [64] * 8
    assert src[:4] == [(3 * 256 + j * 64, 64) for j in range(4)]  # whole remote block 3, slab by slab
    assert dst[:4] == [(5 * 512 + j * 128 + 64, 64) for j in range(4)]  # second head of each local slab
    whole = Segment(3, 5, 2)
    assert pieces(whole, reader, remote=False) == [(5 * 512, 2 * 512)] and num_pieces(whole, 2) == 1


class _Listener:
    def __init__(self) -> None:
        self.results: list[PullResult] = []
        self.done = threading.Event()

    def on_pull_finished(self, result: PullResult) -> None:
        self.results.append(result)
        self.done.set()

    def on_pull_request(self, request: object) -> str | None:
        return None

    def on_reader_done(self, request_id: str, reader: PeerKey, ok: bool) -> None:
        pass

    def on_renew(self, request_ids: list[str], reader: PeerKey) -> None:
        pass


def test_pull_from_an_unknown_peer_ends_once_with_nothing_done() -> None:
    from connectors.ucx.tag_transport import UcxTagTransport

    region = np.zeros(4 * 512, dtype=np.uint8)
    transport = UcxTagTransport(region, 512, PeerKey("d", 1, 0), geometry=HeadGeometry(2, 2, 64))
    listener = _Listener()
    transport.start(listener)
    try:
        transport.pull(PullOp(7, PeerKey("nobody", 1, 0), "r", (Segment(0, 0, 2, 0, 1, 1),), 1.0))
        assert listener.done.wait(10)
        (result,) = listener.results
        assert (result.xfer_id, result.ok, result.reason, result.done_segments) == (7, False, "peer_unknown", ())
    finally:
        transport.shutdown()
