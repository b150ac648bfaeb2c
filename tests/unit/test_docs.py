"""The docs' data and images: every file in docs/data and docs/img is referenced from the docs,
and every docs/data or docs/img path the docs name exists (plot commands name their data, so a
plot whose data went missing fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# A path under docs/data or docs/img as the docs write it: `docs/data/x.json`, or relative to
# the document (`img/x.png` in docs/*.md, `../img/x.png` in docs/decisions/*.md), with shell
# braces (`c{32,48}`) and globs (`*`) allowed.
PATH = re.compile(r"(?<![\w/.-])(?:docs/|\.\./)?((?:data|img)/[\w.{},*-]+)")


def expand_braces(pattern: str) -> list[str]:
    """`a{1,2}b{x,y}` -> [a1bx, a1by, a2bx, a2by] (no nesting; a brace without a comma stays)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [x for alt in m.group(1).split(",") for x in expand_braces(head + alt + tail)]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted(DOCS.glob("decisions/*.md"))]


def references() -> dict[str, list[str]]:
    """Referenced path (relative to docs/, braces expanded, globs kept) -> where it was named."""
    refs: dict[str, list[str]] = {}
    for doc in documents():
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                for path in expand_braces(m.group(1).rstrip(".,")):
                    refs.setdefault(path, []).append(f"{doc.relative_to(ROOT)}:{lineno}")
    return refs


def matches(path: str) -> list[Path]:
    return sorted(DOCS.glob(path)) if "*" in path else [p for p in [DOCS / path] if p.is_file()]


def test_brace_expansion() -> None:
    assert expand_braces("data/x_{1,2}_{a,b}.json") == ["data/x_1_a.json", "data/x_1_b.json", "data/x_2_a.json",
                                                       "data/x_2_b.json"]
    assert expand_braces("data/{kind}.json") == ["data/{kind}.json"]
    assert [m.group(1) for m in PATH.finditer("see `docs/data/a.json`, ![p](img/b.png) and ../img/c.png.")] == [
        "data/a.json", "img/b.png", "img/c.png."]
    assert not PATH.search("bench-results/img/x.png") and not PATH.search("metadata/x")


def test_every_referenced_data_or_image_exists() -> None:
    missing = {path: where for path, where in references().items() if not matches(path)}
    assert not missing, f"docs name files that do not exist: {missing}"


@pytest.mark.parametrize("folder", ["data", "img"])
def test_every_data_file_and_image_is_referenced(folder: str) -> None:
    used = {p for path in references() for p in matches(path)}
    unused = sorted(str(p.relative_to(ROOT)) for p in (DOCS / folder).iterdir() if p.is_file() and p not in used)
    assert not unused, f"files no doc references (remove them: history is in git): {unused}"
