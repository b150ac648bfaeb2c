"""The vLLM suite: runs in `.venv-vllm` (`make install-vllm`; `make test` runs
`.venv-vllm/bin/python -m pytest tests/vllm` after the main suite). In an environment without
vLLM (the main `.venv`) every test here is skipped, and nothing here imports vLLM at
collection time.

Every vLLM process these tests start (servers, engines, through `os.environ`) runs with
`VLLM_CPU_CI_ENV=1`, vLLM's own switch for its CPU CI: the model is still traced by dynamo, but
run eagerly instead of compiled by inductor, and the warm-up passes are skipped. Engine starts
drop from minutes to seconds on two cores; what the tests check (tokens, transfers, events,
harnesses) does not depend on the compiler. Benchmarks run outside the suite keep vLLM's default.

They also run with `VLLM_ENABLE_V1_MULTIPROCESSING=0`, which on vLLM's CPU platform lets a
tensor-parallel-1 engine keep its default "uni" executor: the worker runs inside the engine-core
process instead of a third process of its own, one vLLM import (~25 s of CPU on two cores) less
per engine. Tensor parallel 2 (test_vllm_tp.py) still gets vLLM's multiprocessing executor, one
worker process per rank. vLLM's engine core stays a process of its own either way (`AsyncLLM`
and the OpenAI server always run it out of process).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
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


CI_ENV = {"VLLM_CPU_CI_ENV": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="session", autouse=True)
def vllm_ci_mode() -> Iterator[None]:
    """`CI_ENV` for every process started under tests/vllm (see the module docstring)."""
    before = {name: os.environ.get(name) for name in CI_ENV}
    os.environ.update(CI_ENV)
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
