"""The other managers of this user on this machine, and what their models hold.

A user can have several managers at once: a JupyterLab server's extension, `jupyter-llama
serve` in a shell, the background manager a plain kernel started. Each writes what its loaded
models use (per device) to a file of its own in a folder all of them share (the one the
background manager's state lives in: Jupyter's runtime folder), and reads the others'. So
their memory is never a surprise: it counts against this user's budgets (a budget is the
user's, whichever manager loads), and a load that does not fit says which other manager
holds what. Host and GPU free memory, read live, already reflect the others' models.

Files are ``jupyter-llama-usage-<pid>.json``, mode 0600, written atomically, with the
process's start time beside its PID; one whose process is gone (or whose PID a later process
has been given) is removed by whoever reads it. What they say is counted only from a folder
of this user's that nobody else can write, and only from files of this user's
(:mod:`..private`): on a shared machine another user's file would otherwise make this
user's loads refused. A folder others can write leaves the board unused (logged once, with
why).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..models.store import atomic_write_json
from ..private import UntrustedFile, read_trusted, trusted_folder
from ..procs import same_process, start_time

PREFIX = "jupyter-llama-usage-"


@dataclass
class Peer:
    pid: int
    url: str
    models: list[dict] = field(default_factory=list)  # {"name": ..., "by_device": {device: bytes}}

    def by_device(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.models:
            for d, n in (m.get("by_device") or {}).items():
                out[d] = out.get(d, 0) + int(n)
        return out

    def describe(self, device: str | None = None) -> str:
        """``pid 123 at http://...: tiny:latest 1.2 GiB`` (on ``device`` only, if given)."""
        from .report import format_bytes

        held = [(m["name"], (m.get("by_device") or {}).get(device, 0) if device else
                 sum((m.get("by_device") or {}).values())) for m in self.models]
        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in held if n)
        return f"pid {self.pid} at {self.url or '?'}" + (f": {parts}" if parts else "")


class PeerBoard:
    """This manager's entry in ``folder``, and the other live managers' entries."""

    def __init__(self, folder: str | os.PathLike, url: str = "", pid: int | None = None):
        self.folder = Path(folder)
        self.url = url
        self.pid = os.getpid() if pid is None else pid
        self.path = self.folder / f"{PREFIX}{self.pid}.json"
        self._started = start_time(self.pid)  # with the PID, so that a reused PID is not taken for us
        self.problem: str | None = None  # why the folder is not used (another user could write to it)

    def _usable(self, make: bool = False) -> bool:
        """Whether the folder is this user's alone (checked each time: it may be made later);
        ``make``: made (0700) when missing. Why one others could write to is not used is
        logged once."""
        try:
            trusted_folder(self.folder, make=make)
        except UntrustedFile as e:
            if self.problem is None:
                logging.getLogger(__name__).warning("jupyter-llama: other managers' memory is not counted: %s", e)
            self.problem = str(e)
            return False
        except OSError:  # (missing, or not a folder: nothing to read, nowhere to write)
            return False
        self.problem = None
        return True

    def publish(self, models: list[dict]) -> None:
        """Write what this manager's models hold now (an empty list when nothing is loaded)."""
        if not self._usable(make=True):
            return
        try:  # (0600 in a 0700 folder; a write cut short leaves no temporary file)
            atomic_write_json(self.path, {"pid": self.pid, "started": self._started, "url": self.url,
                                           "models": models}, fsync=False)
        except OSError:
            pass  # a read-only or missing folder: the others just do not see us

    def close(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass

    def others(self) -> list[Peer]:
        """Live managers other than this one, by PID; files of dead ones are removed."""
        found = []
        if not self._usable():
            return []
        try:
            entries = sorted(self.folder.glob(f"{PREFIX}*.json"))
        except OSError:
            return []
        for p in entries:
            try:
                pid = int(p.stem[len(PREFIX):])
            except ValueError:
                continue
            if pid == self.pid:
                continue
            try:
                data = json.loads(read_trusted(p) or "null")
            except UntrustedFile:
                continue  # not this user's file (only root could have put it here): neither counted nor removed
            except (OSError, ValueError):
                data = None  # being written (atomically: it has a whole file or none), or unreadable
            started = data.get("started") if isinstance(data, dict) else None
            if not same_process(pid, started if isinstance(started, int) else None):
                try:  # gone, or its PID now belongs to a process that started later
                    p.unlink()
                except OSError:
                    pass
                continue
            if not isinstance(data, dict):
                continue
            models = [m for m in data.get("models") or [] if isinstance(m, dict) and "name" in m]
            found.append(Peer(pid, str(data.get("url") or ""), models))
        return found


def usage(peers: list[Peer]) -> dict[str, int]:
    """Bytes per device that ``peers`` hold together."""
    out: dict[str, int] = {}
    for p in peers:
        for d, n in p.by_device().items():
            out[d] = out.get(d, 0) + n
    return out
