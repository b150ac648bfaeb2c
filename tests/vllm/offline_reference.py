"""vLLM offline (`vllm.LLM`) greedy tokens with the settings pdserve gives its vLLM engines on
this CPU: the reference of the parity tests. Run as a process of its own (its engine and its
memory go when it exits): `python offline_reference.py SPEC.json` prints a JSON object, each
dtype's list of token lists, one per prompt, each computed alone, on a line of its own after
`MARKER`. Several dtypes are one process (one vLLM import), one `LLM` after the other.

SPEC: {"model", "dtypes": [...], "tp", "max_tokens", "max_model_len", "prompts": [[ids]], "vllm": {...}}.
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

MARKER = "pdserve-offline-reference: "  # vLLM logs to stdout too: the answer's line is marked


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    answers = {}
    for dtype in spec["dtypes"]:
        answers[dtype] = _greedy(spec, dtype)
        cleanup_dist_env_and_memory()  # the next LLM initializes vLLM's (single-rank) process group anew
    print(MARKER + json.dumps(answers), flush=True)


def _greedy(spec: dict[str, Any], dtype: str) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(spec["model"], dtype=dtype, tensor_parallel_size=spec.get("tp", 1), block_size=32,
              max_model_len=spec["max_model_len"], kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True,
              seed=0, **spec.get("vllm", {}))
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    answers = [list(llm.generate(TokensPrompt(prompt_token_ids=p), params, use_tqdm=False)[0].outputs[0].token_ids)
               for p in spec["prompts"]]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return answers


if __name__ == "__main__":
    main(sys.argv[1])
