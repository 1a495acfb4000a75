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
import signal
import subprocess
import tempfile
import threading

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
        self.log_path = log_path  # None: chosen as it starts (see :meth:`start`)
        self.proc: subprocess.Popen | None = None

    @property
    def info(self) -> ServerInfo:
        return ServerInfo(self.url, self.token, "embedded")

    def client_env(self) -> dict[str, str]:
        """Environment variables that point a client (a CLI, a kernel) at this manager."""
        return {"JUPYTER_LLAMA_URL": self.url, "JUPYTER_LLAMA_TOKEN": self.token}

    def start(self, timeout: float = START_TIMEOUT) -> "EmbeddedManager":
        from .background import ManagerStartFailed, start_serve

        if self.log_path is None:  # a folder of its own that only this user can enter, named at random (a fixed
            # name in the shared temporary folder is one another user could have made first)
            self.log_path = os.path.join(tempfile.mkdtemp(prefix="jupyter-llama-embedded-"), "manager.log")
        atexit.register(self.stop)  # never outlive the interpreter that started it
        try:
            self.proc = start_serve(self.port, self.token, self.log_path, what="embedded jupyter-llama manager",
                                    tied=True, extra_env=self.extra_env, timeout=timeout)
        except ManagerStartFailed as e:
            raise ServerNotFound(str(e)) from None
        return self

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
