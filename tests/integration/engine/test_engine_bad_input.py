"""Bad input fails with a clear ValueError, changes no state, and the engine keeps serving."""

from __future__ import annotations

import pytest

from engine.config import ModelLoadError
from engine.request import RequestMode, SamplingParams


@pytest.mark.parametrize(("prompt", "params", "match"), [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 2, 512], SamplingParams(), "outside the vocabulary"),
    ([1, -1], SamplingParams(), "outside the vocabulary"),
    ([1] * 512, SamplingParams(), "max_model_len"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_k=-3), "top_k"),
    ([1, 2], SamplingParams(stop_token_ids=[9999]), "stop_token_ids"),
    ([1, 2], SamplingParams(stop=["x"]), "tokenizer"),
])
def test_bad_request_is_refused_and_engine_keeps_serving(tiny_model, make_engine, prompt, params, match) -> None:
    model = tiny_model("llama_gqa_llama3")
    engine = make_engine(model.path)
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()
    assert engine.check_leaks() == []
    [out] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert out == model.reference([5, 6, 7], 4)


def test_duplicate_id_and_too_many_given_outputs(tiny_model, make_engine) -> None:
    engine = make_engine(tiny_model("llama_gqa_llama3").path)
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("y", [1, 2], SamplingParams(max_tokens=2), mode=RequestMode.REMOTE_KV,
                           output_token_ids=[4, 5])
    with pytest.raises(ValueError, match="not waiting for remote KV"):
        engine.finish_remote_kv("x", ok=True)
    while engine.has_unfinished_requests():
        engine.step()


def test_malformed_model_directories(tmp_path, tiny_model) -> None:
    import json
    import shutil

    from engine.llm_engine import LLMEngine

    with pytest.raises(ModelLoadError, match="no config.json"):
        LLMEngine(tmp_path)
    src = tiny_model("llama_gqa_llama3").path
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
        LLMEngine(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.2"):
        LLMEngine(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ModelLoadError, match="has shape"):
        LLMEngine(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="cannot read safetensors"):
        LLMEngine(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLMEngine(bad)
