"""What the manager costs a client's stream, against the bare child and llama-server's router.

Three servers of the same model file, side by side in one run:

* **ours**: a ``jupyter-llama serve`` (its own process, as users run it) with the model
  loaded under fixed options; streamed through ``/llama/api/generate`` (NDJSON) and
  ``/llama/v1/chat/completions`` (SSE);
* **bare**: a llama-server started by hand with exactly our child's command line (read back
  from ``GET /llama/api/log``), streamed through its ``/completion`` and
  ``/v1/chat/completions``;
* **router**: llama-server's own router mode (``--models-dir`` over the same files, the same
  flags, ``--models-max 1``), through the same two routes with the ``model`` field.

The client is this process, with one lean HTTP/1.1 reader for all three (it parses every
line's JSON, as any client must, and counts the lines that carry text). What it times is
what a user receives: from sending the request to the first text (time to first token) and
to the last byte (the stream's wall time). Rounds alternate the order of the sides.

* tokens/s = all tokens / all wall time, for 1 stream and for 8 concurrent streams (the
  child has 8 slots); goals: ours >= 0.97 x bare and >= the router's ratio;
* added time to first token (median, against bare); goals: <= the router's + 2 ms (1
  stream), <= 10 ms (8 streams);
* model swap with room for one model (A loaded, B requested, a one-token answer): ours
  against stopping the bare child A and starting B by hand (SIGTERM, wait, spawn, poll
  ``/health`` every 5 ms, one token); goal <= 1.10; the router's swap is shown beside it;
* with ``--workers`` (the default) all of it again with the model on two RPC workers
  (ggml-rpc-server on loopback, the same two for every side).

Usage: ``.venv/bin/python bench/api_overhead.py [--rounds N] [--n-predict N] [--no-workers]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_llama.client import LlamaClient  # noqa: E402
from jupyter_llama.embedded import EmbeddedManager  # noqa: E402
from jupyter_llama.engine.binary import find_engine  # noqa: E402
from jupyter_llama.engine.http1 import post_lines  # noqa: E402
from jupyter_llama.engine.runner import child_pids, free_port, process_alive  # noqa: E402
from jupyter_llama.engine.worker import LocalWorker  # noqa: E402
from jupyter_llama.models.synth import SynthShape, write_synthetic  # noqa: E402

# 24 MB f16, 4 blocks 512 wide: a token every ~1 ms on one core, where the relay shows most
SHAPE = SynthShape(layers=4, embd=512, heads=8, kv_heads=8, ctx=2048, type="f16")
PROMPTS = ["Once upon a time", "The quick brown fox", "In a small village", "Write a poem about"]
SIDES = ("ours", "bare", "router")
ROUTES = ("ollama", "openai")


# ============================================================================ one stream


@dataclass
class Server:
    """Where one side listens and how its routes are called."""

    name: str
    port: int
    headers: dict[str, str] = field(default_factory=dict)
    prefix: str = ""  # ours: /llama
    model_field: str | None = None  # ours and the router route by the body's model
    relay_pid: int | None = None  # the process between the client and the child (none for bare)
    up: Callable[[], Awaitable[None]] | None = None  # bring this side up before its turn (workers)
    down: Callable[[], Awaitable[None]] | None = None

    def request(self, route: str, prompt: str, n: int) -> tuple[str, dict]:
        """(path, body) for a streamed greedy generation of ``n`` tokens."""
        if route == "ollama" and self.name == "ours":
            return self.prefix + "/api/generate", {
                "model": self.model_field, "prompt": prompt, "raw": True, "stream": True,
                "options": {"num_predict": n, "temperature": 0, "ignore_eos": True}}
        if route == "ollama":
            body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "stream": True}
            path = "/completion"
        else:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            path = self.prefix + "/v1/chat/completions"
        if self.model_field:
            body["model"] = self.model_field
        return path, body


def _text(route: str, server: str, line: bytes) -> bool:
    """Whether a line of the answer carries generated text."""
    if route == "ollama" and server == "ours":
        return bool(line) and bool(json.loads(line).get("response"))
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return False
    ev = json.loads(line[6:])
    if route == "ollama":
        return bool(ev.get("content"))
    choices = ev.get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def stream(server: Server, route: str, prompt: str, n: int) -> tuple[float, float, int]:
    """(seconds to the first text, seconds to the end, text chunks) of one streamed request."""
    path, body = server.request(route, prompt, n)
    t0 = time.perf_counter()
    first, count = None, 0
    async for line in post_lines(server.port, path, json.dumps(body).encode(), server.headers):
        if _text(route, server.name, line):
            count += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - t0, end - t0, count


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process so far (from /proc; 10 ms resolution)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def streams_phase(servers: dict[str, Server], rounds: int, n: int, counts=(1, 8)) -> dict:
    """Per route and stream count, per side: tokens/s (all tokens / all wall), median TTFT, and
    the CPU the relaying process (ours: the manager; the router) spent per token.

    Sides take turns in an order that rotates and reverses from round to round. A side with
    ``up``/``down`` (on RPC workers, where a ggml-rpc-server serves one llama-server at a
    time) is brought up before its turn and down after it."""
    acc = {(route, k): {s: {"tokens": 0, "wall": 0.0, "ttft": [], "cpu": 0.0} for s in servers}
           for route in ROUTES for k in counts}
    for i in range(rounds):
        order = list(servers)[i % 3:] + list(servers)[:i % 3]
        if i % 2:
            order.reverse()
        for side in order:
            srv = servers[side]
            if srv.up is not None:
                await srv.up()
            try:
                for route in ROUTES:
                    if i == 0 or srv.up is not None:  # warm the path (connections, prompt cache)
                        await stream(srv, route, PROMPTS[0], 8)
                    for k in counts:
                        prompts = [PROMPTS[(i + j) % len(PROMPTS)] for j in range(k)]
                        c0, t0 = cpu_seconds(srv.relay_pid), time.perf_counter()
                        res = await asyncio.gather(*(stream(srv, route, p, n) for p in prompts))
                        a = acc[(route, k)][side]
                        a["wall"] += time.perf_counter() - t0
                        a["cpu"] += cpu_seconds(srv.relay_pid) - c0
                        a["tokens"] += sum(r[2] for r in res)
                        a["ttft"] += [r[0] for r in res]
            finally:
                if srv.down is not None:
                    await srv.down()
    return {key: {s: {"tps": a["tokens"] / a["wall"], "ttft_ms": statistics.median(a["ttft"]) * 1000,
                      "tokens": a["tokens"], "cpu_us": a["cpu"] / a["tokens"] * 1e6} for s, a in sides.items()}
            for key, sides in acc.items()}


# ============================================================================ processes


class Procs:
    """Every process this bench starts, stopped by its own PID at the end."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        self.procs.append(p)
        return p

    @staticmethod
    def stop(p: subprocess.Popen) -> None:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)


async def wait_health(port: int, proc: subprocess.Popen, every: float = 0.005, timeout: float = 60) -> None:
    """Poll /health until it answers 200 (what a hand-written launcher does)."""
    deadline = time.monotonic() + timeout
    req = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited ({proc.returncode}) before answering /health")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(req)
            status = await reader.readline()
            writer.close()
            if status.split()[1:2] == [b"200"]:
                return
        except (OSError, IndexError):
            pass
        await asyncio.sleep(every)
    raise RuntimeError(f"llama-server on port {port} did not become healthy in {timeout:g}s")


def bare_argv(argv: list[str], port: int) -> list[str]:
    """Our child's command line with another port."""
    out = list(argv)
    out[out.index("--port") + 1] = str(port)
    return out


def router_argv(argv: list[str], models_dir: Path, port: int) -> list[str]:
    """Router mode with our child's flags (its children inherit them) but no model of its own."""
    drop = {"--model", "--port", "--host", "--alias"}
    flags = [x for i, x in enumerate(argv[1:], 1) if x not in drop and argv[i - 1] not in drop]
    return [argv[0], "--models-dir", str(models_dir), "--models-max", "1", "--host", "127.0.0.1",
            "--port", str(port), *flags]


# ============================================================================ swaps


async def one_token(server: Server, model: str | None) -> None:
    body = {"prompt": "Hi", "n_predict": 1, "stream": True}
    if model:
        body["model"] = model
    async for _ in post_lines(server.port, "/completion", json.dumps(body).encode(), server.headers):
        pass


async def swap_phase(ours: Server, load_opts: dict, argvs: dict[str, list[str]], router: Server, procs: Procs,
                     tmp: Path, rounds: int) -> dict:
    """Seconds per swap (median) for ours, bare stop-and-start, and the router; A and B
    alternate, starting from A loaded. Each side has the model to itself while it swaps."""
    ours_s, bare_s, router_s = [], [], []
    target = ["b", "a"]
    if ours.up is not None:
        await ours.up()
    for i in range(rounds):
        body = {"model": target[i % 2], "prompt": "Hi", "raw": True, "stream": False, "keep_alive": "10m",
                "options": dict(load_opts, num_predict=1)}
        t0 = time.perf_counter()
        async for _ in post_lines(ours.port, "/llama/api/generate", json.dumps(body).encode(), ours.headers):
            pass
        ours_s.append(time.perf_counter() - t0)
    if ours.down is not None:
        await ours.down(model=target[(rounds - 1) % 2])
    port = free_port()
    current = procs.start(bare_argv(argvs["a"], port), tmp / "swap.log")
    await wait_health(port, current)
    for i in range(rounds):
        name = target[i % 2]
        t0 = time.perf_counter()
        current.send_signal(signal.SIGTERM)
        await asyncio.to_thread(current.wait)  # a blocking waitpid: Popen.wait(timeout) polls in 50 ms steps
        current = procs.start(bare_argv(argvs[name], port), tmp / "swap.log")
        await wait_health(port, current)
        await one_token(Server("bare", port), None)
        bare_s.append(time.perf_counter() - t0)
    Procs.stop(current)
    if router.up is not None:
        await router.up()
    await one_token(router, "a")
    for i in range(rounds):
        t0 = time.perf_counter()
        await one_token(router, target[i % 2])
        router_s.append(time.perf_counter() - t0)
    if router.down is not None:
        await router.down()
    return {"ours": statistics.median(ours_s), "bare": statistics.median(bare_s), "router": statistics.median(router_s)}


# ============================================================================ one setup


async def measure(engine, tmp: Path, args, workers: tuple[LocalWorker, LocalWorker] | None) -> dict:
    """All three phases for one placement (the host's CPU, or two RPC workers)."""
    models = tmp / "files"
    models.mkdir(exist_ok=True)
    for name, seed in (("a", 1), ("b", 2)):
        if not (models / f"{name}.gguf").exists():
            write_synthetic(models / f"{name}.gguf", SynthShape(**{**SHAPE.__dict__, "seed": seed}))
    env = {"JUPYTER_LLAMA_MODELS": str(tmp / ("store-w" if workers else "store")), "JUPYTER_LLAMA_SERVER": engine.path,
           "JUPYTER_LLAMA_MAX_LOADED_MODELS": "1"}
    if workers:
        env["JUPYTER_LLAMA_RPC_WORKERS"] = ",".join(w.endpoint for w in workers)
    procs = Procs()
    mgr = EmbeddedManager(log_path=str(tmp / "serve.log"), env=env).start()
    try:
        c = LlamaClient(mgr.url, mgr.token)
        for name in ("a", "b"):
            c.create(name, files={f"{name}.gguf": c.create_blob(models / f"{name}.gguf")})
        headers = c.server.headers()
        load_opts = {"num_ctx": args.ctx, "num_parallel": args.slots, "num_thread": args.threads}

        def load(name: str) -> list[str]:
            c.generate(name, "", options=load_opts, keep_alive="10m", stream=False)
            return c.log(name, lines=0)["argv"]

        argvs = {name: load(name) for name in ("b", "a")}  # a stays loaded
        ours = Server("ours", mgr.port, headers, prefix="/llama", model_field="a", relay_pid=mgr.proc.pid)
        bare = Server("bare", free_port())
        router = Server("router", free_port(), model_field="a")
        running: dict[str, subprocess.Popen] = {}

        async def bare_up() -> None:
            running["bare"] = procs.start(bare_argv(argvs["a"], bare.port), tmp / "bare.log")
            await wait_health(bare.port, running["bare"])

        async def router_up() -> None:
            running["router"] = procs.start(router_argv(argvs["a"], models, router.port), tmp / "router.log")
            router.relay_pid = running["router"].pid
            await wait_health(router.port, running["router"])

        async def down(side: str) -> None:
            proc = running.pop(side)
            children = child_pids(proc.pid)  # the router's own children go with it
            Procs.stop(proc)
            for pid in children:
                while process_alive(pid):
                    await asyncio.sleep(0.01)

        if workers:  # one llama-server at a time on the workers: each side comes up for its turn
            async def ours_up() -> None:
                load("a")

            async def ours_down(model: str = "a") -> None:
                c.generate(model, keep_alive=0, stream=False)

            c.generate("a", keep_alive=0, stream=False)
            ours.up, ours.down = ours_up, ours_down
            bare.up, bare.down = bare_up, lambda: down("bare")
            router.up, router.down = router_up, lambda: down("router")
        else:
            await bare_up()
            await router_up()
        res = await streams_phase({"ours": ours, "bare": bare, "router": router}, args.rounds, args.n_predict)
        for side in list(running):
            await down(side)
        if not workers:
            router.up, router.down = router_up, lambda: down("router")
        res["swap"] = await swap_phase(ours, load_opts, argvs, router, procs, tmp, args.swap_rounds)
        res["argv"] = argvs["a"]
        return res
    finally:
        procs.stop_all()
        mgr.stop()


# ============================================================================ report


def report(title: str, res: dict) -> bool:
    ok = True
    print(f"\n## {title}")
    argv = res["argv"]
    print("child: " + " ".join(Path(argv[0]).name if i == 0 else x for i, x in enumerate(argv)
                               if not x.startswith("/") or i == 0))
    head = f"{'route':<7}{'streams':>8}  {'measure':<26}{'ours':>9}{'bare':>9}{'router':>9}  {'result':<34}"
    print(head)
    print("-" * len(head))
    for (route, k), r in ((key, v) for key, v in res.items() if isinstance(key, tuple)):
        o, b, t = r["ours"], r["bare"], r["router"]
        ratio, rratio = o["tps"] / b["tps"], t["tps"] / b["tps"]
        good = ratio >= 0.97 and ratio >= rratio
        ok &= good
        print(f"{route:<7}{k:>8}  {'tokens/s':<26}{o['tps']:>9.0f}{b['tps']:>9.0f}{t['tps']:>9.0f}  "
              f"ours/bare {ratio:.3f}, router/bare {rratio:.3f} {'ok' if good else 'MISSED'}")
        added, radded = o["ttft_ms"] - b["ttft_ms"], t["ttft_ms"] - b["ttft_ms"]
        limit = radded + 2 if k == 1 else 10
        good = added <= limit
        ok &= good
        print(f"{'':<7}{'':>8}  {'time to first token ms':<26}{o['ttft_ms']:>9.2f}{b['ttft_ms']:>9.2f}"
              f"{t['ttft_ms']:>9.2f}  ours {added:+.2f}, router {radded:+.2f} (goal <= {limit:+.2f}) "
              f"{'ok' if good else 'MISSED'}")
        print(f"{'':<7}{'':>8}  {'relay CPU per token us':<26}{o['cpu_us']:>9.0f}{'':>9}{t['cpu_us']:>9.0f}")
    s = res["swap"]
    ratio = s["ours"] / s["bare"]
    good = ratio <= 1.10
    ok &= good
    print(f"{'swap':<7}{'':>8}  {'A loaded, B requested ms':<26}{s['ours'] * 1000:>9.0f}{s['bare'] * 1000:>9.0f}"
          f"{s['router'] * 1000:>9.0f}  ours/bare {ratio:.2f} (goal <= 1.10), router/bare "
          f"{s['router'] / s['bare']:.2f} {'ok' if good else 'MISSED'}")
    return ok


async def main_async(args) -> int:
    engine = find_engine()
    print(f"engine: {engine.path} ({engine.version}); {os.cpu_count()} CPUs; model: synthetic llama "
          f"{SHAPE.layers}x{SHAPE.embd} f16; {args.rounds} rounds of {args.n_predict} tokens per side, "
          f"{args.swap_rounds} swaps")
    ok = True
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        ok &= report("on the host's CPU", await measure(engine, tmp, args, None))
        if args.workers:
            with contextlib.ExitStack() as stack:
                pair = tuple(stack.enter_context(LocalWorker(engine, threads=args.threads)) for _ in range(2))
                ok &= report(f"on two RPC workers ({pair[0].endpoint}, {pair[1].endpoint})",
                             await measure(engine, tmp, args, pair))
    print("\nall goals met" if ok else "\nsome goals missed (see above)")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--swap-rounds", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8, help="the child's -np")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="the child's -t")
    ap.add_argument("--ctx", type=int, default=512, help="context per request (num_ctx)")
    ap.add_argument("--no-workers", dest="workers", action="store_false", help="skip the RPC-worker part")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
