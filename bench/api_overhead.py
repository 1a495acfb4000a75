"""What the Jupyter server adds on top of talking to the llama-server child directly.

Side by side in one run, alternating, on the same child, same prompts and sampling:

* generation through the Jupyter server (NDJSON ``<base>/llama/api/generate``, with the
  Jupyter token) against requests straight to the child's ``/completion`` (SSE, with the
  child's own API key, which only this process can see: the ServerApp runs in-process so
  the bench can read the runner's URL and key from the scheduler);
* for 1 and for 8 concurrent streams (the child has 8 slots, so both cases use the same
  child): decode tokens/s per stream (tokens after the first / time after the first), the
  aggregate tokens/s (all tokens / wall time), and time to first token.

Goals: tokens/s ratio (server / direct) >= 0.95; added time to first token <= 10 ms median.

The measuring client runs in a separate process (so its own work does not share the
server's interpreter); the server and the child run in this one and its child.

Usage: ``.venv/bin/python bench/api_overhead.py [--rounds N] [--n-predict N] [--model FILE.gguf]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jupyter_llama.engine.runner import free_port

PROMPTS = ["Once upon a time", "The quick brown fox", "In a small village", "Write a poem about"]
SAMPLING = {"temperature": 0, "ignore_eos": True}


# ============================================================================ client (subprocess)


async def _direct(client, child_url: str, key: str, prompt: str, n: int) -> tuple[float, float, int]:
    """(time to first token, seconds after it, tokens) straight from the child."""
    t0 = time.perf_counter()
    first, count = None, 0
    body = {"prompt": prompt, "n_predict": n, "stream": True, **SAMPLING}
    async with client.stream("POST", child_url + "/completion", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("content"):
                count += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    return first - t0, end - first, count


async def _server(client, api: str, token: str, model: str, prompt: str, n: int) -> tuple[float, float, int]:
    """The same through the Jupyter server's Ollama API."""
    t0 = time.perf_counter()
    first, count = None, 0
    body = {"model": model, "prompt": prompt, "raw": True, "options": {"num_predict": n, **SAMPLING}}
    async with client.stream("POST", api + "api/generate", json=body,
                             headers={"Authorization": f"token {token}"}) as r:
        assert r.status_code == 200, (await r.aread())
        async for line in r.aiter_lines():
            if not line:
                continue
            chunk = json.loads(line)
            if chunk.get("response"):
                count += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    return first - t0, end - first, count


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc; 10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def client_main(cfg: dict) -> dict:
    import httpx

    out: dict = {}
    server_pid = cfg["server_pid"]
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(trust_env=False, timeout=None, limits=limits) as client:
        # warm both paths (connections, prompt cache)
        await _direct(client, cfg["child"], cfg["key"], PROMPTS[0], 8)
        await _server(client, cfg["api"], cfg["token"], cfg["model"], PROMPTS[0], 8)
        for streams in cfg["streams"]:
            rows = {"direct": [], "server": []}
            walls = {"direct": [], "server": []}
            server_cpu = 0.0
            for i in range(cfg["rounds"]):
                order = ("direct", "server") if i % 2 == 0 else ("server", "direct")
                for side in order:
                    prompts = [PROMPTS[(i + k) % len(PROMPTS)] for k in range(streams)]
                    t0 = time.perf_counter()
                    if side == "direct":
                        res = await asyncio.gather(*(_direct(client, cfg["child"], cfg["key"], p, cfg["n"])
                                                     for p in prompts))
                    else:
                        c0 = _cpu_seconds(server_pid)
                        res = await asyncio.gather(*(_server(client, cfg["api"], cfg["token"], cfg["model"], p,
                                                             cfg["n"]) for p in prompts))
                        server_cpu += _cpu_seconds(server_pid) - c0
                    wall = time.perf_counter() - t0
                    rows[side] += res
                    walls[side].append(sum(r[2] for r in res) / wall)
            out[str(streams)] = {
                side: {
                    "ttft_ms": statistics.median(r[0] for r in rows[side]) * 1000,
                    "decode_tps": statistics.median((r[2] - 1) / r[1] for r in rows[side] if r[1] > 0),
                    "aggregate_tps": statistics.median(walls[side]),
                    "tokens": statistics.median(r[2] for r in rows[side]),
                } for side in rows
            }
            out[str(streams)]["server_cpu_us_per_token"] = server_cpu / sum(r[2] for r in rows["server"]) * 1e6
        # what one request costs the server before any token: many 1-token requests
        c0 = _cpu_seconds(server_pid)
        n_req = 40
        for i in range(n_req):
            await _server(client, cfg["api"], cfg["token"], cfg["model"], PROMPTS[i % len(PROMPTS)], 1)
        out["server_cpu_ms_per_request"] = (_cpu_seconds(server_pid) - c0) / n_req * 1000
    return out


# ============================================================================ server (this process)




def _print_table(results: dict, meta: dict) -> bool:
    print(f"engine: {meta['engine']}")
    print(f"model: {meta['model_desc']}; child: -np {meta['slots']} -t {meta['threads']}; "
          f"n_predict={meta['n']}; rounds={meta['rounds']}")
    print()
    head = (f"{'streams':>7}  {'measure':<30}{'server':>11}{'direct':>11}{'result':>16}{'goal':>12}")
    print(head)
    print("-" * len(head))
    ok = True
    per_request = results.pop("server_cpu_ms_per_request", None)
    for streams, r in results.items():
        s, d = r["server"], r["direct"]
        ratio = s["decode_tps"] / d["decode_tps"]
        agg = s["aggregate_tps"] / d["aggregate_tps"]
        added = s["ttft_ms"] - d["ttft_ms"]
        ok &= ratio >= 0.95 and added <= 10
        print(f"{streams:>7}  {'decode tokens/s per stream':<30}{s['decode_tps']:>11.1f}{d['decode_tps']:>11.1f}"
              f"{f'ratio {ratio:.3f}':>16}{'>= 0.95':>12}")
        print(f"{'':>7}  {'aggregate tokens/s':<30}{s['aggregate_tps']:>11.1f}{d['aggregate_tps']:>11.1f}"
              f"{f'ratio {agg:.3f}':>16}{'':>12}")
        print(f"{'':>7}  {'time to first token ms':<30}{s['ttft_ms']:>11.2f}{d['ttft_ms']:>11.2f}"
              f"{f'{added:+.2f} ms':>16}{'<= 10 ms':>12}")
        print(f"{'':>7}  {'server CPU per token':<30}{r['server_cpu_us_per_token']:>9.0f}us")
    if per_request is not None:
        print(f"{'':>7}  {'server CPU per request':<30}{per_request:>9.2f}ms  (1-token requests, sequential)")
    print()
    print("all goals met" if ok else "some goals missed (see above)")
    return ok


def server_main(args) -> int:
    from jupyter_server.serverapp import ServerApp

    from jupyter_llama.engine.binary import find_engine
    from jupyter_llama.models.store import ModelStore
    from jupyter_llama.models.synth import SynthShape, write_synthetic

    engine = find_engine()
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    store = ModelStore(root / "models")
    if args.model:
        store.create("bench", args.model)
        desc = Path(args.model).name
    else:
        shape = SynthShape(layers=6, embd=384, heads=6, kv_heads=2, seed=3)
        path = write_synthetic(root / "bench.gguf", shape)
        store.create("bench", path)
        desc = f"synthetic llama 6x384 ({path.stat().st_size / 2**20:.1f} MiB)"
    os.environ.update(JUPYTER_LLAMA_MODELS=str(root / "models"), JUPYTER_CONFIG_DIR=str(root / "config"),
                      JUPYTER_DATA_DIR=str(root / "data"), JUPYTER_RUNTIME_DIR=str(root / "runtime"))
    port, token = free_port(), "bench-token"
    app = ServerApp.instance(jpserver_extensions={"jupyter_llama": True})
    app.initialize(argv=[f"--ServerApp.port={port}", "--ServerApp.ip=127.0.0.1", "--ServerApp.open_browser=False",
                         f"--IdentityProvider.token={token}", "--ServerApp.allow_root=True",
                         "--ServerApp.log_level=WARN", "--ServerApp.base_url=/bench/",
                         f"--LlamaExtension.server_binary={engine.path}"],
                   find_extensions=False)
    ext = app.extension_manager.extension_points["jupyter_llama"].app
    api = f"http://127.0.0.1:{port}/bench/llama/"
    load_opts = {"num_ctx": args.ctx, "num_parallel": args.slots, "num_thread": args.threads}
    state: dict = {"rc": 1}

    async def run() -> None:
        import httpx

        try:
            async with httpx.AsyncClient(trust_env=False, timeout=None) as c:
                r = await c.post(api + "api/generate", json={"model": "bench", "options": load_opts,
                                                             "keep_alive": -1},
                                 headers={"Authorization": f"token {token}"})
                assert r.status_code == 200, r.text
            lo = next(iter(ext.scheduler.loaded.values()))
            cfg = {"api": api, "token": token, "model": "bench", "child": lo.runner.url, "key": lo.runner.api_key,
                   "streams": args.streams, "rounds": args.rounds, "n": args.n_predict, "server_pid": os.getpid()}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--client", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate(json.dumps(cfg).encode())
            if proc.returncode != 0:
                print("client failed", file=sys.stderr)
                return
            results = json.loads(out)
            meta = {"engine": f"{engine.path} ({engine.version})", "model_desc": desc, "slots": args.slots,
                    "threads": args.threads, "n": args.n_predict, "rounds": args.rounds}
            _print_table(results, meta)
            state["rc"] = 0
        finally:
            app.stop()

    app.io_loop.add_callback(run)
    try:
        app.start()
    finally:
        tmp.cleanup()
    return state["rc"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--slots", type=int, default=8, help="the child's -np")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="the child's -t")
    ap.add_argument("--ctx", type=int, default=512, help="context per request (num_ctx)")
    ap.add_argument("--model", help="a GGUF file to use instead of the synthetic one")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        cfg = json.loads(sys.stdin.read())
        print(json.dumps(asyncio.run(client_main(cfg))))
        return 0
    return server_main(args)


if __name__ == "__main__":
    sys.exit(main())
