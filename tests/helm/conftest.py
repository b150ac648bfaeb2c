"""The `values_name` fixture: every test taking it runs once per CI values file (and defaults)."""

from __future__ import annotations

import pytest
from chart_render import VALUES_NAMES


@pytest.fixture(params=VALUES_NAMES)
def values_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)
