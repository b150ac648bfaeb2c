"""Sampler (seeded, top-k, top-p) and incremental detokenization with stop strings."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine.detokenizer import IncrementalDetokenizer
from engine.request import SamplingParams
from engine.sampler import Sampler


def test_greedy_and_seeded_sampling_is_reproducible() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    s = Sampler()
    assert s.sample(logits, ["a", "b", "c"], [SamplingParams()] * 3) == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=1.0, seed=42)
    runs = []
    for _ in range(2):
        s.add_request("x", p)
        runs.append([s.sample(logits[:1], ["x"], [p])[0] for _ in range(20)])
        s.remove_request("x")
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]])
    s = Sampler()
    k1 = SamplingParams(temperature=1.0, top_k=1, seed=1)
    s.add_request("k", k1)
    assert {s.sample(logits, ["k"], [k1])[0] for _ in range(30)} == {0}
    p = SamplingParams(temperature=1.0, top_p=0.8, seed=2)
    s.add_request("p", p)
    assert {s.sample(logits, ["p"], [p])[0] for _ in range(200)} == {0, 1}


def _tokenizer() -> Tokenizer:
    vocab = {"a": 0, "b": 1, "c": 2, " ": 3, "STOP": 4, "é": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return tok


def test_stop_string_cuts_text_and_sets_stopped() -> None:
    tok = _tokenizer()
    d = IncrementalDetokenizer(tok, [0], stop=["bc"])
    deltas = [d.add(t) for t in (0, 1, 2, 0)]
    assert "".join(deltas) == d.text
    assert d.stopped and d.text == "a"
    assert d.add(0) == ""


def test_deltas_concatenate_to_the_full_text() -> None:
    d = IncrementalDetokenizer(_tokenizer(), [], stop=[])
    ids = [0, 3, 1, 5, 2, 3, 5]
    assert "".join(d.add(t) for t in ids) == "a bébcé"[:0] + _tokenizer().decode(ids)
