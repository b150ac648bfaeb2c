"""Model registry: architecture name -> implementation, and checkpoint loading."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from engine.models.llama import AllReduce, LlamaModel

logger = logging.getLogger(__name__)


def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors checkpoint (single file or sharded + index)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: malformed index ({e})") from None
        files = sorted({root / f for f in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors checkpoint found")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: listed in the index but missing")
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors ({e})") from None
    return weights


def load_model(config: ModelConfig, *, rank: int = 0, tp_size: int = 1, all_reduce: AllReduce | None = None,
               device: str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaModel:
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {config.architecture!r}")
    weights = load_weights(config.model_dir)
    return LlamaModel(config, weights, rank=rank, tp_size=tp_size, all_reduce=all_reduce,
                      device=device, dtype=dtype)
