"""Loading at TP reads each rank's shard only: the weights a rank loads are byte-equal to slicing
the full checkpoint tensors (split, MQA-replicated and biased heads; one file or an index of
several), and a rank's peak host RSS while loading stays near its shard, far below the full
checkpoint (measured in a fresh process with ru_maxrss)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from connectors.head_map import rank_heads
from engine.config import ModelConfig, ModelLoadError
from engine.models import load_model
from engine.models.checkpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[3]


def _full_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _expected_layer(full: dict[str, torch.Tensor], cfg: ModelConfig, i: int, rank: int, tp: int) -> dict[str, Any]:
    """Rank `rank`'s layer i, sliced from the full tensors (the layout the model documents)."""
    p, hd = f"model.layers.{i}.", cfg.head_dim
    nq, ni = cfg.num_heads * hd // tp, cfg.intermediate_size // tp
    k0, k1 = (h * hd for h in rank_heads(rank, tp, cfg.num_kv_heads))

    def qkv(kind: str) -> torch.Tensor:
        return torch.cat([full[p + f"self_attn.q_proj.{kind}"][rank * nq:(rank + 1) * nq],
                          full[p + f"self_attn.k_proj.{kind}"][k0:k1], full[p + f"self_attn.v_proj.{kind}"][k0:k1]])

    return {"qkv": qkv("weight"), "qkv_bias": qkv("bias") if cfg.qkv_bias else None,
            "o_proj": full[p + "self_attn.o_proj.weight"][:, rank * nq:(rank + 1) * nq],
            "gate_up": torch.cat([full[p + "mlp.gate_proj.weight"][rank * ni:(rank + 1) * ni],
                                  full[p + "mlp.up_proj.weight"][rank * ni:(rank + 1) * ni]]),
            "down": full[p + "mlp.down_proj.weight"][:, rank * ni:(rank + 1) * ni],
            "input_norm": full[p + "input_layernorm.weight"], "post_norm": full[p + "post_attention_layernorm.weight"]}


def _assert_byte_equal(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str) -> None:
    if expected is None:
        assert actual is None, what
        return
    assert actual is not None and actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert actual.contiguous().view(torch.uint8).equal(expected.contiguous().view(torch.uint8)), what


@pytest.mark.parametrize("kind", ["llama_gqa_llama3", "qwen2_bias", "llama_tied_mqa_headdim"])
def test_tp2_shards_are_byte_equal_to_slices_of_the_full_tensors(tiny_model, kind: str) -> None:
    model = tiny_model(kind)
    cfg = ModelConfig.from_dir(model.path)
    full = _full_tensors(model.path)
    for tp in (1, 2):
        for rank in range(tp):
            loaded = load_model(cfg, rank=rank, tp_size=tp)
            _assert_byte_equal(loaded.embed, full["model.embed_tokens.weight"], "embed")
            _assert_byte_equal(loaded.norm, full["model.norm.weight"], "norm")
            _assert_byte_equal(loaded.lm_head, full.get("lm_head.weight", full["model.embed_tokens.weight"]), "lm_head")
            for i, layer in enumerate(loaded.layers):
                for name, expected in _expected_layer(full, cfg, i, rank, tp).items():
                    _assert_byte_equal(getattr(layer, name), expected, f"{kind} tp {tp} rank {rank} layer {i} {name}")


def test_an_indexed_multi_file_checkpoint_loads_the_same_shards(tiny_model, tmp_path: Path) -> None:
    model = tiny_model("qwen2_bias")
    split = tmp_path / "split"
    model.hf.save_pretrained(split, max_shard_size="40KB")
    assert (split / "model.safetensors.index.json").is_file() and len(list(split.glob("*.safetensors"))) > 2
    one, many = ModelConfig.from_dir(model.path), ModelConfig.from_dir(split)
    a, b = load_model(one, rank=1, tp_size=2), load_model(many, rank=1, tp_size=2)
    for la, lb in zip(a.layers, b.layers, strict=True):
        _assert_byte_equal(la.qkv, lb.qkv, "qkv")
        _assert_byte_equal(la.down, lb.down, "down")
    (split / next(iter(sorted(split.glob("*.safetensors")))).name).unlink()
    with pytest.raises(ModelLoadError, match="listed in the index but missing"):
        Checkpoint(split)


# -- peak RSS -----------------------------------------------------------------------------------

# Peak RSS is read as VmHWM (this process image's high-water mark, reset after the imports):
# ru_maxrss would carry the parent's peak over fork + exec.
RSS_PROBE = """
import dataclasses, json, sys
import torch
torch.set_num_threads(1)
from engine.config import ModelConfig
from engine.models import load_model

def status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

path, rank, tp, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
config = ModelConfig.from_dir(path, dtype=dtype)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
before = status_kib("VmRSS")
model = load_model(config, rank=rank, tp_size=tp, dtype=getattr(torch, dtype))
tensors = [model.embed, model.norm, model.cos, model.sin]
for layer in model.layers:
    tensors += [t for f in dataclasses.fields(layer) if isinstance(t := getattr(layer, f.name), torch.Tensor)]
if model.lm_head is not model.embed:
    tensors.append(model.lm_head)
for t in tensors:
    t.sum()  # every byte the rank holds is resident now, as once it serves
peak = status_kib("VmHWM")
held = sum(t.numel() * t.element_size() for t in tensors)
print(json.dumps({"load_kib": peak - before, "held_kib": held // 1024}))
"""


def rss_of_loading(path: Path, rank: int, tp: int, dtype: str = "float32") -> dict[str, int]:
    """Peak RSS growth (KiB) of a fresh process while it loads rank `rank` of `tp`, and the
    bytes (KiB) of the tensors it holds afterwards."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(path), str(rank), str(tp), dtype], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.splitlines()[-1]))


def _write_layer_heavy_model(path: Path) -> int:
    """A random Llama whose bytes are almost all in the sharded layer weights (small vocabulary);
    returns the checkpoint size in KiB."""
    from safetensors.torch import save_file

    hidden, inter, layers, heads, kv_heads, vocab = 512, 2048, 8, 8, 4, 256
    hd = hidden // heads
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * hd, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    path.mkdir()
    save_file({n: torch.randn(s, generator=g) for n, s in shapes.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "vocab_size": vocab, "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": True}
    (path / "config.json").write_text(json.dumps(config))
    return (path / "model.safetensors").stat().st_size // 1024


def test_a_tp2_rank_peaks_near_its_shard_not_the_whole_checkpoint(tmp_path: Path) -> None:
    checkpoint_kib = _write_layer_heavy_model(tmp_path / "model")
    full = rss_of_loading(tmp_path / "model", 0, 1)
    shard = rss_of_loading(tmp_path / "model", 1, 2)
    print(f"checkpoint {checkpoint_kib} KiB; tp 1: peak +{full['load_kib']} KiB holding {full['held_kib']} KiB; "
          f"tp 2 rank 1: peak +{shard['load_kib']} KiB holding {shard['held_kib']} KiB")
    assert shard["held_kib"] < 0.55 * checkpoint_kib
    # Generous: the shard, plus one tensor mapped while it is read, plus allocator slack.
    assert shard["load_kib"] < shard["held_kib"] + 0.25 * checkpoint_kib
    assert shard["load_kib"] < 0.75 * checkpoint_kib and shard["load_kib"] < 0.8 * full["load_kib"]
