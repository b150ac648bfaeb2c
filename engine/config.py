"""Model facts read from a Hugging Face directory, and the KV-cache spec derived from them.

`ModelConfig.from_dir` understands both config dialects: transformers 5 writes `rope_parameters`
(rope_theta, rope_type and scaling inside one dict) where transformers 4 wrote top-level
`rope_theta` / `rope_scaling`. A missing theta is an error only when neither dialect has it and
the architecture has no documented default.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from connectors.head_map import partition_problem

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
KV_LAYOUT = "NHL2BD"  # [num_blocks, kv_heads, num_layers, K/V, block_size, head_dim]


class ModelLoadError(ValueError):
    """A model directory that cannot be served; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the engine, the handshake and the KV layout need to know about a model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    model_dir: str = ""

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, dtype: str = "float32",
                 max_model_len: int = 0) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, dtype=dtype, max_model_len=max_model_len, model_dir=str(model_dir),
                             source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, dtype: str = "float32", max_model_len: int = 0,
                  model_dir: str = "", source: str = "config") -> ModelConfig:
        arch = _architecture(raw, source)
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            cfg_len = int(raw.get("max_position_embeddings", 2048))
            window = raw.get("sliding_window") if arch == "MistralForCausalLM" else None
            if window:
                # Sequences never exceed the window, so full attention equals windowed attention.
                cfg_len = min(cfg_len, int(window))
            num_kv = int(raw.get("num_key_value_heads") or num_heads)
            config = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=num_kv,
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_rope(raw, arch, source),
                max_model_len=min(max_model_len, cfg_len) if max_model_len > 0 else cfg_len,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                dtype=dtype,
                eos_token_ids=_ids(raw.get("eos_token_id")),
                bos_token_id=raw.get("bos_token_id"),
                model_dir=model_dir,
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: malformed field: {e}") from None
        config.validate(source)
        return config

    def validate(self, source: str = "config") -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_model_len"):
            if getattr(self, name) < 1:
                raise ModelLoadError(f"{source}: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads ({self.num_heads}) is not a multiple of "
                                 f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim must be even for rotary embeddings, got {self.head_dim}")

    def check_tp(self, tp_size: int) -> None:
        """Raises ValueError unless heads and the MLP split evenly over tp_size ranks and the KV
        heads either split evenly or, when fewer than tp_size (MQA), replicate evenly
        (`connectors.head_map`)."""
        for name, value in (("num_attention_heads", self.num_heads),
                            ("intermediate_size", self.intermediate_size)):
            if value % tp_size:
                raise ValueError(f"tp={tp_size} does not divide {name}={value}")
        problem = partition_problem(self.num_kv_heads, tp_size)
        if problem is not None:
            raise ValueError(problem)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape facts of one rank's KV cache tensor (layout NHL2BD: heads outermost in a block)."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads_local: int
    head_dim: int
    dtype: str
    element_size: int
    tp_size: int = 1
    layout: str = KV_LAYOUT
    kv_head_ranges: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    device_kind: str = "cpu"  # where the cache lives: cpu or cuda (part of the compatibility hash)

    @property
    def block_nbytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads_local * self.block_size * self.head_dim * self.element_size

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_blocks, self.num_kv_heads_local, self.num_layers, 2, self.block_size, self.head_dim)


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        model_type = raw.get("model_type")
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        if model_type in by_type:
            return by_type[model_type]
        raise ModelLoadError(f"{source}: no 'architectures' and unknown model_type {model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: unsupported hidden_act {raw.get('hidden_act')!r} (only silu)")
    return str(arch)


def _rope(raw: dict[str, Any], arch: str, source: str) -> RopeConfig:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        scaling: dict[str, Any] = dict(params)
        theta = params.get("rope_theta", raw.get("rope_theta"))
    else:
        scaling = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta")
    if theta is None:
        # transformers' own default for all three architectures; said out loud because a wrong
        # theta produces fluent nonsense rather than an error.
        logger.warning("%s: no rope_theta in rope_parameters or at the top level; using 10000", source)
        theta = 10000.0
    rope_type = str(scaling.get("rope_type") or scaling.get("type") or "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope type {rope_type!r}; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    orig = scaling.get("original_max_position_embeddings")
    if rope_type == "llama3" and orig is None:
        raise ModelLoadError(f"{source}: llama3 rope scaling needs original_max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
    )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)
