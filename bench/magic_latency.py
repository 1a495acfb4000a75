"""What the `%llama` magic costs over talking to the API with httpx yourself, side by side.

* ``%llama ps`` round trip against ``GET api/ps`` with httpx (goal: magic median <= 50 ms);
* ``%llama run`` time to the first displayed chunk against the first NDJSON chunk of the same
  ``POST api/generate`` with httpx (goal: <= +20 ms median).

Both talk to the same manager: a `jupyter-llama serve` started for the bench.
Usage: ``.venv/bin/python bench/magic_latency.py [--rounds N]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

import httpx
from IPython.core.displaypub import DisplayPublisher
from IPython.core.interactiveshell import InteractiveShell

from jupyter_llama.embedded import EmbeddedManager
from jupyter_llama.engine.binary import find_engine


class FirstDisplay(DisplayPublisher):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.first: float | None = None

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False):
        if self.first is None:
            self.first = time.perf_counter()


def main(rounds: int) -> int:
    engine = find_engine()
    with tempfile.TemporaryDirectory() as tmp:
        m = EmbeddedManager(log_path=os.path.join(tmp, "serve.log"),
                            env={"JUPYTER_LLAMA_MODELS": tmp, "JUPYTER_LLAMA_SERVER": engine.path,
                                 "JUPYTER_LLAMA_KEEP_ALIVE": "-1"})
        m.start(timeout=180)
        try:
            os.environ.update(m.client_env())
            sh = InteractiveShell.instance()
            pub = FirstDisplay(shell=sh)
            sh.display_pub = pub
            sh.run_line_magic("load_ext", "jupyter_llama")
            quiet = contextlib.redirect_stdout(io.StringIO())
            with quiet:
                sh.run_line_magic("llama", "synth bench --layers 4 --embd 256 --heads 4 --kv-heads 2")
                sh.run_line_magic("llama", "load bench --num-ctx 1024 --keep-alive -1")
            http = httpx.Client(base_url=m.url, headers={"Authorization": f"token {m.token}"}, trust_env=False,
                                timeout=60)
            body = {"model": "bench", "prompt": "Once upon a time", "options": {"num_ctx": 1024, "num_predict": 8}}

            ps_magic, ps_http, first_magic, first_http = [], [], [], []
            for i in range(rounds):
                for side in (("magic", "http") if i % 2 == 0 else ("http", "magic")):
                    if side == "magic":
                        t0 = time.perf_counter()
                        with contextlib.redirect_stdout(io.StringIO()):
                            sh.run_line_magic("llama", "ps")
                        ps_magic.append(time.perf_counter() - t0)
                        pub.first = None
                        t0 = time.perf_counter()
                        with contextlib.redirect_stdout(io.StringIO()):
                            sh.run_line_magic("llama", "run bench 'Once upon a time' --num-ctx 1024 --num-predict 8")
                        first_magic.append(pub.first - t0)
                    else:
                        t0 = time.perf_counter()
                        http.get("api/ps").raise_for_status()
                        ps_http.append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        with http.stream("POST", "api/generate", json=body) as r:
                            for line in r.iter_lines():
                                if line and json.loads(line).get("response"):
                                    first_http.append(time.perf_counter() - t0)
                                    break
            http.close()
        finally:
            m.stop()

    med = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    added = med(first_magic) - med(first_http)
    print(f"engine: {engine.path}; rounds={rounds}")
    print(f"{'measure':<36}{'magic':>10}{'httpx':>10}{'result':>14}{'goal':>12}")
    print(f"{'ps round trip, ms (median)':<36}{med(ps_magic):>10.2f}{med(ps_http):>10.2f}"
          f"{f'{med(ps_magic):.2f} ms':>14}{'<= 50 ms':>12}")
    print(f"{'run: first chunk shown, ms (median)':<36}{med(first_magic):>10.2f}{med(first_http):>10.2f}"
          f"{f'+{added:.2f} ms':>14}{'<= +20 ms':>12}")
    ok = med(ps_magic) <= 50 and added <= 20
    print("all goals met" if ok else "some goals missed (see above)")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    sys.exit(main(ap.parse_args().rounds))
