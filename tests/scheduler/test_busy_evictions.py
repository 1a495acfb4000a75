"""Two failures of Ollama's scheduler, proved absent here on real children (issue 52 item 5).

* Ollama #17408: a load that had to evict runner A while concurrent requests kept A busy
  deadlocked every later load, forever and silently. Here every request ends, the load
  happens, and a later load is not held up.
* Ollama #14578: a request for a model already loaded waited behind another model's
  eviction and load. Here it is answered while the other load is still under way (shown by
  the order of events, not by a clock).
"""

from __future__ import annotations

import asyncio

import pytest
from schedutil import wait_for

from jupyter_llama.engine.runner import Runner
from jupyter_llama.load_options import LoadOptions

pytestmark = pytest.mark.engine

OPTS = LoadOptions(num_ctx=256, num_parallel=1)
BUSY = LoadOptions(num_ctx=512, num_parallel=2)



def held_load(gate: asyncio.Event, path: str):
    """A runner factory whose child for ``path`` is started, then not waited for until
    ``gate`` opens: that model's load is under way (its child running, the load lock held)
    for as long as the test needs."""

    class HeldLoad(Runner):
        async def _wait_ready(self):
            if self.model_path == path:
                await gate.wait()
            await super()._wait_ready()

    return HeldLoad


async def test_17408_a_load_that_must_evict_a_busy_runner_ends_and_later_loads_are_not_deadlocked(
        make_scheduler, small_models):
    sched = make_scheduler(max_loaded_models=1)
    a, b, c = small_models[:3]
    await sched.load(a, BUSY)
    done: list[int] = []
    errors: list[str] = []
    rounds, clients = 6, 4

    async def client(i: int) -> None:
        for _ in range(rounds):  # back to back, overlapping the others: A is rarely idle
            try:
                async with sched.use(a, BUSY) as lease:
                    await lease.runner.complete_text("Once upon a time", n_predict=8)
                done.append(i)
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors.append(repr(e))

    running = [asyncio.create_task(client(i)) for i in range(clients)]
    await wait_for(lambda: sched.in_flight > 0 and len(done) >= 1)  # A is busy
    load_b = asyncio.create_task(sched.load(b, BUSY))
    # (bounds that catch a deadlock; not a measure of speed)
    await asyncio.wait_for(asyncio.gather(load_b, *running), 600)
    assert not errors, errors[:5]
    assert len(done) == rounds * clients, "every request ended, answered"
    evict = [e for e in sched.events.history if e.kind == "evict" and e.model == a and e.data["for_model"] == b]
    assert evict and "busy" in evict[0].data["rule"], [e.message for e in sched.events.history if e.kind == "evict"]
    assert any(e.kind == "loaded" and e.model == b for e in sched.events.history)
    lo = await asyncio.wait_for(sched.load(c, BUSY), 120)  # a later load goes ahead
    assert lo.state == "ready" and [p["path"] for p in sched.ps()] == [c]
    assert sched.pending == 0 and sched.in_flight == 0


async def test_14578_a_loaded_models_request_is_not_held_behind_another_models_eviction_and_load(
        make_scheduler, small_models):
    a, b, c = small_models[:3]
    gate = asyncio.Event()
    sched = make_scheduler(max_loaded_models=2, runner_factory=held_load(gate, c))
    await sched.load(a, OPTS, keep_alive="10m")
    busy_a = await sched.acquire(a, OPTS)  # A busy too: B (shorter keep_alive) is the victim
    busy_b = await sched.acquire(b, OPTS, keep_alive="1m")
    load_c = asyncio.create_task(sched.load(c, OPTS))
    evict = None
    while evict is None:
        await asyncio.sleep(0.01)
        evict = next((e for e in sched.events.history if e.kind == "evict"), None)
    assert evict.model == b and evict.data["for_model"] == c

    # 1. C's load waits for B's request to end (an eviction of a busy runner, the load lock held)
    async with sched.use(a, OPTS) as lease:
        text, timings = await lease.runner.complete_text("Hi", n_predict=2)
        assert timings["predicted_n"] >= 1
    answered_during_eviction = sched.events.history[-1].seq
    assert not load_c.done() and not any(e.kind == "unload" and e.model == b for e in sched.events.history)

    # 2. B's request ends; C's child starts and loads (held), the load lock still held
    busy_b.release()
    await wait_for(lambda: any(lo.ref.path == c and lo.runner is not None and lo.runner.proc is not None
                               for lo in sched.loaded.values()))
    async with sched.use(a, OPTS) as lease:
        text, timings = await lease.runner.complete_text("Hi", n_predict=2)
        assert timings["predicted_n"] >= 1
    answered_during_load = sched.events.history[-1].seq
    assert not load_c.done()
    (loading,) = [lo for lo in sched.loaded.values() if lo.ref.path == c]
    assert loading.state == "loading"

    gate.set()
    await asyncio.wait_for(load_c, 120)
    busy_a.release()
    loaded_c = next(e.seq for e in sched.events.history if e.kind == "loaded" and e.model == c)
    unloaded_b = next(e.seq for e in sched.events.history if e.kind == "unload" and e.model == b)
    assert answered_during_eviction < unloaded_b < answered_during_load < loaded_c
    assert sorted(p["path"] for p in sched.ps()) == sorted([a, c])
