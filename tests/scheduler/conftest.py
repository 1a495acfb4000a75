"""Schedulers over real llama-server children, always shut down after the test."""

from __future__ import annotations

import pytest

from jupyter_llama.memory.devices import Budgets
from jupyter_llama.procs import process_alive
from jupyter_llama.scheduler import Scheduler, SchedulerSettings

SHAPE = dict(layers=2, embd=64, heads=4, kv_heads=2, ctx=2048)


@pytest.fixture
def small_models(make_model):
    """Four same-shaped small models (different files, so different runners)."""
    return [str(make_model(f"small{i}", seed=10 + i, **SHAPE)) for i in range(4)]


@pytest.fixture
async def make_scheduler(engine):
    made: list[Scheduler] = []

    def make(**settings) -> Scheduler:
        budget = settings.pop("budget", None)
        extra = {k: settings.pop(k) for k in ("predictor", "runner_factory", "resolver") if k in settings}
        s = SchedulerSettings(binary=engine.path, **settings)
        if budget is not None:
            s.budgets = Budgets(limits={"cpu": int(budget)})
        sched = Scheduler(s, **extra)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        await sched.shutdown()
        assert not sched.loaded
        for ev in sched.events.history:
            pid = ev.data.get("pid")
            if pid:
                assert not process_alive(pid), f"child {pid} outlived the scheduler"
