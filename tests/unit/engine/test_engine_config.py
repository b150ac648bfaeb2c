"""Model config parsing: both rope dialects, defaults, and clear errors."""

from __future__ import annotations

import json

import pytest

from engine.config import ModelConfig, ModelLoadError

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_transformers5_and_transformers4_dialects_agree() -> None:
    v5 = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}})
    v4 = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}})
    assert v5.rope == v4.rope
    assert v5.rope.theta == 5e5 and v5.rope.rope_type == "llama3" and v5.rope.factor == 8.0


def test_theta_inside_rope_parameters_is_not_ignored() -> None:
    cfg = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}})
    assert cfg.rope.theta == 100000.0


def test_facts() -> None:
    cfg = ModelConfig.from_dict({**BASE, "head_dim": 24, "tie_word_embeddings": True, "eos_token_id": [2, 7],
                                 "rope_theta": 1e4})
    assert (cfg.head_dim, cfg.tie_word_embeddings, cfg.eos_token_ids, cfg.qkv_bias) == (24, True, (2, 7), False)
    qwen = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6})
    assert qwen.qkv_bias
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 128})
    assert mistral.max_model_len == 128
    assert ModelConfig.from_dict(BASE, max_model_len=100).max_model_len == 100


@pytest.mark.parametrize(("patch", "match"), [
    ({"architectures": ["BertModel"]}, "unsupported architecture 'BertModel'"),
    ({"architectures": None, "model_type": "gpt2"}, "unknown model_type"),
    ({"vocab_size": None}, "malformed field"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "original_max_position_embeddings"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_errors_name_the_problem(patch, match) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_dict({**BASE, **patch})


def test_missing_field_and_bad_json(tmp_path) -> None:
    raw = dict(BASE)
    del raw["hidden_size"]
    with pytest.raises(ModelLoadError, match="missing required field 'hidden_size'"):
        ModelConfig.from_dict(raw)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_dir(tmp_path).num_layers == 2


def test_tp_divisibility() -> None:
    cfg = ModelConfig.from_dict(BASE)
    cfg.check_tp(2)
    cfg.check_tp(4)  # 2 KV heads replicate over 4 ranks (each holds one), heads split 4 ways
    with pytest.raises(ValueError, match="num_attention_heads"):
        cfg.check_tp(8)
    mqa = ModelConfig.from_dict({**BASE, "num_attention_heads": 6, "num_key_value_heads": 2,
                                 "intermediate_size": 192})
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not divide tp=3"):
        mqa.check_tp(3)
