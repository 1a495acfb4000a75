"""What the scheduler adds, side by side with doing the same by hand, in one run.

* Request latency to a warm model: ``scheduler.use(model)`` + one short request, against the
  same request sent to the runner directly (goal: added median <= 1 ms).
* Swapping one model for another (cap of 1 loaded model): ``scheduler.load(B)`` while A is
  loaded, against stopping a bare llama-server for A and starting one for B, polled on
  ``/health`` every 5 ms (goal: <= +10%).

Usage: ``.venv/bin/python bench/scheduler_overhead.py [--rounds N]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from jupyter_llama.engine.binary import find_engine
from jupyter_llama.engine.launch import build_argv
from jupyter_llama.engine.runner import free_port
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.models.synth import SynthShape, write_synthetic
from jupyter_llama.scheduler import Scheduler, SchedulerSettings

OPTS = LoadOptions(num_ctx=512, num_parallel=1)
REQUEST = {"prompt": "Hi", "n_predict": 1, "cache_prompt": False}


async def bare_swap(binary: str, stop_proc: subprocess.Popen | None, model: Path) -> tuple[float, subprocess.Popen]:
    port = free_port()
    argv = build_argv(binary, model, OPTS, port=port)
    t0 = time.perf_counter()
    if stop_proc is not None:
        stop_proc.terminate()
        stop_proc.wait()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    async with httpx.AsyncClient(trust_env=False) as c:
        while True:
            try:
                r = await c.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
                if r.status_code == 200:
                    return time.perf_counter() - t0, proc
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("bare llama-server exited during start")
            await asyncio.sleep(0.005)


async def main(rounds: int, rounds_swap: int = 16) -> int:
    engine = find_engine()
    with tempfile.TemporaryDirectory() as tmp:
        a = write_synthetic(Path(tmp) / "a.gguf", SynthShape(layers=4, embd=256, heads=4, kv_heads=2, seed=1))
        b = write_synthetic(Path(tmp) / "b.gguf", SynthShape(layers=4, embd=256, heads=4, kv_heads=2, seed=2))
        sched = Scheduler(SchedulerSettings(binary=engine.path, max_loaded_models=1))
        try:
            # --- latency through the scheduler to a warm model
            lo = await sched.load(str(a), OPTS)
            runner = lo.runner
            for _ in range(5):  # warm both paths
                await runner.post("/completion", REQUEST)
            via, direct = [], []
            for i in range(rounds):
                for side in (("via", "direct") if i % 2 == 0 else ("direct", "via")):
                    t0 = time.perf_counter()
                    if side == "via":
                        async with sched.use(str(a), OPTS) as lease:
                            await lease.runner.post("/completion", REQUEST)
                        via.append(time.perf_counter() - t0)
                    else:
                        await runner.post("/completion", REQUEST)
                        direct.append(time.perf_counter() - t0)
            added_ms = (statistics.median(via) - statistics.median(direct)) * 1000

            # --- swapping models: ours (evict A, load B) against bare stop-and-start, alternating
            # round by round so that drift in the machine's load hits both sides alike.
            ours, bare = [], []
            models = [str(a), str(b)]
            proc = None
            _, proc = await bare_swap(engine.path, None, Path(models[0]))  # bare side starts with A too
            for i in range(rounds_swap):
                target = models[(i + 1) % 2]
                t0 = time.perf_counter()
                await sched.load(target, OPTS)
                ours.append(time.perf_counter() - t0)
                dt, proc = await bare_swap(engine.path, proc, Path(target))
                bare.append(dt)
            proc.terminate()
            proc.wait()
        finally:
            await sched.shutdown()

    swap_ours, swap_bare = statistics.median(ours), statistics.median(bare)
    swap_ratio = swap_ours / swap_bare
    print(f"engine: {engine.path} ({engine.version}); rounds={rounds}")
    print(f"{'measure':<40}{'ours':>12}{'baseline':>12}{'result':>16}{'goal':>12}")
    print(f"{'request to warm model, ms (median)':<40}{statistics.median(via) * 1000:>12.3f}"
          f"{statistics.median(direct) * 1000:>12.3f}{f'+{added_ms:.3f} ms':>16}{'<= 1 ms':>12}")
    print(f"{f'swap A -> B, ms (median of {len(ours)})':<40}{swap_ours * 1000:>12.1f}{swap_bare * 1000:>12.1f}"
          f"{f'ratio {swap_ratio:.3f}':>16}{'<= 1.10':>12}")
    ok = added_ms <= 1 and swap_ratio <= 1.10
    print("all goals met" if ok else "some goals missed (see above)")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    sys.exit(asyncio.run(main(ap.parse_args().rounds)))
