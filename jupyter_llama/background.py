"""One manager per user for every place without a Jupyter server: plain IPython, VS Code's
notebooks, scripts and shell commands share it.

It is ``jupyter-llama serve`` on a free loopback port with a random token, started on first
use, detached (it outlives the kernel or command that started it, so ``jupyter-llama run``
twice loads the model once), and it exits by itself once nothing is loaded and nothing has
asked for a while (``JUPYTER_LLAMA_MANAGER_IDLE``, default 10 minutes). Where it is lies in
a state file, readable by this user only, in Jupyter's runtime directory (or
``JUPYTER_LLAMA_MANAGER_DIR``): its URL, token and PID. A lock file makes two first uses at
once start one manager, not two. It runs with the settings (``JUPYTER_LLAMA_*``) of the
process that started it; ``jupyter-llama status`` says which manager a command uses.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal, NamedTuple, overload

import httpx

from .config import ConfigError, env, parse_duration
from .private import open_log, read_trusted, trusted_folder, write_private

__all__ = ["Manager", "ManagerStartFailed", "answers", "ensure", "find", "start_serve", "state_dir", "stop",
           "IDLE_DEFAULT"]

IDLE_DEFAULT = "10m"
START_TIMEOUT = 60.0
STATE_NAME = "jupyter-llama-manager.json"
SOURCE = "background manager"


class Manager(NamedTuple):
    """Where the background manager is (``client.find_server`` makes a ServerInfo of it)."""

    url: str  # its API root, ending in "llama/"
    token: str | None  # (as its state file has it; a manager it started has one)
    pid: int
    source: str  # in words, for `jupyter-llama status`
    unlike: str | None = None  # how its settings differ from this process's (see settings_unlike)


# Settings that say how to find or run the manager, not what it does once running.
_NOT_ITS_SETTINGS = ("JUPYTER_LLAMA_URL", "JUPYTER_LLAMA_TOKEN", "JUPYTER_LLAMA_MANAGER_DIR")


def _settings() -> dict[str, str]:
    """This process's JUPYTER_LLAMA_* settings that a manager started now would take on."""
    return {k: v for k, v in os.environ.items() if k.startswith("JUPYTER_LLAMA_") and k not in _NOT_ITS_SETTINGS}


def settings_unlike(theirs: dict[str, str]) -> str | None:
    """How the settings a running manager was started with (``theirs``) differ from this
    process's, in words (None when they agree). It keeps its own until it is stopped (see
    ``client.find_server`` for what a command does about it)."""
    ours = _settings()
    names = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if not names:
        return None
    said = [f"{k} is {ours[k]!r} here" if k in ours else f"{k} is not set here" for k in names[:4]]
    those = ", ".join(f"{k}={theirs[k]!r}" if k in theirs else f"{k} unset" for k in names[:4])
    more = f" (and {len(names) - 4} more)" if len(names) > 4 else ""
    return f"{'; '.join(said)}{more}, but the background manager runs with {those}"


class ManagerStartFailed(RuntimeError):
    """It could not be started; the message says why and where its log is."""


def state_dir() -> Path:
    """Where the state file lives: ``JUPYTER_LLAMA_MANAGER_DIR``, else Jupyter's runtime directory."""
    chosen = env("MANAGER_DIR")
    if chosen:
        return Path(chosen)
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir())


def _state_path() -> Path:
    return state_dir() / STATE_NAME


def _where() -> str:
    return "JUPYTER_LLAMA_MANAGER_DIR" if env("MANAGER_DIR") else "Jupyter's runtime folder (JUPYTER_RUNTIME_DIR)"


@overload
def _state_folder(make: Literal[True]) -> Path: ...


@overload
def _state_folder(make: bool) -> Path | None: ...


def _state_folder(make: bool) -> Path | None:
    """The state folder, checked to be this user's alone (it holds the manager's token);
    None when it does not exist and ``make`` is False. UntrustedFile (a ConfigError) when
    another user could write or read it."""
    d = state_dir()
    if not make and not os.path.lexists(d):
        return None
    try:
        return trusted_folder(d, secret=True, make=make,
                              purpose=f"the background manager keeps its state in {_where()}; point "
                                      "JUPYTER_LLAMA_MANAGER_DIR at a folder of your own")
    except OSError as e:
        raise ConfigError(f"the background manager keeps its state in {_where()}, {d}, which cannot be made a "
                          f"folder: {e.strerror or e}; point JUPYTER_LLAMA_MANAGER_DIR at a folder you can write") \
            from None


def _read_state() -> dict | None:
    """The state file, when there is one and it is this user's alone (it names the process
    that every command sends its prompts to); UntrustedFile, naming it, otherwise."""
    if _state_folder(make=False) is None:
        return None
    try:
        data = json.loads(read_trusted(_state_path(), secret=True) or "null")
    except ValueError:
        return None
    ok = isinstance(data, dict) and isinstance(data.get("url"), str) and isinstance(data.get("pid"), int)
    return data if ok else None


def _alive(pid: int) -> bool:
    """The state file's process still runs and is a manager (a PID may be reused after an
    idle exit or a reboot: never signal a process that is not ours)."""
    from .procs import process_alive

    if not process_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"jupyter_llama.server.serve" in f.read()
    except OSError:  # no /proc (macOS): the answer to api/version decides
        return True


def answers(url: str, token: str | None, timeout: float = 1.0) -> bool:
    """Whether a jupyter-llama API at ``url`` (ending in ``llama/``) answers with this token."""
    try:
        r = httpx.get(url + "api/version", headers={"Authorization": f"token {token}"} if token else {},
                      timeout=timeout, trust_env=False)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def find() -> Manager | None:
    """The running background manager of this user, if there is one and it answers."""
    st = _read_state()
    if st is None or not _alive(st["pid"]) or not answers(st["url"], st.get("token")):
        return None
    theirs = st.get("settings")
    return Manager(st["url"], st.get("token"), st["pid"], f"{SOURCE} (pid {st['pid']}, state in {_state_path()})",
                   settings_unlike(theirs) if isinstance(theirs, dict) else None)


def ensure(timeout: float = START_TIMEOUT) -> Manager:
    """The background manager, started now if none runs (one start when several ask at once)."""
    from filelock import FileLock, Timeout

    found = find()
    if found is not None:
        return found
    d = _state_folder(make=True)
    idle = parse_duration(env("MANAGER_IDLE") or IDLE_DEFAULT, "JUPYTER_LLAMA_MANAGER_IDLE")  # (said before the lock)
    try:
        with FileLock(str(d / (STATE_NAME + ".lock")), timeout=timeout + 30):
            found = find() or _wait_for_running(timeout)  # another process may have started it meanwhile
            if found is not None:
                return found
            return _start(d, timeout, idle)
    except Timeout:
        raise ManagerStartFailed(f"another process has been starting the background manager for over "
                                 f"{timeout + 30:.0f}s (lock {d / (STATE_NAME + '.lock')}); try again") from None


def _wait_for_running(timeout: float) -> Manager | None:
    """A manager whose process runs but did not answer in time (busy loading a model): wait
    for it rather than start a second one beside it."""
    st = _read_state()
    if st is None or not _alive(st["pid"]):
        return None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(st["pid"]):
        found = find()
        if found is not None:
            return found
        time.sleep(0.2)
    return None


def start_serve(port: int, token: str, log_path: str | os.PathLike, *, what: str, tied: bool,
                extra_argv: tuple[str, ...] = (), extra_env: dict[str, str] | None = None,
                timeout: float = START_TIMEOUT) -> subprocess.Popen:
    """Start ``jupyter-llama serve`` on 127.0.0.1:``port`` with ``token`` (in its environment,
    never on the command line), its output appended to ``log_path``, and return once it
    answers. ``tied``: it dies with this process (``setpriv --pdeathsig``), as the embedded
    manager does; else it outlives it, as the background manager does. ManagerStartFailed
    (naming ``what`` and the log) when it exits or stays silent for ``timeout`` seconds."""
    argv = [sys.executable, "-m", "jupyter_llama.server.serve", "--ip", "127.0.0.1", "--port", str(port),
            "--log-level", "WARN", *extra_argv]
    if os.geteuid() == 0:
        argv.append("--allow-root")
    setpriv = shutil.which("setpriv") if tied else None
    if setpriv:
        argv = [setpriv, "--pdeathsig", "TERM", "--", *argv]
    environ = dict(os.environ, **(extra_env or {}), JUPYTER_TOKEN=token)
    environ.pop("JUPYTER_LLAMA_URL", None)  # it must not try to find itself
    with open_log(log_path) as log:  # its own session either way: signals to our group pass it by
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=environ,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}/llama/"
    deadline = time.monotonic() + timeout
    while not answers(url, token, timeout=2.0):
        if proc.poll() is not None:
            raise ManagerStartFailed(f"the {what} exited at start (code {proc.returncode}); its log: {log_path}\n"
                                     f"{_tail(Path(log_path))}")
        if time.monotonic() > deadline:
            _terminate(proc.pid)
            raise ManagerStartFailed(f"the {what} did not answer within {timeout:.0f}s; its log: {log_path}")
        time.sleep(0.05)
    return proc


def _start(d: Path, timeout: float, idle: float) -> Manager:
    from .engine.runner import free_port

    port, token = free_port(), secrets.token_urlsafe(24)
    url = f"http://127.0.0.1:{port}/llama/"
    log_path = d / "jupyter-llama-manager.log"
    proc = start_serve(port, token, log_path, what="background jupyter-llama manager", tied=False,
                       extra_argv=("--exit-when-idle", str(idle)), timeout=timeout)
    state = {"url": url, "token": token, "pid": proc.pid, "started": time.time(), "log": str(log_path),
             "settings": _settings()}
    write_private(_state_path(), json.dumps(state))  # (it holds the token: 0600, written through no link)
    return Manager(url, token, proc.pid, f"{SOURCE} (pid {proc.pid}, started now, state in {_state_path()})")


def stop(timeout: float = 15.0) -> int | None:
    """Stop the background manager (it stops every model first); its PID, or None if none ran."""
    st = _read_state()
    if st is None or not _alive(st["pid"]):
        return None
    _terminate(st["pid"], timeout)
    try:
        _state_path().unlink()
    except OSError:
        pass
    return st["pid"]


def _terminate(pid: int, timeout: float = 15.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):  # gone, or not ours
        return
    from .procs import process_alive  # alive at all (a dying manager's cmdline is already empty)

    deadline = time.monotonic() + timeout
    while process_alive(pid):
        _reap(pid)
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            break
        time.sleep(0.02)
    _reap(pid)


def _reap(pid: int) -> None:
    try:  # our own child (started in this process): collect it
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _tail(path: Path, n: int = 10) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-n:])
    except OSError:
        return ""

