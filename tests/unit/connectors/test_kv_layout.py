"""`StridedKVLayout`: the byte ranges of a block transfer in each vLLM 0.32 layout, checked
against an oracle that maps every byte of both sides' range lists to its logical cell.

Golden piece counts pin the point of the layouts: block-outermost moves a run of whole blocks
as one range, vLLM's CPU layout (LBHNC) as one range per layer.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from connectors.kv_layout import (
    VLLM_LAYOUTS,
    StridedKVLayout,
    layout_from_strides,
    vllm_layout_strides,
)
from connectors.ucx.transport import Segment

L, N, C = 3, 4, 8  # layers, slots per block, content bytes


def _layout(name: str, num_blocks: int, heads: int, *, padded_block: int | None = None,
            pages: int = 1) -> StridedKVLayout:
    shape = (L, num_blocks * pages, heads, N)
    return StridedKVLayout(name, shape, vllm_layout_strides(name, shape, C, padded_block), C, blocks_per_page=pages)


def _cells(layout: StridedKVLayout, pieces: list[tuple[int, int]], first_block: int, first_head: int) -> list[tuple]:
    """The logical (layer, block - first, head - first, slot, byte) of every byte of `pieces`, in order."""
    where: dict[int, tuple] = {}
    for idx in itertools.product(*(range(e) for e in layout.shape)):
        off = layout.offset + sum(i * s for i, s in zip(idx, layout.strides, strict=True))
        l_, kb, h, n = idx
        for c in range(layout.content_nbytes):
            where[off + c] = (l_, kb - first_block * layout.blocks_per_page, h - first_head, n, c)
    return [where[o] for off, length in pieces for o in range(off, off + length)]


@pytest.mark.parametrize("name", list(VLLM_LAYOUTS))
@pytest.mark.parametrize("pages", [1, 2])
def test_whole_blocks_and_head_ranges_line_up_cell_for_cell(name: str, pages: int) -> None:
    writer, reader = _layout(name, 7, 4, pages=pages), _layout(name, 9, 4, pages=pages)
    whole = Segment(2, 5, 3)
    w, r = writer.pieces(whole, remote=True), reader.pieces(whole, remote=False)
    assert [n for _, n in w] == [n for _, n in r] and len(w) == writer.num_pieces(whole)
    assert _cells(writer, w, 2, 0) == _cells(reader, r, 5, 0)
    assert len(_cells(writer, w, 2, 0)) == 3 * writer.block_nbytes
    # heterogeneous TP: heads 1..2 of a 4-head writer into heads 0..1 of a 2-head reader
    small = _layout(name, 9, 2, pages=pages)
    seg = Segment(2, 5, 3, remote_head=1, local_head=0, num_heads=2)
    w, r = writer.pieces(seg, remote=True), small.pieces(seg, remote=False)
    assert [n for _, n in w] == [n for _, n in r] and len(w) == writer.num_pieces(seg) == small.num_pieces(seg)
    cells_w = [(a, b, h - 1, n, c) for a, b, h, n, c in _cells(writer, w, 2, 0)]
    assert cells_w == _cells(small, r, 5, 0)
    assert all(0 <= h < 2 for _, _, h, _, _ in cells_w) and len(cells_w) == 3 * L * pages * 2 * N * C


@pytest.mark.parametrize(("name", "whole", "heads"), [
    ("BHLNC", 1, 3), ("BLHNC", 1, 3 * L), ("LBHNC", L, L * 3), ("LBNHC", L, L * 3 * N), ("LHBNC", L * 4, L * 2),
    ("BLNHC", 1, 3 * L * N)])
def test_range_counts(name: str, whole: int, heads: int) -> None:
    layout = _layout(name, 8, 4)
    assert layout.num_pieces(Segment(1, 1, 3)) == whole
    assert layout.num_pieces(Segment(1, 1, 3, 0, 0, 2)) == heads


def test_padded_block_stride_moves_each_block_alone() -> None:
    dense = L * 4 * N * C
    layout = _layout("BLHNC", 8, 4, padded_block=dense + 64)
    pieces = layout.pieces(Segment(2, 2, 3), remote=False)
    assert pieces == [((2 + i) * (dense + 64), dense) for i in range(3)]


@pytest.mark.parametrize("name", list(VLLM_LAYOUTS))
def test_layout_read_back_from_strides(name: str) -> None:
    shape = (L, 8, 4, N)
    assert layout_from_strides(shape, vllm_layout_strides(name, shape, C)) == name


def test_validate_refuses_overlap_and_overrun() -> None:
    layout = _layout("LBHNC", 8, 4)
    layout.validate(layout.span_nbytes)
    with pytest.raises(ValueError, match="region has"):
        layout.validate(layout.span_nbytes - 1)
    bad = StridedKVLayout("LBHNC", layout.shape, (layout.strides[0], 8, layout.strides[2], layout.strides[3]), C)
    with pytest.raises(ValueError, match="overlaps"):
        bad.validate(1 << 20)
    with pytest.raises(ValueError, match="unknown KV layout"):
        StridedKVLayout("NHD", layout.shape, layout.strides, C).validate(1 << 20)


def test_pieces_cover_exactly_the_segment_bytes() -> None:
    layout = _layout("LBHNC", 8, 2)
    region = np.zeros(layout.span_nbytes, dtype=np.uint8)
    for off, length in layout.pieces(Segment(0, 3, 2), remote=False):
        region[off:off + length] += 1
    assert region.max() == 1 and int(region.sum()) == 2 * layout.block_nbytes
