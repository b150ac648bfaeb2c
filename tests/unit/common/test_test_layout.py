"""Test modules are imported by basename (pytest's default import mode, no packages under
tests/), so two test files with the same name in different folders break collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_test_file_basenames_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "__init__.py" and p.name != "conftest.py")
    assert [n for n, c in names.items() if c > 1] == []
