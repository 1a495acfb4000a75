"""Processes by PID, as this package's parts ask about them (each other, their children).

A PID outlives its process: the kernel hands it out again. So a record that names a process
by PID for others to find later (a peer's usage file, :mod:`.memory.peers`) also keeps the
process's start time, and the check compares both: :func:`same_process`. (The background
manager's state file checks the command line instead, :func:`.background._alive`.) A
process one means to signal later (a soak's clean-up of what its manager left) is recorded
the same way, by :func:`descendants`, and signalled only while it is still that process:
:func:`signal_recorded`.
"""

from __future__ import annotations

import os

__all__ = ["child_environment", "child_pids", "descendants", "exit_words", "process_alive", "same_process",
           "signal_recorded", "start_time"]


# Words in the name of an environment variable that holds a credential (JUPYTER_LLAMA_TOKEN,
# OPENAI_API_KEY, JUPYTERHUB_API_TOKEN, HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...).
_CREDENTIAL_WORDS = ("TOKEN", "API_KEY", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")


def child_environment() -> dict[str, str]:
    """The environment for a child this manager starts (llama-server, ggml-rpc-server,
    llama-fit-params): this process's, less every variable that holds a credential and less
    llama.cpp's own ``LLAMA_ARG_*`` settings (a child's command line is the manager's
    choice). A child reads untrusted input (a model's file, a client's prompt), and the
    manager's token opens the whole API; a child that needs a key of its own is given it
    after this (``LLAMA_API_KEY``)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("LLAMA_ARG_") and not any(w in k.upper() for w in _CREDENTIAL_WORDS)}


def exit_words(code: int | None) -> str:
    """How a child ended, in words: ``exit code 1``, or for a signal (a negative code, as
    subprocess and asyncio give it) ``killed by SIGABRT (exit code -6)``."""
    if code is None or code >= 0:
        return f"exit code {code}"
    import signal

    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name} (exit code {code})"


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces and
    parentheses): the process's state first, then its parent, ... (None: no such process,
    or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a dead child nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat(pid)
    return fields is not None and len(fields) > 0 and fields[0] != "Z"


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s 22nd field), or
    None where there is no /proc or no such process."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def same_process(pid: int, started: int | None) -> bool:
    """Whether ``pid`` is alive and is the process that had it when ``started`` was read
    (``started`` None: no start time was recorded, so being alive is all there is to check)."""
    if not process_alive(pid):
        return False
    return started is None or start_time(pid) in (None, started)


def child_pids(parent: int, name: str | None = None) -> list[int]:
    """Live (non-zombie) children of ``parent``, optionally only those whose program is ``name``
    (e.g. ``"llama-server"``): how a manager, or a test, checks that nothing was left running."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        fields = _stat(d)
        if not fields or fields[0] == "Z" or int(fields[1]) != parent:
            continue
        if name is not None:
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    program = os.path.basename(f.read().split(b"\0", 1)[0].decode(errors="replace"))
            except OSError:
                continue
            if program != name:
                continue
        out.append(int(d))
    return out


def descendants(root: int) -> dict[int, int]:
    """The live (non-zombie) descendants of ``root`` (its children, theirs, ...), each with its
    start time, as read in one pass over /proc: a record of them to act on later, when they
    may have been orphaned (their parent is then another) and their PIDs handed out again
    (:func:`signal_recorded`). Empty where there is no /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    kids: dict[int, list[tuple[int, int]]] = {}
    for d in entries:
        if not d.isdigit():
            continue
        fields = _stat(d)  # one read: the parent and the start time are of the same process
        try:
            if fields and fields[0] != "Z":
                kids.setdefault(int(fields[1]), []).append((int(d), int(fields[19])))
        except (IndexError, ValueError):
            continue
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, started in kids.get(todo.pop(), ()):
            if pid not in out and pid != root:
                out[pid] = started
                todo.append(pid)
    return out


def signal_recorded(pid: int, started: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is alive and still the process recorded with the
    start time ``started`` (:func:`descendants`, :func:`start_time`); True when it was sent.
    A record without a start time matches nothing: a PID alone may name anyone's process by
    now. Where the system has pidfds the process is held by one from before the check to the
    signal, so that its PID cannot pass to another process in between."""
    import signal

    if started is None:
        return False
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd here (not Linux, an old kernel): check, then kill
        fd = None
    try:
        if not process_alive(pid) or start_time(pid) != started:
            return False
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)
