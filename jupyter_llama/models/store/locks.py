"""File locks: the store's only way of keeping operations, in this process or another, from
undoing each other.

A blob's lock is held from landing (or finding) the blob until the manifest that names it is
written, and by the garbage collector while it deletes one; ``manifests.lock`` is held while
a manifest is written or deleted. Each wait is bounded by :data:`LOCK_WAIT` and ends early
when the store is stopping; a wait that runs out is :class:`StoreBusy` (409), never a hang.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from pathlib import Path
from typing import Iterable

from filelock import Timeout

from .errors import StoreBusy
from .layout import StoreLayout

LOCK_WAIT = 30.0
"""Seconds an operation waits for a lock another one holds (a blob's, the manifests'). Locks
are held only while a file lands or a manifest is written, so a longer wait means the holder
is stuck: the waiter gives up with :class:`StoreBusy` rather than polling forever (a thread
polling forever also kept the server from stopping)."""

_CONTENDED = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


class RemovableLock:
    """An exclusive lock on a file (``flock``), by default deleted on release, so a finished
    job leaves nothing behind.

    Deleting a lock file is safe only if a waiter checks, once it holds the lock, that the file
    it locked is still the one at the path (the holder may have removed it meanwhile, and a
    third process made a new one); if not, it locks the new file instead. Only the holder
    deletes the file, and only while it is still the file it holds.

    A wait is bounded (``timeout`` seconds, :data:`LOCK_WAIT` unless told; negative: no bound)
    and ends early when ``stop`` is set. :meth:`release` never raises and frees everything it
    took, whatever happened meanwhile: a lock left held would keep every later waiter polling.
    ``what`` names the locked thing in the :class:`StoreBusy` sentence of ``with``.
    """

    def __init__(self, path: Path, *, remove: bool = True, timeout: float | None = None, what: str = "",
                 stop: threading.Event | None = None):
        self.path = path
        self.remove = remove
        self.timeout = LOCK_WAIT if timeout is None else timeout
        self.what = what or f"the lock {path.name}"
        self._stop = stop
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None  # (device, inode) of the file held

    def acquire(self, timeout: float | None = None, poll: float = 0.05) -> None:
        """Take the lock, waiting at most ``timeout`` seconds (the lock's own unless given;
        negative: no bound); filelock's ``Timeout`` when it stays taken (or ``stop`` is set)."""
        import fcntl

        wait = self.timeout if timeout is None else timeout
        deadline = None if wait < 0 else time.monotonic() + wait
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            fd = os.open(self.path, flags, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as e:
                        if e.errno not in _CONTENDED:
                            raise
                    if (self._stop is not None and self._stop.is_set()) or (
                            deadline is not None and time.monotonic() >= deadline):
                        raise Timeout(str(self.path)) from None
                    if self._stop is not None:
                        self._stop.wait(poll)
                    else:
                        time.sleep(poll)
                held = os.fstat(fd)
                try:
                    now = os.stat(self.path)
                    same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                self._fd, self._ident = fd, (held.st_dev, held.st_ino)
                return
            os.close(fd)  # we locked a file its holder had removed: lock the one there now

    def release(self) -> None:
        """Give the lock up (deleting its file first, when ``remove``); a second call does
        nothing. A descriptor that no longer names the locked file (closed, or its number
        reused by someone else) is left alone: closing it would close another's file."""
        import fcntl

        fd, ident = self._fd, self._ident
        if fd is None:
            return
        self._fd = self._ident = None
        try:
            st = os.fstat(fd)
        except OSError:
            return
        if (st.st_dev, st.st_ino) != ident:
            return
        try:
            if self.remove:  # while still holding it: waiters on this file will look again
                with contextlib.suppress(OSError):
                    now = os.stat(self.path)
                    if (now.st_dev, now.st_ino) == ident:
                        os.unlink(self.path)
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(fd)

    def take(self) -> "RemovableLock":
        """:meth:`acquire`, with a wait that runs out said as :class:`StoreBusy` (409)."""
        try:
            self.acquire()
        except Timeout:
            if self._stop is not None and self._stop.is_set():
                raise StoreBusy(f"the model store is closing (the server is stopping): {self.what} was not "
                                "changed; try again once it is back") from None
            raise StoreBusy(f"another operation on the model store (a create, copy, delete or pull) has held "
                            f"{self.what} for over {self.timeout:g} s; nothing was changed, try again in a "
                            "moment") from None
        return self

    def __enter__(self) -> "RemovableLock":
        return self.take()

    def __exit__(self, *exc) -> None:
        self.release()


class Locks:
    """Several locks, taken in order (each wait bounded: StoreBusy) and all released on
    exit, whatever happens."""

    def __init__(self, locks: list[RemovableLock]):
        self.locks = locks

    def __enter__(self):
        try:
            for lk in self.locks:
                lk.take()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for lk in reversed(self.locks):
            lk.release()  # (never raises; one not taken is a no-op)


class StoreLocks(StoreLayout):
    """The store's locks, their files under ``locks/`` (a part of ModelStore)."""

    _stopping: threading.Event  # set by stop_waiting: lock waits end at once (made by ModelStore.__init__)

    def lock(self, key: str, timeout: float | None = None) -> RemovableLock:
        """A file lock named ``key`` whose file stays (``manifests``: the one every manifest
        write and delete takes); its ``with`` waits at most ``timeout`` seconds (:data:`LOCK_WAIT`),
        then says StoreBusy."""
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        what = "the list of models" if key == "manifests" else f"the lock {key}"
        return RemovableLock(self.locks_dir / f"{key}.lock", remove=False, timeout=timeout, what=what,
                             stop=self._stopping)

    def removable_lock(self, key: str, what: str = "", stop: threading.Event | None = None) -> RemovableLock:
        """A lock whose file is gone once it is released (for one-off work such as a download,
        whose waiter polls it with its own cancel checks)."""
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        return RemovableLock(self.locks_dir / f"{key}.lock", what=what or f"the lock {key}", stop=stop)

    def _blob_lock(self, hexd: str) -> RemovableLock:
        """A blob's lock: its file goes when it is released, so a deleted blob leaves no lock
        file behind (waiters re-check that they hold the file at the path)."""
        return self.removable_lock(f"sha256-{hexd}", what=f"blob sha256:{hexd[:12]}", stop=self._stopping)

    def _blob_locks(self, digests: Iterable[str]) -> Locks:
        return Locks([self._blob_lock(h) for h in sorted(set(digests))])
