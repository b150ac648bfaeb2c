"""`Checkpoint`: a safetensors checkpoint read tensor by tensor, and slice by slice.

Contracts:
- Opening reads only the headers: names, shapes, which file holds what (a single file, several
  `*.safetensors`, or a sharded checkpoint with `model.safetensors.index.json`).
- `read(name, rows=..., cols=...)` returns a contiguous CPU tensor of only that slice, in the
  file's dtype (`safe_open(...).get_slice(name)[...]`): a tensor-parallel rank reads its shard
  and never the whole checkpoint. safetensors (0.8) hands a row slice out as a view of the
  file's mapping, which stays mapped while the tensor lives and whose only resident pages are
  the slice's (shared with the page cache); a column slice is copied out, and its mapping ends
  with the read.
- Every problem (missing file, malformed index or header, unknown tensor) raises
  `ModelLoadError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.config import ModelLoadError

Range = tuple[int, int]  # [start, end)


class Checkpoint:
    """The tensors of a model directory's safetensors files (see the module docstring)."""

    def __init__(self, model_dir: str | Path) -> None:
        self._files: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for f in _checkpoint_files(Path(model_dir)):
            for name, shape in _read_shapes(f).items():
                self._files[name] = f
                self._shapes[name] = shape

    @property
    def names(self) -> list[str]:
        return list(self._shapes)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, rows: Range | None = None, cols: Range | None = None) -> torch.Tensor:
        """`name`, or only rows [a, b) of dim 0 and / or columns [c, d) of dim 1, as a contiguous
        CPU tensor (see the module docstring)."""
        from safetensors import SafetensorError, safe_open

        path = self._files[name]
        try:
            with safe_open(str(path), framework="pt") as f:
                part = f.get_slice(name)
                r = slice(*rows) if rows is not None else slice(None)
                if cols is None:
                    tensor: torch.Tensor = part[r]
                else:
                    tensor = part[r, slice(*cols)]
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read {name!r} ({e})") from None
        return tensor.contiguous()


def _checkpoint_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({root / f for f in weight_map.values()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: malformed index ({e})") from None
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{root}: no *.safetensors checkpoint found")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: listed in the index but missing")
    return files


def _read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from None
