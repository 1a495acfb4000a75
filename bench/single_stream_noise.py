"""What one stream's ours / bare can tell on this machine: the manager, and the child against itself.

``bench/api_overhead.py`` judges one stream's throughput by ours / bare: tokens/s through the
manager over tokens/s from the very child behind it, asked directly. Both sides ask the same
process, so the ratio would be 1 but for the relay, were each request's speed the same; it is
not: the child's own decode rate moves from one request to the next with nothing else running.
How far it moves sets how small a difference a given number of requests can show.

This measures exactly that, on one model and one route, with three sides taking turns request
by request (each triple in a rotated order, so no side is always first after another):

* **ours**: a streamed greedy generation through the manager;
* **bare**: the same request to the manager's child directly (the sampling the manager sends
  it, so that both sample alike, as in ``api_overhead.py``);
* **bare again**: the very same request as bare, a second time. bare again / bare is the null:
  what ours / bare would read if the relay cost nothing.

It prints, for ours / bare and for bare again / bare: the ratio of all tokens over all wall
time (what a user receives: first byte to last, as ``api_overhead.py`` counts it), its 95%
interval from resampling the triples, and the spread of a single pair's ratio; then the
difference of the two ratios with its interval (the relay's cost with the noise of this
machine's requests taken out), and the manager's CPU a token over the whole run.

Usage: ``.venv/bin/python bench/single_stream_noise.py [--model gemma|synthetic] [--route ollama|openai]
[--triples N] [--n-predict N] [--save FILE]``; ``--pool FILE...`` reports saved runs together.
With Gemma, 150 triples of 64 tokens take about 11 minutes on two cores. Figures: bench/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from api_overhead import (  # noqa: E402  (the sides' requests and readers are the main bench's)
    PROMPTS,
    SHAPE,
    Server,
    argv_port,
    child_key,
    cpu_seconds,
    gemma_file,
    machine_times,
    ratio_interval,
    steal_share,
    stream,
    tps_ratio,
)

from jupyter_llama.client import LlamaClient  # noqa: E402
from jupyter_llama.embedded import EmbeddedManager  # noqa: E402
from jupyter_llama.engine.binary import find_engine  # noqa: E402
from jupyter_llama.models.synth import write_synthetic  # noqa: E402

SIDES = ("ours", "bare", "again")
DRAWS = 4000


def rotations(i: int) -> tuple[str, ...]:
    """The order of the sides in triple ``i``: the six orders in turn, so that over every six
    triples each side comes first, second and third twice, and after each other side once."""
    orders = [("ours", "bare", "again"), ("bare", "again", "ours"), ("again", "ours", "bare"),
              ("ours", "again", "bare"), ("again", "bare", "ours"), ("bare", "ours", "again")]
    return orders[i % len(orders)]


def report(rows: list[dict], cpu_us: float | None, steal: float | None) -> None:
    # (the triples as api_overhead's rounds, so that its ratio and paired bootstrap judge them)
    sides = {side: {"rounds": [list(r[side]) for r in rows]} for side in SIDES}
    every = range(len(rows))
    cpu = "-" if cpu_us is None else f"{cpu_us:.0f} us"
    print(f"{len(rows)} triples; steal {'-' if steal is None else f'{steal:.1%}'}; the manager's CPU a token "
          f"(its requests' own work included) {cpu}")
    print(f"{'':22} {'ratio':>7} {'95% interval':>18} {'one pair: sd':>13}")
    for side, words in (("ours", "ours / bare"), ("again", "bare again / bare")):
        pairs = [tps_ratio(sides, [i], side, "bare") for i in every]
        lo, hi = ratio_interval(sides, side, "bare", draws=DRAWS)
        print(f"{words:22} {tps_ratio(sides, every, side, 'bare'):7.4f} {f'[{lo:.4f}, {hi:.4f}]':>18} "
              f"{statistics.stdev(pairs):13.4f}")
    lo, hi = ratio_interval(sides, "ours", "bare", ("again", "bare"), DRAWS)
    diff = tps_ratio(sides, every, "ours", "bare") - tps_ratio(sides, every, "again", "bare")
    print(f"{'ours/bare - null':22} {diff:+7.4f} {f'[{lo:+.4f}, {hi:+.4f}]':>18}")
    rates = [r["bare"][0] / r["bare"][1] for r in rows]
    mean = statistics.fmean(rates)
    spread = statistics.stdev(rates) / mean
    print(f"bare alone: {mean:.1f} tokens/s a request, sd {spread:.1%} from one request to the next")


async def run(args) -> tuple[list[dict], float]:
    engine = find_engine()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        if args.model == "gemma":
            model_file = Path(gemma_file())
        else:
            model_file = tmp / "a.gguf"
            write_synthetic(model_file, SHAPE)
        env = {"JUPYTER_LLAMA_MODELS": str(tmp / "store"), "JUPYTER_LLAMA_SERVER": engine.path,
               "JUPYTER_LLAMA_MAX_LOADED_MODELS": "1"}
        mgr = EmbeddedManager(log_path=str(tmp / "serve.log"), env=env).start()
        try:
            c = LlamaClient(mgr.url, mgr.token)
            c.create("a", files={"a.gguf": c.create_blob(model_file)})
            c.generate("a", "", options={"num_ctx": args.ctx, "num_parallel": args.slots, "num_thread": args.threads},
                       keep_alive="10m", stream=False)
            info = c.log("a", lines=0)
            ours = Server("ours", mgr.port, c.server.headers(), prefix="/llama", model_field="a",
                          relay_pid=mgr.proc.pid)
            bare = Server("bare", argv_port(info["argv"]), {"Authorization": f"Bearer {child_key(info['pid'])}"})
            servers = {"ours": ours, "bare": bare, "again": bare}
            print(f"{engine.version}; {os.cpu_count()} CPUs; {args.model} model; {args.route} route; "
                  f"{args.triples} triples of {args.n_predict} tokens; -t {args.threads}, -np {args.slots}", flush=True)
            for side in ("ours", "bare"):  # warm both paths (connections, the prompt cache)
                await stream(servers[side], args.route, PROMPTS[0], 8)
            rows: list[dict] = []
            cpu0, times0 = cpu_seconds(mgr.proc.pid), machine_times()
            ours_tokens = 0
            for i in range(args.triples):
                prompt = PROMPTS[(i // 6) % len(PROMPTS)]  # (one prompt for each six orders)
                row = {}
                for side in rotations(i):
                    _, wall, tokens = await stream(servers[side], args.route, prompt, args.n_predict)
                    row[side] = (tokens, wall)
                ours_tokens += row["ours"][0]
                rows.append(row)
            cpu = cpu_seconds(mgr.proc.pid) - cpu0
            # (the manager's CPU counts its work for bare's requests too: none, they do not pass it)
            cpu_us = cpu / max(1, ours_tokens) * 1e6
            report(rows, cpu_us, steal_share(times0, machine_times()))
            return rows, cpu_us
        finally:
            mgr.stop()


def pool(paths: list[str]) -> int:
    """The report over the triples of saved runs, which must be of one model and route."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    kinds = {(r["args"]["model"], r["args"]["route"], r["args"]["n_predict"]) for r in runs}
    if len(kinds) != 1:
        print(f"--pool: the runs are of different models, routes or lengths ({sorted(kinds)}): pool one kind at a time",
              file=sys.stderr)
        return 2
    model, route, n = kinds.pop()
    print(f"{len(runs)} runs of the {model} model, {route} route, {n} tokens a request: {', '.join(paths)}")
    cpus = [r["cpu_us"] for r in runs if r.get("cpu_us") is not None]
    report([t for r in runs for t in r["triples"]], statistics.fmean(cpus) if cpus else None, None)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gemma", "synthetic"), default="gemma")
    ap.add_argument("--route", choices=("ollama", "openai"), default="ollama")
    ap.add_argument("--triples", type=int, default=150, help="rounds of the three sides (six or more)")
    ap.add_argument("--n-predict", type=int, default=64, help="tokens a request")
    ap.add_argument("--slots", type=int, default=8, help="the child's -np (as api_overhead.py)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="the child's -t")
    ap.add_argument("--ctx", type=int, default=512, help="context per request (num_ctx)")
    ap.add_argument("--save", metavar="FILE", help="write each triple's (tokens, seconds) per side (JSON) to FILE")
    ap.add_argument("--pool", metavar="FILE", nargs="+",
                    help="measure nothing: the triples of runs saved with --save (one model and route), together")
    args = ap.parse_args()
    if args.triples < 6:
        ap.error("--triples: six or more (each of the six orders once)")
    if args.pool:
        return pool(args.pool)
    rows, cpu_us = asyncio.run(run(args))
    if args.save:
        Path(args.save).write_text(json.dumps({"args": vars(args), "triples": rows, "cpu_us": cpu_us}))
        print(f"triples written to {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
