"""Sampler: greedy, temperature, top-k and top-p sampling with per-request generators."""

from __future__ import annotations

import torch

from engine.request import SamplingParams


class Sampler:
    """Samples one token per logits row. A request with a seed draws from its own generator,
    so its output does not depend on what else is in the batch."""

    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def add_request(self, request_id: str, params: SamplingParams) -> None:
        if params.seed is not None:
            self._generators[request_id] = torch.Generator().manual_seed(params.seed)

    def remove_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @property
    def num_generators(self) -> int:
        return len(self._generators)

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        if all(p.temperature == 0.0 for p in params):
            return logits.argmax(dim=-1).tolist()
        out = []
        for i, p in enumerate(params):
            row = logits[i]
            if p.temperature == 0.0:
                out.append(int(row.argmax()))
                continue
            probs = _probs(row, p)
            gen = self._generators.get(request_ids[i], self._default)
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
        return out


def _probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    row = row.float() / p.temperature
    if 0 < p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop = cum - sorted_logits.softmax(-1) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.empty_like(row).scatter_(0, order, sorted_logits)
    return row.softmax(-1)
