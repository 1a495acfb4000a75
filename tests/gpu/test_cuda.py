"""The device path on a real NVIDIA GPU: a CUDA build of llama-server, real children, NVML.

Marked ``gpu``: each test skips, saying why, unless the engine in use is a CUDA build that
sees a CUDA device and NVML lists a GPU (`bench/gpu_check.sh` builds that engine and runs
these on a GPU machine). Every figure a test measures is also written to the file named by
``JUPYTER_LLAMA_GPU_FIGURES`` (one JSON object per line), which gpu_check.sh prints as its
table.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from jupyter_llama.engine.binary import gpu_devices
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory import devices as devmod
from jupyter_llama.memory.report import DETAILED, HOST, MiB
from jupyter_llama.procs import process_alive
from jupyter_llama.scheduler import Scheduler, SchedulerSettings

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

GPU = "cuda:0"
# About 230 MB of f16 weights in 9 offloadable layers (8 blocks and the output).
SHAPE = dict(layers=8, embd=1024, heads=16, kv_heads=4, ctx=4096, seed=11)
OPTS = LoadOptions(num_ctx=2048, num_parallel=1)


@pytest.fixture(scope="module")
def cuda_engine(engine):
    if engine.backend != "cuda":
        pytest.skip(f"the engine in use is not a CUDA build ({engine.reason or engine.path}); "
                    "`jupyter-llama engine build --cuda` on a machine with an NVIDIA GPU makes one")
    if not gpu_devices(engine.path, "cuda"):
        pytest.skip(f"the CUDA build sees no CUDA device: {engine.reason}")
    if not devmod.list_gpus():
        pytest.skip(f"NVML lists no GPU ({devmod.last_gpu_error})")
    return engine


@pytest.fixture
def record(request):
    """``record(**figures)``: one line of gpu_check.sh's table for this test."""
    path = os.environ.get("JUPYTER_LLAMA_GPU_FIGURES")

    def write(**figures):
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.name, **figures}) + "\n")

    return write


@pytest.fixture
async def make_scheduler(cuda_engine):
    made: list[Scheduler] = []

    def make(budgets: dict[str, int] | None = None, **settings) -> Scheduler:
        s = SchedulerSettings(binary=cuda_engine.path, budgets=devmod.Budgets(limits=dict(budgets or {})),
                              keep_alive=60.0, **settings)
        made.append(Scheduler(s))
        return made[-1]

    yield make
    for sched in made:
        await sched.shutdown()
        for ev in sched.events.history:
            if ev.data.get("pid"):
                assert not process_alive(ev.data["pid"])


@pytest.fixture
def model(make_model):
    return str(make_model("gpumodel", **SHAPE))


def _gpu_used_by(pid: int) -> int | None:
    """NVML's memory figure for one process on GPU 0 (None where NVML hides processes, as in
    some containers)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid and p.usedGpuMemory:
                return int(p.usedGpuMemory)
        return None
    finally:
        pynvml.nvmlShutdown()


def _gpu0_used() -> int:
    return next(g.used for g in devmod.list_gpus() if g.id == GPU)


async def test_full_offload_puts_every_layer_and_the_cache_on_the_gpu(make_scheduler, model, record):
    sched = make_scheduler()
    lo = await sched.load(model, OPTS.replace(num_gpu=999))
    actual = lo.actual
    assert actual.layers_offloaded == actual.layers_total == SHAPE["layers"] + 1
    used = actual.by_device()
    assert used[GPU] > used.get(HOST, 0), used
    assert actual.total(device=GPU, component="kv") > 0
    async with sched.use(model) as lease:
        text, timings = await lease.runner.complete_text("Once upon a time", n_predict=16)
    record(layers=f"{actual.layers_offloaded}/{actual.layers_total}", gpu_mib=round(used[GPU] / MiB),
           host_mib=round(used.get(HOST, 0) / MiB), decode_tokens_per_s=round(timings.get("predicted_per_second", 0)))


async def test_num_gpu_offloads_exactly_that_many_layers(make_scheduler, model, record):
    sched = make_scheduler()
    lo = await sched.load(model, OPTS.replace(num_gpu=3))
    assert lo.actual.layers_offloaded == 3
    used = lo.actual.by_device()
    assert used[GPU] > 0 and used[HOST] > 0
    full = SHAPE["layers"] + 1
    record(layers=f"3/{full}", gpu_mib=round(used[GPU] / MiB), host_mib=round(used[HOST] / MiB))
    await sched.unload(model)
    lo = await sched.load(model, OPTS.replace(num_gpu=0))
    assert lo.actual.layers_offloaded == 0 and lo.actual.total(device=GPU) == 0


async def test_automatic_fit_under_a_budget_splits_the_model(make_scheduler, model, record):
    sched = make_scheduler()
    whole = (await sched.load(model, OPTS.replace(num_gpu=999))).actual.total(device=GPU)
    await sched.unload(model)
    budget = whole // 2
    sched.settings.budgets = devmod.Budgets(limits={GPU: budget})
    lo = await sched.load(model, OPTS)
    actual = lo.actual
    assert 0 < actual.layers_offloaded < actual.layers_total
    assert actual.total(device=GPU) <= budget
    record(budget_mib=round(budget / MiB), gpu_mib=round(actual.total(device=GPU) / MiB),
           layers=f"{actual.layers_offloaded}/{actual.layers_total}")


async def test_the_logs_cuda0_buffers_against_nvml_for_the_childs_pid(make_scheduler, model, record):
    before = _gpu0_used()
    sched = make_scheduler()
    lo = await sched.load(model, OPTS.replace(num_gpu=999))
    logged = lo.actual.total(device=GPU)
    by_pid = _gpu_used_by(lo.runner.pid)
    by_device = _gpu0_used() - before
    measured = by_pid if by_pid is not None else by_device
    # NVML counts the CUDA context and cuBLAS's workspace as well as ggml's buffers.
    assert measured >= 0.98 * logged, (measured, logged)
    record(log_cuda0_mib=round(logged / MiB), nvml_pid_mib=None if by_pid is None else round(by_pid / MiB),
           nvml_device_delta_mib=round(by_device / MiB), context_and_workspace_mib=round((measured - logged) / MiB))


async def test_the_detailed_estimate_against_actual_vram(make_scheduler, model, record):
    sched = make_scheduler()
    for num_gpu in (999, 4):
        lo = await sched.load(model, OPTS.replace(num_gpu=num_gpu))
        pred, actual = lo.predictions[DETAILED], lo.actual
        for dev in (GPU, HOST):
            p, a = pred.total(device=dev), actual.total(device=dev)
            record(num_gpu=num_gpu, device=dev, estimate_mib=round(p / MiB, 1), actual_mib=round(a / MiB, 1),
                   error_pct=round((p - a) / a * 100, 1) if a else None)
            assert abs(p - a) <= 0.10 * a, (num_gpu, dev, p, a)
        await sched.unload(model)


async def test_a_vram_budget_evicts_the_first_model_for_the_second(make_scheduler, model, make_model, record):
    other = str(make_model("gpumodel2", **{**SHAPE, "seed": 12}))
    sched = make_scheduler()
    one = (await sched.load(model, OPTS.replace(num_gpu=999))).actual.total(device=GPU)
    await sched.unload(model)
    sched.settings.budgets = devmod.Budgets(limits={GPU: int(one * 1.5)})
    lo1 = await sched.load(model, OPTS.replace(num_gpu=999))
    t0 = time.monotonic()
    lo2 = await sched.load(other, OPTS.replace(num_gpu=999))
    swap = time.monotonic() - t0
    evicted = [e for e in sched.events.history if e.kind == "evict"]
    assert [e.model for e in evicted] == [lo1.name], [e.message for e in sched.events.history]
    assert lo2.actual.layers_offloaded == lo2.actual.layers_total
    assert [lo.name for lo in sched.loaded.values()] == [lo2.name]
    record(budget_mib=round(one * 1.5 / MiB), model_mib=round(one / MiB), swap_s=round(swap, 2),
           evicted=len(evicted))


async def test_unload_waits_for_the_gpu_memory_to_come_back(make_scheduler, model, record):
    sched = make_scheduler()
    await sched.load(model, OPTS.replace(num_gpu=999))
    await sched.unload(model)
    rec = [e for e in sched.events.history if e.kind == "recover" and GPU in e.data.get("devices", [])]
    assert rec and rec[-1].data["recovered"], [e.message for e in sched.events.history]
    record(waited_ms=round(rec[-1].data["waited"] * 1000), gained_mib=round(rec[-1].data["gained"][GPU] / MiB))
