"""Model registry: architecture name -> implementation, and checkpoint loading."""

from __future__ import annotations

import logging

import torch

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from engine.models.checkpoint import Checkpoint
from engine.models.llama import AllReduce, LlamaModel

logger = logging.getLogger(__name__)


def load_model(config: ModelConfig, *, rank: int = 0, tp_size: int = 1, all_reduce: AllReduce | None = None,
               device: str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaModel:
    """Rank `rank`'s shard of the model on `device`: only its slices are read from the checkpoint
    (engine/models/checkpoint.py) and moved to the device."""
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {config.architecture!r}")
    return LlamaModel(config, Checkpoint(config.model_dir), rank=rank, tp_size=tp_size, all_reduce=all_reduce,
                      device=device, dtype=dtype)
