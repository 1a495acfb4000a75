"""The loop makes each runner with its injected factory: no process is needed to drive it.

Engine-free and quick: the runner here never starts a child. The behaviour of real loads
is judged in ``test_scheduler.py``, on llama-server children.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jupyter_llama.engine.launch import BARE_PROMPT_CHAT_TEMPLATE
from jupyter_llama.engine.runner import LoadError
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory import devices as devmod
from jupyter_llama.memory.report import COARSE, DETAILED, HOST, WEIGHTS, MemoryReport, MiB
from jupyter_llama.models.ref import ModelRef
from jupyter_llama.scheduler import LoadFailed, Scheduler, SchedulerSettings


class RefusingRunner:
    """A runner whose child never starts (as one whose llama-server exits at once)."""

    made: list[tuple] = []

    def __init__(self, path, options, **kw):
        RefusingRunner.made.append((path, options, kw))
        self.parser = SimpleNamespace(n_lines=0)
        self.pid = None

    async def start(self):
        raise LoadError("llama-server exited at once", exit_code=1)


async def test_the_runner_comes_from_the_factory_and_its_failure_is_the_loads(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")  # (only its existence is checked: the resolver below reads nothing)
    ref = ModelRef(name="m", path=str(model), info=SimpleNamespace(context_length=2048))

    async def resolve(name):
        return ref

    def predict(ref, options, gpus, split=None):
        rep = MemoryReport(DETAILED)
        rep.add(HOST, WEIGHTS, 10 * MiB)
        return {DETAILED: rep, COARSE: rep}

    host = devmod.HostMemory(total=8 << 30, available=4 << 30)
    RefusingRunner.made.clear()
    sched = Scheduler(SchedulerSettings(binary="/nonexistent/llama-server", load_timeout=7.0), resolver=resolve,
                      predictor=predict, inventory=lambda: devmod.Inventory(host, [], devmod.Budgets()),
                      runner_factory=RefusingRunner)
    try:
        with pytest.raises(LoadFailed, match="failed to load m: llama-server exited at once"):
            await sched.load("m", LoadOptions(num_ctx=256))
        (path, options, kw), = RefusingRunner.made
        assert path == str(model) and options.num_ctx == 256
        # (the model carries no chat template: its child gets Ollama's default one, the bare prompt)
        assert kw == {"binary": "/nonexistent/llama-server", "name": "m", "load_timeout": 7.0,
                      "extra_args": ["--chat-template", BARE_PROMPT_CHAT_TEMPLATE]}
        assert sched.loaded == {} and [e.kind for e in sched.events.history] == ["fit", "load", "error"]
    finally:
        await sched.shutdown()
