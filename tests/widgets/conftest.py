"""A real jupyter-llama manager for the widget tests: ``jupyter-llama serve`` as a subprocess.

The widgets talk to the manager through the synchronous ``LlamaClient`` (and, in their
live loops, ``AsyncLlamaClient``), so the manager must not share the test's event loop: it
runs in its own process, on a free loopback port, with a token, its own model store (``tiny``
and ``other``, small synthetic models) and a CPU budget of 32 MiB (so "does not fit" can be
shown). It is stopped (SIGTERM, then SIGKILL) at the end of the session, and so are any
llama-server children it left.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from jupyter_llama.engine.runner import child_pids, free_port, process_alive

TINY = dict(layers=2, embd=64, heads=4, kv_heads=2, ctx=4096, seed=3)
OTHER = dict(layers=2, embd=64, heads=4, kv_heads=2, ctx=4096, seed=4)
BUDGET = "cpu=32MiB"
START_TIMEOUT = 120.0


@dataclass
class Manager:
    url: str  # http://127.0.0.1:<port>/
    token: str
    proc: subprocess.Popen
    models_dir: Path
    log: Path

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""




@pytest.fixture(scope="session")
def manager(engine, make_model, tmp_path_factory):
    """A running ``jupyter-llama serve`` (own store, budget, token); always stopped afterwards."""
    from jupyter_llama.models.store import ModelStore

    root = tmp_path_factory.mktemp("widgets-manager")
    models_dir = root / "models"
    store = ModelStore(models_dir)
    store.create("tiny", make_model("w-tiny", **TINY))
    store.create("other", make_model("w-other", **OTHER))
    for d in ("runtime", "config", "data"):
        (root / d).mkdir()
    port = free_port()
    token = secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_TOKEN=token, JUPYTER_LLAMA_MODELS=str(models_dir),
               JUPYTER_LLAMA_SERVER=engine.path, JUPYTER_LLAMA_MEMORY_LIMIT=BUDGET, JUPYTER_LLAMA_KEEP_ALIVE="30s",
               JUPYTER_RUNTIME_DIR=str(root / "runtime"), JUPYTER_CONFIG_DIR=str(root / "config"),
               JUPYTER_DATA_DIR=str(root / "data"))
    for k in ("JUPYTER_LLAMA_URL", "JUPYTER_LLAMA_TOKEN", "JUPYTER_LLAMA_NUM_PARALLEL", "JUPYTER_LLAMA_GPU_OVERHEAD"):
        env.pop(k, None)
    argv = [sys.executable, "-m", "jupyter_llama.server.serve", "--ip", "127.0.0.1", "--port", str(port),
            "--log-level", "INFO"]
    if os.geteuid() == 0:
        argv.append("--allow-root")
    log = root / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    m = Manager(f"http://127.0.0.1:{port}/", token, proc, models_dir, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter-llama serve exited with {proc.returncode}:\n{m.tail()}")
            try:
                r = httpx.get(f"{m.url}llama/api/version", headers={"Authorization": f"token {token}"},
                              timeout=2.0, trust_env=False)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter-llama serve did not answer within {START_TIMEOUT:.0f}s:\n{m.tail()}")
            time.sleep(0.2)
        yield m
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server stops its children), then SIGKILL; then any llama-server it left."""
    if proc.poll() is None:
        runners = child_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
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

