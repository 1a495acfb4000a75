"""The scheduler on real llama-server children: Ollama's scheduler scenarios and ours."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from jupyter_llama.engine.runner import RunnerCrashed
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory.report import MemoryReport
from jupyter_llama.scheduler import (
    BadRequest,
    DoesNotFit,
    Event,
    LoadFailed,
    ModelNotFound,
    ModelState,
    PinnedInTheWay,
    Scheduler,
    SchedulerSettings,
    ServerBusy,
)

pytestmark = pytest.mark.engine

OPTS = LoadOptions(num_ctx=256, num_parallel=1)
LONG = LoadOptions(num_ctx=2048, num_parallel=1)  # room for a stream that outlasts the test's checks


async def wait_for(cond, timeout: float = 30.0) -> None:
    """Poll ``cond()`` until it holds (fails after ``timeout``: a liveness bound, not a speed check)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.02)


async def wait_for_event(sched: Scheduler, kind: str, model: str | None = None, timeout: float = 30.0,
                         since: int = 0) -> Event:
    """The first event of ``kind`` (for ``model``) after ``since``: from history, or as it arrives."""
    def match(e: Event) -> bool:
        return e.seq > since and e.kind == kind and (model is None or e.model == model)

    for e in sched.events.history:
        if match(e):
            return e
    deadline = time.monotonic() + timeout
    with sched.events.listen() as sub:
        while True:
            e = await asyncio.wait_for(sub.get(), max(0.01, deadline - time.monotonic()))
            if match(e):
                return e


def kinds(sched: Scheduler, model: str | None = None) -> list[str]:
    return [e.kind for e in sched.events.history if model is None or e.model == model]


async def generate(lease, n: int = 4) -> str:
    text, _ = await lease.runner.complete_text("Hello", n_predict=n)
    return text


async def measure_actual(make_scheduler, model: str) -> tuple[int, int]:
    """(actual bytes, predicted bytes used for fitting) of one model under OPTS."""
    sched = make_scheduler()
    lo = await sched.load(model, OPTS)
    actual, need = lo.actual.total(), sched._need(lo.predictions, lo.fit_source).total()
    await sched.unload(model)
    return actual, need


# ----------------------------------------------------------------------------- reuse and reload


async def test_reuse_on_identical_options(make_scheduler, small_models):
    sched = make_scheduler()
    a = small_models[0]
    async with sched.use(a, OPTS) as l1:
        pid = l1.runner.pid
        assert await generate(l1)
    async with sched.use(a, OPTS) as l2:
        assert l2.runner.pid == pid
        assert l2.load_duration == 0.0
    assert kinds(sched).count("load") == 1


async def test_reload_only_when_a_load_option_changes(make_scheduler, small_models):
    sched = make_scheduler()
    a = small_models[0]
    lo = await sched.load(a, OPTS)
    pid = lo.runner.pid
    # Automatic values (None) never cause a reload; neither does asking again with the same options.
    same = await sched.load(a, LoadOptions())
    assert same.runner.pid == pid
    assert (await sched.load(a, LoadOptions(num_ctx=256))).runner.pid == pid
    # A changed load option does, and the event says which option changed and how.
    lo2 = await sched.load(a, LoadOptions(num_ctx=512, num_parallel=1))
    assert lo2.runner.pid != pid
    ev = await wait_for_event(sched, "reload", a)
    assert ev.data["changed"] == ["num_ctx"]
    assert "num_ctx 256 -> 512" in ev.message
    assert lo2.actual.n_ctx == 512


async def test_generate_and_embed_on_one_model_reload_once_not_on_every_switch(make_scheduler, small_models):
    """Issue 16 item 9: embed then generate then embed ... reloaded the model every time
    ("load options changed: embedding False -> True" and back)."""
    sched = make_scheduler()
    a = small_models[0]
    lo = await sched.load(a, OPTS)
    emb = await sched.load(a, OPTS.replace(embedding=True))  # the one reload: --embeddings
    assert emb.runner.pid != lo.runner.pid and "--embedding" in emb.runner.argv
    for _ in range(2):
        gen = await sched.load(a, OPTS)
        assert gen.runner.pid == emb.runner.pid
        async with sched.use(a, OPTS) as lease:
            text, timings = await lease.runner.complete_text("Once upon a time", n_predict=4)
        assert timings.get("predicted_n") == 4
        async with sched.use(a, OPTS.replace(embedding=True)) as lease:
            vectors, tokens = await lease.runner.embed(["hello there"])
        assert lease.runner.pid == emb.runner.pid and len(vectors) == 1 and tokens > 0
    assert len([e for e in sched.events.history if e.kind == "reload"]) == 1


async def test_free_memory_that_an_eviction_gives_back_counts_in_the_dry_run(make_scheduler, small_models, engine):
    """Where free memory (not a budget) is the limit, the dry run of the eviction rule counts
    what each victim would give back: a model that fits once another is unloaded evicts it and
    loads, rather than being refused as if nothing would come free."""
    from jupyter_llama.memory import devices as devmod

    a, b = small_models[:2]
    need = (await make_scheduler().predict(b, OPTS))[1]["detailed"].total()
    # host memory as a machine where only a third of the model is free once a is loaded
    host = devmod.HostMemory(total=64 * need, available=need // 3)
    sched = Scheduler(SchedulerSettings(binary=engine.path),
                      inventory=lambda: devmod.Inventory(host, [], devmod.Budgets(limits={})))
    try:
        first = await sched.load(a, OPTS)  # alone, it gets to try (and does fit, really)
        second = await sched.load(b, OPTS)
        assert second.runner.alive and first.state == ModelState.GONE
        assert [e.model for e in sched.events.history if e.kind == "evict"] == [first.name]
    finally:
        await sched.shutdown()


async def test_a_model_that_cannot_fit_even_alone_evicts_nothing(make_scheduler, small_models, make_model):
    """Issue 17 item 3: a load that would not fit with every other model unloaded is a 507 at
    once, and the loaded models keep their work (they were all evicted first, then it failed)."""
    small = small_models[0]
    big = str(make_model("too-big", layers=4, embd=512, heads=8, kv_heads=8, ctx=2048, seed=77))
    probe = make_scheduler()
    need = (await probe.predict(big, OPTS))[1]["detailed"].total()
    have = (await probe.predict(small, OPTS))[1]["detailed"].total()
    sched = make_scheduler(budget=int(have * 2.5))  # room for the small one, never for the big one
    assert need > have * 2.5
    lo = await sched.load(small, OPTS)
    with pytest.raises(DoesNotFit) as e:
        await sched.load(big, OPTS)
    assert "unloading every other model would not make room" in str(e.value) and "none was unloaded" in str(e.value)
    assert [e.kind for e in sched.events.history if e.kind in ("evict", "unload")] == []
    assert lo.runner.alive and sched.loaded
    await sched.unload(small)
    with pytest.raises(DoesNotFit, match="budget"):  # alone, it is over the budget: refused as before
        await sched.load(big, OPTS)


async def test_a_request_right_after_an_idle_unload_began_never_gets_the_stopping_runner(make_scheduler, small_models):
    """A soak found "runner for soak1:latest is not ready (stopping)": a request leased a runner
    whose stop had been decided (keep_alive 0, expiry, an eviction) but had not begun."""
    sched = make_scheduler()
    a = small_models[0]
    async with sched.use(a, OPTS, keep_alive=0):
        pass  # released: its stop is decided, in a task that has not run yet
    lease = await sched.acquire(a, OPTS, keep_alive=0)  # before that task runs
    try:
        text, timings = await lease.runner.complete_text("Once upon a time", n_predict=2)
        assert timings.get("predicted_n") == 2
    finally:
        lease.release()
    reloads = [e for e in sched.events.history if e.kind == "reload"]
    assert all("was being unloaded" in e.message for e in reloads), [e.message for e in reloads]


async def test_concurrent_requests_for_a_loading_model_share_one_load(make_scheduler, small_models):
    sched = make_scheduler()
    leases = await asyncio.gather(*(sched.acquire(small_models[1], OPTS) for _ in range(6)))
    try:
        assert len({lease.runner.pid for lease in leases}) == 1
        assert kinds(sched).count("load") == 1
        assert sched.in_flight == 6
    finally:
        for lease in leases:
            lease.release()
    assert sched.in_flight == 0


# ----------------------------------------------------------------------------- several models, cap, budget


async def test_several_models_under_the_cap(make_scheduler, small_models):
    sched = make_scheduler(max_loaded_models=3)
    for m in small_models[:3]:
        await sched.load(m, OPTS)
    assert len(sched.ps()) == 3
    assert "evict" not in kinds(sched)
    # The fourth goes over the cap: the idle model with the shortest keep_alive goes.
    await sched.load(small_models[0], OPTS, keep_alive="10m")
    await sched.load(small_models[1], OPTS, keep_alive="1m")
    await sched.load(small_models[2], OPTS, keep_alive="5m")
    await sched.load(small_models[3], OPTS)
    ev = await wait_for_event(sched, "evict")
    assert ev.model == small_models[1]
    assert "cap (3)" in ev.message and "shortest keep_alive" in ev.message
    assert {p["path"] for p in sched.ps()} == {small_models[0], small_models[2], small_models[3]}


async def test_oversized_model_evicts_idle_ones_and_budget_is_never_exceeded(make_scheduler, small_models, make_model):
    small_actual, small_need = await measure_actual(make_scheduler, small_models[0])
    big = str(make_model("big", layers=4, embd=256, heads=4, kv_heads=2, ctx=2048, seed=7))
    big_actual, big_need = await measure_actual(make_scheduler, big)
    small_cost, big_cost = max(small_actual, small_need), max(big_actual, big_need)
    # Three small models fit; the big one fits only after at least one of them is evicted.
    budget = max(2 * small_actual + small_cost, small_actual + big_cost) + small_actual // 4
    sched = make_scheduler(budget=budget, max_loaded_models=4)
    for m in small_models[:3]:
        await sched.load(m, OPTS)
    assert len(sched.ps()) == 3 and "evict" not in kinds(sched)
    await sched.load(big, OPTS)
    evictions = [e for e in sched.events.history if e.kind == "evict"]
    assert 1 <= len(evictions) <= 3
    assert all("not enough memory" in e.message or "over the budget" in e.message for e in evictions)
    assert big in {p["path"] for p in sched.ps()}
    used = sum(p["size"] for p in sched.ps())
    assert used <= budget, f"{used} in use against a budget of {budget}"
    fit = [e for e in sched.events.history if e.kind == "fit" and e.model == big][-1]
    assert fit.data["fits"] and fit.data["devices"]["cpu"]["budget"] == budget


async def test_the_fit_plan_is_the_verdict_the_load_acts_on(make_scheduler, small_models, make_model):
    """``estimate()['fit']`` (what /api/estimate, the picker and the panel show) is the same
    computation the load then runs: same need, same room, same verdict, same victims."""
    small_actual, small_need = await measure_actual(make_scheduler, small_models[0])
    big = str(make_model("big2", layers=4, embd=256, heads=4, kv_heads=2, ctx=2048, seed=8))
    big_actual, big_need = await measure_actual(make_scheduler, big)
    # both small ones fit; the big one fits beside one of them, not beside both
    budget = max(small_actual, small_need) + max(big_actual, big_need) + small_actual // 4
    sched = make_scheduler(budget=budget, max_loaded_models=4)
    await sched.load(small_models[0], OPTS, keep_alive=30)
    await sched.load(small_models[1], OPTS, keep_alive=60)
    plan = (await sched.estimate(big, OPTS))["fit"]
    cpu = plan.devices["cpu"]
    used = sum(p["size"] for p in sched.ps())
    assert plan.estimator == "detailed+10%" and cpu["budget"] == budget and cpu["in_use"] == used
    assert cpu["available"] == budget - used and cpu["need"] > cpu["available"] and not cpu["fits"]
    assert plan.verdict == "evict" and plan.evict[0] == small_models[0], "shortest keep_alive first"
    # an already loaded model is planned without its own memory counted against it
    again = (await sched.estimate(small_models[1], OPTS))["fit"]
    assert again.devices["cpu"]["in_use"] == used - next(p["size"] for p in sched.ps() if p["path"] == small_models[1])

    await sched.load(big, OPTS)
    evicted = [e.data["victim"] for e in sched.events.history if e.kind == "evict"]
    assert evicted == plan.evict, (evicted, plan.evict)
    fit_event = [e for e in sched.events.history if e.kind == "fit" and e.model == big][-1]
    assert fit_event.data["estimator"] == plan.estimator

    coarse = make_scheduler(budget=budget, fit_estimator="coarse")
    assert (await coarse.estimate(big, OPTS))["fit"].estimator == "coarse", "the configured estimator, no margin"


async def test_model_larger_than_the_budget_is_refused_with_numbers(make_scheduler, small_models):
    sched = make_scheduler(budget=64 * 1024)
    with pytest.raises(DoesNotFit, match=r"budget there is 64\.0 KiB.*JUPYTER_LLAMA_MEMORY_LIMIT"):
        await sched.load(small_models[0], OPTS)
    assert not sched.loaded


async def test_advice_for_weights_too_large_names_no_devices_the_machine_lacks(make_scheduler, make_model):
    """Over the host's budget by its weights, on a machine with no GPU and no RPC worker: the
    advice is a smaller model or quantisation, not "more layers on devices" it does not have."""
    wide = str(make_model("wide", layers=4, embd=512, heads=8, kv_heads=4, ctx=256, type="f16"))
    sched = make_scheduler(budget=4 << 20)
    if (await sched.inventory()).accelerators():
        pytest.skip("this machine has a GPU or an RPC worker to put layers on")
    with pytest.raises(DoesNotFit) as refused:
        await sched.load(wide, OPTS)
    said = str(refused.value)
    assert "the weights: use a smaller quantisation of the model, or a smaller model" in said, said
    assert "num_gpu" not in said and "devices" not in said, said


# ----------------------------------------------------------------------------- queue, errors, expiry


async def test_queue_limit_gives_server_busy(make_scheduler, small_models):
    sched = make_scheduler(max_queue=2)
    # The file's metadata is read (in a thread) before a request joins the queue. Read it
    # once first, so that all six reach the queue before the load ends: otherwise a read
    # slower than the child's start (a loaded CI machine) lets a late request find the
    # model ready and take the fast path, and the count depends on timing.
    await sched.resolver(small_models[2])
    results = await asyncio.gather(*(sched.acquire(small_models[2], OPTS) for _ in range(6)), return_exceptions=True)
    busy = [r for r in results if isinstance(r, ServerBusy)]
    leases = [r for r in results if not isinstance(r, BaseException)]
    assert len(busy) == 4 and len(leases) == 2, results
    assert "server busy" in str(busy[0])
    for lease in leases:
        lease.release()
    assert "busy" in kinds(sched)


async def test_bad_model_path_errors_and_idle_model_still_expires(make_scheduler, small_models, tmp_path):
    sched = make_scheduler()
    a = small_models[0]
    await sched.load(a, OPTS, keep_alive=0.5)
    with pytest.raises(ModelNotFound, match='model ".*nope.gguf" not found: no such file /'):
        await sched.load(str(tmp_path / "nope.gguf"), OPTS)
    ev = await wait_for_event(sched, "unload", a, timeout=10)
    assert ev.data["rule"] == "keep_alive"
    assert "expire" in kinds(sched, a)
    assert not sched.loaded


async def test_truncated_model_is_refused_before_any_child_starts(make_scheduler, small_models, tmp_path):
    bad = tmp_path / "cut.gguf"
    data = open(small_models[0], "rb").read()
    bad.write_bytes(data[: len(data) // 2])
    sched = make_scheduler()
    with pytest.raises(BadRequest, match=r"cut\.gguf: truncated"):
        await sched.load(str(bad), OPTS)
    assert not sched.loaded and "load" not in kinds(sched)


async def test_startup_failure_reaches_the_caller_with_the_childs_error(make_scheduler, small_models, tmp_path):
    # A GGUF we can read but llama.cpp refuses: an unknown tokenizer model.
    bad = tmp_path / "badtok.gguf"
    data = open(small_models[0], "rb").read()
    marker = b"tokenizer.ggml.model\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llama"
    assert marker in data
    bad.write_bytes(data.replace(marker, marker[:-5] + b"nosuch"[:5]))
    sched = make_scheduler()
    with pytest.raises(LoadFailed) as info:
        await sched.load(str(bad), OPTS)
    msg = str(info.value)
    assert "exited while loading" in msg and "llama-server log" in msg and "tokenizer" in msg.lower()
    assert not sched.loaded
    assert "error" in kinds(sched, str(bad))


async def test_explicit_unload_with_a_cancelled_request_leaves_nothing(make_scheduler, small_models):
    sched = make_scheduler()
    a = small_models[0]
    lease = await sched.acquire(a, LONG)

    async def stream():
        try:
            async for _ in lease.runner.completion("Go", n_predict=100000, ignore_eos=True):
                pass
        finally:
            lease.release()

    task = asyncio.create_task(stream())
    await asyncio.sleep(0.1)
    unloading = asyncio.create_task(sched.unload(a))
    await asyncio.sleep(0.05)
    assert not task.done(), "the stream is still generating"
    assert not unloading.done() and lease.loaded.unload_when_idle, "unload waits for the running request"
    task.cancel()
    assert await asyncio.wait_for(unloading, 10) is True
    assert not sched.loaded and sched.in_flight == 0


async def test_keep_alive_zero_while_busy_unloads_after_the_request(make_scheduler, small_models):
    sched = make_scheduler()
    a = small_models[0]
    first = await sched.acquire(a, OPTS, keep_alive="5m")
    second = await sched.acquire(a, OPTS, keep_alive=0)  # a later request's own value wins
    assert await generate(second)
    second.release()
    assert sched.loaded, "still busy with the first request"
    first.release()
    ev = await wait_for_event(sched, "unload", a, timeout=10)
    assert ev.data["rule"] == "keep_alive"


async def test_expiry_while_busy_unloads_after_the_request(make_scheduler, small_models):
    sched = make_scheduler()
    a = small_models[0]
    lease = await sched.acquire(a, OPTS, keep_alive=0.2)
    lo = lease.loaded
    sched._expire(lo)  # the timer's callback, arriving while a request holds the runner
    assert lo.unload_when_idle and sched.loaded
    assert await generate(lease)
    lease.release()
    await wait_for_event(sched, "unload", a, timeout=10)
    assert not sched.loaded


# ----------------------------------------------------------------------------- victims and pinning


async def test_victim_idle_over_busy_then_shortest_keep_alive(make_scheduler, small_models):
    sched = make_scheduler(max_loaded_models=2)
    a, b, c = small_models[:3]
    busy = await sched.acquire(a, OPTS, keep_alive="1m")  # shortest, but busy
    await sched.load(b, OPTS, keep_alive="10m")  # idle
    await sched.load(c, OPTS)
    ev = await wait_for_event(sched, "evict")
    assert ev.model == b and "idle" in ev.data["rule"]
    busy.release()


async def test_busy_victim_unloads_when_its_request_finishes(make_scheduler, small_models):
    sched = make_scheduler(max_loaded_models=1)
    a, b = small_models[:2]
    lease = await sched.acquire(a, OPTS)
    loading = asyncio.create_task(sched.load(b, OPTS))
    ev = await wait_for_event(sched, "evict", a, timeout=10)
    assert "busy" in ev.data["rule"]
    await asyncio.sleep(0.2)
    assert not loading.done()
    lease.release()
    await asyncio.wait_for(loading, 30)
    assert [p["path"] for p in sched.ps()] == [b]


async def test_pinned_models_are_kept_and_named(make_scheduler, small_models):
    sched = make_scheduler(max_loaded_models=2)
    a, b, c, d = small_models
    await sched.load(a, OPTS, keep_alive=-1)
    await sched.load(b, OPTS, keep_alive="5m")
    await sched.load(c, OPTS)  # evicts b (unpinned) although a has been idle longer
    assert (await wait_for_event(sched, "evict")).model == b
    await sched.load(c, OPTS, keep_alive="-1")  # now both loaded models are pinned
    with pytest.raises(PinnedInTheWay, match=r"only pinned models .*JUPYTER_LLAMA_EVICT_PINNED"):
        await sched.load(d, OPTS)
    assert {p["path"] for p in sched.ps()} == {a, c}
    assert all(p["pinned"] for p in sched.ps())


async def test_evict_pinned_setting_allows_it(make_scheduler, small_models):
    sched = make_scheduler(max_loaded_models=1, evict_pinned=True)
    await sched.load(small_models[0], OPTS, keep_alive=-1)
    await sched.load(small_models[1], OPTS)
    assert "pinned" in (await wait_for_event(sched, "evict")).data["rule"]


# ----------------------------------------------------------------------------- crashes, OOM, shutdown


async def test_crash_mid_request_then_reload(make_scheduler, small_models):
    sched = make_scheduler()
    a = small_models[0]
    lease = await sched.acquire(a, LONG)
    pid = lease.runner.pid
    with pytest.raises(RunnerCrashed):
        async for i, _ in _enumerate(lease.runner.completion("Go", n_predict=100000, ignore_eos=True)):
            if i == 2:
                os.kill(pid, signal.SIGKILL)
    lease.release()
    await wait_for_event(sched, "crash", a, timeout=10)
    async with sched.use(a, LONG) as again:
        assert again.runner.pid != pid
        assert await generate(again)


async def test_idle_child_death_is_noticed(make_scheduler, small_models):
    sched = make_scheduler()
    lo = await sched.load(small_models[0], OPTS)
    os.kill(lo.runner.pid, signal.SIGKILL)
    await wait_for_event(sched, "crash", small_models[0], timeout=10)
    await wait_for_event(sched, "unload", small_models[0], timeout=10)
    assert sched.ps() == []


@pytest.fixture
def oom_model(make_model):
    """Tiny weights, but a training context whose KV cache cannot be allocated on this machine."""
    return str(make_model("oom", layers=1, embd=256, heads=2, kv_heads=2, ctx=64 * 1024 * 1024, seed=5))


async def test_oom_with_automatic_context_steps_down(make_scheduler, oom_model, monkeypatch):
    monkeypatch.setenv("JUPYTER_LLAMA_CONTEXT_LENGTH", str(64 * 1024 * 1024))  # automatic: the training context
    # llama.cpp's own --fit would shrink an automatic context before allocating (it does so for
    # host memory too); with it off, the full training context is tried and runs out of memory.
    sched = make_scheduler(fit_estimator="coarse", max_loaded_models=2)
    lo = await sched.load(oom_model, LoadOptions(num_parallel=1, fit=False))
    ev = await wait_for_event(sched, "oom_retry", oom_model)
    assert ev.data["ctx_to"] == 32768
    assert lo.options.num_ctx == 32768 and lo.actual.n_ctx == 32768


def optimistic_predictor(ref, options, gpus, split=None):
    """An estimator that is badly wrong (a GPU scheduler's usual failure): it says 1 MiB."""
    rep = MemoryReport("coarse")
    rep.add("cpu", "weights", 1 << 20)
    return {"coarse": rep}


async def test_oom_with_explicit_context_evicts_others_once(make_scheduler, oom_model, small_models):
    # The prediction fits beside the loaded model, but the child runs out of memory: Ollama's
    # recovery evicts every other model and tries exactly once more, keeping the explicit context.
    sched = make_scheduler(fit_estimator="coarse", predictor=optimistic_predictor)
    await sched.load(small_models[0], OPTS)
    huge = LoadOptions(num_ctx=64 * 1024 * 1024, num_parallel=1)
    with pytest.raises(LoadFailed):
        await sched.load(oom_model, huge)
    retries = [e for e in sched.events.history if e.kind == "oom_retry"]
    assert len(retries) == 1 and retries[0].data["victims"] == [small_models[0]]
    assert not sched.loaded


async def test_oom_alone_with_explicit_context_is_not_retried(make_scheduler, oom_model):
    sched = make_scheduler(fit_estimator="coarse")
    with pytest.raises(LoadFailed, match="exited while loading"):
        await sched.load(oom_model, LoadOptions(num_ctx=64 * 1024 * 1024, num_parallel=1))
    assert "oom_retry" not in kinds(sched)


async def test_shutdown_stops_every_child(make_scheduler, small_models):
    sched = make_scheduler()
    pids = [(await sched.load(m, OPTS)).runner.pid for m in small_models[:3]]
    await sched.shutdown()
    assert not sched.loaded
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_events_explain_a_load(make_scheduler, small_models):
    sched = make_scheduler()
    await sched.load(small_models[0], OPTS)
    evs = sched.events.recent(small_models[0])
    assert [e.kind for e in evs] == ["fit", "load", "loaded"]
    fit, _, loaded = evs
    assert fit.data["fits"] and fit.data["devices"]["cpu"]["need"] > 0
    assert "llama.cpp allocated" in loaded.message and "predicted" in loaded.message
    assert loaded.data["actual"]["total"] > 0


async def _enumerate(aiter):
    i = 0
    async for x in aiter:
        yield i, x
        i += 1


async def test_no_unpinned_model_is_evicted_for_nothing(make_scheduler, small_models, make_model):
    # Room for two small models. One is pinned, one is not; a big model would need the pinned
    # one's memory too, so it is refused at once and the unpinned model stays loaded.
    small_actual, small_need = await measure_actual(make_scheduler, small_models[0])
    big = str(make_model("big2", layers=4, embd=256, heads=4, kv_heads=2, ctx=2048, seed=8))
    budget = small_actual + max(small_actual, small_need) + small_actual // 4
    sched = make_scheduler(budget=budget, max_loaded_models=4)
    await sched.load(small_models[0], OPTS, keep_alive=-1)
    await sched.load(small_models[1], OPTS, keep_alive="5m")
    with pytest.raises(PinnedInTheWay, match=r"evicting every unpinned model would not be enough"):
        await sched.load(big, OPTS)
    assert "evict" not in kinds(sched)
    assert {p["path"] for p in sched.ps()} == {small_models[0], small_models[1]}


# ----------------------------------------------------------------------------- the projector


async def test_a_registered_projector_reaches_llama_server(engine, tmp_path):
    """A model registered with a projector (``ModelRef.mmproj``) is started with ``--mmproj``,
    and llama.cpp loads it (a synthetic projector made for the text model's width)."""
    import dataclasses

    from jupyter_llama.models.synth import write_projector, write_synthetic
    from jupyter_llama.scheduler import FileResolver, SchedulerSettings

    model = write_synthetic(tmp_path / "vision.gguf", layers=2, embd=64)
    proj = write_projector(tmp_path / "vision-mmproj.gguf", text_embd=64)
    files = FileResolver()

    async def with_projector(name: str):
        return dataclasses.replace(await files(name), mmproj=str(proj))

    sched = Scheduler(SchedulerSettings(binary=engine.path), resolver=with_projector)
    try:
        lo = await sched.load(str(model), OPTS)
        argv = lo.runner.argv
        assert argv[argv.index("--mmproj") + 1] == str(proj)
        # the log is read as it arrives, so the line may land just after /health answered
        await wait_for(lambda: any("loaded multimodal model" in ln for ln in lo.runner.parser.lines))
        explicit = await sched.estimate(str(model), OPTS.replace(mmproj="/elsewhere/p.gguf"))
        assert explicit["options"].mmproj == "/elsewhere/p.gguf", "a request naming a projector wins"
    finally:
        await sched.shutdown()


async def test_a_model_deleted_while_its_request_waited_is_not_found(make_scheduler, make_model, tmp_path):
    """Issue 17 item 8: a request resolved its name, then the file went (a delete raced it):
    404 (ModelNotFound), not a 500 about a missing file, and nothing is evicted or started."""
    import shutil

    from jupyter_llama.models.gguf_info import read_gguf_info
    from jupyter_llama.models.ref import ModelRef

    path = tmp_path / "doomed.gguf"
    shutil.copy(make_model("doomed", layers=1, embd=32), path)
    ref = ModelRef(name="doomed:latest", path=str(path), info=read_gguf_info(path))

    async def resolver(name):
        return ref

    sched = make_scheduler()
    sched.resolver = resolver
    path.unlink()
    with pytest.raises(ModelNotFound, match="deleted while this request waited"):
        await sched.acquire("doomed")
    assert not sched.loaded and not [e for e in sched.events.history if e.kind == "load"]
