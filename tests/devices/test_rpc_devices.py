"""The device path for real: ggml-rpc-server workers on loopback as a CPU-only machine's GPUs.

Every test starts its own workers (stopped by PID, also when the test fails) and real
llama-server children through the scheduler. Budgets on the workers make them small, so
llama.cpp's own --fit really splits a model between workers and the host.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from jupyter_llama.engine.runner import RunnerCrashed
from jupyter_llama.engine.worker import LocalWorker
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory import devices as devmod
from jupyter_llama.memory import fitparams as fp
from jupyter_llama.memory import rpc
from jupyter_llama.memory.report import DETAILED, HOST, MiB
from jupyter_llama.procs import process_alive
from jupyter_llama.scheduler import ModelState

pytestmark = pytest.mark.engine

SHAPE = dict(layers=4, embd=512, heads=8, kv_heads=8, ctx=2048, seed=3)  # 24 MB f16, 5 layers with the output
OPTS = LoadOptions(num_ctx=512, num_parallel=1)


@pytest.fixture
def model(make_model):
    return str(make_model("rpcmodel", **SHAPE))


def by_device(lo) -> dict[str, int]:
    return lo.actual.by_device()


# ----------------------------------------------------------------------------- the probe


def test_probe_reports_the_workers_memory_and_unreachable_ones(workers):
    (w,) = workers(1)
    st = rpc.probe(w.endpoint)
    assert st.reachable and st.version and st.version.startswith("7.")
    assert len(st.devices) == 1 and st.devices[0].id == w.id and st.devices[0].total > 0
    w.stop()
    gone = rpc.probe(w.endpoint, timeout=1.0)
    assert not gone.reachable and "connection refused" in gone.error


def test_a_paused_worker_is_reported_within_the_timeout_never_a_hang(workers):
    (w,) = workers(1)
    w.pause()
    try:
        st = rpc.probe(w.endpoint, timeout=0.5)
        assert not st.reachable and "did not answer within 0.5s" in st.error
    finally:
        w.resume()


def test_inventory_lists_workers_with_budgets_and_the_reason_one_is_down(workers, monkeypatch):
    a, b = workers(2)
    b.stop()
    monkeypatch.setenv("JUPYTER_LLAMA_RPC_WORKERS", f"{a.endpoint},{b.endpoint}")
    monkeypatch.setenv("JUPYTER_LLAMA_MEMORY_LIMIT", f"{a.id}=64MiB,cpu=4GiB")
    inv = devmod.inventory()
    rows = {d.id: d for d in inv.devices()}
    assert rows[a.id].reachable and rows[a.id].budget == 64 * MiB and rows[a.id].usable == 64 * MiB
    assert not rows[b.id].reachable and rows[b.id].usable == 0
    assert [d.id for d in inv.accelerators()] == [a.id]
    text = devmod.format_inventory(inv)
    assert "unreachable" in text and "connection refused" in text and a.id in text


def test_budget_grammar_takes_rpc_devices():
    limits = devmod.parse_memory_limit("rpc:127.0.0.1:50052=64MiB,RPC:localhost:7=1GiB,cpu=4GiB")
    assert limits == {"rpc:127.0.0.1:50052": 64 * MiB, "rpc:localhost:7": 1024 * MiB, "cpu": 4096 * MiB}
    with pytest.raises(Exception, match="HOST:PORT|unknown device"):
        devmod.parse_memory_limit("rpc:nohost=1GiB")


# ----------------------------------------------------------------------------- placement


async def test_budgets_become_fit_targets_and_llama_cpp_splits_within_them(workers, make_scheduler, model, engine):
    a, b = workers(2)
    sched = make_scheduler([a, b], {a.id: 30 * MiB, b.id: 5 * MiB})
    lo = await sched.load(model, OPTS)
    argv = lo.runner.argv
    assert "--rpc" in argv and argv[argv.index("--rpc") + 1] == f"{a.endpoint},{b.endpoint}"
    assert "--fit-target" in argv
    used = by_device(lo)
    assert 0 < used[a.id] <= 30 * MiB and 0 < used[b.id] <= 5 * MiB and used[HOST] > 0
    actual = lo.actual
    assert 0 < actual.layers_offloaded < actual.layers_total
    # the detailed prediction describes the same placement, per device
    pred = lo.predictions[DETAILED]
    for dev in (HOST, a.id, b.id):
        assert abs(pred.total(device=dev) - actual.total(device=dev)) <= 0.10 * actual.total(device=dev), dev
    ps = sched.ps()[0]
    assert ps["layers_offloaded"] == actual.layers_offloaded and ps["size_vram"] == used[a.id] + used[b.id]
    # llama.cpp's own projection names the same devices (it said rpc0, rpc1); figures of a few MiB
    # are too small for its whole MiB, so it is not shown, but it ran, for the same placement
    await sched.unload(model, reason="test")
    fit = await fp.run_fit_params_async(engine.fit_params, model, lo.options)
    proj = fit.projection
    assert proj is not None, fit.error
    assert set(proj.by_device()) <= {HOST, a.id, b.id} and a.id in proj.by_device(), proj.by_device()
    assert fit.fitted[:2] == ["-c", str(lo.options.total_ctx)]


async def test_num_gpu_exact_and_zero(workers, make_scheduler, model):
    a, b = workers(2)
    sched = make_scheduler([a, b])
    lo = await sched.load(model, OPTS.replace(num_gpu=3))
    assert lo.actual.layers_offloaded == 3 and "--fit-target" not in lo.runner.argv
    assert set(by_device(lo)) == {HOST, a.id, b.id}
    await sched.unload(model)
    lo = await sched.load(model, OPTS.replace(num_gpu=0))
    assert "--rpc" not in lo.runner.argv and set(by_device(lo)) == {HOST}
    assert sched.held_workers() == {}


async def test_a_worker_serves_one_runner_and_a_second_model_takes_the_other(workers, make_scheduler, model,
                                                                              make_model):
    a, b = workers(2)
    other = str(make_model("rpcmodel2", **{**SHAPE, "seed": 4}))
    sched = make_scheduler([a, b], {a.id: 80 * MiB, b.id: 80 * MiB})
    lo1 = await sched.load(model, OPTS.replace(num_gpu=5))
    assert set(lo1.options.rpc) == {a.endpoint, b.endpoint}
    await sched.unload(model)
    # automatic placement on a big budget: one worker is enough, the other stays free
    # automatic placement where one worker's budget holds no layer: that worker is left free
    sched.settings.budgets = devmod.Budgets(limits={a.id: 80 * MiB, b.id: MiB // 2})
    lo1 = await sched.load(model, OPTS)
    assert lo1.options.rpc == (a.endpoint,)
    sched.settings.budgets = devmod.Budgets(limits={a.id: 80 * MiB, b.id: 80 * MiB})
    lo2 = await sched.load(other, OPTS)  # a is held by the first model: the second goes to b
    assert lo2.options.rpc == (b.endpoint,) and by_device(lo2)[b.id] > 0
    assert [e.model for e in sched.events.history if e.kind == "evict"] == []  # nothing evicted for it
    inv = await sched.inventory()
    assert inv.held == {a.endpoint: lo1.name, b.endpoint: lo2.name}
    text = devmod.format_inventory(inv)
    assert "in use by" in text


async def test_unload_waits_for_the_worker_to_answer_again(workers, make_scheduler, model):
    (a,) = workers(1)
    sched = make_scheduler([a])
    await sched.load(model, OPTS.replace(num_gpu=2))
    await sched.unload(model)
    rec = [e for e in sched.events.history if e.kind == "recover"]
    assert rec and rec[-1].data["worker"] == a.endpoint and rec[-1].data["free"]
    assert rpc.probe(a.endpoint).reachable


async def test_the_plan_after_an_unload_takes_the_workers_answer_as_it_came(workers, make_scheduler, model,
                                                                            monkeypatch):
    """The answer a worker gave once our runner let it go stands for it in the next plan (a
    swap on workers pays one round of probes, not two), and only there: a look at the devices
    meanwhile (the panel's poll) asks, and leaves it; the plan after that asks again."""
    (a,) = workers(1)
    sched = make_scheduler([a])
    await sched.load(model, OPTS.replace(num_gpu=2))
    await sched.unload(model)
    asked = []
    real = rpc.probe
    monkeypatch.setattr(rpc, "probe", lambda ep, timeout=2.0: asked.append(ep) or real(ep, timeout))
    inv = await sched.inventory()
    assert asked == [a.endpoint] and inv.workers[0].reachable
    inv = await sched.inventory(planning=True)
    assert asked == [a.endpoint] and inv.workers[0].reachable and inv.workers[0].devices[0].free > 0
    inv = await sched.inventory(planning=True)
    assert asked == [a.endpoint, a.endpoint] and inv.workers[0].reachable


async def test_a_swap_on_workers_starts_the_next_child_as_the_old_one_exits(workers, make_scheduler, model,
                                                                            make_model):
    """With room for one model, B evicts A and takes A's workers without waiting for A to be
    gone: B's child starts while A's exits (the workers take B's connection once A's closes),
    B is placed on the workers by their answers from before A, and it answers."""
    a, b = workers(2)
    other = str(make_model("rpcmodel-swap", **{**SHAPE, "seed": 5}))
    sched = make_scheduler([a, b], max_loaded_models=1)
    first = await sched.load(model, OPTS)
    assert set(first.options.rpc) == {a.endpoint, b.endpoint}
    old_pid = first.runner.pid
    second = await sched.load(other, OPTS)
    assert set(second.options.rpc) == {a.endpoint, b.endpoint} and by_device(second)[a.id] > 0
    # handed over: stopped behind the new load, with no wait for its workers to answer again
    # (which of the old one's exit and the new one's start is logged first is a race, by design)
    assert [e.data["behind"] for e in sched.events.history if e.kind == "unload" and e.model == first.name] == [True]
    assert not [e for e in sched.events.history if e.kind == "recover" and e.model == first.name]
    await asyncio.wait_for(first.gone.wait(), 10)  # (it went while B loaded: B's workers were waiting on it)
    assert not process_alive(old_pid) and first.state == ModelState.GONE
    assert not [e for e in sched.events.history if e.kind == "recover" and e.data.get("free") is None]
    async with sched.use(other) as lease:
        text, timings = await lease.runner.complete_text("Once upon a time", n_predict=4)
    assert text and timings["predicted_n"] == 4


async def test_a_look_at_the_devices_during_a_swap_does_not_take_the_workers_from_it(workers, make_scheduler, model,
                                                                                     make_model, monkeypatch):
    """While an evicted runner on the workers is still exiting (here slowly), a look at the
    devices (the panel polls api/devices) does not ask its workers, which would answer only
    once it is gone and be reported unreachable: the new model still gets both workers."""
    a, b = workers(2)
    other = str(make_model("rpcmodel-swap", **{**SHAPE, "seed": 5}))
    sched = make_scheduler([a, b], max_loaded_models=1, worker_timeout=0.5)
    first = await sched.load(model, OPTS)
    real_stop = first.runner.stop

    async def slow_stop(*args, **kw):  # a big model's teardown
        await asyncio.sleep(1.5)
        return await real_stop(*args, **kw)

    monkeypatch.setattr(first.runner, "stop", slow_stop)
    unanswered = []
    real = rpc.probe

    def probe(ep, timeout=2.0):
        st = real(ep, timeout)
        if not st.reachable:
            unanswered.append(ep)
        return st

    monkeypatch.setattr(rpc, "probe", probe)
    done = asyncio.Event()

    async def poll() -> None:
        while not done.is_set():
            await sched.inventory()  # back to back: always in the middle of one when the swap plans

    poller = asyncio.ensure_future(poll())
    try:
        second = await sched.load(other, OPTS)
    finally:
        done.set()
        await poller
    assert set(second.options.rpc or ()) == {a.endpoint, b.endpoint} and unanswered == []


async def test_default_cap_counts_workers_as_gpus(workers, make_scheduler):
    ws = workers(2)
    sched = make_scheduler(ws)
    inv = await sched.inventory()
    assert sched.max_loaded(len(inv.accelerators(include_unusable=True))) == 6


# ----------------------------------------------------------------------------- faults


async def test_a_worker_killed_mid_stream_ends_it_naming_the_worker(workers, make_scheduler, model):
    a, b = workers(2)
    sched = make_scheduler([a, b])
    lo = await sched.load(model, LoadOptions(num_ctx=2048, num_parallel=1, num_gpu=5))
    async with sched.use(model) as lease:
        with pytest.raises(RunnerCrashed, match=b.endpoint):
            n = 0
            async for _ in lease.runner.completion("Once upon a time", n_predict=1500, stream=True):
                n += 1
                if n == 3:
                    b.kill()
    crash = await _wait_kind(sched, "crash")
    assert b.endpoint in crash.message and crash.data["lost_workers"] == [b.endpoint]
    assert not lo.runner.alive
    # how it ended, in words, and its own last lines rather than a debugger's
    assert "(killed by SIG" in crash.message or "(exit code" in crash.message, crash.message
    assert "Inferior" not in crash.message and "gdb" not in crash.message, crash.message
    lo2 = await sched.load(model, OPTS)  # the next request loads on what is left
    assert lo2.options.rpc == (a.endpoint,)


async def test_a_worker_that_stops_answering_fails_the_load_within_the_stall_timer(workers, engine, model):
    from jupyter_llama.engine.runner import LoadError, Runner

    (a,) = workers(1)
    a.pause()  # accepts connections (the kernel does), answers nothing: the child's load stalls
    r = Runner(model, OPTS.replace(rpc=(a.endpoint,)), binary=engine.path, load_timeout=2.0)
    try:
        with pytest.raises(LoadError, match=f"stalled.*{a.endpoint}"):
            await r.start()
        assert not r.alive and not process_alive(r.pid)
    finally:
        a.resume()


async def test_out_of_memory_on_a_worker_with_an_automatic_context_steps_down(workers, make_scheduler, make_model,
                                                                              monkeypatch):
    monkeypatch.setenv("JUPYTER_LLAMA_CONTEXT_LENGTH", str(64 * 1024 * 1024))  # automatic: the training context
    # Tiny weights and a 64M-token training context: with llama.cpp's --fit off, the whole model
    # and its KV cache go to the worker, which cannot allocate the cache; the scheduler steps the
    # automatic context down once, and the retry loads on the same worker.
    (w,) = workers(1)
    sched = make_scheduler([w], fit_estimator="coarse")
    oom = str(make_model("rpc-oom", layers=1, embd=256, heads=2, kv_heads=2, ctx=64 * 1024 * 1024, seed=5))
    lo = await sched.load(oom, LoadOptions(num_parallel=1, fit=False))
    retries = [e for e in sched.events.history if e.kind == "oom_retry"]
    assert len(retries) == 1 and retries[0].data["ctx_to"] == 32768, [e.message for e in sched.events.history]
    assert lo.options.num_ctx == 32768 and lo.actual.n_ctx == 32768
    assert lo.options.rpc == (w.endpoint,) and by_device(lo).get(w.id, 0) > 0, by_device(lo)
    assert w.alive, "the worker survives a failed allocation"


async def test_a_projector_a_worker_cannot_hold_is_retried_on_the_cpu(engine, make_scheduler, tmp_path):
    """The projector goes to the first device (here a worker whose allocations beyond 80 MB fail,
    as a full GPU's would); it runs out of memory there, and the load is retried once with
    ``--no-mmproj-offload``: the projector on the CPU, the model loaded."""
    import dataclasses

    from jupyter_llama.models.synth import write_projector, write_synthetic
    from jupyter_llama.scheduler import FileResolver

    model = write_synthetic(tmp_path / "vision.gguf", layers=2, embd=64)
    proj = write_projector(tmp_path / "vision-mmproj.gguf", text_embd=64, ff=200_000)  # about 100 MB of weights
    files = FileResolver()

    async def with_projector(name: str):
        return dataclasses.replace(await files(name), mmproj=str(proj))

    w = LocalWorker(engine, address_space=80 * 1000 * 1000)
    try:
        sched = make_scheduler([w])
        sched.resolver = with_projector
        lo = await sched.load(str(model), LoadOptions(num_ctx=512, num_parallel=1))
        retries = [e for e in sched.events.history if e.kind == "oom_retry"]
        assert len(retries) == 1 and "projector on the CPU" in retries[0].message, [
            e.message for e in sched.events.history]
        assert lo.options.mmproj_offload is False and "--no-mmproj-offload" in lo.runner.argv
        assert lo.runner.alive
    finally:
        w.stop()


async def test_a_paused_worker_is_left_out_of_placement(workers, make_scheduler, model):
    a, b = workers(2)
    sched = make_scheduler([a, b], worker_timeout=0.5)
    b.pause()
    try:
        lo = await sched.load(model, OPTS)
        assert lo.options.rpc == (a.endpoint,)
    finally:
        b.resume()


async def _wait_kind(sched, kind, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in sched.events.history:
            if e.kind == kind:
                return e
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {kind} event")


# ----------------------------------------------------------------------------- the worker command


def test_worker_command_refuses_bad_ports_and_warns_beyond_loopback(engine, tmp_path):
    import subprocess
    import sys

    from jupyter_llama.engine.worker import UNSAFE_BIND_WARNING, WorkerError, _is_loopback, worker_argv

    with pytest.raises(WorkerError, match="not a port number"):
        worker_argv(engine, host="127.0.0.1", port=70000)
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("10.0.0.5")
    assert "no authentication" in UNSAFE_BIND_WARNING
    r = subprocess.run([sys.executable, "-m", "jupyter_llama.cli", "worker", "--port", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--port 0 is not a port number" in r.stderr and "Traceback" not in r.stderr


def test_a_busy_workers_probe_does_not_kill_it(workers):
    """A probe of a worker that serves another client gives up after its timeout; the worker
    reads it once that client leaves, and answered a socket already closed: SIGPIPE, at its
    default in the worker (subprocess restores it), killed the worker without a word."""
    import socket
    import time

    (w,) = workers(1)
    busy = socket.create_connection(("127.0.0.1", w.port))  # (the worker's one client)
    time.sleep(0.1)
    assert not rpc.probe(w.endpoint, timeout=0.3).reachable  # another manager's look, given up
    busy.close()
    deadline = time.monotonic() + 10
    while not rpc.probe(w.endpoint, timeout=1.0).reachable:  # it reads the probe, answers it, and goes on
        assert w.alive, f"the worker died ({w.proc.returncode})"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    assert w.alive


def test_worker_command_says_a_port_in_use_and_goes_with_its_worker(engine, workers, tmp_path):
    """`jupyter-llama worker` on a port that another worker has: a sentence and status 2 (the
    worker printed that it could not make its socket, and exited 0). Stopped with SIGTERM, it
    stops its worker (which went on serving as an orphan)."""
    import signal
    import subprocess
    import sys
    import time

    from jupyter_llama.engine.runner import free_port
    from jupyter_llama.procs import child_pids, process_alive

    (w,) = workers(1)
    r = subprocess.run([sys.executable, "-m", "jupyter_llama.cli", "worker", "--port", str(w.port)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"127.0.0.1:{w.port} is in use (another worker?)" in r.stderr, r.stderr
    port = free_port()
    # started as under nohup (a hang-up ignored): it stays so, and SIGTERM stops it and its worker
    cli = subprocess.Popen([sys.executable, "-m", "jupyter_llama.cli", "worker", "--port", str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 30
        while not rpc.probe(f"127.0.0.1:{port}", timeout=1.0).reachable:
            assert cli.poll() is None and time.monotonic() < deadline, "the worker did not come up"
            time.sleep(0.05)
        kids = child_pids(cli.pid)
        assert kids
        cli.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert cli.poll() is None and rpc.probe(f"127.0.0.1:{port}", timeout=2.0).reachable  # (nohup's promise)
        cli.send_signal(signal.SIGTERM)
        out, err = cli.communicate(timeout=30)
        assert cli.returncode == 0, err
        assert f"RPC worker on 127.0.0.1:{port}" in out + err, (out, err)
        deadline = time.monotonic() + 10
        while any(process_alive(k) for k in kids):
            assert time.monotonic() < deadline, "the worker outlived its command"
            time.sleep(0.05)
        assert not rpc.probe(f"127.0.0.1:{port}", timeout=1.0).reachable
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()


async def test_the_estimate_of_a_reload_counts_the_workers_the_model_holds_as_free(workers, make_scheduler, model):
    """A model on both workers, estimated with other options: a reload lets its workers go
    first, so the estimate places it on them (it showed the host alone, and the reload then
    went to the workers)."""
    a, b = workers(2)
    sched = make_scheduler([a, b])
    lo = await sched.load(model, OPTS.replace(num_gpu=4))
    assert set(lo.options.rpc) == {a.endpoint, b.endpoint}
    est = await sched.estimate(model, OPTS.replace(num_gpu=4, num_parallel=2))
    assert not est["same_options"]
    planned = est["estimates"][DETAILED].by_device()
    assert planned.get(a.id, 0) > 0 and planned.get(b.id, 0) > 0, planned
    reloaded = await sched.load(model, OPTS.replace(num_gpu=4, num_parallel=2))
    assert set(by_device(reloaded)) == set(planned), (by_device(reloaded), planned)
