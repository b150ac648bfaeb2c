"""The vLLM start-up self-check's comparison (connectors/vllm/greedy_check.py): identical greedy
tokens pass; the first difference is named (prompt, position, both tokens) and refuses."""

from __future__ import annotations

import pytest

from connectors.vllm.greedy_check import CHECK_PROMPTS, CompiledPathDiverges, GreedyCheck


def test_identical_tokens_pass() -> None:
    check = GreedyCheck(("a", "b"), ((1, 2, 3), (4, 5)), ((1, 2, 3), (4, 5)))
    assert check.first_difference() is None
    check.verify()


def test_the_first_differing_token_is_named() -> None:
    # The README's capital question: 504 ("The") in eager bfloat16, 60 ("L") compiled (decision 0040).
    check = GreedyCheck(("same", "capital"), ((7, 8), (60, 23, 39614)), ((7, 8), (504, 3575, 282)))
    with pytest.raises(CompiledPathDiverges, match=r"prompt 'capital': token 0 is 60 on the serving path, 504 in "
                                                   r"the reference mode.*--no-vllm-self-check"):
        check.verify()


def test_a_shorter_answer_differs_at_its_end() -> None:
    check = GreedyCheck(("p",), ((1, 2),), ((1, 2, 3),))
    assert "token 2 is the end on the serving path, 3 in the reference mode" in (check.first_difference() or "")


def test_mismatched_lengths_are_an_error() -> None:
    with pytest.raises(ValueError, match="2 prompts, 1 served and 2 reference answers"):
        GreedyCheck(("a", "b"), ((1,),), ((1,), (2,))).first_difference()


def test_the_prompt_set_has_chat_and_raw_prompts() -> None:
    assert {chat for _, chat in CHECK_PROMPTS} == {True, False}
