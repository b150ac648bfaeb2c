"""Fixtures of the scheduler integration tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from scheduler_harness import ControlHarness


@pytest.fixture
async def harness() -> AsyncIterator[ControlHarness]:
    h = ControlHarness()
    await h.start()
    try:
        yield h
    finally:
        for c in h.clients:
            await asyncio.to_thread(c.close)
        await h.stop()
