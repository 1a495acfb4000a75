"""Twenty users' clients at once against one shared model, through a real JupyterHub.

Starts a JupyterHub on loopback ports with configurable-http-proxy and `jupyter-llama serve`
as its service (tests/hub/hubutil.py), makes USERS users through the Hub's REST API, and
has each send REQUESTS streamed generations of the same small model at once, at most
CONCURRENT of them in flight per user (their quota 'concurrent', which a well-behaved
client keeps to). The model has SLOTS slots, so most requests wait in the service's fair
queue. Prints, per run:

* the slowest user's median time to first token over the fastest user's (fair queueing
  keeps it near 1; the issue's bar is 2);
* requests lost (no answer, an error, a stream without its last line): must be 0;
* requests refused by a quota (429/507), and the refusals the service counted: must be 0.

Exits 1 when a request was lost or a quota refused one; skips (exit 0, saying why) without
JupyterHub, configurable-http-proxy (``make hub-deps``) or an engine.

    .venv/bin/python bench/hub_fairness.py [--users 20] [--requests 4] [--slots 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "hub"))

import httpx  # noqa: E402
from hubutil import missing, start_hub  # noqa: E402


async def one_user(hub, user: str, token: str, requests: int, concurrent: int, predict: int, out: dict) -> None:
    """``requests`` streamed generations, ``concurrent`` at a time; each one's first-token time."""
    limits = asyncio.Semaphore(concurrent)
    record = out[user] = {"first": [], "lost": 0, "refused": 0, "errors": []}
    timeout = httpx.Timeout(connect=30.0, read=300.0, write=30.0, pool=None)
    async with httpx.AsyncClient(base_url=hub.service_url, headers={"Authorization": f"token {token}"},
                                 timeout=timeout, trust_env=False,
                                 limits=httpx.Limits(max_connections=concurrent + 1)) as client:
        async def ask(i: int) -> None:
            async with limits:
                body = {"model": "shared", "prompt": f"{user} asks, {i}",
                        "options": {"num_predict": predict, "num_ctx": 512, "seed": i}}
                t0 = time.monotonic()
                first = None
                try:
                    async with client.stream("POST", "api/generate", json=body) as r:
                        if r.status_code in (429, 507):
                            record["refused"] += 1
                            record["errors"].append((await r.aread()).decode(errors="replace")[:200])
                            return
                        if r.status_code != 200:
                            record["lost"] += 1
                            record["errors"].append(f"{r.status_code} {(await r.aread())[:200]!r}")
                            return
                        done = False
                        async for line in r.aiter_lines():
                            if not line:
                                continue
                            chunk = json.loads(line)
                            if "error" in chunk:
                                record["errors"].append(chunk["error"][:200])
                                break
                            if first is None:
                                first = time.monotonic() - t0
                            done = done or bool(chunk.get("done"))
                        if not done:
                            record["lost"] += 1
                            return
                except httpx.HTTPError as e:
                    record["lost"] += 1
                    record["errors"].append(f"{type(e).__name__}: {e}")
                    return
                record["first"].append(first)

        await asyncio.gather(*(ask(i) for i in range(requests)))


async def run(hub, users: list[str], tokens: dict[str, str], args) -> dict:
    out: dict[str, dict] = {}
    await asyncio.gather(*(one_user(hub, u, tokens[u], args.requests, args.concurrent, args.predict, out)
                           for u in users))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--requests", type=int, default=4, help="requests per user")
    p.add_argument("--concurrent", type=int, default=2, help="each user's quota 'concurrent', which clients keep to")
    p.add_argument("--slots", type=int, default=2, help="the model's slots (num_parallel)")
    p.add_argument("--predict", type=int, default=16, help="tokens per answer")
    p.add_argument("--timeout", type=float, default=600.0, help="the whole run's bound, in seconds")
    args = p.parse_args(argv)

    why = missing()
    if why is not None:
        print(f"hub_fairness: skipped: {why}")
        return 0
    from jupyter_llama.engine.binary import EngineBroken, EngineNotFound, find_engine
    from jupyter_llama.models.store import ModelStore
    from jupyter_llama.models.synth import SynthShape, write_synthetic

    try:
        engine = find_engine()
    except (EngineNotFound, EngineBroken) as e:
        print(f"hub_fairness: skipped: no llama-server ({e}); `jupyter-llama engine build` makes one")
        return 0
    with tempfile.TemporaryDirectory(prefix="hub-fairness-") as tmp:
        root = Path(tmp)
        gguf = write_synthetic(root / "shared.gguf",
                               SynthShape(layers=4, embd=128, heads=4, kv_heads=2, ctx=2048, seed=7))
        ModelStore(root / "models").create("shared", str(gguf))
        users = [f"user{i:02d}" for i in range(args.users)]
        quotas = {"default": {"concurrent": args.concurrent, "models": 1}}
        hub = start_hub(root / "hub", engine_path=engine.path, models_dir=root / "models",
                        service_config={"admin_users": ["admin"], "quotas": quotas},
                        service_env={"JUPYTER_LLAMA_NUM_PARALLEL": str(args.slots)})
        try:
            hub.add_users(users + ["admin"])
            tokens = {u: hub.token(u) for u in users}
            with hub.client("admin") as admin:  # the model loads once, before the clock starts
                r = admin.post("api/generate", json={"model": "shared", "prompt": "", "options": {"num_ctx": 512}})
                assert r.status_code == 200, r.text
            t0 = time.monotonic()
            out = asyncio.run(asyncio.wait_for(run(hub, users, tokens, args), args.timeout))
            wall = time.monotonic() - t0
            with hub.client("admin") as admin:
                metrics = admin.get("metrics").text
        finally:
            hub.stop()
    medians = {u: statistics.median(r["first"]) for u, r in out.items() if r["first"]}
    lost = sum(r["lost"] for r in out.values())
    refused = sum(r["refused"] for r in out.values())
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("jupyter_llama_refusals_total{"))
    total = args.users * args.requests
    print(f"hub_fairness: {args.users} users x {args.requests} streamed requests ({args.predict} tokens), "
          f"{args.concurrent} at a time per user, one shared model with {args.slots} slots, through the Hub's proxy")
    print(f"  wall time: {wall:.1f}s for {total} requests")
    if medians:
        slow, fast = max(medians.values()), min(medians.values())
        print(f"  median first token per user: fastest {fast * 1000:.0f} ms, slowest {slow * 1000:.0f} ms; "
              f"slowest / fastest = {slow / fast:.2f} (the issue's bar: at most 2)")
    print(f"  requests lost: {lost}")
    print(f"  refused by a quota: {refused} (the service counted {counted:.0f})")
    for u, r in sorted(out.items()):
        for e in r["errors"][:2]:
            print(f"    {u}: {e}")
    return 1 if lost or refused or counted else 0


if __name__ == "__main__":
    sys.exit(main())
