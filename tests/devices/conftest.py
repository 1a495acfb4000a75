"""Fixtures of the device tests: local ggml-rpc-server workers, and schedulers over them."""

from __future__ import annotations

import pytest

from jupyter_llama.engine.worker import LocalWorker
from jupyter_llama.memory import devices as devmod
from jupyter_llama.procs import process_alive
from jupyter_llama.scheduler import Scheduler, SchedulerSettings


@pytest.fixture
def workers(engine):
    """Start ``n`` workers on free loopback ports; all are stopped after the test."""
    started: list[LocalWorker] = []
    if not engine.worker:
        pytest.fail(f"the engine at {engine.path} has no ggml-rpc-server: "
                    "rebuild it (jupyter-llama engine build --force)")

    def start(n: int = 2) -> list[LocalWorker]:
        ws = [LocalWorker(engine) for _ in range(n)]
        started.extend(ws)
        return ws

    yield start
    for w in started:
        w.stop()
        assert not w.alive


@pytest.fixture
async def make_scheduler(engine):
    made: list[Scheduler] = []

    def make(ws: list[LocalWorker], budgets: dict[str, int] | None = None, **settings) -> Scheduler:
        s = SchedulerSettings(binary=engine.path, rpc_workers=tuple(w.endpoint for w in ws),
                              budgets=devmod.Budgets(limits=dict(budgets or {})), keep_alive=60.0, **settings)
        sched = Scheduler(s)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        await sched.shutdown()
        for ev in sched.events.history:
            pid = ev.data.get("pid")
            if pid:
                assert not process_alive(pid)
