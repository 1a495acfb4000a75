"""A child process watched from the event loop, whichever loop that is.

``asyncio.create_subprocess_exec`` spawns through the loop: on asyncio's own loop that is
``subprocess.Popen`` (vfork, without a ``preexec_fn``, whose cost does not grow with the
server's heap), on uvloop it is libuv's spawn, which forks the whole process (a cost that
grows with the heap); a model swap pays it once per child. So children are started with
``subprocess.Popen`` here, on any loop, and only watched through the loop: their output as a
read pipe, their exit through a pidfd (Linux 5.3+; a thread waiting on the pid elsewhere).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import sys
import termios
from typing import Callable, Sequence

__all__ = ["ChildProcess"]

PIPE_BYTES = 1 << 20  # the pipe of a child's output: the most an unprivileged process may ask for, by default


class ChildProcess:
    """A started child: ``pid``, ``returncode`` (None while it runs), ``stdout`` (a
    StreamReader of its merged stdout and stderr), :meth:`wait`, and :meth:`close` for the
    pipe and pidfd once it has been reaped."""

    def __init__(self, popen: subprocess.Popen, stdout: asyncio.StreamReader, transport: asyncio.ReadTransport):
        self._popen = popen
        self.pid = popen.pid
        self.stdout = stdout
        self._transport = transport
        self._exited: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pidfd: int | None = None
        self._watch()

    @classmethod
    async def start(cls, argv: Sequence[str], env: dict[str, str], *, preexec_fn: Callable[[], None] | None = None,
                    limit: int = 1 << 20) -> "ChildProcess":
        """Start ``argv`` in a process group of its own (what stops it stops any helper it
        forks), stdin from /dev/null, stdout and stderr into one pipe read by the loop.

        It stays in this process's session, as Ollama's runners and llama-server's router's
        children do. Linux schedules each session's processes as one group (autogroup); in a
        session of its own the child was a group apart from the manager that relays its
        tokens, and a relayed stream ran measurably slower than the same child asked directly
        (bench/history/2026-12-01-to-06-wire-speed.md has the probes)."""
        popen = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, env=env, process_group=0, preexec_fn=preexec_fn)
        out = popen.stdout
        assert out is not None  # (stdout=PIPE)
        try:  # room for a while of output between reads (hold_output): the default pipe holds 64 KiB
            fcntl.fcntl(out.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (AttributeError, OSError):  # not Linux, or over /proc/sys/fs/pipe-max-size
            pass
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        try:
            transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop),
                                                        out)
        except BaseException:
            popen.kill()
            popen.wait()
            out.close()
            raise
        return cls(popen, reader, transport)

    def hold_output(self, held: bool) -> None:
        """Stop (True) or go back to (False) reading the child's output as it comes: meanwhile
        it waits in the pipe, and the next read takes all of it at once."""
        if self._transport.is_closing():
            return
        if held:
            self._transport.pause_reading()
        else:
            self._transport.resume_reading()

    def output_waiting(self) -> int:
        """Bytes of the child's output in the pipe, not read yet (0 where that cannot be asked)."""
        out = self._popen.stdout
        assert out is not None  # (stdout=PIPE)
        try:
            return int.from_bytes(fcntl.ioctl(out.fileno(), termios.FIONREAD, b"\0\0\0\0"),
                                  sys.byteorder)
        except (OSError, ValueError):  # closed, or no FIONREAD here
            return 0

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has exited, else None. Asked of the kernel each time (a
        reap that does not block), not only when the loop has run the exit's callback: a
        child whose exit can be reaped is dead to whoever asks next (a lease, ``ps``), not
        alive for a few more turns of the loop. (A child killed is a zombie in /proc a little
        before that, while its threads are torn down.)"""
        code = self._popen.returncode
        if code is None:
            try:
                code = self._popen.poll()
            except OSError:  # (not ours to reap any more: the loop's callback will say)
                code = self._popen.returncode
        return code

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd here: a thread of its own waits for the exit
            import threading

            def wait() -> None:
                self._popen.wait()
                self._settle()

            threading.Thread(target=wait, daemon=True, name=f"wait-{self.pid}").start()
            return
        loop.add_reader(self._pidfd, self._on_pidfd)

    def _on_pidfd(self) -> None:
        assert self._pidfd is not None  # (called by the reader _watch added on it)
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self._popen.wait()  # it has exited: this reaps at once
        self._settle()

    def _settle(self) -> None:
        if not self._exited.done():
            self._exited.get_loop().call_soon_threadsafe(self._set_exited)

    def _set_exited(self) -> None:
        if not self._exited.done():
            self._exited.set_result(self._popen.returncode)

    async def wait(self) -> int:
        """Its exit status, once it has exited (negative: the signal that ended it)."""
        return await asyncio.shield(self._exited)

    def close(self) -> None:
        """Release the pipe and the pidfd (after :meth:`wait`)."""
        self._transport.close()
        if self._pidfd is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._pidfd)
            except RuntimeError:
                pass
            os.close(self._pidfd)
            self._pidfd = None
