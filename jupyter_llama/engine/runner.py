"""One llama-server child: started, watched, talked to and stopped by us.

A :class:`Runner` owns exactly one child process. It starts it with the argv of
:mod:`.launch`, reads its log as it arrives into a :class:`~.logparse.LogParser` (which
yields the memory llama.cpp actually allocated), waits for ``/health``, talks to it over
plain HTTP/1.1 on loopback (:mod:`.http1`: a fresh connection per request, no client
library between), and always reaps the child on :meth:`Runner.stop`.

Children never outlive the manager: each runs in its own process group, is started under
``setpriv --pdeathsig KILL`` (or ``prctl(PR_SET_PDEATHSIG)`` when setpriv is missing) so
the kernel kills it when its parent dies even by SIGKILL, and an ``atexit`` hook stops the
ones still running at a normal interpreter exit.

The runner is in parts, one seam a module: this one is the process's life (start, log,
readiness, health and the watch for a child that stops answering, stop); its requests to
the child are :mod:`.child_requests`; its protocol around the context (prompts, tokens,
fitting a prompt or a chat to the context, embeddings) is :mod:`.child_context`; its states
and errors are :mod:`.runner_state`. Each name importable from this module before the split
still is.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import time
import weakref
from pathlib import Path

from ..errors import BadRequest, EngineError, RequestError
from ..load_options import LoadOptions
from ..memory.report import MemoryReport
from ..procs import child_environment, exit_words
from . import http1
from .child_context import DEFAULT_RESERVE as DEFAULT_RESERVE
from .child_context import ChildContext
from .child_context import _turn_start as _turn_start
from .child_context import reserve_for as reserve_for
from .child_requests import _TRANSPORT_ERRORS
from .launch import build_argv
from .logparse import LogParser
from .process import ChildProcess
from .runner_state import CRASH_MESSAGE as CRASH_MESSAGE
from .runner_state import LoadError, LoadStopped, RunnerCrashed, RunnerState

# While it starts: the log's "model loaded" line is what ends the wait (then HEALTH_POLL_READY_S
# until /health says ok). Before that line, /health is asked as a fallback for a build whose
# log says it otherwise, HEALTH_POLL_S after the start and twice as long after each miss, up to
# HEALTH_POLL_MAX_S: each ask costs the event loop CPU, which a child loading onto busy cores
# (RPC workers on the same ones) feels, so a fast swap should be asked only a few times.
HEALTH_POLL_S = 0.02
HEALTH_POLL_MAX_S = 0.25
HEALTH_POLL_READY_S = 0.002  # polls after that line, until /health says ok
HEALTH_TIMEOUT_S = 0.5
# A request that has made no progress (no byte from the child) for STALL_CHECK_S has the
# child's /health asked; two missed answers in a row (STALL_HEALTH_TIMEOUT_S each) and the
# child is taken for wedged: killed, and the request fails saying so. A busy child answers
# /health from its HTTP thread while it computes (a long prompt is not a stall).
STALL_CHECK_S = 5.0
LOG_READ_EVERY_S = 0.1  # how often a serving child's log is read (see _read_log); 0: as it comes
LOG_READ_BYTES = 1 << 18  # the most one read of it takes
STALL_HEALTH_TIMEOUT_S = 2.0
STALL_MISSES = 2

# llama.cpp's refusals (src/llama-context.cpp, b11434) of load options that do not suit the
# model: a quantised KV cache whose blocks do not divide its attention heads, a quantised V
# cache without flash attention, K and V types a model needs equal.
_BLOCKS = re.compile(r"\b([KV]) cache type (\w+) with block size (\d+) does not divide n_embd_head_[kv]=(\d+)")
_V_NEEDS_FA = ("quantized V cache requires flash_attn", "quantized V cache was requested, but this requires Flash")
_SAME_KV = re.compile(r"model does not support different K \((\w+)\) and V \((\w+)\) cache types")


def options_mistake(name: str, lines: list[str]) -> str | None:
    """What a child's log says was wrong with its load options for this model, as a sentence,
    followed by llama-server's own line (None when it says nothing of the kind)."""
    for ln in reversed(lines):
        said = f' (llama-server: "{ln.strip()[:200]}")'
        m = _BLOCKS.search(ln)
        if m:
            kv, kind, block, head = m.groups()
            return (f"cache_type_{kv.lower()} {kind} does not suit {name}: its blocks of {block} values do not divide "
                    f"the model's attention head size of {head}; use f16, bf16 or f32 for it" + said)
        if any(s in ln for s in _V_NEEDS_FA):
            return (f"a quantised V cache (cache_type_v) needs flash attention, which {name} cannot use with these "
                    "options; set flash_attn on, or use cache_type_v f16" + said)
        m = _SAME_KV.search(ln)
        if m:
            return (f"{name} needs the same cache type for K and V (got cache_type_k {m.group(1)} and "
                    f"cache_type_v {m.group(2)}); set kv_cache_type, or both to one type" + said)
    return None


_LIVE: "weakref.WeakSet[Runner]" = weakref.WeakSet()


@atexit.register
def _kill_live_children() -> None:
    for r in list(_LIVE):
        r.kill_now()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the kernel's pick; taken by the caller soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_SETPRIV = shutil.which("setpriv")


def _pdeathsig_preexec() -> None:  # pragma: no cover - runs in the forked child
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Runner(ChildContext):
    """A llama-server child for one model file under one set of load options.

    Its requests (:class:`~.child_requests.ChildRequests`) and its protocol around the context
    (:class:`~.child_context.ChildContext`) come from its parts; this class is the process."""

    def __init__(self, model_path: str | os.PathLike, options: LoadOptions | None = None, *,
                 binary: str | os.PathLike, name: str | None = None, load_timeout: float = 300.0,
                 extra_args: list[str] | None = None, log_lines: int = 2000):
        self.model_path = str(model_path)
        self.options = options or LoadOptions()
        self.binary = str(binary)
        self.name = name or Path(self.model_path).name
        self.load_timeout = load_timeout
        self.extra_args = list(extra_args or [])
        self.parser = LogParser(max_lines=log_lines)
        self.proc: ChildProcess | None = None
        self.port: int | None = None
        self.api_key = ""
        self.argv: list[str] = []
        self.state = RunnerState.NEW
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.returncode: int | None = None
        self._last_output = time.monotonic()
        self._reader: asyncio.Task | None = None
        self._ready_line = asyncio.Event()
        self._exited = asyncio.Event()
        self._stop_lock = asyncio.Lock()
        self._stop_asked = False  # stop() was called: no child is started after it, a starting one is stopped
        self._spawning: asyncio.Event | None = None  # while a child is being started: set once it is (or failed)
        self._lost_workers: list[str] | None = None

    # ------------------------------------------------------------------ properties

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def _child_port(self) -> int:
        """The port of the child: only asked for once a child was started (``_spawn`` sets it)."""
        assert self.port is not None, "the runner has not started a child"
        return self.port

    @property
    def serving(self) -> bool:
        """Ready and its process running: a request may be sent to it now."""
        return self.state == RunnerState.READY and self.alive

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def load_duration(self) -> float | None:
        if self.started_at is None or self.ready_at is None:
            return None
        return self.ready_at - self.started_at

    @property
    def slots(self) -> int:
        """Requests the child works on at once (its ``n_seq_max``, from its log; before that, the
        slots it was asked for, or 1)."""
        return self.parser.n_seq or self.options.num_parallel or 1

    def memory(self) -> MemoryReport:
        """What llama.cpp actually allocated, as read from this child's log."""
        return self.parser.report()

    def __repr__(self) -> str:
        return f"<Runner {self.name} pid={self.pid} port={self.port} {self.state}>"

    # ------------------------------------------------------------------ start

    async def start(self) -> "Runner":
        """Start the child and wait until it answers ``/health``; raise :class:`LoadError` if not
        (BadRequest when its log says the load options do not suit the model: :func:`options_mistake`)."""
        if self._stop_asked and self.state in (RunnerState.NEW, RunnerState.STOPPED) and self.proc is None:
            raise self._stopped_error()  # stopped before it was started: it starts no child
        if self.state != RunnerState.NEW:
            raise EngineError(f"runner for {self.name} was already started ({self.state})")
        if not os.path.isfile(self.model_path):
            self.state = RunnerState.FAILED
            raise LoadError(f"model file {self.model_path} does not exist")
        self.state = RunnerState.STARTING
        for _attempt in range(3):
            try:
                if self._stop_asked:  # stopped before (or between) its tries: no child is started
                    raise self._stopped_error()
                await self._spawn()
                await self._wait_ready()
                return self
            except _PortTaken:
                await self._reap()
                self.parser = LogParser(max_lines=self.parser.lines.maxlen or 2000)
                self._ready_line = asyncio.Event()
                self._exited = asyncio.Event()
                continue
            except BaseException:
                stopped = self._stop_asked  # (before our own stop below, which sets it)
                await self.stop()
                self.state = RunnerState.STOPPED if stopped else RunnerState.FAILED
                raise
        self.state = RunnerState.FAILED
        raise LoadError(f"could not find a free port for {self.name} after 3 tries")

    async def _spawn(self) -> None:
        self.port = free_port()
        self.api_key = secrets.token_urlsafe(24)
        self.argv = build_argv(self.binary, self.model_path, self.options, port=self.port, alias=self.name)
        self.argv += self.extra_args
        env = child_environment()  # (none of the manager's credentials)
        env["LLAMA_API_KEY"] = self.api_key  # never on the command line
        # On an abort (a worker gone mid-graph, mostly) ggml attaches gdb to print a backtrace:
        # seconds of a dying child, and gdb's lines where the crash's own last lines belong.
        env.setdefault("GGML_NO_BACKTRACE", "1")
        argv, preexec = self.argv, None
        if _SETPRIV:
            argv = [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]
        else:  # pragma: no cover - Debian always has setpriv (util-linux)
            preexec = _pdeathsig_preexec
        self.started_at = time.monotonic()
        self._last_output = self.started_at
        # The child exists from the fork on, but ``proc`` only once its pipe is watched (an
        # await): a stop meanwhile waits for this (see stop), so no child is ever started that
        # nobody stops.
        spawning = self._spawning = asyncio.Event()
        try:
            self.proc = await ChildProcess.start(argv, env, preexec_fn=preexec)
            _LIVE.add(self)
            self._reader = asyncio.create_task(self._read_log(), name=f"llama-log-{self.name}")
        finally:
            spawning.set()

    async def _read_log(self) -> None:
        assert self.proc and self.proc.stdout
        stream = self.proc.stdout
        partial = b""
        try:
            while True:
                # what has arrived, in one read: a request makes the child log ~40 lines at once
                data = await stream.read(LOG_READ_BYTES)
                if not data:
                    if partial:
                        self.parser.feed(partial.decode("utf-8", "replace"))
                    break
                self._last_output = time.monotonic()
                *lines, partial = (partial + data).split(b"\n")
                if len(partial) > 1 << 20:  # a line past 1 MiB: take it as it is
                    lines.append(partial)
                    partial = b""
                self.parser.feed_lines([raw.decode("utf-8", "replace") for raw in lines])
                if self.parser.ready and not self._ready_line.is_set():
                    self._ready_line.set()
                if (self.parser.ready and self.parser.listening and LOG_READ_EVERY_S and len(data) < LOG_READ_BYTES
                        and not self.proc.output_waiting()):
                    # Serving: what it logs now is per-request chatter (~40 lines a request at
                    # the verbosity the memory figures need), written a line at a time. Read as
                    # it came, that was a wake-up of the event loop per line, some of them
                    # between a request and its first token; left in the pipe for a moment,
                    # it is one read (bench/api_overhead.py). While more is waiting (a full
                    # read, or bytes left in the pipe) it is read on at once, so a chatty
                    # child never gets ahead.
                    # Its exit ends the wait at once (whoever waits for the child, waits for
                    # this reader to read it to the end).
                    self.proc.hold_output(True)
                    exited = asyncio.ensure_future(self.proc.wait())
                    try:
                        await asyncio.wait({exited}, timeout=LOG_READ_EVERY_S)
                    finally:
                        exited.cancel()
                        self.proc.hold_output(False)
        finally:
            self.returncode = await self.proc.wait()
            self._exited.set()
            _LIVE.discard(self)

    def _crash_hint(self) -> str:
        """A known cause, when the log shows one, for a child that died of a signal."""
        if self.returncode != -signal.SIGSEGV:
            return ""
        if any("AMX model buffer" in ln or "AMX_INT8 = 1" in ln for ln in self.parser.lines):
            return ("; this llama-server uses ggml's AMX kernels, which crash on some Xeons with quantised "
                    "weights (llama.cpp#20824): run `jupyter-llama engine build`, whose engine leaves them out, "
                    "and unset JUPYTER_LLAMA_SERVER")
        return ""

    async def _wait_ready(self) -> None:
        deadline_gap = self.load_timeout
        exited = asyncio.ensure_future(self._exited.wait())
        ready_line = asyncio.ensure_future(self._ready_line.wait())
        gap, asked = HEALTH_POLL_S, False
        try:
            while True:
                if self._exited.is_set():
                    await asyncio.sleep(0)  # let the reader drain the last lines
                    if self._stop_asked:  # it exited because we stopped it: no crash, no fault of the model
                        raise self._stopped_error()
                    if any("address already in use" in ln.lower() or "couldn't bind" in ln.lower()
                           for ln in list(self.parser.lines)[-20:]):
                        raise _PortTaken()
                    mistake = options_mistake(self.name, list(self.parser.lines)[-40:])
                    if mistake:  # the request's load options do not suit this model: the client's to change
                        raise BadRequest(mistake)
                    raise LoadError(
                        f"llama-server exited while loading {self.name} ({exit_words(self.returncode)})"
                        + self._crash_hint(),
                        exit_code=self.returncode, log_lines=self.parser.last_error_lines(),
                        oom=self.parser.oom)
                if asked and await self._health_ok():  # (not before the first wait: it has only just started)
                    self.ready_at = time.monotonic()
                    self.state = RunnerState.READY
                    return
                if time.monotonic() - self._last_output > deadline_gap:
                    raise LoadError(
                        f"llama-server stalled while loading {self.name}: no output and no answer on /health "
                        f"for {deadline_gap:.0f}s (load timeout; set JUPYTER_LLAMA_LOAD_TIMEOUT to wait longer)"
                        + (f"; it was loading onto RPC worker(s) {', '.join(self.options.rpc)}: one that stops "
                           "answering stalls the load" if self.options.rpc else ""),
                        log_lines=list(self.parser.lines)[-10:])
                # Wake on exit, on the log's "model loaded" line, or at the next poll tick; once
                # that line is out, the HTTP listener follows within milliseconds: poll fast.
                waiters = {exited} if ready_line.done() else {exited, ready_line}
                await asyncio.wait(waiters, timeout=HEALTH_POLL_READY_S if ready_line.done() else gap,
                                   return_when=asyncio.FIRST_COMPLETED)
                gap, asked = min(gap * 2, HEALTH_POLL_MAX_S), True
        finally:
            exited.cancel()
            ready_line.cancel()

    def _stopped_error(self) -> LoadStopped:
        return LoadStopped(f"the start of llama-server for {self.name} was stopped by its manager before the "
                           "model was ready")

    # ------------------------------------------------------------------ health

    async def _health_ok(self, timeout: float = HEALTH_TIMEOUT_S) -> bool:
        try:
            body = await http1.request_json(self._child_port, "/health", None, self._headers(), timeout=timeout)
        except (RequestError, ValueError, *_TRANSPORT_ERRORS):
            return False
        return isinstance(body, dict) and body.get("status") == "ok"

    async def health(self) -> bool:
        """True when the child is alive and answers ``/health`` with ok."""
        return self.alive and await self._health_ok()

    async def _watched(self, coro, last: list[float] | None = None):
        """Await ``coro`` (a request to the child) while watching for a wedged child: see
        STALL_CHECK_S. ``last[0]``, which the caller moves on, is the loop time of its latest
        progress; without it, progress is only the start.

        The watch is a timer beside the request, not a task around it, so a request costs no
        extra task and no extra turns of the event loop where it starts and ends (every
        stream passes here, and each turn is time before the first token and after the
        last). Only a request quiet for STALL_CHECK_S gets a watching task, which asks
        ``/health``; when it finds the child wedged it kills it and cancels the request,
        whose failure (the cancellation, or the connection the kill broke) is RunnerCrashed."""
        loop = asyncio.get_running_loop()
        last = last if last is not None else [loop.time()]
        task = asyncio.current_task()
        assert task is not None  # (a coroutine awaited in the event loop runs in a task)
        verdict: list[RunnerCrashed] = []
        cancelled: list[bool] = []  # the watch cancelled the request (and so may take it back)
        waiting = True  # still in ``await coro`` (the watch may cancel only that)
        watch: asyncio.Task | None = None

        async def watching() -> None:
            misses = 0
            while True:
                if loop.time() - last[0] < STALL_CHECK_S or await self._health_ok(STALL_HEALTH_TIMEOUT_S):
                    misses = 0
                else:
                    misses += 1
                    if misses >= STALL_MISSES:
                        break
                await asyncio.sleep(STALL_CHECK_S)
            quiet = loop.time() - last[0]
            verdict.append(RunnerCrashed(
                f"llama-server for {self.name} stopped answering: nothing for {quiet:.0f}s and no answer on "
                f"/health ({misses} tries); it was killed and will be started again on the next request"))
            self.state = RunnerState.FAILED
            self._signal(signal.SIGKILL)  # it stopped answering: the next request gets a fresh child
            if self.proc is not None:  # dead before anyone hears of it: `alive` is False from now on
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.proc.wait(), 5.0)
            if waiting:
                cancelled.append(True)
                task.cancel()

        timer: asyncio.TimerHandle  # the check that is due next (set below, moved on by due)

        def due() -> None:
            nonlocal timer, watch
            if loop.time() - last[0] < STALL_CHECK_S:
                timer = loop.call_at(last[0] + STALL_CHECK_S, due)
            else:
                watch = loop.create_task(watching())

        timer = loop.call_later(STALL_CHECK_S, due)
        try:
            return await coro
        except BaseException:
            waiting = False
            if not verdict:
                raise
            if watch is not None and not watch.done():
                with contextlib.suppress(BaseException):  # the kill, seen through: `alive` is False
                    await asyncio.shield(watch)
            if cancelled and task.cancelling():
                task.uncancel()  # the watch's own cancellation, now told as what it was
            raise verdict[0] from None
        finally:
            waiting = False
            timer.cancel()
            if watch is not None and not watch.done():
                watch.cancel()

    # ------------------------------------------------------------------ stop

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop gracefully (SIGTERM to its group), then forcefully (SIGKILL); always reap.

        A stop while the child is being started waits for that start to have a process to
        stop, and stops it; a stop before the start means no child is started at all
        (:meth:`start` raises :class:`LoadStopped`). Either way, when this returns no child of
        this runner is running, nor will be."""
        self._stop_asked = True
        async with self._stop_lock:
            if self._spawning is not None:
                await self._spawning.wait()
            if self.proc is None:
                self.state = RunnerState.STOPPED if self.state != RunnerState.FAILED else self.state
                return
            if self.state is not RunnerState.FAILED:
                self.state = RunnerState.STOPPING
            if self.proc.returncode is None:
                self._signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout)
                except asyncio.TimeoutError:
                    self._signal(signal.SIGKILL)
            await self._reap()
            if self.state != RunnerState.FAILED:
                self.state = RunnerState.STOPPED

    async def _reap(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), 10)
            except asyncio.TimeoutError:
                self._signal(signal.SIGKILL)
                await self.proc.wait()
        self.returncode = self.proc.returncode
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._reader.cancel()
        self.proc.close()  # the pipe and pidfd now, not at garbage collection
        _LIVE.discard(self)

    def _signal(self, sig: int) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # its own group: any helper it forked goes too
        except ProcessLookupError:
            pass
        except PermissionError:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill_now(self) -> None:
        """Synchronous last resort (atexit, finalisers): SIGKILL the child's group."""
        self._signal(signal.SIGKILL)


class _PortTaken(Exception):
    """The port we picked was taken before the child bound it; try another."""
