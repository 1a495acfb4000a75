"""A scheduler shared by many people (Scheduler.share) on real llama-server children: quotas,
the fair queue, who holds each model, the eviction rule for sharing."""

from __future__ import annotations

import asyncio

import pytest

from jupyter_llama.errors import OverMemoryQuota, QuotaExceeded
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.scheduler import EventKind
from jupyter_llama.scheduler.fairness import Who, parse_quotas

pytestmark = pytest.mark.engine

OPTS = LoadOptions(num_ctx=256, num_parallel=1)  # one slot: a second request waits for it
ALICE, BOB, CAROL = Who("alice"), Who("bob", ("ta",)), Who("carol")


async def test_one_persons_queue_does_not_delay_anothers_first(make_scheduler, small_models):
    sched = make_scheduler()
    sched.share()
    model = small_models[0]
    first = await sched.acquire(model, OPTS, user=ALICE)
    assert first.loaded.runner.slots == 1
    alices = [asyncio.ensure_future(sched.acquire(model, OPTS, user=ALICE)) for _ in range(6)]
    await _until(lambda: sched.users.gates[first.loaded.ref.key].queued == 6)
    bobs = asyncio.ensure_future(sched.acquire(model, OPTS, user=BOB))
    await _until(lambda: sched.users.gates[first.loaded.ref.key].queued == 7)
    assert first.loaded.users == {"alice": 7, "bob": 1} and first.loaded.refcount == 8
    pending = set(alices) | {bobs}
    held = first
    while pending:  # each release lets the next in turn in
        held.release()
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        held = done.pop().result()
    held.release()
    turns = [e for e in sched.events.history if e.kind == EventKind.TURN]
    queued = [e for e in sched.events.history if e.kind == EventKind.QUEUE]
    assert [e.data["user"] for e in queued] == ["alice"] * 6 + ["bob"]
    # by the events' order: bob's one request waited behind at most one of alice's six, all
    # of which were queued before it
    order = [e.data["user"] for e in turns]
    assert order.index("bob") <= 1, order
    assert sorted(order) == ["alice"] * 6 + ["bob"]
    lo = first.loaded
    assert lo.refcount == 0 and not lo.users and lo.used_by == {"alice", "bob"} and lo.loaded_by == "alice"
    assert not sched.users.in_flight and sched.users.requests[(model, "alice")] == 7


async def test_a_waiting_request_that_gives_up_leaves_its_place(make_scheduler, small_models):
    sched = make_scheduler()
    sched.share()
    model = small_models[0]
    first = await sched.acquire(model, OPTS, user=ALICE)
    gone = asyncio.ensure_future(sched.acquire(model, OPTS, user=ALICE))
    stays = asyncio.ensure_future(sched.acquire(model, OPTS, user=BOB))
    gate = sched.users.gates[first.loaded.ref.key]
    await _until(lambda: gate.queued == 2)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert gate.queued == 1 and first.loaded.users == {"alice": 1, "bob": 1}
    first.release()
    lease = await asyncio.wait_for(stays, 30)
    assert lease.who == BOB and gate.active == 1
    lease.release()
    assert gate.active == 0 and not sched.users.in_flight


async def test_requests_over_quota_are_429(make_scheduler, small_models):
    sched = make_scheduler()
    sched.share(parse_quotas({"default": {"concurrent": 2, "per_minute": 3}}))
    model = small_models[0]
    a = await sched.acquire(model, OPTS, user=ALICE)
    b = asyncio.ensure_future(sched.acquire(model, OPTS, user=ALICE))  # waits for the one slot
    await _until(lambda: sched.users.in_flight["alice"] == 2)
    with pytest.raises(QuotaExceeded, match=r"quota 'concurrent' \(default\) allows at once \(2\)") as e:
        await sched.acquire(model, OPTS, user=ALICE)
    assert e.value.status == 429
    a.release()
    (await b).release()
    (await sched.acquire(model, OPTS, user=ALICE)).release()  # the third this minute
    with pytest.raises(QuotaExceeded, match=r"3 requests in the last minute.*'per_minute' \(default\)"):
        await sched.acquire(model, OPTS, user=ALICE)
    (await sched.acquire(model, OPTS, user=CAROL)).release()  # another person's own minute
    refusals = [e for e in sched.events.history if e.kind == EventKind.REFUSE]
    assert [(e.data["user"], e.data["quota"]) for e in refusals] == [("alice", "concurrent"), ("alice", "per_minute")]
    assert sched.users.refusals[("alice", "concurrent")] == 1 and not sched.users.in_flight


async def test_loads_over_quota_are_507_and_evict_nothing(make_scheduler, small_models):
    sched = make_scheduler()
    sched.share(parse_quotas({"default": {"models": 1}, "users": {"carol": {"memory": "1KiB"}}}))
    (await sched.acquire(small_models[0], OPTS, user=ALICE)).release()
    with pytest.raises(OverMemoryQuota, match=r"1 model\(s\) loaded by alice's requests.*quota 'models' \(default\)") \
            as e:
        await sched.acquire(small_models[1], OPTS, user=ALICE)
    assert e.value.status == 507 and len(sched.loaded) == 1
    # a model someone else loaded is used freely: it counts against its loader's quota
    (await sched.acquire(small_models[0], OPTS, user=BOB)).release()
    (await sched.acquire(small_models[1], OPTS, user=BOB)).release()
    with pytest.raises(OverMemoryQuota, match=r"quota 'memory' on cpu \(user carol\) of 1\.0 KiB"):
        await sched.acquire(small_models[2], OPTS, user=CAROL)
    assert {lo.loaded_by for lo in sched.loaded.values()} == {"alice", "bob"}
    info = {i["name"]: i for i in sched.ps()}
    assert sorted(info[small_models[0]]["used_by"]) == ["alice", "bob"]
    assert not [e for e in sched.events.history if e.kind == EventKind.EVICT]


async def test_the_person_over_their_share_is_evicted_first(make_scheduler, small_models):
    sched = make_scheduler(max_loaded_models=3)
    sched.share()
    # bob's model is the one the plain rule (the same keep_alive: by path) would take first
    assert sorted(small_models[:3])[0] == small_models[0]
    (await sched.acquire(small_models[0], OPTS, user=BOB)).release()
    for m in small_models[1:3]:
        (await sched.acquire(m, OPTS, user=ALICE)).release()
    (await sched.acquire(small_models[3], OPTS, user=CAROL)).release()
    evicted = [e for e in sched.events.history if e.kind == EventKind.EVICT]
    assert len(evicted) == 1
    # alice holds two of the three: one of hers goes, though bob's is as idle
    assert evicted[0].model in small_models[1:3], evicted[0].message
    assert "more than an equal share" in evicted[0].message


async def _until(cond, timeout: float = 30.0) -> None:
    """Poll ``cond()`` until it holds (a liveness bound, not a speed check)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met"
        await asyncio.sleep(0.01)
