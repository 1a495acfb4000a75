"""200 requests from 20 concurrent clients over 4 models, with a cap of 2 and a budget for 2."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from jupyter_llama.load_options import LoadOptions
from jupyter_llama.procs import child_pids
from jupyter_llama.scheduler import ServerBusy

pytestmark = [pytest.mark.engine, pytest.mark.slow]

OPTS = LoadOptions(num_ctx=256, num_parallel=2)


def llama_children() -> list[int]:
    """PIDs of llama-server processes whose parent is this test process."""
    return child_pids(os.getpid(), "llama-server")


async def test_stress_cap_and_budget_hold(make_scheduler, small_models):
    probe = make_scheduler()
    lo = await probe.load(small_models[0], OPTS)
    actual, need = lo.actual.total(), probe._need(lo.predictions, lo.fit_source).total()
    await probe.shutdown()
    budget = 2 * max(actual, need) + actual // 2

    sched = make_scheduler(max_loaded_models=2, budget=budget, keep_alive=2.0)
    samples = {"max_children": 0, "max_loaded": 0, "max_used": 0, "n": 0}
    stop = asyncio.Event()

    async def sampler():
        while not stop.is_set():
            samples["n"] += 1
            samples["max_children"] = max(samples["max_children"], len(llama_children()))
            samples["max_loaded"] = max(samples["max_loaded"], len(sched.ps()))
            samples["max_used"] = max(samples["max_used"], sum(p["size"] for p in sched.ps()))
            await asyncio.sleep(0.05)

    done, busy, errors = 0, 0, []

    async def client(i: int):
        nonlocal done, busy
        rng = random.Random(i)
        for _ in range(10):
            model = small_models[rng.randrange(4)]
            try:
                async with sched.use(model, OPTS) as lease:
                    text, timings = await lease.runner.complete_text("Hi", n_predict=3)
                    assert timings["predicted_n"] >= 1
                done += 1
            except ServerBusy:
                busy += 1
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors.append(repr(e))

    watch = asyncio.create_task(sampler())
    try:
        await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(20))), 600)
    finally:
        stop.set()
        await watch
    assert not errors, errors[:5]
    assert busy == 0, "nobody should be refused below the queue limit (512)"
    assert done == 200
    assert samples["n"] > 10
    assert samples["max_children"] <= 2, samples
    assert samples["max_loaded"] <= 2, samples
    assert samples["max_used"] <= budget, samples
    await sched.shutdown()
    assert llama_children() == []
