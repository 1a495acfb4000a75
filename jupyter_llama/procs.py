"""Processes by PID, as this package's parts ask about them (each other, their children).

A PID outlives its process: the kernel hands it out again. So a record that names a process
by PID for others to find later (a peer's usage file, :mod:`.memory.peers`) also keeps the
process's start time, and the check compares both: :func:`same_process`. (The background
manager's state file checks the command line instead, :func:`.background._alive`.)
"""

from __future__ import annotations

import os

__all__ = ["process_alive", "same_process", "start_time"]


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a dead child nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s 22nd field), or
    None where there is no /proc or no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # after the command name, which may hold spaces and parentheses: state is field 3
            return int(f.read().rsplit(")", 1)[-1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def same_process(pid: int, started: int | None) -> bool:
    """Whether ``pid`` is alive and is the process that had it when ``started`` was read
    (``started`` None: no start time was recorded, so being alive is all there is to check)."""
    if not process_alive(pid):
        return False
    return started is None or start_time(pid) in (None, started)
