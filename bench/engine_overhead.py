"""What our runner adds on top of talking to llama-server directly.

Side by side in one run, on the same child, alternating, same prompts:

* generation tokens/s through ``Runner.completion`` against a plain httpx stream to the
  same child (goal: ratio >= 0.98);
* time to first token, ours minus plain (goal: median <= 2 ms);
* start-to-ready of ``Runner.start()`` against bare ``llama-server`` started by hand and
  polled on ``/health`` every 5 ms (goal: <= +100 ms).

Usage: ``.venv/bin/python bench/engine_overhead.py [--rounds N]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from jupyter_llama.engine.binary import find_engine
from jupyter_llama.engine.launch import build_argv
from jupyter_llama.engine.runner import Runner, free_port
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.models.synth import SynthShape, write_synthetic

PROMPTS = ["Once upon a time", "The quick brown fox", "In a small village", "Write a poem about"]


async def plain_stream(client: httpx.AsyncClient, url: str, key: str, payload: dict) -> tuple[float, float, int]:
    """Time to first content chunk, generation seconds after it, tokens generated.

    llama-server closes idle keep-alive connections; like the runner, retry once when a
    pooled connection turns out to be closed before any byte came back."""
    try:
        return await _plain_stream(client, url, key, payload)
    except httpx.RemoteProtocolError:
        return await _plain_stream(client, url, key, payload)


async def _plain_stream(client: httpx.AsyncClient, url: str, key: str, payload: dict) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first = None
    n = 0
    async with client.stream("POST", url + "/completion", json=dict(payload, stream=True),
                             headers={"Authorization": f"Bearer {key}"}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("content"):
                first = time.perf_counter()
            if chunk.get("stop"):
                n = chunk["timings"]["predicted_n"]
    end = time.perf_counter()
    return first - t0, end - first, n


async def ours_stream(runner: Runner, payload: dict) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first = None
    n = 0
    async for chunk in runner.completion(**payload):
        if first is None and chunk.get("content"):
            first = time.perf_counter()
        if chunk.get("stop"):
            n = chunk["timings"]["predicted_n"]
    end = time.perf_counter()
    return first - t0, end - first, n


async def bare_start(binary: str, model: Path, options: LoadOptions) -> float:
    port = free_port()
    argv = build_argv(binary, model, options, port=port)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        async with httpx.AsyncClient(trust_env=False) as c:
            while True:
                try:
                    r = await c.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
                    if r.status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError("bare llama-server exited during start")
                await asyncio.sleep(0.005)
    finally:
        proc.terminate()
        proc.wait()


async def ours_start(binary: str, model: Path, options: LoadOptions) -> float:
    r = Runner(model, options, binary=binary)
    t0 = time.perf_counter()
    await r.start()
    dt = time.perf_counter() - t0
    await r.stop()
    return dt


async def main(rounds: int, n_predict: int) -> int:
    engine = find_engine()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_synthetic(Path(tmp) / "bench.gguf", SynthShape(layers=6, embd=384, heads=6, kv_heads=2, seed=3))
        options = LoadOptions(num_ctx=2048, num_parallel=1)
        print(f"engine: {engine.path} ({engine.version})")
        print(f"model: {model.name} {model.stat().st_size / 2**20:.1f} MiB; rounds={rounds}; n_predict={n_predict}")

        runner = Runner(model, options, binary=engine.path)
        await runner.start()
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=None) as client:
                ours, plain = [], []
                for i in range(rounds):
                    payload = {"prompt": PROMPTS[i % len(PROMPTS)], "n_predict": n_predict, "temperature": 0,
                               "ignore_eos": True, "cache_prompt": False}
                    # Alternate which side goes first so drift hits both equally.
                    order = [("ours", None), ("plain", None)] if i % 2 == 0 else [("plain", None), ("ours", None)]
                    for side, _ in order:
                        if side == "ours":
                            ours.append(await ours_stream(runner, payload))
                        else:
                            plain.append(await plain_stream(client, runner.url, runner.api_key, payload))
        finally:
            await runner.stop()

        def tps(rows):
            return statistics.median(n / gen for _, gen, n in rows if gen > 0)

        ttft_ours = statistics.median(t for t, _, _ in ours)
        ttft_plain = statistics.median(t for t, _, _ in plain)
        tps_ours, tps_plain = tps(ours), tps(plain)

        starts_ours, starts_bare = [], []
        for i in range(5):
            if i % 2 == 0:
                starts_bare.append(await bare_start(engine.path, model, options))
                starts_ours.append(await ours_start(engine.path, model, options))
            else:
                starts_ours.append(await ours_start(engine.path, model, options))
                starts_bare.append(await bare_start(engine.path, model, options))
        s_ours, s_bare = statistics.median(starts_ours), statistics.median(starts_bare)

    ratio = tps_ours / tps_plain
    added_ttft_ms = (ttft_ours - ttft_plain) * 1000
    added_start_ms = (s_ours - s_bare) * 1000
    print()
    print(f"{'measure':<34}{'ours':>12}{'plain':>12}{'result':>14}{'goal':>12}")
    print(f"{'generation tokens/s (median)':<34}{tps_ours:>12.1f}{tps_plain:>12.1f}"
          f"{f'ratio {ratio:.3f}':>14}{'>= 0.98':>12}")
    print(f"{'time to first token ms (median)':<34}{ttft_ours * 1000:>12.2f}{ttft_plain * 1000:>12.2f}"
          f"{f'+{added_ttft_ms:.2f} ms':>14}{'<= 2 ms':>12}")
    print(f"{'start to ready ms (median of 5)':<34}{s_ours * 1000:>12.1f}{s_bare * 1000:>12.1f}"
          f"{f'+{added_start_ms:.1f} ms':>14}{'<= 100 ms':>12}")
    ok = ratio >= 0.98 and added_ttft_ms <= 2 and added_start_ms <= 100
    print("\nall goals met" if ok else "\nsome goals missed (see above)")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--n-predict", type=int, default=64)
    a = ap.parse_args()
    sys.exit(asyncio.run(main(a.rounds, a.n_predict)))
