"""Silent connections against ``jupyter-llama serve``, past its descriptor limit: is a client
still served, and how much did the manager log and spend?

Not run by CI. It starts a real ``serve`` (no model needed) with a descriptor limit of
``--descriptors`` (soft and hard, default 1024, a common soft limit), then, in one run:

1. baseline: ``--requests`` authenticated ``GET api/version`` one after another, timed;
2. flood: opens ``--flood`` silent connections (default 4 x the descriptor limit) as fast as
   it can, each sending nothing, and keeps them open, while a second thread sends the same
   requests; every ``--check-every`` connections the flood pauses for nothing;
3. prints per phase: requests answered 200, failed (and how), median and 95th percentile
   latency, then the manager's log size and lines, its CPU seconds during the flood, and
   its open descriptors at the end.

Before the connection cap the flood made ``accept`` fail for lack of descriptors: the
manager spun a core, logged every failed accept, and clients timed out. A ratio of the flood
median to the baseline median is printed; judge it over several runs.

Usage: ``.venv/bin/python bench/slowloris.py [--descriptors N] [--flood N] [--requests N]``
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jupyter_llama.engine.runner import free_port  # noqa: E402

TOKEN = "slowloris-bench-token"


def start_serve(tmp: Path, descriptors: int) -> tuple[subprocess.Popen, int, Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_LLAMA_", "JPY_"))}
    home = tmp / "home"
    env.update(JUPYTER_LLAMA_MODELS=str(tmp / "models"), HOME=str(home), JUPYTER_CONFIG_DIR=str(home / "config"),
               JUPYTER_DATA_DIR=str(home / "data"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               JUPYTER_PLATFORM_DIRS="1")
    port = free_port()
    log_path = tmp / "serve.log"

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))

    with open(log_path, "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "jupyter_llama.server.serve", "--port", str(port),
                              "--token", TOKEN, "--allow-root", "--no-browser"], env=env, stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=limit, cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise SystemExit("serve exited:\n" + log_path.read_text())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/llama/api/version", headers=auth(), timeout=2,
                         trust_env=False).status_code == 200:
                return p, port, log_path
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    p.kill()
    raise SystemExit("serve did not answer within 60 s")


def auth() -> dict:
    return {"Authorization": f"token {TOKEN}"}


def timed_requests(port: int, n: int, stop: threading.Event | None = None) -> dict:
    """``n`` requests, each on a fresh connection (what a client meeting a busy server does)."""
    times, failures = [], {}
    for _ in range(n):
        if stop is not None and stop.is_set():
            break
        t = time.perf_counter()
        try:
            status = httpx.get(f"http://127.0.0.1:{port}/llama/api/version", headers=auth(), timeout=10,
                               trust_env=False).status_code
            if status == 200:
                times.append(time.perf_counter() - t)
            else:
                failures[str(status)] = failures.get(str(status), 0) + 1
        except httpx.HTTPError as e:
            failures[type(e).__name__] = failures.get(type(e).__name__, 0) + 1
    return {"times": times, "failures": failures}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(name: str, r: dict) -> str:
    t = sorted(r["times"])
    if not t:
        return f"{name:9} answered 0, failed {r['failures']}"
    p95 = t[min(len(t) - 1, int(0.95 * len(t)))]
    return (f"{name:9} answered {len(t):4}, failed {sum(r['failures'].values()):3} {r['failures'] or ''}  "
            f"median {statistics.median(t) * 1e3:7.2f} ms  p95 {p95 * 1e3:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--descriptors", type=int, default=1024)
    ap.add_argument("--flood", type=int, default=None, help="silent connections (default 4 x descriptors)")
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    flood = args.flood or 4 * args.descriptors
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < flood + 64:
        raise SystemExit(f"this process may open {hard} descriptors; the flood needs {flood + 64}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory() as tmp:
        p, port, log_path = start_serve(Path(tmp), args.descriptors)
        try:
            base = timed_requests(port, args.requests)
            log_before = log_path.stat().st_size
            cpu_before = cpu_seconds(p.pid)
            sockets: list[socket.socket] = []
            result: dict = {}
            stop = threading.Event()
            client = threading.Thread(target=lambda: result.update(timed_requests(port, args.requests, stop)))
            client.start()
            refused = 0
            started = time.monotonic()
            for _ in range(flood):
                try:
                    sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:
                    refused += 1
            flood_s = time.monotonic() - started
            client.join(120)
            stop.set()
            cpu = cpu_seconds(p.pid) - cpu_before
            log_text = log_path.read_text(errors="replace")[log_before:]
            fds = len(os.listdir(f"/proc/{p.pid}/fd"))
            for s in sockets:
                s.close()
        finally:
            p.kill()
            p.wait(10)
    print(f"serve with {args.descriptors} descriptors; {flood} silent connections opened in {flood_s:.1f} s "
          f"({refused} refused at connect)")
    print(summary("baseline", base))
    print(summary("flood", result))
    if base["times"] and result.get("times"):
        ratio = statistics.median(result['times']) / statistics.median(base['times'])
        print(f"flood median / baseline median: {ratio:.2f}")
    print(f"log during the flood: {len(log_text)} bytes, {len(log_text.splitlines())} lines; "
          f"'Too many open files': {log_text.count('Too many open files')}")
    print(f"serve CPU during the flood: {cpu:.2f} s; descriptors open at the end: {fds} of {args.descriptors}")


if __name__ == "__main__":
    main()
