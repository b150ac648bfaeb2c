"""pdserve's own engine in bfloat16 against transformers on a fixed prompt set (issue 35).

The documented tolerance: the same greedy tokens, except that a prompt may part ways at a
near-tie — where transformers in float32 puts the two tokens less than one bfloat16 step of the
logits apart (`NEAR_TIE`, 0.125 nats), which bfloat16 rounding decides either way — and then
only there (every token before it the same). Measured on the demo model: the README's capital
question is such a tie for vLLM's compiled graph (0.082 nats, decision 0040), and the long raw
prompt here for pdserve's engine ("Once upon a time," token 5: 0.073 nats between 2591 and 260;
transformers in bfloat16 and float32 both take 2591, pdserve's bfloat16 engine 260). Every other
prompt's 16 tokens are transformers' exactly. In float32 the engine matches transformers with no
tolerance (test_engine_greedy_parity.py).
"""

from __future__ import annotations

import pytest
import torch

from engine.demo_model import demo_model_dir
from engine.request import SamplingParams

MAX_TOKENS = 16
NEAR_TIE = 0.125  # nats: about one bfloat16 step of the logits (0.0625 to 0.125 between 8 and 32)
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PREAMBLE = "You are a helpful assistant. Answer briefly and precisely, in plain English. "
PROMPTS = [CHAT.format("What is the capital of France?"), "The capital of France is", "def fibonacci(n):",
           CHAT.format(PREAMBLE * 4 + "Name three primary colors."), PREAMBLE * 5 + "Once upon a time,"]


@pytest.mark.slow
def test_native_engine_bfloat16_matches_transformers_to_the_near_tie_tolerance(make_engine) -> None:
    from transformers import AutoModelForCausalLM

    path = demo_model_dir()
    engine = make_engine(path, kv_cache_memory="64MiB", dtype="bfloat16", block_size=16, torch_threads=1)
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    assert max(map(len, prompts)) > 64, "a prompt over several blocks"
    ours = [engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0] for p in prompts]
    bf16 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="eager").eval()
    fp32 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    identical = 0
    for text, prompt, got in zip(PROMPTS, prompts, ours, strict=True):
        want = _greedy(bf16, prompt, len(got))
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if at is None:
            identical += 1
            continue
        margin = _margin(fp32, prompt + got[:at], want[at], got[at])
        assert margin < NEAR_TIE, f"{text[-30:]!r} token {at}: ours {got[at]}, transformers {want[at]}, " \
                                  f"{margin:.3f} nats apart in float32 (more than a near-tie)"
    assert identical >= len(PROMPTS) - 1, f"only {identical} of {len(PROMPTS)} prompts identical"
    assert "Paris" in engine.tokenizer.decode(ours[0])


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, `n` tokens, past any end-of-sequence token (as ignore_eos)."""
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def _margin(model: torch.nn.Module, context: list[int], a: int, b: int) -> float:
    """|log p(a) - log p(b)| of the next token after `context`."""
    with torch.inference_mode():
        logprobs = model(torch.tensor([context])).logits[0, -1].float().log_softmax(-1)
    return abs(float(logprobs[a] - logprobs[b]))
