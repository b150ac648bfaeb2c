"""`GreedyCheck`: a vLLM engine's start-up self-check of its serving path against its reference mode.

vLLM runs a model through a compiled graph (dynamo + inductor on CPU, and CUDA graphs on GPU)
unless `enforce_eager`. The compiled graph is meant to compute what the model's eager forward
computes; where it does not (decision 0040: inductor's fused bfloat16 RMSNorm / SiLU on an
AVX2 CPU flipped the demo model's first answer token), the engine answers wrongly and nothing
says so. The check: a few short prompts (`CHECK_PROMPTS`, raw text and one chat turn) greedy to
`CHECK_TOKENS` tokens, once on the serving path and once with every compiled module of the
model run eagerly (vLLM's own `do_not_compile` switch of `support_torch_compile` modules: the
same weights, dtype, KV cache and attention backend, only the compiler taken out). Any token that
differs refuses the engine, naming the prompt, the position and both tokens.

An engine that runs eagerly already (pdserve's CPU default, or `enforce_eager`) has nothing to
compare: the check is skipped. This module is the torch- and vLLM-free half (the prompt set and
the comparison); `connectors.vllm.engine` runs the generations.
"""

from __future__ import annotations

from dataclasses import dataclass

CHECK_TOKENS = 8
# (text, chat): a chat prompt goes through the model's chat template (as `llm.chat` does).
CHECK_PROMPTS: tuple[tuple[str, bool], ...] = (
    ("What is the capital of France?", True),
    ("The capital of France is", False),
    ("1, 2, 3, 4, 5,", False),
    ("def fibonacci(n):", False),
)


class CompiledPathDiverges(RuntimeError):
    """The serving path's greedy tokens are not the reference mode's (the message says where)."""


@dataclass(frozen=True, slots=True)
class GreedyCheck:
    """Greedy tokens of the check prompts on the serving path and in the reference mode."""

    prompts: tuple[str, ...]
    served: tuple[tuple[int, ...], ...]
    reference: tuple[tuple[int, ...], ...]

    def first_difference(self) -> str | None:
        """None when every prompt's tokens are identical; else a one-line description of the first
        prompt that differs (its text, the first differing position, both tokens)."""
        if not len(self.prompts) == len(self.served) == len(self.reference):
            raise ValueError(f"{len(self.prompts)} prompts, {len(self.served)} served and "
                             f"{len(self.reference)} reference answers")
        for text, served, reference in zip(self.prompts, self.served, self.reference, strict=True):
            if served == reference:
                continue
            at = next((i for i, (a, b) in enumerate(zip(served, reference, strict=False)) if a != b),
                      min(len(served), len(reference)))
            return (f"prompt {text!r}: token {at} is {_at(served, at)} on the serving path, {_at(reference, at)} "
                    f"in the reference mode (served {list(served)}, reference {list(reference)})")
        return None

    def verify(self) -> None:
        """Raises CompiledPathDiverges when any prompt's tokens differ."""
        difference = self.first_difference()
        if difference is not None:
            raise CompiledPathDiverges(
                f"the compiled model disagrees with its eager forward, greedy: {difference}; serve eagerly "
                f"(--vllm-arg enforce_eager=true, pdserve's CPU default) or in float32, or pass "
                f"--no-vllm-self-check to serve anyway (decision 0040)")


def _at(tokens: tuple[int, ...], i: int) -> str:
    return str(tokens[i]) if i < len(tokens) else "the end"
