"""`StridedKVLayout`: where a rank's KV blocks and heads lie in registered memory, and the byte
ranges a block transfer moves.

vLLM 0.32 places every attention layer's KV in one backing allocation and views it as a 5-D
logical `[L, B, H, N, C]` tensor — layers, blocks, KV heads, token slots of a block, content
(one token's K and V of one head, contiguous) — whose physical order is one of six stride
permutations (`vllm/v1/kv_cache_layout.py` `KVCacheLayout`, RFC #42082): `VLLM_LAYOUTS` here,
C always innermost. The connector registers that allocation with the data plane as it is and
describes it by this class (the four byte strides of L, B, H, N, the content size, the offset
of element 0); nothing is copied.

A transfer moves a `Segment` — a run of blocks, all the rank's heads or a head range — as the
maximal byte ranges its cells form, found from the innermost dimension out: full dimensions
whose stride continues the range merge into it, the first partial one (the block run, or the
head range) contributes its count and ends it, and every dimension outside is iterated in
physical order. Block-outermost layouts (`BHLNC`, `BLHNC`) move a run of whole blocks as one
range; layer-outermost ones (`LBHNC`, vLLM's CPU attention) as one range per layer. Both ends
of a transfer use the same layout (the compatibility hash covers it) and the same L, N, C, and
a segment is partial or full in the same dimensions on both ends, so the writer's and the
reader's lists have the same number of ranges of the same lengths, in the same order — under
different TP sizes too (H differs; head-range segments never merge across H).

Pure: no torch; `connectors/vllm/kv_region.py` reads a layout off vLLM's tensors.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

# Physical order (outermost first) of the logical dims L=0, B=1, H=2, N=3; C is innermost.
VLLM_LAYOUTS: dict[str, tuple[int, int, int, int]] = {
    "LBHNC": (0, 1, 2, 3),
    "LBNHC": (0, 1, 3, 2),
    "LHBNC": (0, 2, 1, 3),
    "BLHNC": (1, 0, 2, 3),
    "BLNHC": (1, 0, 3, 2),
    "BHLNC": (1, 2, 0, 3),
}
# B outermost: a run of whole blocks is one range (BHLNC: a head range of it too, per block).
BLOCK_OUTERMOST = tuple(name for name, order in VLLM_LAYOUTS.items() if order[0] == 1)
LAYOUT_PREFIX = "vllm:"  # the handshake's name of a vLLM layout: "vllm:LBHNC"
_L, _B, _H, _N = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class _Pick:
    start: int
    count: int
    full: bool


@dataclass(frozen=True, slots=True)
class StridedKVLayout:
    """One rank's KV as a strided `[L, B, H, N, C]` view of a byte region (see the module docstring).

    `shape` is (L, B, H, N) with B in the attention kernel's blocks: `blocks_per_page` of them
    make one block of vLLM's block manager (what block ids name), consecutively. `strides` are
    bytes; `content_nbytes` is C in bytes; `offset` is the byte of element (0, 0, 0, 0)."""

    name: str
    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]
    content_nbytes: int
    offset: int = 0
    blocks_per_page: int = 1

    @property
    def order(self) -> tuple[int, int, int, int]:
        return VLLM_LAYOUTS[self.name]

    @property
    def num_layers(self) -> int:
        return self.shape[_L]

    @property
    def num_blocks(self) -> int:
        return self.shape[_B] // self.blocks_per_page

    @property
    def num_local_heads(self) -> int:
        return self.shape[_H]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's KV (every layer and head), padding excluded: what a transfer moves."""
        layers, _, heads, slots = self.shape
        return layers * self.blocks_per_page * heads * slots * self.content_nbytes

    @property
    def span_nbytes(self) -> int:
        """One past the last byte the layout addresses."""
        return self.offset + sum((e - 1) * s for e, s in zip(self.shape, self.strides, strict=True)) + \
            self.content_nbytes

    def validate(self, region_nbytes: int) -> None:
        """Raises ValueError unless the layout is one of `VLLM_LAYOUTS` with strides in its order
        that fit `region_nbytes` and never overlap two cells."""
        if self.name not in VLLM_LAYOUTS:
            raise ValueError(f"unknown KV layout {self.name!r} (known: {', '.join(VLLM_LAYOUTS)})")
        if min(self.shape) < 1 or self.content_nbytes < 1 or self.blocks_per_page < 1 or self.offset < 0:
            raise ValueError(f"KV layout {self}: sizes must be >= 1")
        if self.shape[_B] % self.blocks_per_page:
            raise ValueError(f"KV layout: {self.shape[_B]} kernel blocks are not whole pages of {self.blocks_per_page}")
        inner = self.content_nbytes
        for dim in reversed(self.order):
            if self.shape[dim] == 1:
                continue
            if self.strides[dim] < inner:
                raise ValueError(f"KV layout {self.name}: stride {self.strides[dim]} of dim {'LBHN'[dim]} overlaps "
                                 f"the {inner} bytes inside it (strides {self.strides})")
            inner = self.strides[dim] * self.shape[dim]
        if self.span_nbytes > region_nbytes:
            raise ValueError(f"KV layout addresses {self.span_nbytes} bytes, the region has {region_nbytes}")

    def _plan(self, first_block: int, num_blocks: int, head: int, num_heads: int
              ) -> tuple[int, int, list[tuple[int, _Pick]]]:
        """(base offset, range length, the dims iterated outside it with their picks)."""
        r = self.blocks_per_page
        picks = (_Pick(0, self.shape[_L], True), _Pick(first_block * r, num_blocks * r, False),
                 _Pick(head, num_heads, False) if num_heads else _Pick(0, self.shape[_H], True),
                 _Pick(0, self.shape[_N], True))
        length, base, stop = self.content_nbytes, self.offset, 0
        for pos in reversed(range(4)):
            dim = self.order[pos]
            pick, stride = picks[dim], self.strides[dim]
            if pick.full and self.shape[dim] == 1:
                continue
            if stride != length:  # not contiguous with the range inside: iterate it
                stop = pos + 1
                break
            base += pick.start * stride
            length *= self.shape[dim] if pick.full else pick.count
            if not pick.full:
                stop = pos
                break
        return base, length, [(self.strides[d], picks[d]) for d in self.order[:stop]]

    def pieces(self, seg: Any, *, remote: bool) -> list[tuple[int, int]]:
        """(byte offset, length) of the ranges `seg` (a `connectors.ucx.transport.Segment`)
        moves on one side: the remote block and head (`remote=True`, the writer) or the local."""
        first = seg.remote_block if remote else seg.local_block
        head = seg.remote_head if remote else seg.local_head
        base, length, outer = self._plan(first, seg.num_blocks, head, seg.num_heads)
        ranges = [range(p.start, p.start + p.count) for _, p in outer]
        strides = [s for s, _ in outer]
        return [(base + sum(i * s for i, s in zip(idx, strides, strict=True)), length)
                for idx in itertools.product(*ranges)]

    def num_pieces(self, seg: Any) -> int:
        """How many ranges `seg` moves (the same on both sides)."""
        _, _, outer = self._plan(seg.local_block, seg.num_blocks, seg.local_head, seg.num_heads)
        return math.prod(p.count for _, p in outer)


def layout_from_strides(shape: tuple[int, int, int, int], strides: tuple[int, int, int, int]) -> str | None:
    """The name of the `VLLM_LAYOUTS` order whose strides decrease outward, dims of size 1
    ignored (the first such, in `VLLM_LAYOUTS` order), or None if no order fits."""
    for name, order in VLLM_LAYOUTS.items():
        sized = [strides[d] for d in order if shape[d] > 1]
        if all(a > b for a, b in itertools.pairwise(sized)):
            return name
    return None


def vllm_layout_strides(name: str, shape: tuple[int, int, int, int], content_nbytes: int,
                        block_stride: int | None = None) -> tuple[int, int, int, int]:
    """Byte strides of (L, B, H, N) as vLLM 0.32 computes them for a dense layout
    (`vllm/v1/kv_cache_interface.py` `compute_layout_strides`: innermost first, each dim's
    stride the bytes inside it), optionally with a fixed block stride (block-outermost
    layouts: the packed block of every layer, possibly padded)."""
    strides = [0, 0, 0, 0]
    current = content_nbytes
    for dim in reversed(VLLM_LAYOUTS[name]):
        strides[dim] = block_stride if dim == _B and block_stride else current
        current = strides[dim] * shape[dim]
    return strides[0], strides[1], strides[2], strides[3]


@dataclass(frozen=True, slots=True)
class KVRegion:
    """KV memory registered in place: `memory` is the whole allocation as a flat uint8 tensor
    (CPU or CUDA), `layout` where blocks and heads lie in it."""

    memory: Any
    layout: StridedKVLayout
    block_size: int  # tokens per block
    head_dim: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(self.memory.numel())

    @property
    def memory_type(self) -> str:
        return str(self.memory.device.type)
