"""A soak: minutes of mixed traffic against a real ``jupyter-llama serve``, then what it left.

Not run by CI or the test suite. It starts its own manager (``EmbeddedManager``, as users'
scripts do) over a fresh store with 4 synthetic models and a cap of 2 loaded models, so loads
and evictions happen all the time, and for ``--minutes`` (default 30) runs beside each other:

* ``--clients`` clients (default 4), each in a loop: generate and chat, streamed and one-shot,
  and embed, on a random model of the 4;
* an admin: copies and deletes, pulls from a local file host (a small HTTP server of this
  script, with Range and ETag), show and tags;
* bad requests now and then (unknown model, broken JSON, a wrong digest, bad options...): each
  must get a 4xx, never a 5xx;
* a killer: now and then SIGKILL of a runner's llama-server (its PID from ``api/ps``, killed
  only while it is a process of this soak's manager).

It prints at the start and at the end the manager's RSS and open files (from /proc/<pid>),
then the requests served, the errors by kind (status and the message with names and numbers
blanked out), whether any client error got a 5xx, and the manager's processes left once it
has stopped (must be 0; any left are named and killed).

It kills only its own processes: the manager it started, and the processes it recorded as
the manager's descendants (each second, and just before the stop), each by its PID *and*
its start time (``procs.descendants``, ``procs.signal_recorded``). A PID alone is not
enough: after thousands of runners PIDs come round again, and a soak run as root would kill
whoever had the number by then. A llama-server over this soak's store that it has no record
of is named, not killed.

Usage: ``.venv/bin/python bench/soak.py [--minutes N] [--clients N] [--seed N]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_llama.embedded import EmbeddedManager  # noqa: E402
from jupyter_llama.engine.binary import find_engine  # noqa: E402
from jupyter_llama.models.synth import SynthShape, write_synthetic  # noqa: E402
from jupyter_llama.procs import descendants, process_alive, signal_recorded, start_time  # noqa: E402

MODELS = [f"soak{i}" for i in range(4)]
SHAPE = dict(layers=2, embd=64, heads=4, kv_heads=2, ctx=2048)  # 0.7 MB: loads in a blink on one core
OPTS = {"num_ctx": 1024, "num_parallel": 2, "num_thread": 1}
PROMPTS = ["Once upon a time", "The quick brown fox", "In a small village", "Write a poem about"]


# ============================================================================ a file host


# The suite's own file host (Range, ETag), which counts what it sent.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "server"))
from srvutil import FileHost  # noqa: E402

# ============================================================================ bookkeeping


def proc_stats(pid: int) -> dict:
    """RSS (bytes) and open file descriptors of a process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def fmt_stats(s: dict) -> str:
    return f"RSS {s['rss'] / 2**20:.1f} MiB, {s['fds']} open files"


_BLANKS = [(re.compile(r'"[^"]*"'), '"…"'), (re.compile(r"'[^']*'"), "'…'"),
           (re.compile(r"sha256[:-][0-9a-f]{6,64}"), "sha256:…"), (re.compile(r"/[\w./@%+-]+"), "/…"),
           (re.compile(r"\b\d[\d,.]*\b"), "N"), (re.compile(r"\bsoak\d\b|\bcopy-\d+\b|\bpulled-\d+\b"), "NAME")]


def message_class(msg: str) -> str:
    """A message with its names, paths, digests and numbers blanked out (one kind of error)."""
    msg = (msg.strip().splitlines() or [""])[0]
    for rx, sub in _BLANKS:
        msg = rx.sub(sub, msg)
    return msg[:110]


class Stats:
    def __init__(self):
        self.served = 0
        self.ok = collections.Counter()  # op -> count
        self.errors = collections.Counter()  # (status, class) -> count
        self.examples: dict[tuple, str] = {}
        self.client_5xx: list[str] = []  # a bad request answered with a 5xx: a bug
        self.kills = 0
        self.pids_seen: set[int] = set()
        self.records: set[tuple[int, int]] = set()  # (PID, start time) of every process of the manager seen
        self.ops = collections.Counter()

    def error(self, op: str, status, msg: str) -> None:
        key = (status, message_class(msg))
        self.errors[key] += 1
        self.examples.setdefault(key, f"{op}: " + " | ".join(msg.strip().splitlines()[:2])[:300])


# ============================================================================ traffic


async def check(stats: Stats, op: str, r: httpx.Response | None, body: bytes = b"", status=None, msg="") -> bool:
    """Count one answered request; True when it succeeded."""
    stats.served += 1
    stats.ops[op] += 1
    if r is None:
        stats.error(op, status, msg)
        return False
    if r.status_code >= 400:
        try:
            err = json.loads(body or r.content).get("error")
            err = err.get("message") if isinstance(err, dict) else err
        except ValueError:
            err = (body or r.content)[:200].decode(errors="replace")
        stats.error(op, r.status_code, str(err))
        return False
    stats.ok[op] += 1
    return True


async def streamed(c: httpx.AsyncClient, stats: Stats, op: str, path: str, body: dict) -> None:
    """A streamed request: an ``error`` line mid-stream counts as an error of kind "stream"."""
    try:
        async with c.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                await check(stats, op, r, await r.aread())
                return
            last = None
            async for line in r.aiter_lines():
                if line.strip():
                    last = line
            ev = json.loads(last) if last else {}
            if "error" in ev:
                await check(stats, op, None, status="stream", msg=str(ev["error"]))
            elif not (ev.get("done") or ev.get("status") == "success"):
                await check(stats, op, None, status="stream", msg=f"the stream ended without done: {last!r:.100}")
            else:
                await check(stats, op, r, b"{}")
    except (httpx.HTTPError, ValueError) as e:
        await check(stats, op, None, status=type(e).__name__, msg=str(e) or type(e).__name__)


async def oneshot(c: httpx.AsyncClient, stats: Stats, op: str, method: str, path: str, **kw) -> httpx.Response | None:
    try:
        r = await c.request(method, path, **kw)
    except httpx.HTTPError as e:
        await check(stats, op, None, status=type(e).__name__, msg=str(e) or type(e).__name__)
        return None
    await check(stats, op, r)
    return r


async def client_loop(c: httpx.AsyncClient, stats: Stats, rng: random.Random, deadline: float) -> None:
    while time.monotonic() < deadline:
        model = rng.choice(MODELS)
        opts = dict(OPTS, num_predict=rng.randint(4, 24))
        prompt = rng.choice(PROMPTS)
        kind = rng.choice(["gen-stream", "gen", "chat-stream", "chat", "embed", "gen-stream", "chat-stream"])
        if kind.startswith("gen"):
            body = {"model": model, "prompt": prompt, "raw": True, "options": opts, "stream": kind == "gen-stream"}
            if kind == "gen-stream":
                await streamed(c, stats, kind, "api/generate", body)
            else:
                await oneshot(c, stats, kind, "POST", "api/generate", json=body)
        elif kind.startswith("chat"):
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "options": opts,
                    "stream": kind == "chat-stream"}
            if kind == "chat-stream":
                await streamed(c, stats, kind, "api/chat", body)
            else:
                await oneshot(c, stats, kind, "POST", "api/chat", json=body)
        else:
            await oneshot(c, stats, kind, "POST", "api/embed",
                          json={"model": model, "input": [prompt, prompt[::-1]], "options": OPTS})


BAD = [
    ("unknown model", "POST", "api/generate", {"json": {"model": "no-such-model", "prompt": "x"}}),
    ("broken json", "POST", "api/generate", {"content": b'{"model": "soak0", "prompt": '}),
    ("messages not a list", "POST", "api/chat", {"json": {"model": "soak0", "messages": "hi"}}),
    ("bad option", "POST", "api/generate", {"json": {"model": "soak0", "prompt": "x", "options": {"num_ctx": "lots"}}}),
    ("copy of nothing", "POST", "api/copy", {"json": {"source": "no-such-model", "destination": "x"}}),
    ("delete of nothing", "DELETE", "api/delete", {"json": {"model": "no-such-model"}}),
    ("wrong digest", "POST", "api/blobs/sha256:" + "0" * 64, {"content": b"not these bytes"}),
    ("bad digest", "POST", "api/blobs/sha256:xyz", {"content": b"x"}),
    ("bad name", "POST", "api/show", {"json": {"model": "a b c::"}}),
    ("missing upstream", "POST", "api/pull", {"json": {"model": "PULLHOST/missing.gguf", "destination": "y",
                                                       "stream": False}}),
    ("unknown route", "GET", "api/nope", {}),
]


async def bad_loop(c: httpx.AsyncClient, stats: Stats, rng: random.Random, deadline: float, host: FileHost) -> None:
    while time.monotonic() < deadline:
        await asyncio.sleep(rng.uniform(0.5, 2.0))
        what, method, path, kw = rng.choice(BAD)
        if "json" in kw and "PULLHOST" in json.dumps(kw["json"]):
            kw = {"json": json.loads(json.dumps(kw["json"]).replace("PULLHOST", host.url))}
        r = await oneshot(c, stats, f"bad: {what}", method, path, **kw)
        if r is not None and r.status_code >= 500:
            stats.client_5xx.append(f"{what}: {r.status_code} {r.text[:200]}")
        elif r is not None and r.status_code < 400:
            stats.client_5xx.append(f"{what}: accepted ({r.status_code}) {r.text[:200]}")


async def admin_loop(c: httpx.AsyncClient, stats: Stats, rng: random.Random, deadline: float, host: FileHost) -> None:
    n = 0
    while time.monotonic() < deadline:
        await asyncio.sleep(rng.uniform(1.0, 4.0))
        n += 1
        act = rng.choice(["copy", "pull", "show", "tags"])
        if act == "copy":
            name = f"copy-{n}"
            r = await oneshot(c, stats, "copy", "POST", "api/copy",
                              json={"source": rng.choice(MODELS), "destination": name})
            if r is not None and r.status_code == 200:
                if rng.random() < 0.5:  # use it once, then delete it (it is unloaded first)
                    await oneshot(c, stats, "gen (copy)", "POST", "api/generate",
                                  json={"model": name, "prompt": "Once", "raw": True, "stream": False,
                                        "options": dict(OPTS, num_predict=4)})
                await oneshot(c, stats, "delete", "DELETE", "api/delete", json={"model": name})
        elif act == "pull":
            name = f"pulled-{n}"
            await streamed(c, stats, "pull", "api/pull",
                           {"model": f"{host.url}/p{rng.randint(0, 1)}.gguf", "destination": name})
            await oneshot(c, stats, "delete", "DELETE", "api/delete", json={"model": name})
        elif act == "show":
            await oneshot(c, stats, "show", "POST", "api/show", json={"model": rng.choice(MODELS)})
        else:
            await oneshot(c, stats, "tags", "GET", "api/tags")


async def killer_loop(c: httpx.AsyncClient, stats: Stats, rng: random.Random, deadline: float,
                      every: float, manager: int) -> None:
    while time.monotonic() < deadline:
        await asyncio.sleep(rng.uniform(every * 0.5, every * 1.5))
        try:
            ps = (await c.get("api/ps")).json()["models"]
        except (httpx.HTTPError, ValueError, KeyError):
            continue
        pids = [m["pid"] for m in ps if m.get("pid")]
        stats.pids_seen.update(pids)
        if pids and time.monotonic() < deadline:
            pid = rng.choice(pids)
            started = descendants(manager).get(pid)  # None: no process of the manager's has it now
            if started is not None:
                stats.records.add((pid, started))
                if signal_recorded(pid, started, signal.SIGKILL):
                    stats.kills += 1


async def watch_loop(c: httpx.AsyncClient, stats: Stats, deadline: float, pid: int, t0: float) -> None:
    """Runner PIDs seen (loads), the manager's processes (a record to clean up by), and a line
    of progress a minute."""
    last = time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        stats.records.update(descendants(pid).items())
        try:
            for m in (await c.get("api/ps")).json()["models"]:
                if m.get("pid"):
                    stats.pids_seen.add(m["pid"])
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.monotonic() - last >= 60:
            last = time.monotonic()
            print(f"  {(last - t0) / 60:4.1f} min: {stats.served} requests, {sum(stats.errors.values())} errors, "
                  f"{stats.kills} kills, {len(stats.pids_seen)} runners seen; manager {fmt_stats(proc_stats(pid))}",
                  flush=True)


# ============================================================================ the run


def program(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def our_llama_servers(store: Path) -> list[int]:
    """Every live llama-server whose model lies in this soak's store, whoever its parent is
    (to name what outlived the manager; such a process is killed only by its record)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0].decode(errors="replace")) == "llama-server" and \
                any(str(store).encode() in a for a in argv) and process_alive(int(d)):
            out.append(int(d))
    return out


async def run(args) -> int:
    engine = find_engine()
    tmp = Path(tempfile.mkdtemp(prefix="jupyter-llama-soak-"))
    store = tmp / "store"
    files = tmp / "files"
    files.mkdir()
    for i, _name in enumerate(MODELS):
        write_synthetic(files / f"m{i}.gguf", SynthShape(seed=100 + i, **SHAPE))
    for i in range(2):
        write_synthetic(files / f"p{i}.gguf", SynthShape(seed=200 + i, **SHAPE))
    env = {"JUPYTER_LLAMA_MODELS": str(store), "JUPYTER_LLAMA_SERVER": engine.path,
           "JUPYTER_LLAMA_MAX_LOADED_MODELS": str(args.max_loaded), "JUPYTER_LLAMA_KEEP_ALIVE": "30s"}
    mgr = EmbeddedManager(log_path=str(tmp / "serve.log"), env=env)
    mgr.start(timeout=180)
    pid = mgr.proc.pid
    rng = random.Random(args.seed)
    stats = Stats()
    left: list[str] = []  # "PID program" of each process of the manager left, killed
    unrecorded: list[int] = []
    print(f"soak: {args.minutes:g} min, {len(MODELS)} models, at most {args.max_loaded} loaded, "
          f"{args.clients} clients, a runner killed every ~{args.kill_every:g}s; engine {engine.path}; "
          f"store {store}", flush=True)
    try:
        with FileHost({f"/p{i}.gguf": files / f"p{i}.gguf" for i in range(2)}) as host:
            async with httpx.AsyncClient(base_url=mgr.url, headers={"Authorization": f"token {mgr.token}"},
                                         timeout=httpx.Timeout(180.0), trust_env=False,
                                         limits=httpx.Limits(max_connections=64)) as c:
                for i, name in enumerate(MODELS):  # uploaded and created as an Ollama client does
                    data = (files / f"m{i}.gguf").read_bytes()
                    digest = "sha256:" + hashlib.sha256(data).hexdigest()
                    r = await c.post(f"api/blobs/{digest}", content=data)
                    assert r.status_code == 201, r.text
                    r = await c.post("api/create", json={"model": name, "files": {f"m{i}.gguf": digest},
                                                         "stream": False})
                    assert r.status_code == 200, r.text
                r = await c.post("api/generate", json={"model": MODELS[0], "prompt": "hi", "raw": True,
                                                       "stream": False, "options": dict(OPTS, num_predict=2)})
                assert r.status_code == 200, r.text
                start = proc_stats(pid)
                print(f"start: manager pid {pid}: {fmt_stats(start)}", flush=True)
                t0 = time.monotonic()
                deadline = t0 + args.minutes * 60
                tasks = [client_loop(c, stats, random.Random(rng.random()), deadline) for _ in range(args.clients)]
                tasks += [admin_loop(c, stats, random.Random(rng.random()), deadline, host),
                          bad_loop(c, stats, random.Random(rng.random()), deadline, host),
                          killer_loop(c, stats, random.Random(rng.random()), deadline, args.kill_every, pid),
                          watch_loop(c, stats, deadline, pid, t0)]
                await asyncio.gather(*tasks)
                elapsed = time.monotonic() - t0
                end = proc_stats(pid)
                r = await c.get("api/ps")
                loaded = [m["name"] for m in r.json()["models"]]
    finally:
        if mgr.proc is not None and mgr.proc.poll() is None:
            stats.records.update(descendants(pid).items())  # the last record, while they are still its
        mgr.stop(timeout=30)
        if mgr.proc is not None and mgr.proc.poll() is None:
            mgr.proc.kill()  # (Popen's own: it will not signal a PID it has reaped)
        # what outlived the manager: the processes recorded as its, if each is still the one
        # recorded (PID and start time); a llama-server over this store without a record is named
        for p, started in sorted(stats.records):
            if process_alive(p) and start_time(p) == started:
                name = program(p)  # (read before it is killed: for the report)
                if signal_recorded(p, started, signal.SIGKILL):
                    left.append(f"{p} {name}")
        killed = {int(w.split()[0]) for w in left}
        unrecorded = sorted(set(our_llama_servers(store)) - killed)
    print(f"end:   manager pid {pid}: {fmt_stats(end)}  (RSS {'+' if end['rss'] >= start['rss'] else ''}"
          f"{(end['rss'] - start['rss']) / 2**20:.1f} MiB, open files {end['fds'] - start['fds']:+d})")
    print(f"ran {elapsed / 60:.1f} min; loaded at the end: {', '.join(loaded) or 'none'}")
    errors = sum(stats.errors.values())
    print(f"requests served: {stats.served} ({stats.served - errors} ok, {errors} errors); "
          f"runners seen: {len(stats.pids_seen)}, killed: {stats.kills}; file host sent {host.sent / 1e6:.1f} MB")
    print("by operation: " + ", ".join(f"{op} {stats.ok[op]}/{n}" for op, n in sorted(stats.ops.items())))
    print("errors by kind (status, message class) x count:")
    for (status, cls), n in sorted(stats.errors.items(), key=lambda kv: (-kv[1], str(kv[0]))):
        print(f"  {status!s:>6}  x{n:<5} {cls}")
    fivexx = {k: n for k, n in stats.errors.items() if isinstance(k[0], int) and k[0] >= 500}
    print(f"5xx answers: {sum(fivexx.values())}" + ("" if not fivexx else " (examples below)"))
    for k in fivexx:
        print(f"    {stats.examples[k]}")
    print("5xx (or success) for a client error: " + ("none" if not stats.client_5xx else
                                                     f"{len(stats.client_5xx)}: " + "; ".join(stats.client_5xx[:5])))
    print(f"processes of the manager left after it stopped: {len(left)}" +
          (f" (killed, each by its PID and start time: {', '.join(left)})" if left else ""))
    if unrecorded:
        print(f"llama-servers over this soak's store with no record of being the manager's, left alone: {unrecorded}")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"kept {tmp} (serve.log there)")
    return 1 if left or unrecorded or stats.client_5xx else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-loaded", type=int, default=2)
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between runner kills, about")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the store and the manager's log")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
