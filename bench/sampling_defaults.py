"""What Ollama's sampling defaults cost in the child, on a real model: llama-server alone.

The manager sends its child Ollama's defaults for every sampling option a request leaves
unset (``api.options.OLLAMA_SAMPLING_DEFAULTS``; the OpenAI routes with temperature and
top_p 1), as Ollama does, so that a client samples as it would against Ollama. Among them is
a repeat penalty over the last 64 tokens, which llama-server's own defaults leave off. In
llama.cpp's order of samplers the penalty looks up every token of the vocabulary before
top-k narrows them, so its cost grows with the vocabulary (Gemma 3's is 262k); the manager
sends the order with top-k first. This bench asks one llama-server (no manager between) for
the same greedy generations with llama-server's defaults, with Ollama's values in
llama.cpp's order, and with them in the manager's order, taking turns, at 1 and at 8
concurrent streams, and prints each side's tokens/s as the child reports them (its
``timings``) and the ratios. No goal: it says what the defaults cost, which
bench/api_overhead.py keeps out of its comparison by sending every side the same.

    .venv/bin/python bench/sampling_defaults.py [--rounds 4] [--n-predict 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from jupyter_llama.api.options import OLLAMA_SAMPLING_DEFAULTS  # noqa: E402
from jupyter_llama.engine.binary import EngineBroken, EngineNotFound, find_engine  # noqa: E402
from jupyter_llama.engine.runner import free_port  # noqa: E402

PROMPT = "Once upon a time"
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "List of prime numbers: 2, 3, 5,",
           "The the the the the"]
STREAMS = 8


async def tokens_per_second(client: httpx.AsyncClient, url: str, sampling: dict, n: int) -> float:
    body = {"prompt": PROMPT, "n_predict": n, "ignore_eos": True, **sampling, "temperature": 0}
    r = await client.post(url, json=body, timeout=600)
    r.raise_for_status()
    return float(r.json()["timings"]["predicted_per_second"])


async def measure(url: str, rounds: int, n: int) -> dict[str, list[float]]:
    values = {k: v for k, v in OLLAMA_SAMPLING_DEFAULTS.items() if k != "samplers"}
    sides = {"llama-server's": {}, "Ollama's": values, "Ollama's, top-k first": dict(OLLAMA_SAMPLING_DEFAULTS)}
    out: dict[str, list[float]] = {f"{s} {k}": [] for s in sides for k in ("1", str(STREAMS))}
    async with httpx.AsyncClient(trust_env=False) as client:
        await tokens_per_second(client, url, {}, 4)  # (warm: the prompt's cache, the first allocations)
        for i in range(rounds):
            order = list(sides.items())[i % len(sides):] + list(sides.items())[:i % len(sides)]
            for name, sampling in order:
                out[f"{name} 1"].append(await tokens_per_second(client, url, sampling, n))
                each = await asyncio.gather(*(tokens_per_second(client, url, sampling, n) for _ in range(STREAMS)))
                out[f"{name} {STREAMS}"].append(sum(each))
        # Do the two orders choose alike? Greedy answers to a few prompts, compared.
        alike = 0
        for prompt in PROMPTS:
            texts = []
            for sampling in (sides["Ollama's"], sides["Ollama's, top-k first"]):
                body = {"prompt": prompt, "n_predict": 128, **sampling, "temperature": 0}
                texts.append((await client.post(url, json=body, timeout=600)).json()["content"])
            alike += texts[0] == texts[1]
        out["alike"] = [float(alike)]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--n-predict", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    try:
        engine = find_engine()
    except (EngineNotFound, EngineBroken) as e:
        print(f"sampling_defaults: skipped: no llama-server ({e}); `jupyter-llama engine build` makes one")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from api_overhead import gemma_file  # (installs the model's package when absent)

    port = free_port()
    child = subprocess.Popen([engine.path, "-m", gemma_file(), "--host", "127.0.0.1", "--port", str(port),
                              "-c", "4096", "-np", str(STREAMS), "-t", str(args.threads)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                print(f"sampling_defaults: llama-server did not start (exit {child.poll()})")
                return 1
            time.sleep(0.1)
        out = asyncio.run(measure(f"http://127.0.0.1:{port}/completion", args.rounds, args.n_predict))
    finally:
        child.terminate()
        child.wait(30)
    print(f"sampling_defaults: Gemma 3 270M Q4_K_M, one llama-server ({args.threads} threads, {STREAMS} slots), "
          f"greedy, {args.n_predict} tokens a stream, {args.rounds} rounds taking turns")
    for k in ("1", str(STREAMS)):
        theirs = out[f"llama-server's {k}"]
        print(f"  {k} stream(s): tokens/s with llama-server's defaults {statistics.mean(theirs):.1f}")
        for side in ("Ollama's", "Ollama's, top-k first"):
            ours = out[f"{side} {k}"]
            print(f"    with {side} {statistics.mean(ours):.1f}: / llama-server's = "
                  f"{statistics.mean(ours) / statistics.mean(theirs):.3f} (rounds: "
                  f"{', '.join(f'{o / t:.3f}' for o, t in zip(ours, theirs, strict=True))})")
    print(f"  greedy answers of 128 tokens to {len(PROMPTS)} prompts, the same in both orders: "
          f"{int(out['alike'][0])} of {len(PROMPTS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
