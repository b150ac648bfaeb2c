"""Head-range segments: their pieces on both sides, and a pull that ends before its pieces are
laid out (one in-process UCX worker; about a second)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transport_listener import RecordingListener

from connectors.ucx.handshake import PeerKey
from connectors.ucx.transport import HeadGeometry, PullOp, Segment, num_pieces, pieces
from engine.config import KVCacheSpec
from engine.kv_cache import allocate_kv_cache


def test_pieces_of_a_head_range_line_up_on_both_sides() -> None:
    # Writer holds 1 head, reader 2 (2 -> 1 gather): head 0 of the writer is head 1 of the reader.
    writer, reader = HeadGeometry(1, 256), HeadGeometry(2, 256)
    seg = Segment(remote_block=3, local_block=5, num_blocks=2, remote_head=0, local_head=1, num_heads=1)
    src, dst = pieces(seg, writer, remote=True), pieces(seg, reader, remote=False)
    assert len(src) == len(dst) == num_pieces(seg) == 2  # one per block
    assert [n for _, n in src] == [n for _, n in dst] == [256, 256]
    assert src == [(3 * 256, 256), (4 * 256, 256)]  # the writer's whole blocks 3 and 4
    assert dst == [(5 * 512 + 256, 256), (6 * 512 + 256, 256)]  # the second head of local blocks 5, 6
    whole = Segment(3, 5, 2)
    assert pieces(whole, reader, remote=False) == [(5 * 512, 2 * 512)] and num_pieces(whole) == 1


@pytest.mark.parametrize(("heads", "first", "count"), [(4, 1, 2), (4, 0, 1), (4, 3, 1), (2, 0, 2)])
def test_a_head_range_of_an_engine_kv_cache_is_one_piece_per_block(heads: int, first: int, count: int) -> None:
    # The engine's own cache tensor (its KVCacheSpec layout), each element labelled with its head:
    # the pieces of a head range hold exactly that range's elements, one piece per block. (In the
    # earlier NL2HBD layout a head range of a block was 2 * num_layers strided pieces.)
    spec = KVCacheSpec(num_blocks=5, block_size=4, num_layers=3, num_kv_heads_local=heads, head_dim=8,
                       dtype="float32", element_size=4)
    kv = allocate_kv_cache(spec, torch.float32)
    head_axis = spec.layout.index("H")  # the layout names its axes
    labels = torch.arange(heads, dtype=torch.float32).view([heads if i == head_axis else 1 for i in range(6)])
    kv.copy_(labels.expand(spec.shape))
    geometry = HeadGeometry(heads, spec.block_nbytes // heads)
    seg = Segment(remote_block=1, local_block=0, num_blocks=3, remote_head=first, num_heads=count)
    got = pieces(seg, geometry, remote=True)
    assert len(got) == num_pieces(seg) == 3
    flat = kv.view(-1).view(torch.uint8)
    per_head = spec.num_layers * 2 * spec.block_size * spec.head_dim
    for offset, length in got:
        values = flat[offset:offset + length].view(torch.float32)
        assert values.numel() == count * per_head
        assert sorted(set(values.tolist())) == list(range(first, first + count))


def test_pull_from_an_unknown_peer_ends_once_with_nothing_done() -> None:
    from connectors.ucx.tag_transport import UcxTagTransport

    region = np.zeros(4 * 512, dtype=np.uint8)
    transport = UcxTagTransport(region, 512, PeerKey("d", 1, 0), geometry=HeadGeometry(2, 256))
    listener = RecordingListener()
    transport.start(listener)
    try:
        transport.pull(PullOp(7, PeerKey("nobody", 1, 0), "r", (Segment(0, 0, 2, 0, 1, 1),), 1.0))
        assert listener.done.wait(10)
        (result,) = listener.results
        assert (result.xfer_id, result.ok, result.reason, result.done_segments) == (7, False, "peer_unknown", ())
    finally:
        transport.shutdown()
