"""A real jupyter-llama manager for the widget tests: ``jupyter-llama serve`` as a subprocess.

The widgets talk to the manager through the synchronous ``LlamaClient`` (and, in their
live loops, ``AsyncLlamaClient``), so the manager must not share the test's event loop: it
runs in its own process, started the way the product starts one (``EmbeddedManager``), with
its own model store (``tiny`` and ``other``, small synthetic models) and a CPU budget of
32 MiB (so "does not fit" can be shown). It is stopped at the end of the session, and so
are any llama-server children it left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from jupyter_llama.procs import child_pids, process_alive

# (trained long: a context that outgrows the budget)
TINY = dict(layers=2, embd=64, heads=4, kv_heads=2, ctx=32768, seed=3)
OTHER = dict(layers=2, embd=64, heads=4, kv_heads=2, ctx=4096, seed=4)
BUDGET = "cpu=32MiB"
START_TIMEOUT = 120.0


@dataclass
class Manager:
    url: str  # http://127.0.0.1:<port>/llama/
    token: str
    proc: subprocess.Popen
    models_dir: Path
    log: Path


@pytest.fixture(scope="session")
def manager(engine, make_model, tmp_path_factory):
    """A running ``jupyter-llama serve`` (own store, budget, token); always stopped afterwards."""
    from jupyter_llama.embedded import EmbeddedManager
    from jupyter_llama.models.store import ModelStore

    root = tmp_path_factory.mktemp("widgets-manager")
    models_dir = root / "models"
    store = ModelStore(models_dir)
    store.create("tiny", make_model("w-tiny", **TINY))
    store.create("other", make_model("w-other", **OTHER))
    for d in ("runtime", "config", "data"):
        (root / d).mkdir()
    log = root / "serve.log"
    # Empty values are unset to the manager: the test's own environment cannot change its settings.
    em = EmbeddedManager(log_path=str(log), env={
        "JUPYTER_LLAMA_MODELS": str(models_dir), "JUPYTER_LLAMA_SERVER": engine.path,
        "JUPYTER_LLAMA_MEMORY_LIMIT": BUDGET, "JUPYTER_LLAMA_KEEP_ALIVE": "30s",
        "JUPYTER_LLAMA_NUM_PARALLEL": "", "JUPYTER_LLAMA_GPU_OVERHEAD": "", "JUPYTER_LLAMA_RPC_WORKERS": "",
        "JUPYTER_RUNTIME_DIR": str(root / "runtime"), "JUPYTER_CONFIG_DIR": str(root / "config"),
        "JUPYTER_DATA_DIR": str(root / "data")})
    em.start(timeout=START_TIMEOUT)  # fails with the log's tail if it does not come up
    try:
        yield Manager(em.url, em.token, em.proc, models_dir, log)
    finally:
        runners = child_pids(em.proc.pid)
        em.stop(timeout=20)
        deadline = time.monotonic() + 10
        while any(process_alive(p) for p in runners) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in runners:
            if process_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def client(manager):
    """A LlamaClient for the manager; after the test every model is unloaded again."""
    from jupyter_llama.client import LlamaClient

    c = LlamaClient(manager.url, manager.token)
    try:
        yield c
    finally:
        try:
            for m in c.ps().get("models", []):
                c.unload(m["name"])
        finally:
            c.close()

