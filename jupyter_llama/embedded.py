"""An embedded manager for places with no Jupyter server (plain IPython, VS Code, scripts, the CLI).

It is the same code and the same API: ``jupyter-llama serve`` started as a child of the
current process on a free loopback port with a random token (passed in the environment,
never on the command line). It dies with its owner: it is stopped at interpreter exit, and
started under ``setpriv --pdeathsig`` so even a SIGKILL of the owner takes it (and, through
the runners' own parent-death signal, every llama-server) down.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from .client import ServerInfo, ServerNotFound
from .engine.runner import free_port

START_TIMEOUT = 60.0

_lock = threading.Lock()
_current: "EmbeddedManager | None" = None


class EmbeddedManager:
    """A private ``jupyter-llama serve`` owned by this process."""

    def __init__(self, log_path: str | None = None, env: dict[str, str] | None = None):
        self.extra_env = dict(env or {})
        self.port = free_port()
        self.token = secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{self.port}/llama/"
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"jupyter-llama-embedded-{os.getpid()}.log")
        self.proc: subprocess.Popen | None = None

    @property
    def info(self) -> ServerInfo:
        return ServerInfo(self.url, self.token, "embedded")

    def client_env(self) -> dict[str, str]:
        """Environment variables that point a client (a CLI, a kernel) at this manager."""
        return {"JUPYTER_LLAMA_URL": self.url, "JUPYTER_LLAMA_TOKEN": self.token}

    def start(self, timeout: float = START_TIMEOUT) -> "EmbeddedManager":
        argv = [sys.executable, "-m", "jupyter_llama.server.serve", "--ip", "127.0.0.1", "--port", str(self.port),
                "--log-level", "WARN"]
        if os.geteuid() == 0:
            argv.append("--allow-root")
        setpriv = shutil.which("setpriv")
        if setpriv:
            argv = [setpriv, "--pdeathsig", "TERM", "--", *argv]
        env = dict(os.environ, **self.extra_env, JUPYTER_TOKEN=self.token)
        env.pop("JUPYTER_LLAMA_URL", None)  # it must not try to find itself
        atexit.register(self.stop)  # never outlive the interpreter that started it
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False, timeout=2.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerNotFound(f"the embedded jupyter-llama manager exited at start (code "
                                         f"{self.proc.returncode}); its log: {self.log_path}\n{self._tail()}")
                try:
                    r = c.get(self.url + "api/version", headers={"Authorization": f"token {self.token}"})
                    if r.status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise ServerNotFound(f"the embedded jupyter-llama manager did not answer within {timeout:.0f}s; "
                             f"its log: {self.log_path}")

    def _tail(self, n: int = 10) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the server stops every runner), then SIGKILL if it lingers."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def embedded(start: bool = True) -> EmbeddedManager | None:
    """This process's embedded manager, started on first use."""
    global _current
    with _lock:
        if _current is not None and _current.running:
            return _current
        if not start:
            return None
        _current = EmbeddedManager().start()
        return _current


def stop_embedded() -> None:
    global _current
    with _lock:
        if _current is not None:
            _current.stop()
            _current = None
