"""Paged attention in plain torch: write new K/V into the block cache, attend over the blocks.

The KV cache is one tensor [num_blocks, kv_heads, num_layers, 2, block_size, head_dim] (NHL2BD:
heads outermost in a block, so a head range of a block is contiguous for the KV transfer); a
layer's cache is the strided view [num_blocks, kv_heads, 2, block_size, head_dim]. For a
step, `AttentionMetadata` says where each new token's K/V goes (block id, offset) and how the
step's tokens group into requests: decode requests (one new token) are attended together in one
padded SDPA call; prefill chunks one SDPA call each, causal with the chunk's offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeq:
    token_start: int  # first row of this chunk in the step's token batch
    num_tokens: int
    start_pos: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor  # blocks covering [0, start_pos + num_tokens)


@dataclass(slots=True)
class AttentionMetadata:
    slot_block: torch.Tensor  # [T] block id per new token
    slot_offset: torch.Tensor  # [T] offset inside the block
    decode_rows: torch.Tensor | None  # [B] rows of the decode tokens in the batch
    decode_block_table: torch.Tensor | None  # [B, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size], True = attend
    prefills: list[PrefillSeq]
    all_decode: bool  # every token is a decode token, rows in order


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """layer_cache: [num_blocks, H, 2, bs, D]; k, v: [T, H, D]."""
    layer_cache[:, :, 0][meta.slot_block, :, meta.slot_offset] = k
    layer_cache[:, :, 1][meta.slot_block, :, meta.slot_offset] = v


def _gather(layer_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] block ids -> K, V of shape [..., H, n * bs, D]."""
    g = layer_cache[block_ids]  # [..., n, H, 2, bs, D]
    lead = g.shape[:-5]
    n, h, _, bs, d = g.shape[-5:]
    g = g.movedim(-5, -3)  # [..., H, 2, n, bs, D]
    g = g.reshape(*lead, h, 2, n * bs, d)
    return g.select(-3, 0), g.select(-3, 1)


def paged_attention(q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, Hq, D] (rotary applied); the step's K/V must already be written. Returns [T, Hq, D]."""
    if not meta.all_decode or q.device.type != "cpu":
        return _paged_attention(q, layer_cache, meta, scale)
    # Decode-only attention is many tiny kernels: on a loaded CPU every parallel region can wait
    # a scheduler quantum for a descheduled thread, so it runs on one thread (no cost when idle).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _paged_attention(q, layer_cache, meta, scale)
    finally:
        torch.set_num_threads(threads)


def _paged_attention(q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    out = torch.empty_like(q) if not meta.all_decode else None
    gqa = q.shape[1] != layer_cache.shape[1]
    if meta.decode_rows is not None:
        assert meta.decode_block_table is not None
        k, v = _gather(layer_cache, meta.decode_block_table)  # [B, H, L, D]
        qd = q.unsqueeze(2) if meta.all_decode else q[meta.decode_rows].unsqueeze(2)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=gqa).squeeze(2)
        if meta.all_decode:
            return o
        assert out is not None
        out[meta.decode_rows] = o
    assert out is not None
    for seq in meta.prefills:
        rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
        total = seq.start_pos + seq.num_tokens
        k, v = _gather(layer_cache, seq.block_ids)
        k, v = k[:, :total], v[:, :total]
        qs = q[rows].transpose(0, 1)  # [Hq, n, D]
        if seq.start_pos == 0:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            qpos = torch.arange(seq.start_pos, total, device=q.device).unsqueeze(1)
            mask = torch.arange(total, device=q.device).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[rows] = o.transpose(0, 1)
    return out
