"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV cache, with TP sharding.

Weights come from Hugging Face safetensors; q/k/v and gate/up are fused into one matrix each.
Each rank reads only its own slices of the sharded tensors from the checkpoint and moves only
those to its device (engine/models/checkpoint.py).
Under tensor parallelism rank r holds attention heads [r*H/T, (r+1)*H/T), the KV heads of
`connectors.head_map.rank_heads` (a split, or one replicated head when KV heads < T, as for
MQA) and the matching MLP columns; o_proj and down_proj outputs are all-reduced. Embeddings and the LM head
are replicated. The numerics follow transformers (RMSNorm in float32, rotate-half RoPE).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from connectors.head_map import rank_heads
from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.config import ModelConfig, ModelLoadError, RopeConfig
from engine.models.checkpoint import Checkpoint, Range

AllReduce = Callable[[torch.Tensor], None]


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    assert rope.original_max_position_embeddings is not None
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaModel:
    """One rank's shard of the model. `forward` returns the final hidden states [T, hidden]."""

    def __init__(self, config: ModelConfig, checkpoint: Checkpoint, *, rank: int = 0,
                 tp_size: int = 1, all_reduce: AllReduce | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        config.check_tp(tp_size)
        self.config = config
        self.rank, self.tp_size = rank, tp_size
        self.all_reduce = all_reduce
        self.num_heads = config.num_heads // tp_size
        self.kv_heads = rank_heads(rank, tp_size, config.num_kv_heads)
        self.num_kv_heads = self.kv_heads[1] - self.kv_heads[0]
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.dtype, self.device = dtype, device
        take = _Taker(checkpoint, dtype, device)
        self.embed = take("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        self.norm = take("model.norm.weight", (config.hidden_size,))
        if config.tie_word_embeddings and "lm_head.weight" not in checkpoint:
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight", (config.vocab_size, config.hidden_size))
        self.layers = [self._layer(take, i) for i in range(config.num_layers)]
        take.check_unused()
        inv_freq = rope_inv_freq(config.rope, config.head_dim)
        freqs = torch.arange(config.max_model_len).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def _layer(self, take: _Taker, i: int) -> LayerWeights:
        c, r, t = self.config, self.rank, self.tp_size
        p = f"model.layers.{i}."
        hd = c.head_dim
        q = _shard(c.num_heads * hd, r, t)
        kv = (self.kv_heads[0] * hd, self.kv_heads[1] * hd)
        inter = _shard(c.intermediate_size, r, t)
        q_shape, kv_shape = (c.num_heads * hd, c.hidden_size), (c.num_kv_heads * hd, c.hidden_size)
        qkv = torch.cat([take(p + "self_attn.q_proj.weight", q_shape, rows=q),
                         take(p + "self_attn.k_proj.weight", kv_shape, rows=kv),
                         take(p + "self_attn.v_proj.weight", kv_shape, rows=kv)])
        qkv_bias = None
        if c.qkv_bias:
            qkv_bias = torch.cat([take(p + "self_attn.q_proj.bias", q_shape[:1], rows=q),
                                  take(p + "self_attn.k_proj.bias", kv_shape[:1], rows=kv),
                                  take(p + "self_attn.v_proj.bias", kv_shape[:1], rows=kv)])
        mlp_shape = (c.intermediate_size, c.hidden_size)
        return LayerWeights(
            input_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
            qkv=qkv,
            qkv_bias=qkv_bias,
            o_proj=take(p + "self_attn.o_proj.weight", (c.hidden_size, c.num_heads * hd), cols=q),
            o_bias=take.optional(p + "self_attn.o_proj.bias", (c.hidden_size,)),
            post_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
            gate_up=torch.cat([take(p + "mlp.gate_proj.weight", mlp_shape, rows=inter),
                               take(p + "mlp.up_proj.weight", mlp_shape, rows=inter)]),
            down=take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size), cols=inter),
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        c = self.config
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        nq, nkv, hd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        t = input_ids.shape[0]
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q = rotate(qkv[:, :nq].view(t, -1, hd), cos, sin)
            k = rotate(qkv[:, nq:nq + nkv].view(t, -1, hd), cos, sin)
            v = qkv[:, nq + nkv:].view(t, -1, hd)
            layer_cache = kv_cache[:, :, i]  # [num_blocks, H, 2, bs, D], a strided view
            write_kv(layer_cache, k, v, meta)
            attn = paged_attention(q, layer_cache, meta, self.scale)
            o = F.linear(attn.reshape(t, nq), layer.o_proj)
            if self.all_reduce is not None:
                self.all_reduce(o)
            if layer.o_bias is not None:
                o = o + layer.o_bias
            h = h + o
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gu = F.linear(x, layer.gate_up)
            inter = gu.shape[-1] // 2
            m = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], layer.down)
            if self.all_reduce is not None:
                self.all_reduce(m)
            h = h + m
        return rms_norm(h, self.norm, c.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)


def _shard(size: int, rank: int, tp: int) -> Range:
    """Rank `rank`'s equal part [start, end) of `size` split over `tp` ranks."""
    n = size // tp
    return rank * n, (rank + 1) * n


class _Taker:
    """Reads named tensors (or their rank's slices) from a checkpoint, checking shapes and
    reporting leftovers."""

    IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: str) -> None:
        self.checkpoint = checkpoint
        self.used: set[str] = set()
        self.dtype, self.device = dtype, device

    def __call__(self, name: str, shape: tuple[int, ...], *, rows: Range | None = None,
                 cols: Range | None = None) -> torch.Tensor:
        """The tensor `name` of the full shape `shape`, or rows [a, b) / columns [c, d) of it,
        in the model's dtype on its device (only the slice is read and moved)."""
        if name not in self.checkpoint:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        return self._get(name, shape, rows, cols)

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self._get(name, shape, None, None) if name in self.checkpoint else None

    def _get(self, name: str, shape: tuple[int, ...], rows: Range | None, cols: Range | None) -> torch.Tensor:
        actual = self.checkpoint.shape(name)
        if actual != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {actual}, config implies {shape}")
        self.used.add(name)
        return self.checkpoint.read(name, rows, cols).to(dtype=self.dtype, device=self.device)

    def check_unused(self) -> None:
        left = [n for n in self.checkpoint.names if n not in self.used and not n.endswith(self.IGNORED_SUFFIXES)
                and n != "lm_head.weight"]
        if left:
            raise ModelLoadError(f"checkpoint has {len(left)} tensors the model does not use, e.g. {left[:3]} "
                                 "(wrong architecture in config.json?)")
