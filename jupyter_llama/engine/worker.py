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

import errno
import functools
import ipaddress
import os
import signal
import socket
import subprocess
import time
from typing import Callable

from ..memory import rpc
from ..procs import child_environment, exit_words
from .binary import Engine
from .runner import _SETPRIV, _pdeathsig_preexec, free_port

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


def _port_taken(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port`` (the worker would print that it
    cannot make its socket, and exit 0)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the worker binds: a closing socket is no owner)
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def run_worker(engine: Engine, *, host: str = "127.0.0.1", port: int = rpc.DEFAULT_PORT, threads: int | None = None,
               device: str | None = None, cache: bool = False, note: Callable[[str], None] = print,
               ready_timeout: float = 30.0) -> int:
    """Run one worker in the foreground until it exits or is stopped (Ctrl-C, SIGTERM,
    SIGHUP: the worker is stopped with it, and dies with this process however it ends); 0
    once stopped so, 1 when the worker ended by itself (said with why)."""
    argv = worker_argv(engine, host=host, port=port, threads=threads, device=device, cache=cache)
    if _port_taken(host, port):
        raise WorkerError(f"{host}:{port} is in use (another worker?): stop what listens there, or give this worker "
                          "another --port", usage=True)
    if not _is_loopback(host):
        note(UNSAFE_BIND_WARNING.format(host=host, port=port))
    proc = subprocess.Popen(_with_pdeathsig(argv), stdin=subprocess.DEVNULL, restore_signals=False,
                            preexec_fn=None if _SETPRIV else _pdeathsig_preexec, env=child_environment())
    stopping: list[int] = []

    def stop(signum, _frame) -> None:
        stopping.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)

    # (a hang-up that is ignored, as under nohup, stays ignored: the worker outlives the terminal)
    signals = [signal.SIGTERM] + ([] if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else [signal.SIGHUP])
    before = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        try:
            local = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
            deadline = time.monotonic() + ready_timeout
            while not stopping and proc.poll() is None and not rpc.probe(f"{local}:{port}", timeout=1.0).reachable:
                if time.monotonic() > deadline:
                    break  # (still running: said as started, its own output says the rest)
                time.sleep(0.05)
            if not stopping and proc.poll() is None:
                note(f"RPC worker on {host}:{port}; on the manager set JUPYTER_LLAMA_RPC_WORKERS="
                     f"{'THIS-HOST' if host in ('0.0.0.0', '::') else host}:{port} (Ctrl-C stops it)")
            code = None
            while code is None and not stopping:  # (once told to stop, it is given a while, then killed)
                try:
                    code = proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
        except KeyboardInterrupt:
            stopping.append(signal.SIGINT)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            code = _wait_or_kill(proc)
        if stopping:
            if code is None:
                code = _wait_or_kill(proc)
            return 0
        note(f"the RPC worker on {host}:{port} ended by itself ({exit_words(code)}); its own lines above say why")
        return 1
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _wait_or_kill(proc: subprocess.Popen, timeout: float = 5.0) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _with_pdeathsig(argv: list[str]) -> list[str]:
    """``argv`` run so that it dies with this process, however this process ends."""
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv] if _SETPRIV else argv


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
        argv = _with_pdeathsig(worker_argv(engine, host="127.0.0.1", port=self.port, threads=threads))
        preexec = None if _SETPRIV else _pdeathsig_preexec
        if address_space is not None:
            # A worker whose allocations beyond ``address_space`` bytes fail, as a full GPU's would
            # (it reports the host's memory all the same): out-of-memory on a device, for tests.
            preexec = functools.partial(_limited, address_space, preexec)
        self._log = open(log_path or os.devnull, "ab")
        # restore_signals False: the worker keeps SIGPIPE ignored, as this process has it. With
        # it at its default, a client that gave up (a busy worker's probe times out) killed the
        # worker once it got round to answering it.
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=preexec, restore_signals=False,
                                     env=child_environment())
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                raise WorkerError(f"ggml-rpc-server exited at once ({exit_words(self.proc.returncode)}) on "
                                  f"{self.endpoint}")
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

