"""Issue 58 item 3, on the scheduler: a model's name re-pointed or deleted while a request
loads it. Every child the scheduler starts is its own until it has exited (a stop during the
child's start waits for it and stops it), and the requests that waited for the stopped load
hear why: 409 when the name now means another file, 404 when it is gone; never the child's
exit worded as an engine crash (500)."""

from __future__ import annotations

import asyncio
import os

import pytest
from schedutil import wait_for

from jupyter_llama.engine import runner as runner_module
from jupyter_llama.engine.process import ChildProcess
from jupyter_llama.engine.runner import Runner
from jupyter_llama.errors import LoadCancelled, ModelNotFound
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.models.gguf_info import read_gguf_info
from jupyter_llama.models.ref import ModelRef
from jupyter_llama.procs import child_pids, process_alive

pytestmark = pytest.mark.engine

OPTS = LoadOptions(num_ctx=256, num_parallel=1)



class Names:
    """A resolver over names the test points at files, as a store's create, copy and delete
    would."""

    def __init__(self, **files: str):
        self.files = dict(files)

    async def __call__(self, name: str) -> ModelRef:
        path = self.files.get(name)
        if path is None:
            raise ModelNotFound(name)
        return ModelRef(name=name, path=path, info=read_gguf_info(path))


@pytest.fixture
def held_spawn(monkeypatch):
    """Children whose start is held, once forked, until the test opens ``gate``: the moment
    between the fork and the runner's ``proc``, when a stop used to find no process.
    ``forked`` gets each child's PID as it is forked."""
    gate = asyncio.Event()
    forked: asyncio.Queue = asyncio.Queue()

    class Held(ChildProcess):
        @classmethod
        async def start(cls, *args, **kwargs):
            child = await ChildProcess.start(*args, **kwargs)
            forked.put_nowait(child.pid)
            await gate.wait()
            return child

    monkeypatch.setattr(runner_module, "ChildProcess", Held)
    yield gate, forked
    gate.set()


def held_load(gate: asyncio.Event, path: str | None = None):
    """A runner factory whose children (of ``path``, or all) are started, then not waited for
    until ``gate`` opens: a load under way for as long as the test needs."""

    class HeldLoad(Runner):
        async def _wait_ready(self):
            if path is None or self.model_path == path:
                await gate.wait()
            await super()._wait_ready()

    return HeldLoad


def ours() -> set[int]:
    return set(child_pids(os.getpid(), "llama-server"))


async def test_a_name_pointed_elsewhere_while_its_child_is_being_started(make_scheduler, small_models, held_spawn):
    gate, forked = held_spawn
    names = Names(race=small_models[0])
    sched = make_scheduler(resolver=names)
    request = asyncio.create_task(sched.acquire("race", OPTS))
    pid = await asyncio.wait_for(forked.get(), 60)
    (lo,) = sched.loaded.values()
    runner = lo.runner
    assert runner.proc is None, "held between the fork and proc"
    names.files["race"] = small_models[1]
    changed = asyncio.create_task(sched.name_changed("race"))
    await wait_for(lambda: runner._stop_asked)  # the stop has landed during the start
    gate.set()
    assert await changed == ["race"]
    with pytest.raises(LoadCancelled, match="another model file.*send the request again") as info:
        await request
    assert info.value.status == 409
    assert not process_alive(pid), "the child started during the stop outlived it"
    assert sched.ps() == [] and pid not in ours()
    kinds = [e.kind for e in sched.events.history]
    assert "unload" in kinds and not any(e.kind == "error" and "load failed" in e.message for e in sched.events.history)
    async with sched.use("race", OPTS) as lease:  # the name loads what it names now
        assert lease.loaded.ref.path == small_models[1]
        text, _ = await lease.runner.complete_text("Hi", n_predict=2)
    assert ours() == {p["pid"] for p in sched.ps()}


async def test_a_name_deleted_while_its_model_loads_is_a_404_not_a_crash(make_scheduler, small_models):
    gate = asyncio.Event()
    names = Names(race=small_models[0])
    sched = make_scheduler(resolver=names, runner_factory=held_load(gate))
    request = asyncio.create_task(sched.acquire("race", OPTS))
    waiter = asyncio.create_task(sched.acquire("race", OPTS))  # a second request waits for the same load
    await wait_for(lambda: any(lo.runner is not None and lo.runner.proc is not None for lo in sched.loaded.values()))
    (lo,) = sched.loaded.values()
    pid = lo.runner.pid
    del names.files["race"]
    assert await sched.name_changed("race") == ["race"]  # stops the child while it loads (SIGTERM)
    assert not process_alive(pid)
    gate.set()
    with pytest.raises(ModelNotFound, match="deleted while it was loading") as info:
        await request
    assert info.value.status == 404
    # (resolved before the delete, it waited for the lock: it finds the name gone, and loads nothing)
    with pytest.raises(ModelNotFound):
        await waiter
    assert sched.ps() == [] and not ours()
    assert not any("SIGTERM" in e.message for e in sched.events.history)


async def test_a_file_deleted_while_its_model_loads_stops_the_load(make_scheduler, small_models):
    """The delete handler unloads what is loaded from the file before it goes: a load of it
    under way is stopped, and its request is told the model was deleted."""
    gate = asyncio.Event()
    sched = make_scheduler(runner_factory=held_load(gate))
    a = small_models[0]
    request = asyncio.create_task(sched.acquire(a, OPTS))
    await wait_for(lambda: any(lo.runner is not None and lo.runner.proc is not None for lo in sched.loaded.values()))
    (lo,) = sched.loaded.values()
    pid = lo.runner.pid
    await sched.unload_file(a, reason="model a deleted")
    gate.set()
    with pytest.raises(ModelNotFound, match="deleted while it was loading"):
        await request
    assert not process_alive(pid) and sched.ps() == []


@pytest.mark.parametrize("held", ["_enforce_budgets", "_publish"])
async def test_a_name_pointed_elsewhere_once_its_child_is_ready_gives_no_lease_of_the_stopped_one(
        make_scheduler, small_models, held):
    """The last moments of a load: its child is ready, and the scheduler checks the budgets
    and tells the other managers what it holds. A name change then stops that child; the
    request must not be handed it (the name race of ``tests/server/test_name_race.py`` found
    one handed a stopping runner: a 500)."""
    gate = asyncio.Event()
    names = Names(race=small_models[0])
    sched = make_scheduler(resolver=names)
    original = getattr(sched, held)
    first = [True]

    async def held_once(*args):
        if first[0]:
            first[0] = False
            await gate.wait()
        return await original(*args)

    setattr(sched, held, held_once)
    request = asyncio.create_task(sched.acquire("race", OPTS))
    await wait_for(lambda: any(lo.state == "ready" for lo in sched.loaded.values()))
    (lo,) = sched.loaded.values()
    pid = lo.runner.pid
    names.files["race"] = small_models[1]
    changed = asyncio.create_task(sched.name_changed("race"))
    await wait_for(lambda: lo.state != "ready")
    gate.set()
    await changed
    with pytest.raises(LoadCancelled):
        await request
    assert not process_alive(pid) and sched.ps() == [] and sched.in_flight == 0


async def test_shutdown_during_a_load_answers_busy_and_leaves_no_child(make_scheduler, small_models, held_spawn):
    gate, forked = held_spawn
    sched = make_scheduler()
    request = asyncio.create_task(sched.acquire(small_models[0], OPTS))
    pid = await asyncio.wait_for(forked.get(), 60)
    stopping = asyncio.create_task(sched.shutdown())
    await wait_for(lambda: all(lo.runner._stop_asked for lo in sched.loaded.values()))
    gate.set()
    await stopping
    from jupyter_llama.errors import ServerBusy

    with pytest.raises(ServerBusy, match="shutting down"):
        await request
    assert not process_alive(pid)
