"""Fixtures for tests that run real llama-server children."""

from __future__ import annotations

import pytest

from jupyter_llama.engine.launch import LoadOptions
from jupyter_llama.engine.runner import Runner


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


@pytest.fixture(scope="session")
def engine():
    """The llama-server this suite runs, found the way users' code finds it."""
    import os

    from jupyter_llama.engine.binary import EngineBroken, EngineNotFound, find_engine

    try:
        return find_engine()
    except (EngineNotFound, EngineBroken) as e:
        if os.environ.get("JUPYTER_LLAMA_REQUIRE_ENGINE") == "1":
            pytest.fail(f"no usable llama-server, but `make test` requires one: {e}")
        pytest.skip(f"no usable llama-server: {e}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A small synthetic llama GGUF (4 blocks, 128 wide, GQA 4/2), made once per session."""
    from jupyter_llama.models.synth import SynthShape, write_synthetic

    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    return write_synthetic(path, SynthShape(layers=4, embd=128, heads=4, kv_heads=2, ctx=4096, seed=1))
