"""Imports follow the flow services → engine → connectors: no module imports a layer above it
(not even lazily, inside a function). Reads the sources; well under a second.

One exception: `connectors/vllm/`, the vLLM plug-in (vLLM loads it by module path into its own
engine-core and worker processes), is glue that runs pdserve's rank agent and control stream
inside vLLM; it may import them from `services/` and `engine/`. The connectors core may not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ABOVE = {"connectors": ("engine", "services", "bench"), "engine": ("services", "bench")}
GLUE = ("connectors/vllm/",)  # see the module docstring


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_import_against_the_flow(package: str) -> None:
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path in sorted((ROOT / package).rglob("*.py"))
           if not str(path.relative_to(ROOT)).startswith(GLUE)
           for line, module in _imported_modules(path)
           if module.split(".")[0] in ABOVE[package]]
    assert bad == []
