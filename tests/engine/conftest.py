"""Fixtures for tests that run real llama-server children directly (without the scheduler)."""

from __future__ import annotations

import pytest

from jupyter_llama.engine.runner import Runner
from jupyter_llama.load_options import LoadOptions


@pytest.fixture
async def start_runner(engine):
    """Start real runners; every one is stopped (and reaped) after the test, pass or fail."""
    started: list[Runner] = []

    async def start(model, options: LoadOptions | None = None, **kw) -> Runner:
        r = Runner(model, options or LoadOptions(num_ctx=512), binary=engine.path, **kw)
        started.append(r)
        await r.start()
        return r

    yield start
    for r in started:
        await r.stop()
        assert not r.alive
