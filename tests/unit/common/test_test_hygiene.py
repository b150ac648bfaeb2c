"""Rules the test suite keeps so that a test can fail: every `pytest.raises` names the error it
expects (`match=`), and every `pdserve bench` command has a smoke test that runs it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from bench.cli import BENCHMARKS

TESTS = Path(__file__).resolve().parents[2]


def _is_pytest_raises(node: ast.Call) -> bool:
    f = node.func
    return isinstance(f, ast.Attribute) and f.attr == "raises" and isinstance(f.value, ast.Name) \
        and f.value.id == "pytest"


def test_every_pytest_raises_names_what_it_expects() -> None:
    missing = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and _is_pytest_raises(node) and len(node.args) < 2 \
                    and not any(k.arg == "match" for k in node.keywords):
                missing.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert missing == [], "pytest.raises without match=: " + ", ".join(missing)


def test_every_bench_command_has_a_smoke_test() -> None:
    text = "\n".join(p.read_text() for p in TESTS.rglob("test_*.py"))
    run = {name for name in BENCHMARKS if re.search(rf'"bench",\s*"{name}"', text)}
    assert sorted(set(BENCHMARKS) - run) == [], "benchmarks without a smoke test (main([\"bench\", NAME, ...]))"
