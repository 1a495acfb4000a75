"""llama.cpp RPC workers (``ggml-rpc-server``) from the built engine.

* :func:`run_worker` is ``jupyter-llama worker``: one worker in the foreground, for this
  machine or another one (where it serves that machine's GPU to a manager elsewhere).
* :class:`LocalWorker` starts one in the background on a loopback port and stops it by its
  PID: what the tests, the benchmarks and the teaching notebooks use to give a machine
  without a GPU real devices (each worker reports its host's memory as its device memory;
  budgets in ``JUPYTER_LLAMA_MEMORY_LIMIT`` make them small).

A worker has no authentication (ggml's RPC protocol has none): whoever reaches its port can
allocate on its device and run graphs there. Loopback is the default; anything else prints a
warning that says so.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import signal
import subprocess
import time
from typing import Callable

from ..memory import rpc
from .binary import Engine
from .runner import _SETPRIV, free_port, _pdeathsig_preexec

UNSAFE_BIND_WARNING = ("warning: ggml's RPC protocol has no authentication and no encryption: anyone who can reach "
                       "{host}:{port} can use this machine's device and read its memory. Expose workers on a "
                       "private network only.")


class WorkerError(RuntimeError):
    def __init__(self, message: str, usage: bool = False):
        super().__init__(message)
        self.usage = usage


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def worker_argv(engine: Engine, *, host: str, port: int, threads: int | None = None, device: str | None = None,
                cache: bool = False) -> list[str]:
    if not engine.worker:
        raise WorkerError(f"this engine ({engine.path}) has no ggml-rpc-server beside it; build one with "
                          "`jupyter-llama engine build --force` (the build now includes the RPC worker)")
    if not 0 < port < 65536:
        raise WorkerError(f"--port {port} is not a port number (1-65535)", usage=True)
    if threads is not None and threads < 1:
        raise WorkerError(f"--threads {threads}: use 1 or more", usage=True)
    argv = [engine.worker, "-H", host, "-p", str(port)]
    if threads:
        argv += ["-t", str(threads)]
    if device:
        argv += ["-d", device]
    if cache:
        argv += ["-c"]
    return argv


def run_worker(engine: Engine, *, host: str = "127.0.0.1", port: int = rpc.DEFAULT_PORT, threads: int | None = None,
               device: str | None = None, cache: bool = False, note: Callable[[str], None] = print) -> int:
    """Run one worker in the foreground until it exits or is interrupted; its exit code."""
    argv = worker_argv(engine, host=host, port=port, threads=threads, device=device, cache=cache)
    if not _is_loopback(host):
        note(UNSAFE_BIND_WARNING.format(host=host, port=port))
    note(f"RPC worker on {host}:{port}; on the manager set JUPYTER_LLAMA_RPC_WORKERS="
         f"{'THIS-HOST' if host in ('0.0.0.0', '::') else host}:{port} (Ctrl-C stops it)")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def _limited(address_space: int, then=None) -> None:  # pragma: no cover - runs in the forked child
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    if then is not None:
        then()


class LocalWorker:
    """A worker on 127.0.0.1 in the background, ready when the constructor returns.

    Use as a context manager (or call :meth:`stop`); it is stopped by its own PID, and it dies
    with the process that started it. ``port`` 0 picks a free port.
    """

    def __init__(self, engine: Engine, port: int = 0, *, threads: int | None = None, log_path: str | None = None,
                 ready_timeout: float = 20.0, address_space: int | None = None):
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.id = rpc.device_id(self.endpoint)
        argv = worker_argv(engine, host="127.0.0.1", port=self.port, threads=threads)
        preexec = None
        if _SETPRIV:
            argv = [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]
        else:  # pragma: no cover - Debian always has setpriv
            preexec = _pdeathsig_preexec
        if address_space is not None:
            # A worker whose allocations beyond ``address_space`` bytes fail, as a full GPU's would
            # (it reports the host's memory all the same): out-of-memory on a device, for tests.
            preexec = functools.partial(_limited, address_space, preexec)
        self._log = open(log_path or os.devnull, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=preexec)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                raise WorkerError(f"ggml-rpc-server exited at once (code {self.proc.returncode}) on {self.endpoint}")
            st = rpc.probe(self.endpoint, timeout=1.0)
            if st.reachable:
                self.status = st
                break
            if time.monotonic() > deadline:
                self.stop()
                raise WorkerError(f"ggml-rpc-server on {self.endpoint} did not answer within {ready_timeout:g}s: "
                                  f"{st.error}")
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the worker stops answering (for fault tests and teaching)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL now, as a crashed machine would go."""
        if self.alive:
            self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 5.0) -> None:
        if self.alive:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> "LocalWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<LocalWorker {self.endpoint} pid={self.proc.pid} {'running' if self.alive else 'stopped'}>"

