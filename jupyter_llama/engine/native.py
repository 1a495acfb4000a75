"""The token relay below Python (``relay.c``): streams' tokens from the child's socket to
the client's, in one thread for all of them (the hub) that holds no Python lock, while the
event loop sleeps.

Why: on two slow cores a Python process woken for each token costs 110 us of CPU for the
smallest relay that can be written on uvloop, and the manager's ~300 (its interpreter,
caches cold after the child's own work), where a C relay costs 55-60, as llama-server's
router does (a probe relaying an event every 6 ms beside a busy process, by /proc's CPU
times; bench/api_overhead.py's "relay CPU per token" fell from 290-378 us to 123-164 with
this relay, on the host at 1 stream). The tokens the C relay writes are
byte for byte what the Python relay would write; everything else in a stream (its last event
with the timings, an error, a tool call, the end) stays in Python: the C relay stops at the
first chunk that is not a token of text and hands it back, unread, with the rest (see
``relay.c``). The answer's head is made in Python too; on serve's connection the C relay
has the stream before the child's head comes, reads that head itself and sends ours with
the first token, unless the child's is not a stream's (an error's), which it leaves unread
for Python (:class:`Target`).

Why one thread for every stream: with a thread a stream, a batch of eight slots' tokens
woke eight threads, each to relay one token and sleep again (perf put ~30% of the manager's
time in the scheduler's switches); one thread waiting on one epoll set is woken fewer times
for the batch. The relay's CPU a token at 8 streams of 64 tokens, three alternating pairs of
16 bursts: 30-38 us with a thread a stream, 23-26 with the hub.

The library is compiled from ``relay.c`` with the machine's C compiler on first use and
cached beside the engine builds (``~/.cache/jupyter-llama/relay``); without a compiler, or
with ``JUPYTER_LLAMA_RELAY=python``, every token goes through the Python relay, as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import os
import select
import shutil
import struct
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Callable

from .. import config

__all__ = ["Run", "Target", "library", "prepare", "sse", "status", "template"]

SOURCE = Path(__file__).with_name("relay.c")
TEMPLATE, SSE = 0, 1
GIVE_BACK, CHILD_ENDED, CLIENT_GONE, STOPPED, FINISHED = 1, 2, 3, 4, 5
# a run started before the child's head (Run.state.head): the child's head is unread (not come,
# or not one it goes on from: every byte of it is left), or it was read (200, chunked) and ours
# went (or waits in what is unsent)
HEAD_UNREAD, HEAD_SENT = 0, 1
READ_BUFFER = 64 * 1024  # the child's bytes one read may bring (a larger chunk goes to Python)
OUT_BUFFER = 96 * 1024
MAX_RUNS = 64  # streams relayed below Python at once (each holds its buffers, 160 KiB); more use the Python relay


class _Spec(ctypes.Structure):
    _fields_ = [("mode", ctypes.c_int),
                ("pat", ctypes.c_char_p), ("pat_len", ctypes.c_int),
                ("head", ctypes.c_char_p), ("head_len", ctypes.c_int),
                ("key", ctypes.c_char_p), ("key_len", ctypes.c_int),
                ("tail", ctypes.c_char_p), ("tail_len", ctypes.c_int),
                ("from_", ctypes.c_char_p), ("from_len", ctypes.c_int),
                ("to", ctypes.c_char_p), ("to_len", ctypes.c_int),
                ("end", ctypes.c_char_p), ("end_len", ctypes.c_int),
                ("done", ctypes.c_char_p), ("done_len", ctypes.c_int),
                ("done_key", ctypes.c_char_p), ("done_key_len", ctypes.c_int),
                ("load", ctypes.c_char_p), ("load_len", ctypes.c_int),
                ("started", ctypes.c_longlong)]


class _State(ctypes.Structure):
    _fields_ = [("events", ctypes.c_long),
                ("left_off", ctypes.c_int), ("left_len", ctypes.c_int),
                ("unsent_off", ctypes.c_int), ("unsent_len", ctypes.c_int),
                ("head", ctypes.c_int)]


def _spec(mode: int, pat=b"", head=b"", key=b"", tail=b"", from_=b"", to=b"", end=b"", done=b"", done_key=b"",
          load=b"", started=0) -> _Spec:
    return _Spec(mode, pat, len(pat), head, len(head), key, len(key), tail, len(tail), from_, len(from_), to, len(to),
                 end, len(end), done, len(done), done_key, len(done_key), load, len(load), started)


def template(pattern: bytes, head: bytes, key: bytes, tail: bytes,
             done: tuple[bytes, bytes, bytes, int] | None = None) -> _Spec:
    """Ollama lines: an event that starts as ``pattern`` says becomes ``head``, the time,
    ``key``, its text's JSON string, ``tail`` (see ``relay.c`` for the pattern's pieces).

    ``done``: how the child's last event becomes the answer's last line, which the C relay
    then writes with the body's end (FINISHED), as :meth:`.ollama._Lines.native_done`
    gives it: the event's pattern, the line's bytes between the time and the reason, its
    load duration (``,"load_duration":N``) and the request's start (``time.monotonic``,
    in ns). Without it, that event and all after it go back to Python."""
    pat, done_key, load, started = done or (b"", b"", b"", 0)
    return _spec(TEMPLATE, pattern, head, key, tail, done=pat, done_key=done_key, load=load, started=started)


def sse(replace: bytes = b"", by: bytes = b"", end: bytes = b"") -> _Spec:
    """Server-sent events passed on as they came, each with its first ``replace`` (if any) made
    ``by``. ``end``: what the answer's end is for the child's ``[DONE]`` (``data: [DONE]`` and a
    blank line): the C relay then writes it and the body's last chunk itself, and stops with
    FINISHED, the client's answer complete (the child's body's own end is left to Python, to
    read and write nothing for). Without it, ``[DONE]`` and all after it go back to Python."""
    return _spec(SSE, from_=replace, to=by, end=end)


# ---------------------------------------------------------------------------- the library

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why_not: str | None = None  # why there is no library (None: not tried yet, or loaded)
_ready = threading.Event()
_hub: select.epoll | None = None  # the set the hub waits on (made with the first run, open while the process lives)
_idle: list["Run"] = []  # runs not relaying a stream now, for the next one
_running: dict[int, "Run"] = {}  # by number: the runs the hub has, until it gives them back
_made = 0  # runs made (each holds its buffers); at most MAX_RUNS
_spoilt: list["Run"] = []  # runs whose start failed, kept for good (see Run.start)
_runs_lock = threading.Lock()  # (Run.make, from event loops that may be on threads of their own)
relayed_events = 0  # tokens relayed below Python in this process (the tests read it)


def _path(cc: str) -> Path:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode()).hexdigest()[:12]
    return config.cache_dir() / "relay" / f"relay-{digest}.so"


RELAYS = ("native", "python")  # JUPYTER_LLAMA_RELAY: a stream's tokens relayed below Python, or by Python


def _build() -> None:
    global _lib, _why_not
    if config.env_choice("RELAY", RELAYS) == "python":
        _why_not = "JUPYTER_LLAMA_RELAY=python"
        return
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        _why_not = "no C compiler (cc) to build it with"
        return
    path = _path(cc)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                _why_not = f"{cc} could not build {SOURCE.name}: {done.stderr.strip()[-300:]}"
                return
            os.replace(tmp, path)  # (another process may have built the same file meanwhile: either is whole)
        except (OSError, subprocess.SubprocessError) as e:
            _why_not = f"{cc} could not build {SOURCE.name}: {e}"
            return
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        _why_not = f"{path} does not load: {e}"
        return
    lib.jl_stream_size.restype = ctypes.c_int
    lib.jl_start.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.POINTER(_Spec), ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                             ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.jl_start.restype = ctypes.c_int
    lib.jl_result.argtypes = [ctypes.c_char_p, ctypes.POINTER(_State)]
    lib.jl_result.restype = ctypes.c_int
    lib.jl_hub_run.argtypes = [ctypes.c_int]
    lib.jl_hub_run.restype = None
    _lib = lib


def _prepare() -> None:
    try:
        with _lock:
            if _lib is None and _why_not is None:
                _build()
    finally:
        _ready.set()


def prepare() -> None:
    """Build (or find) and load the library in a thread of its own, so that a server's start
    does not wait for the compiler; until it is loaded, streams use the Python relay."""
    if not _ready.is_set():
        threading.Thread(target=_prepare, name="jupyter-llama-relay-build", daemon=True).start()


def library(wait: bool = False) -> ctypes.CDLL | None:
    """The loaded library, or None (not loaded yet, or not to be had: :func:`status` says why).
    ``wait``: build it now if need be."""
    if wait and not _ready.is_set():
        _prepare()
    return _lib


def status() -> str:
    """"native" or "python (why)", for serve's start line."""
    if _lib is not None:
        return "native"
    return f"python ({_why_not or 'being built'})"


# ---------------------------------------------------------------------------- one stream


class Target:
    """The client's side of a stream the C relay may write: ``spec`` (what it writes, see
    :func:`template` and :func:`sse`), and the client connection's ``lend(stop)``, which gives
    its socket's descriptor (None when it cannot be lent now: something of ours is still to
    be written, or it has closed) and keeps it untouched until ``take_back(unsent, gone, ended,
    head)``; ``stop`` is for the connection to end the relay early (it is closing).
    ``take_back`` gets what the client had not taken yet (to be written first), whether the
    client has left, whether the C relay has written the answer's end (FINISHED: nothing more
    is to be written) and, for a socket lent before the child's head, how far the run got
    with the heads (``head``, HEAD_*; None otherwise).

    ``lend_before_head(stop)``, where the connection offers it: the same, for an answer whose
    head has not gone: it makes our head now (the handler's, unsent) and gives (descriptor,
    head) for the C relay to send once the child's head says the answer goes on (see
    ``relay.c``), or None; ``take_back`` then forgets ours (HEAD_SENT: it went, or is in
    what is unsent) or makes it unsaid (HEAD_UNREAD: the child's head, an error's perhaps, is
    Python's to read, and the handler's to answer)."""

    def __init__(self, spec: _Spec, lend: Callable[[Callable[[], None]], int | None],
                 take_back: Callable[..., None],
                 lend_before_head: Callable[[Callable[[], None]], tuple[int, bytes] | None] | None = None):
        self.spec, self.lend, self.take_back, self.lend_before_head = spec, lend, take_back, lend_before_head


def _start_hub(lib: ctypes.CDLL) -> None:
    """The hub's epoll set and its thread (in ``jl_hub_run`` for good, without the Python lock)."""
    global _hub
    with _lock:
        if _hub is None:
            ep = select.epoll()
            threading.Thread(target=lib.jl_hub_run, args=(ep.fileno(),), name="jupyter-llama-relay",
                             daemon=True).start()
            _hub = ep


_INT = ctypes.sizeof(ctypes.c_int)


class _Ears:
    """Where the hub tells one event loop which of the streams it started the hub has
    stopped: a pipe that loop reads (the numbers, as ints), each run's ``done(why)`` called
    as its number comes. (A thread of ours that heard them for every loop cost each stop a
    wake-up of that thread and then of the loop, 0.13-0.18 ms on these machines.)

    A run holds its loop's ears while the hub has it, and the loop's reader holds them while
    the loop lives: the pipe closes once neither does, so the hub never writes to a closed
    (and perhaps reused) descriptor."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)  # (a loop that no longer reads never holds up the hub)
        self._pending = b""
        weakref.finalize(self, _close_pipe, self.r, self.w)
        loop.add_reader(self.r, self._heard)

    def _heard(self) -> None:
        try:
            data = os.read(self.r, 4096)
        except BlockingIOError:
            return
        pending = self._pending + data
        whole = len(pending) - len(pending) % _INT
        self._pending = pending[whole:]
        for (number,) in struct.iter_unpack("i", pending[:whole]):
            run = _running.pop(number, None)
            if run is None:
                continue
            try:
                run._ended()
            except Exception as e:  # noqa: BLE001 - one stream's failure, told as a callback's is; the others go on
                asyncio.get_running_loop().call_exception_handler(
                    {"message": "a stream's hand-back from the relay below Python failed", "exception": e})


_ears: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Ears]" = weakref.WeakKeyDictionary()


def _close_pipe(r: int, w: int) -> None:
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def _ears_of(loop: asyncio.AbstractEventLoop) -> _Ears:
    ears = _ears.get(loop)
    if ears is None:
        ears = _ears[loop] = _Ears(loop)
    return ears


class Run:
    """One stretch of a stream relayed by C, on the hub (kept for the next stretch once this
    one is closed): from :meth:`start` until the C relay stops (see ``relay.c`` for why it
    does), when ``done(why)`` is called in the event loop with one of GIVE_BACK,
    CHILD_ENDED, CLIENT_GONE, STOPPED and FINISHED. Then :meth:`leftover` is the child's bytes it did
    not relay and :meth:`unsent` ours the client had not taken; :meth:`close` gives the
    run back."""

    def __init__(self, lib: ctypes.CDLL, number: int):
        self._lib = lib
        self.number = number
        self.state = _State()
        self._mem = ctypes.create_string_buffer(lib.jl_stream_size())
        self._buf = ctypes.create_string_buffer(READ_BUFFER)
        self._out = ctypes.create_string_buffer(OUT_BUFFER)
        self._stop_r, self._stop_w = os.pipe()
        os.set_blocking(self._stop_r, False)
        self._done: Callable[[int], None] | None = None
        self._head: bytes | None = b""  # ours, while the hub has a run started before the child's head
        self._ears: _Ears | None = None
        self._stopped = False

    @staticmethod
    def make() -> "Run | None":
        """A run, or None when the library is not loaded or MAX_RUNS relay at once."""
        global _made
        if _lib is None:
            return None
        loop = asyncio.get_running_loop()
        with _runs_lock:
            try:  # (here, before the connection lends its socket: a failure leaves it untouched)
                if _hub is None:
                    _start_hub(_lib)
                _ears_of(loop)
            except OSError:  # (out of descriptors: this stream goes through Python)
                return None
            if _idle:
                return _idle.pop()
            if _made >= MAX_RUNS:
                return None
            try:
                run = Run(_lib, _made + 1)
            except OSError:
                return None
            _made += 1
            return run

    def start(self, src: int, dst: int, spec: _Spec, done: Callable[[int], None], head: bytes = b"") -> None:
        """Relay from ``src`` to ``dst`` as ``spec`` says; ``head``: ours, for a stream whose
        child has not sent its head yet (see ``relay.c``; ``state.head`` says how far it got)."""
        loop = asyncio.get_running_loop()
        self._spec = spec  # (kept alive while the hub reads it)
        self._head = head  # (likewise)
        ears = self._ears = _ears_of(loop)  # (kept while the hub has this run: see _Ears)
        self._done = done
        self.state = _State()
        _running[self.number] = self
        if self._lib.jl_start(_hub.fileno(), self._mem, src, dst, self._stop_r, self.number, ears.w,
                              ctypes.byref(spec), self._buf, READ_BUFFER, self._out, OUT_BUFFER,
                              head, len(head)) < 0:
            # Its sockets cannot be watched: nothing was read. The hub may still be about to look
            # at it (see jl_start), so it is kept, never started again nor freed.
            del _running[self.number]
            _spoilt.append(self)
            loop.call_soon(done, GIVE_BACK)

    @property
    def before_head(self) -> bool:
        """Started before the child's head, with ours (``start``'s ``head``)."""
        return bool(self._head)

    def _ended(self) -> None:
        """(In its event loop, as the hub has told it.)"""
        self._done(self._lib.jl_result(self._mem, ctypes.byref(self.state)))

    def stop(self) -> None:
        """Make the relay stop (STOPPED) as soon as it can."""
        if not self._stopped:
            self._stopped = True
            os.write(self._stop_w, b"x")

    def leftover(self) -> bytes:
        s = self.state
        return ctypes.string_at(ctypes.addressof(self._buf) + s.left_off, s.left_len) if s.left_len > 0 else b""

    def unsent(self) -> bytes:
        s = self.state
        return ctypes.string_at(ctypes.addressof(self._out) + s.unsent_off, s.unsent_len) if s.unsent_len > 0 else b""

    def close(self) -> None:
        """Give the run back (once ``done`` has been called)."""
        global relayed_events
        relayed_events += self.state.events
        if self._stopped:
            try:
                os.read(self._stop_r, 64)
            except BlockingIOError:
                pass
            self._stopped = False
        self._done = None
        self._ears = None
        if self not in _spoilt:
            self._spec = self._head = None
            _idle.append(self)
