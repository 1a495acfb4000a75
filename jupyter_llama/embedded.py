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
import tempfile

from .client import ServerInfo, ServerNotFound
from .engine.runner import free_port

START_TIMEOUT = 60.0



class EmbeddedManager:
    """A private ``jupyter-llama serve`` owned by this process."""

    def __init__(self, log_path: str | None = None, env: dict[str, str] | None = None):
        """``env``: settings for it (``JUPYTER_LLAMA_*``). Its Jupyter runtime folder (where
        its ``jpserver-*.json`` goes, and its entry on the board where a user's managers count
        each other's memory) is ``JUPYTER_RUNTIME_DIR`` when ``env`` gives it, else a private
        folder of its own, removed when it stops: then no other tool finds it (``jupyter-llama
        ps`` in a terminal goes on talking to the user's own manager) and it counts only its
        own models, so a lesson's budget means the same whatever else runs."""
        self.extra_env = dict(env or {})
        self.own_runtime_dir: str | None = None  # the private one made at start, removed at stop
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
        runtime_dir = self.extra_env.get("JUPYTER_RUNTIME_DIR")
        if runtime_dir is None:
            runtime_dir = self.own_runtime_dir = tempfile.mkdtemp(prefix="jupyter-llama-embedded-runtime-")
        atexit.register(self.stop)  # never outlive the interpreter that started it
        runtime = {"JUPYTER_RUNTIME_DIR": runtime_dir}
        try:
            self.proc = start_serve(self.port, self.token, self.log_path, what="embedded jupyter-llama manager",
                                    tied=True, extra_env={**self.extra_env, **runtime}, timeout=timeout)
        except ManagerStartFailed as e:
            raise ServerNotFound(str(e)) from None
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the server stops every runner), then SIGKILL if it lingers."""
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.own_runtime_dir is not None:
            shutil.rmtree(self.own_runtime_dir, ignore_errors=True)
            self.own_runtime_dir = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
