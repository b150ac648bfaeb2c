"""pdserve with vLLM engines, as `pdserve up --engine vllm` runs them by default, is token-identical
to vLLM offline (`vllm.LLM`) with the same settings, in every dtype the README offers on CPU
(issue 35, decision 0040): chat and raw prompts, short (decode-local) and over a block (remote
prefill + KV pull), greedy, through gRPC and the OpenAI API.

Without vLLM's CI switch (`VLLM_CPU_CI_ENV`, tests/vllm/conftest.py, which runs the compiled
graph eagerly): the engines run what a user's do. Before decision 0040 they ran vLLM's compiled
CPU graph, which in bfloat16 answered the capital prompt `L'Étoile…` where vLLM offline eager
answers `The capital of France is Paris.`

One cluster (1 prefill, 1 decode, demo model) per dtype and one offline reference process for
both dtypes (one vLLM import); none of it compiles.
The self-check's refusal compiles a model with vLLM's inductor: the demo model cut to its first
`COMPILED_LAYERS` layers (its own weights, tokenizer and chat template), whose compiled bfloat16
graph disagrees with its eager forward as the whole model's does: the refusal in 62 s on the
shared 2-core host against 128 s for the 30-layer model (back to back, empty compile caches;
inductor compiles every layer of the one traced graph).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_cluster import BLOCK, generate_greedy, log_problems, offline_greedy_dtypes, vllm_cluster

from services.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(1500)

MAX_TOKENS = 16
MAX_MODEL_LEN = 1024
DTYPES = ("bfloat16", "float32")
LOCAL_BELOW = 64  # the threshold path policy: fewer uncached prompt tokens run decode-local
PREAMBLE = "You are a helpful assistant. Answer briefly and precisely, in plain English. "
# (text, chat, long): long prompts are over LOCAL_BELOW tokens (remote), short ones under it.
PROMPTS = [("What is the capital of France?", True, False), ("The capital of France is", False, False),
           ("def fibonacci(n):", False, False), (PREAMBLE * 4 + "Name three primary colors.", True, True),
           ("Once upon a time, in a land far away. " + PREAMBLE * 5, False, True),
           ("1, 2, 3, 4, 5, 6, 7, 8. " + PREAMBLE * 6, False, True)]
# The long prompts begin differently: a prefix one of them left on the decode engine would make
# another decode-local.
COMPILED_LAYERS = 2  # the refusal's model (cut_demo_model); its compiled bf16 graph disagrees too


@pytest.fixture(scope="module")
def demo_model() -> Path:
    from engine.demo_model import demo_model_dir

    return demo_model_dir()


@pytest.fixture(scope="module")
def cut_demo_model(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's first `COMPILED_LAYERS` decoder layers, its embeddings, final norm,
    tokenizer and chat template: a real model (not random weights) that compiles in a fraction of
    the time."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp(f"demo-{COMPILED_LAYERS}-layers")
    config = json.loads((demo_model / "config.json").read_text())
    assert config["num_hidden_layers"] > COMPILED_LAYERS, config
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": COMPILED_LAYERS}))
    for file in demo_model.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, path / file.name)
    with safe_open(str(demo_model / "model.safetensors"), "pt") as f:
        kept = {name: f.get_tensor(name) for name in f.keys()
                if not name.startswith("model.layers.") or int(name.split(".")[2]) < COMPILED_LAYERS}
    save_file(kept, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def prompts(demo_model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model))
    out = []
    for text, chat, long in PROMPTS:
        ids = (tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
               if chat else tok.encode(text))
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert (len(ids) > LOCAL_BELOW) if long else (len(ids) < LOCAL_BELOW), (text[-30:], len(ids))
        out.append(ids)
    return out


@pytest.fixture(scope="module")
def users_environment() -> Iterator[None]:
    """vLLM's CI switch off for this module's processes (the compile setting is pdserve's)."""
    before = os.environ.pop("VLLM_CPU_CI_ENV", None)
    yield
    if before is not None:
        os.environ["VLLM_CPU_CI_ENV"] = before


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, demo_model: Path, prompts: list[list[int]],
               users_environment: None) -> dict[str, list[list[int]]]:
    """vLLM offline's greedy tokens in every dtype of `DTYPES`, from one process."""
    return offline_greedy_dtypes(demo_model, list(DTYPES), prompts, tmp_path_factory.mktemp("offline"),
                                 max_tokens=MAX_TOKENS, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module", params=DTYPES)
def dtype_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, users_environment: None,
              references: dict[str, list[list[int]]]) -> Iterator[tuple[str, LocalCluster, list[list[int]]]]:
    dtype = str(request.param)
    reference = references[dtype]
    with vllm_cluster(tmp_path_factory, f"vllm-parity-{dtype}", num_prefill=1, num_decode=1, kv_cache_memory="64MiB",
                      scheduler_args=["--path-policy", "threshold", "--path-threshold-tokens", str(LOCAL_BELOW)],
                      max_model_len=MAX_MODEL_LEN, max_num_seqs=4, dtype=dtype, vllm_args=()) as c:
        yield dtype, c, reference


def _http_tokens(c: LocalCluster, prompts: list[list[int]]) -> list[list[int]]:
    from bench.serve import Workload, _drive_http

    results, _ = asyncio.run(_drive_http(c.http_url, Workload(prompts, [MAX_TOKENS] * len(prompts)), 1, 0.0))
    return [list(r.token_ids) for r in results]


def test_pdserve_vllm_is_token_identical_to_vllm_offline(dtype_run: tuple[str, LocalCluster, list[list[int]]],
                                                         prompts: list[list[int]]) -> None:
    dtype, c, reference = dtype_run
    assert len({tuple(r) for r in reference}) == len(reference), "every prompt has its own answer"
    results = generate_greedy(c.target, prompts, MAX_TOKENS, concurrency=1)
    for (text, _, long), result, expected in zip(PROMPTS, results, reference, strict=True):
        assert result.token_ids == expected, f"{dtype} gRPC {text[-40:]!r}: {result.token_ids} != {expected}"
        assert result.path_reason.startswith("remote" if long else "decode_local"), result.path_reason
        if long:
            assert result.transferred_tokens > 0, f"no KV came over the data plane: {result}\n{log_problems(c)}"
    for (text, _, _), tokens, expected in zip(PROMPTS, _http_tokens(c, prompts), reference, strict=True):
        assert tokens == expected, f"{dtype} OpenAI API {text[-40:]!r}: {tokens} != {expected}"
    assert c.wait_no_leaks(timeout=60) == {}


def test_a_compiled_engine_that_disagrees_with_its_eager_forward_refuses_to_start(cut_demo_model: Path,
                                                                                 users_environment: None) -> None:
    """vLLM's compiled CPU graph in bfloat16 (asked for with `enforce_eager=false`) answers a check
    prompt otherwise than the same model run eagerly: the start-up self-check refuses the engine
    with the reason, instead of serving wrong answers. (The whole demo model's compiled graph flips
    the capital question's first token, 60 against 504, decision 0040; the two-layer cut flips the
    third token of a raw prompt, by the same rounding.)"""
    proc = subprocess.run(
        [sys.executable, "-m", "services.common.cli", "decode", "--engine", "vllm", "--engine-id", "compiled-0",
         "--scheduler", "127.0.0.1:9", "--host", "127.0.0.1", "--port", "0", "--model", str(cut_demo_model),
         "--block-size", str(BLOCK), "--dtype", "bfloat16", "--kv-cache-memory", "64MiB", "--max-model-len", "512",
         "--torch-threads", "1", "--vllm-arg", "enforce_eager=false"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("vLLM engine compiled-0 refused at start: the compiled model disagrees with its eager forward, greedy: "
            "prompt 'The capital of France is': token 2 is 28 on the serving path, 216 in the reference mode"
            ) in last, last
