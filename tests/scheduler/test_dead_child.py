"""Issue 58 item 10 (Ollama #16830): a dead child is never handed a request, and ``ps`` never
calls it ready. A child killed (SIGKILL) is dead to the scheduler from the moment the
kernel has it as exited; a request that already held it and failed before any of its answer
went anywhere is sent once more, to a fresh runner, with a ``retry`` event."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from schedutil import wait_for

from jupyter_llama.engine.runner import RunnerCrashed
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.procs import process_alive

pytestmark = pytest.mark.engine

OPTS = LoadOptions(num_ctx=256, num_parallel=1)



def kill_and_see_it_dead(pid: int) -> None:
    """SIGKILL ``pid`` and block (the event loop runs nothing meanwhile) until the kernel has
    it as exited: from here on the kill is observable by anyone."""
    os.kill(pid, signal.SIGKILL)
    while process_alive(pid):  # (a zombie is not alive)
        time.sleep(0.0005)


def events_since(sched, seq: int, kind: str | None = None) -> list:
    return [e for e in sched.events.history if e.seq > seq and (kind is None or e.kind == kind)]


async def test_ps_never_says_ready_for_a_killed_child(make_scheduler, small_models):
    sched = make_scheduler()
    await sched.load(small_models[0], OPTS)
    (entry,) = sched.ps()
    assert entry["state"] == "ready"
    dead = entry["pid"]
    kill_and_see_it_dead(dead)
    seen = []
    while True:  # every read from the kill on, until the scheduler has taken it off
        states = [p["state"] for p in sched.ps() if p["pid"] == dead]
        seen += states
        if not states:
            break
        await asyncio.sleep(0)
    assert "ready" not in seen, seen


async def test_a_request_right_after_a_kill_succeeds_on_a_fresh_runner(make_scheduler, small_models):
    """The child is killed by its PID from ps, and a request sent at once: it is answered by a
    fresh child, and an event says why the first was not used (the request found it dead, or
    it failed on it and was sent again)."""
    sched = make_scheduler()
    a = small_models[0]
    await sched.load(a, OPTS)
    dead = sched.ps()[0]["pid"]
    seq = sched.events.history[-1].seq
    os.kill(dead, signal.SIGKILL)
    async with sched.use(a, OPTS) as lease:
        text, timings = await lease.runner.complete_text("Once upon a time", n_predict=3)
        assert timings["predicted_n"] >= 1
        assert lease.runner.pid != dead
    told = [e for e in events_since(sched, seq) if e.kind in ("retry", "reload") and e.data.get("pid") == dead]
    assert told, [(e.kind, e.message) for e in events_since(sched, seq)]
    await wait_for(lambda: [p["pid"] for p in sched.ps()] == [lease.runner.pid])


async def test_a_request_holding_a_child_that_dies_is_sent_once_more(make_scheduler, small_models):
    """The lease was taken while the child lived; it died before the request was sent."""
    sched = make_scheduler()
    a = small_models[0]
    lease = await sched.acquire(a, OPTS)
    dead = lease.runner.pid
    seq = sched.events.history[-1].seq
    kill_and_see_it_dead(dead)
    try:
        text, timings = await lease.runner.complete_text("Once upon a time", n_predict=3)
        assert timings["predicted_n"] >= 1
        assert lease.runner.pid != dead and lease.loaded.runner.pid == lease.runner.pid
        assert lease.loaded.refcount == 1, "the lease holds the fresh runner"
    finally:
        lease.release()
    (retry,) = events_since(sched, seq, "retry")
    assert retry.data["pid"] == dead and "once more" in retry.message
    assert sched.in_flight == 0
    await wait_for(lambda: [(p["pid"], p["state"]) for p in sched.ps()] == [(lease.runner.pid, "ready")])


@pytest.mark.parametrize("how", ["relay", "stream", "whole"])
async def test_each_kind_of_request_is_sent_once_more(make_scheduler, small_models, how):
    """The handlers' relays (the answer to a callback), the async streams and the whole
    answers (post) alike."""
    sched = make_scheduler()
    a = small_models[1]
    lease = await sched.acquire(a, OPTS)
    dead = lease.runner.pid
    kill_and_see_it_dead(dead)
    try:
        runner = lease.runner  # (taken once, as a handler takes it: it follows the lease)
        if how == "relay":
            got = []
            await runner.relay_completion("Hi", got.extend, n_predict=2)
            assert got
        elif how == "stream":
            chunks = [c async for c in runner.completion("Hi", n_predict=2)]
            assert chunks and chunks[-1].get("stop")
        else:
            body = await runner.post("/tokenize", {"content": "Hi"})
            assert body["tokens"]
        assert runner.pid != dead
    finally:
        lease.release()
    assert len([e for e in sched.events.history if e.kind == "retry"]) == 1


async def test_a_request_is_sent_again_only_once(make_scheduler, small_models):
    """The fresh child dies too: the second failure is the request's answer."""
    sched = make_scheduler()
    lease = await sched.acquire(small_models[2], OPTS)
    kill_and_see_it_dead(lease.runner.pid)
    first = lease.runner.pid
    try:
        await lease.runner.post("/tokenize", {"content": "Hi"})  # (retried: a fresh child)
        assert lease.runner.pid != first
        kill_and_see_it_dead(lease.runner.pid)
        with pytest.raises(RunnerCrashed):
            await lease.runner.post("/tokenize", {"content": "Hi"})
    finally:
        lease.release()
    assert len([e for e in sched.events.history if e.kind == "retry"]) == 1


async def test_a_stream_that_failed_after_its_first_event_is_not_sent_again(make_scheduler, small_models):
    sched = make_scheduler()
    lease = await sched.acquire(small_models[3], LoadOptions(num_ctx=2048, num_parallel=1))
    pid = lease.runner.pid
    got = 0
    try:
        with pytest.raises(RunnerCrashed):
            async for _ in lease.runner.completion("Go", n_predict=100000, ignore_eos=True):
                got += 1
                if got == 2:
                    os.kill(pid, signal.SIGKILL)
    finally:
        lease.release()
    assert got >= 2
    assert not [e for e in sched.events.history if e.kind == "retry"]
