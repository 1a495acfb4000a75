"""What a shell user waits for: the CLI against a bare HTTP call to the same manager.

With the user's background manager (its own state directory here, so nothing else is found):

* cold start: the first `jupyter-llama status` with no manager running (it starts the
  background manager) against `python -c pass` + the same call once it runs; goal <= 2 s;
* `jupyter-llama ps` with the manager running, wall time of the whole command, against one
  `GET /llama/api/ps` from a fresh `python -c` with only httpx imported; goal <= 0.3 s;
* the first token of `jupyter-llama run MODEL PROMPT` for a loaded model, from the command's
  start to the first byte it prints, against a streamed `POST /llama/api/generate` by
  `curl` (time to its first byte); goal <= 0.3 s;
* `jupyter-llama run` twice: the second reuses the loaded model (the manager's load
  events are counted).

Usage: .venv/bin/python bench/cli_latency.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_llama import background  # noqa: E402
from jupyter_llama.engine.binary import find_engine  # noqa: E402

CLI = [sys.executable, "-m", "jupyter_llama.cli"]


def wall(argv, env, first_byte: bool = False) -> float:
    """Seconds from spawning ``argv`` to its exit, or to the first byte of its stdout."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    if first_byte:
        p.stdout.read(1)
        t = time.perf_counter() - t0
        p.stdout.read()
        p.wait()
        return t
    p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"{argv} exited with {p.returncode}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    engine = find_engine()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("JUPYTER_LLAMA_URL", "JUPYTER_LLAMA_TOKEN")}
        env.update(JUPYTER_LLAMA_MODELS=f"{tmp}/models", JUPYTER_LLAMA_SERVER=engine.path,
                   JUPYTER_RUNTIME_DIR=f"{tmp}/runtime", JUPYTER_LLAMA_MANAGER_DIR=f"{tmp}/manager",
                   JUPYTER_LLAMA_KEEP_ALIVE="10m")
        os.environ.update({k: env[k] for k in ("JUPYTER_RUNTIME_DIR", "JUPYTER_LLAMA_MANAGER_DIR")})
        try:
            python = wall([sys.executable, "-c", "pass"], env)
            cold = wall(CLI + ["status"], env)
            st = background.find()
            warm_status = statistics.median(wall(CLI + ["status"], env) for _ in range(args.rounds))
            print(f"cold start (first `jupyter-llama status`, starts the manager): {cold:.2f} s "
                  f"(python itself {python:.2f} s; the same command once it runs {warm_status:.2f} s); "
                  f"goal <= 2 s: {'ok' if cold <= 2 else 'MISSED'}")
            ok &= cold <= 2
            subprocess.run(CLI + ["synth", "bench", "--layers", "4", "--embd", "256"], env=env, check=True,
                           capture_output=True)
            headers = f"Authorization: token {st.token}"
            bare_ps = [sys.executable, "-c", f"import httpx; httpx.get({st.url + 'api/ps'!r}, "
                                             f"headers={{'Authorization': 'token {st.token}'}}, trust_env=False)"]
            ps = statistics.median(wall(CLI + ["ps"], env) for _ in range(args.rounds))
            bare = statistics.median(wall(bare_ps, env) for _ in range(args.rounds))
            print(f"`jupyter-llama ps`, manager running: {ps:.3f} s; a bare GET api/ps from python+httpx "
                  f"{bare:.3f} s; ratio {ps / bare:.2f}; goal <= 0.3 s: {'ok' if ps <= 0.3 else 'MISSED'}")
            ok &= ps <= 0.3
            run = CLI + ["run", "bench", "Once upon a time", "--num-predict", "16"]
            wall(run, env)  # loads it
            first = statistics.median(wall(run, env, first_byte=True) for _ in range(args.rounds))
            body = json.dumps({"model": "bench", "prompt": "Once upon a time", "options": {"num_predict": 16}})
            curl = ["curl", "-sN", "-H", headers, "-d", body, st.url + "api/generate"]
            bare_first = statistics.median(wall(curl, env, first_byte=True) for _ in range(args.rounds))
            print(f"first token of `jupyter-llama run` (model loaded): {first:.3f} s; curl's first byte of the "
                  f"same generate {bare_first:.3f} s; ratio {first / bare_first:.2f}; goal <= 0.3 s: "
                  f"{'ok' if first <= 0.3 else 'MISSED'}")
            ok &= first <= 0.3
            events = json.loads(subprocess.run(CLI + ["explain", "bench", "--json"], env=env, capture_output=True,
                                               text=True).stdout)
            loads = sum(1 for e in events if e.get("kind") == "load")
            print(f"`jupyter-llama run` {args.rounds + 1} times: the model was loaded {loads} time(s) "
                  f"(goal: once): {'ok' if loads == 1 else 'MISSED'}")
            ok &= loads == 1
        finally:
            background.stop()
    print("all goals met" if ok else "some goals missed (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
