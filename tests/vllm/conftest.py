"""The vLLM suite: runs in `.venv-vllm` (`make install-vllm`; `make test` runs
`.venv-vllm/bin/python -m pytest tests/vllm` after the main suite). In an environment without
vLLM (the main `.venv`) every test here is skipped, and nothing here imports vLLM at
collection time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed in this environment (make install-vllm; "
                                   ".venv-vllm/bin/python -m pytest tests/vllm)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)
