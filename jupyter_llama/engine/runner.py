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
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import enum
import os
import re
import secrets
import shutil
import signal
import socket
import time
import weakref
from pathlib import Path
from typing import Any, AsyncGenerator, Awaitable, overload

from ..errors import BadRequest, EngineError, RequestError
from ..load_options import LoadOptions
from ..memory.report import MemoryReport
from ..procs import child_environment, exit_words
from . import http1
from .http1 import BadResponse, sse_events
from .launch import build_argv
from .logparse import LogParser
from .process import ChildProcess

CRASH_MESSAGE = ("model runner has unexpectedly stopped, this may be due to resource limitations "
                 "or an internal error")

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


class LoadError(EngineError):
    """The child failed to start. Carries its exit code and its last error lines."""

    def __init__(self, message: str, *, exit_code: int | None = None, log_lines: list[str] | None = None,
                 oom: bool = False):
        self.exit_code = exit_code
        self.log_lines = list(log_lines or [])
        self.oom = oom
        detail = "\n".join(f"  | {ln}" for ln in self.log_lines[-10:])
        super().__init__(message + (f"\nlast lines of the llama-server log:\n{detail}" if detail else ""))


class RunnerCrashed(EngineError):
    """The child died while serving a request. ``retryable``: it was dead before any of the
    request's answer went to the caller (the request found it dead, or its connection broke
    before the first event), so sending the request again, to a fresh child, repeats nothing
    the caller has seen; False when some of the answer had gone, or when the child was
    killed for not answering (a request that wedges a child may well wedge the next)."""

    def __init__(self, message: str, *, retryable: bool = False):
        self.retryable = retryable
        super().__init__(message)


class LoadStopped(EngineError):
    """The child's start was stopped by its manager (:meth:`Runner.stop` while it loaded): no
    crash of the engine, and no fault of the model. Whoever stopped it says why."""


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


class RunnerState(enum.StrEnum):
    """A runner's life: new -> starting -> ready -> stopping -> stopped, or failed."""

    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


# how a child's connection fails when the child does (it crashed, was killed, hung up)
_TRANSPORT_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, BadResponse)


class Runner:
    """A llama-server child for one model file under one set of load options."""

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

    async def _health_ok(self, timeout: float = HEALTH_TIMEOUT_S) -> bool:
        try:
            body = await http1.request_json(self._child_port, "/health", None, self._headers(), timeout=timeout)
        except (RequestError, ValueError, *_TRANSPORT_ERRORS):
            return False
        return isinstance(body, dict) and body.get("status") == "ok"

    async def health(self) -> bool:
        """True when the child is alive and answers ``/health`` with ok."""
        return self.alive and await self._health_ok()

    # ------------------------------------------------------------------ requests

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    async def lost_workers(self) -> list[str]:
        """The RPC workers of this child that no longer accept connections (asked once, after
        the child died: llama.cpp's abort says only that *a* remote RPC server failed)."""
        if self._lost_workers is None:
            from ..memory.rpc import listening

            eps = list(self.options.rpc or ())
            alive = await asyncio.gather(*(asyncio.to_thread(listening, ep, 1.0) for ep in eps))
            self._lost_workers = [ep for ep, up in zip(eps, alive, strict=True) if not up]
        return self._lost_workers

    def _crash_error(self, retryable: bool = False) -> RunnerCrashed:
        code = self.returncode if self.returncode is not None else (self.proc.returncode if self.proc else None)
        tail = self.parser.last_error_lines(5)
        detail = f" ({exit_words(code)})" if code is not None else ""
        if self._lost_workers:
            detail += f"; RPC worker {', '.join(self._lost_workers)} went away (connection refused)"
        if tail:
            detail += "; last log lines: " + " | ".join(tail)
        return RunnerCrashed(f"{CRASH_MESSAGE}{detail}", retryable=retryable)

    async def _after_transport_error(self, exc: Exception, answered: bool = True) -> EngineError:
        """The error for a request whose connection to the child failed: RunnerCrashed when
        the child is dead (``retryable`` when nothing of the answer had gone to the caller,
        ``answered`` False), else an EngineError that says how the request failed."""
        # Give the reader a moment to notice the exit, so the message carries the exit code.
        if self.proc is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._exited.wait()), 0.5)
            except asyncio.TimeoutError:
                pass
        if not self.alive:
            self.state = RunnerState.FAILED if self.state != RunnerState.STOPPING else self.state
            if self.options.rpc:
                await self.lost_workers()
            return self._crash_error(retryable=not answered)
        return EngineError(f"request to llama-server for {self.name} failed: {str(exc) or type(exc).__name__}")

    def _check_ready(self) -> None:
        if self.state != RunnerState.READY or not self.alive:
            if self.proc is not None and not self.alive and self.state != RunnerState.STOPPED:
                raise self._crash_error(retryable=True)  # dead before this request sent anything
            raise EngineError(f"runner for {self.name} is not ready ({self.state})")

    async def post(self, path: str, payload: dict) -> Any:
        """A request that is answered whole (an embedding, a template applied, a chat not
        streamed); returns its decoded JSON body. Watched as a stream is (see :meth:`_watched`),
        with no progress to see: /health decides after STALL_CHECK_S."""
        return await self._json(path, payload)

    async def get(self, path: str) -> Any:
        return await self._json(path, None)

    async def _json(self, path: str, payload) -> Any:
        """POST ``payload`` (None: a GET) on a fresh connection of our own HTTP/1.1 (see
        :mod:`.http1`): no client library between, whose layers cost about as much CPU again as
        the request itself, and a request before the first token (the template applied to a
        generate's prompt) waits for all of it. A status of 400 or more is the child's
        RequestError; a broken connection says whether the child is gone."""
        self._check_ready()
        try:
            return await self._watched(http1.request_json(self._child_port, path, self._windows(payload),
                                                          self._headers()))
        except _TRANSPORT_ERRORS as e:  # (answered whole or not at all: nothing went to the caller)
            raise await self._after_transport_error(e, answered=False) from None
        except ValueError as e:  # not the JSON llama-server answers with
            raise EngineError(f"llama-server for {self.name} answered {path} with something that is not JSON "
                              f"({e})") from None

    def stream_sse(self, path: str, payload: dict) -> AsyncGenerator[dict, None]:
        """POST with ``stream: true``; yield each server-sent event's JSON object.

        Closing the iterator (or cancelling its consumer) closes the connection, which
        makes llama-server stop generating for it. This path carries every token a user
        receives, so it talks HTTP/1.1 to the child over a plain asyncio protocol (see
        :mod:`.http1`) rather than through a client library: the child is ours, on loopback,
        and answers a streamed request with chunked SSE, and per token httpx's layers cost
        more CPU than the rest of the relay together (bench/api_overhead.py; the CPU it takes
        is taken from the child, which uses every core).
        """
        return self._guarded(path, self._windows(payload))

    @overload
    def _windows(self, payload: dict) -> dict: ...

    @overload
    def _windows(self, payload: None) -> None: ...

    def _windows(self, payload: dict | None) -> dict | None:
        """``payload`` with a penalty window of -1 (Ollama's "the whole context", for
        ``repeat_last_n``; llama.cpp's, for ``dry_penalty_last_n``) made this child's context
        per request, which llama-server takes where it refuses -1 (while that is not known,
        left to llama-server's default: 0 would turn the penalty off)."""
        if payload is None or (payload.get("repeat_last_n") != -1 and payload.get("dry_penalty_last_n") != -1):
            return payload
        n_ctx = self._request_ctx()
        windows = ("repeat_last_n", "dry_penalty_last_n")
        if not n_ctx:
            return {k: v for k, v in payload.items() if not (k in windows and v == -1)}
        return {**payload, **{k: n_ctx for k in windows if payload.get(k) == -1}}

    async def _guarded(self, path: str, payload: dict) -> AsyncGenerator[dict, None]:
        """:func:`.http1.sse_events`, once the child is known to be ready; a broken connection
        says whether the child is gone."""
        self._check_ready()
        events = sse_events(self._child_port, path, payload, self.api_key)
        answered = False
        try:  # closing this iterator closes the child's connection at once, not at garbage collection
            async with contextlib.aclosing(events) as evs:
                async for event in evs:
                    answered = True
                    yield event
        except _TRANSPORT_ERRORS as e:
            raise await self._after_transport_error(e, answered) from None

    async def relay_sse(self, path: str, payload: dict, on_data, named: bool = False) -> None:
        """POST with ``stream: true``; each batch of events' data (JSON bytes, as the child
        wrote them) goes to ``on_data`` from the event loop's read callback, with no task
        switch per token (see :mod:`.http1`; a pending future it returns pauses reading).
        ``named``: a stream of named events (Responses, Anthropic Messages), each passed on
        with its ``event:`` line (see :func:`.http1.sse_sink`). Returns when the stream
        ends; cancelling it closes the child's connection."""
        self._check_ready()
        loop = asyncio.get_running_loop()
        last = [loop.time()]
        answered = [False]  # on_data was given something (even the head, an empty batch)

        def progressing(batch):
            last[0] = loop.time()
            answered[0] = True
            return on_data(batch)

        try:
            await self._watched(http1.relay_sse(self._child_port, path, self._windows(payload), self.api_key,
                                                progressing, named), last)
        except _TRANSPORT_ERRORS as e:
            raise await self._after_transport_error(e, answered[0]) from None

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

    # ------------------------------------------------------------------ the child's protocol

    async def prompt(self, prompt: str, system: str = "", *, raw: bool = False, templated: bool = True,
                     history: list[dict] | None = None) -> str:
        """The text for ``/completion``: ``prompt`` as given (``raw``), or a system turn, the
        ``history`` turns (a model preset's messages) and the user turn through the model's own
        chat template (llama-server's ``/apply-template``); a model without a template gets
        their texts, a blank line apart."""
        if raw:
            return prompt
        history = list(history or [])
        if not templated:
            return "".join(t + "\n\n" for t in [system] + [m.get("content", "") for m in history] if t) + prompt
        messages = ([{"role": "system", "content": system}] if system else []) + history + [
            {"role": "user", "content": prompt}]
        res = await self.post("/apply-template", {"messages": messages})
        return res.get("prompt", prompt)

    def _request_ctx(self) -> int | None:
        """The context one request may use (from the log once the child has said it)."""
        return self.parser.n_ctx_seq or self.parser.n_ctx or self.options.num_ctx

    async def _tokens_over(self, text: str, most: int) -> list[int] | None:
        """``text``'s tokens if there are more than ``most``, else None; text of no more than
        ``most`` bytes is not even tokenised (a token is at least one byte)."""
        if len(text.encode()) <= most:
            return None
        tokens = await self.tokenize(text)
        return tokens if len(tokens) > most else None

    def _prompt_room(self, reserve: int) -> tuple[int | None, int]:
        """(the request's context, the most prompt tokens that leave ``reserve`` of it, at most
        half of it, to generate in); (None, 0) while the context is not known."""
        n_ctx = self._request_ctx()
        if not n_ctx:
            return None, 0
        return n_ctx, max(1, n_ctx - max(0, min(reserve, n_ctx // 2))) - 1

    @property
    def slots(self) -> int:
        """Requests the child works on at once (its ``n_seq_max``, from its log; before that, the
        slots it was asked for, or 1)."""
        return self.parser.n_seq or self.options.num_parallel or 1

    async def fit_to_context(self, prompt: str, reserve: int, truncate: bool = True,
                             context: list[int] | None = None) -> str | list:
        """``prompt`` as it fits a request's context with ``reserve`` tokens left to generate
        in: unchanged when it fits, else (as Ollama does) its first token and its end, as
        token ids; with ``truncate`` False, a 400 that says how long it is.

        ``context``: token ids that come before ``prompt`` (Ollama's ``context``, what an
        earlier answer gave), which ``prompt``'s tokens follow without a BOS of their own. The
        prompt is then ``[*context, prompt]``, a list the child's ``/completion`` reads as those
        ids and the text's tokens, when it fits without counting (its bytes and the ids are
        within the room: no tokenize before the answer starts); else the ids of both, cut as
        above when they do not fit."""
        n_ctx, most = self._prompt_room(reserve)
        if context:
            whole: str | list = [*context, prompt] if prompt else list(context)
            if not n_ctx or len(context) + len(prompt.encode()) <= most:
                return whole
            tokens = context + (await self.tokenize(prompt, add_special=False) if prompt else [])
            if len(tokens) <= most:
                return tokens
            what = "the context and the prompt are"
        else:
            if not n_ctx:
                return prompt
            over = await self._tokens_over(prompt, most)
            if over is None:
                return prompt
            tokens = over
            what = "the prompt is"
        if not truncate:
            raise BadRequest(f"{what} {len(tokens)} tokens, longer than the context of {self.name} "
                             f"({n_ctx} tokens, {n_ctx - most - 1} of them kept to generate in); shorten it, load "
                             "the model with a larger num_ctx, or allow truncate")
        return tokens[:1] + tokens[len(tokens) - (most - 1):] if most > 1 else tokens[:most]

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """``text``'s token ids as the child makes them (``/tokenize``; ``add_special``: with the
        model's BOS, as ``/completion`` tokenizes a text prompt). A small request on the child's
        HTTP thread: it may run beside a stream."""
        res = await self.post("/tokenize", {"content": text, "add_special": add_special})
        return list(res.get("tokens") or []) if isinstance(res, dict) else []

    async def prompt_tokens(self, prompt: str | list) -> list[int]:
        """The token ids the child makes of a ``/completion`` prompt as :meth:`fit_to_context`
        gives it (and llama-server reads it): a text, with the model's BOS; ids, as they are;
        ids then a text, the text's tokens without a BOS after them. (No loop over the ids:
        a context may be long, and this runs beside a stream.)"""
        if isinstance(prompt, str):
            return await self.tokenize(prompt, add_special=True)
        if prompt and isinstance(prompt[-1], str):
            ids = prompt[:-1]
            return ids + await self.tokenize(prompt[-1], add_special=not ids)
        return list(prompt)

    async def conversation_tokens(self, prompt: str | list, answer: str) -> list[int]:
        """The token ids of a ``/completion`` prompt (as :meth:`prompt_tokens` reads it)
        followed by the text of its answer, as Ollama counts a conversation (its ``context``:
        the prompt and the answer tokenized together): the text joins the prompt's text, or
        follows its ids."""
        if isinstance(prompt, str):
            return await self.prompt_tokens(prompt + answer)
        if prompt and isinstance(prompt[-1], str):
            return await self.prompt_tokens([*prompt[:-1], prompt[-1] + answer])
        return await self.prompt_tokens([*prompt, answer]) if answer else list(prompt)

    async def embed(self, inputs: list[str], truncate: bool = True) -> tuple[list, int]:
        """``/embedding`` for ``inputs``, in input order, and the number of prompt tokens they
        took. Each item is one vector when the model pools, or one vector per token when it
        does not (pooling ``none``); pooling and normalising are the API's business. An input
        longer than the context keeps its beginning (Ollama's ``truncate``), or with
        ``truncate`` False is a 400."""
        if not inputs:
            return [], 0
        # the longest input: the request's context, and the micro-batch, which takes an input whole
        n_ctx, n_batch = self._request_ctx(), self.parser.n_ubatch
        most = (min(n_ctx, n_batch) if n_ctx and n_batch else n_ctx or n_batch) or 0  # (0: neither is known)
        content: list = list(inputs)
        for i, text in enumerate(inputs if most else ()):
            over = await self._tokens_over(text, most)
            if over is None:
                continue
            if not truncate:
                what = (f"the context of {self.name} ({most})" if most == n_ctx else f"the batch of {self.name} "
                        f"({most}: an input is embedded in one batch, no longer than the context)")
                raise BadRequest(f"input {i} is {len(over)} tokens, longer than {what}; split it, load the model "
                                 f"with a larger {'num_ctx' if most == n_ctx else 'num_ctx or num_batch'}, or allow "
                                 "truncate")
            content[i] = over[:most]
        try:
            res = await self.post("/embedding", {"content": content})
        except RequestError as e:
            if "too large to process" not in str(e):
                raise
            raise BadRequest(f"an input to embed is longer than the micro-batch of {self.name} ({e}); split it, "
                             "or load the model with a larger num_ubatch (or leave it unset)") from None
        items = sorted(res if isinstance(res, list) else [res], key=lambda it: it.get("index", 0))
        vectors = [it.get("embedding") or [] for it in items]
        if vectors and vectors[0] and isinstance(vectors[0][0], list):  # per-token vectors: one per prompt token
            return vectors, sum(len(v) for v in vectors)
        tokens = 0
        for item in content:  # what was embedded: the text, or its tokens when it was cut
            if isinstance(item, list):
                tokens += len(item)
                continue
            try:
                tokens += len(await self.tokenize(item, add_special=False))
            except EngineError:
                break
        return vectors, tokens

    def completion(self, prompt: str | list, **params) -> AsyncGenerator[dict, None]:
        """Stream llama-server's native ``/completion`` chunks (``content``, ``stop``, ``timings``); the
        prompt is text, or token ids (a prompt cut to the context), or ids then a text (see
        :meth:`fit_to_context`)."""
        return self.stream_sse("/completion", {"prompt": prompt, **params})

    def chat(self, messages: list[dict], **params) -> AsyncGenerator[dict, None]:
        """Stream OpenAI-style ``/v1/chat/completions`` chunks."""
        return self.stream_sse("/v1/chat/completions", {"messages": messages, **params})

    def relay_completion(self, prompt: str | list, on_data, **params) -> Awaitable[None]:
        """:meth:`completion` through :meth:`relay_sse`: its events' JSON to ``on_data``."""
        return self.relay_sse("/completion", {"prompt": prompt, **params}, on_data)

    async def relay_chat(self, messages: list[dict], on_data, *, truncate: bool = True, **params) -> None:
        """:meth:`chat` through :meth:`relay_sse` (see :meth:`send_chat`)."""
        await self.send_chat({"messages": messages, **params}, on_data, truncate=truncate)

    async def send_chat(self, body: dict, on_data=None, *, truncate: bool = True):
        """``/v1/chat/completions`` with ``body``: its events' data to ``on_data`` (as
        :meth:`relay_sse` hands them), or without it the answer (:meth:`post`). A chat longer
        than the context (the child refuses it before it answers) is sent again with what
        :meth:`fit_chat` keeps, as Ollama does; with ``truncate`` False it is a 400 that says so."""
        async def send(b: dict):
            if on_data is None:
                return await self.post("/v1/chat/completions", b)
            return await self.relay_sse("/v1/chat/completions", b, on_data)

        try:
            return await send(body)
        except RequestError as e:
            if not e.context_exceeded:
                raise
            if not truncate:
                raise BadRequest(f"the chat is longer than the context of {self.name} ({e}); shorten it, load the "
                                 "model with a larger num_ctx, or allow truncate (which drops the oldest messages "
                                 "but the system ones)") from None
        return await send(await self.cut_chat(body))

    async def cut_chat(self, body: dict) -> dict:
        """A chat-completions ``body`` the child refused as longer than its context, with the
        messages :meth:`fit_chat` keeps (room left for the body's ``n_predict``, or OpenAI's
        ``max_tokens``/``max_completion_tokens``); a 400 when even that is too long."""
        messages = list(body.get("messages") or [])
        params = {k: v for k, v in body.items() if k != "messages"}
        n = next((params[k] for k in ("n_predict", "max_completion_tokens", "max_tokens") if k in params), None)
        reserve = reserve_for({"n_predict": n})
        kept = await self.fit_chat(messages, reserve, **params)
        if len(kept) == len(messages):
            n_ctx, most = self._prompt_room(reserve)
            size = ""
            if n_ctx:  # (how long, and how much room: the numbers that say how much to cut)
                prompt = (await self.post("/apply-template", {"messages": kept, **_template_params(params)})
                          ).get("prompt", "")
                size = (f" ({len(await self.tokenize(prompt)):,} tokens, where the context of {n_ctx:,} has room "
                        f"for {most:,} beside the answer)")
            raise BadRequest(f"the chat's last message and its system messages, which a cut chat keeps, are longer "
                             f"than the context of {self.name}{size}: shorten them, or load the model with a larger "
                             "num_ctx")
        return {**body, "messages": kept}

    async def fit_chat(self, messages: list[dict], reserve: int, **params) -> list[dict]:
        """What Ollama keeps of a chat longer than the context (its ``chatPrompt``): the
        newest messages that fit with ``reserve`` tokens left to generate in, never fewer than
        the last one (with the assistant turn whose tool calls it answers, for a tool
        result), and the system messages from before them. The prompt of each candidate is
        the model's template applied by the child (``/apply-template``, with the request's
        tools and template options), counted as :meth:`fit_to_context` counts."""
        _n_ctx, most = self._prompt_room(reserve)
        template = _template_params(params)
        starts = sorted({_turn_start(messages, i) for i in range(len(messages))})

        def kept(start: int) -> list[dict]:
            return [m for m in messages[:start] if m.get("role") == "system"] + messages[start:]

        async def fits(start: int) -> bool:
            prompt = (await self.post("/apply-template", {"messages": kept(start), **template})).get("prompt", "")
            return await self._tokens_over(prompt, most) is None

        lo, hi = 0, len(starts) - 1  # the oldest start that fits, by bisection (fewer messages, fewer tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if await fits(starts[mid]):
                hi = mid
            else:
                lo = mid + 1
        return kept(starts[lo])

    def relay_infill(self, prefix: str, suffix: str, on_data, **params) -> Awaitable[None]:
        """Fill in the middle (llama-server's ``/infill``, with the model's FIM tokens): native
        ``/completion`` events, as :meth:`relay_completion`."""
        return self.relay_sse("/infill", {"input_prefix": prefix, "input_suffix": suffix, **params}, on_data)

    async def complete_text(self, prompt: str, **params) -> tuple[str, dict]:
        """Convenience: the whole completion text and the final chunk's timings."""
        parts, timings = [], {}
        async for chunk in self.completion(prompt, **params):
            parts.append(chunk.get("content", ""))
            if chunk.get("stop"):
                timings = chunk.get("timings", {})
        return "".join(parts), timings

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


DEFAULT_RESERVE = 256  # tokens a prompt cut to the context leaves to generate in, when the request sets no limit


def reserve_for(params: dict) -> int:
    """Tokens a prompt cut to the context leaves to generate in: the request's ``n_predict``
    when it sets one, else :data:`DEFAULT_RESERVE`."""
    n = params.get("n_predict")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else DEFAULT_RESERVE


def _template_params(params: dict) -> dict:
    """What of a chat request's fields the model's template reads besides the messages."""
    return {k: params[k] for k in ("tools", "chat_template_kwargs", "tool_choice") if k in params}


def _turn_start(messages: list[dict], i: int) -> int:
    """Where a chat cut before message ``i`` may start: ``i``, or for a tool result, the
    assistant turn whose tool calls it answers (a result never loses its call)."""
    if not 0 < i < len(messages) or messages[i].get("role") != "tool":
        return i
    start = i
    while start > 0 and messages[start - 1].get("role") == "tool":
        start -= 1
    if start > 0 and messages[start - 1].get("role") == "assistant" and messages[start - 1].get("tool_calls"):
        return start - 1
    return i


class _PortTaken(Exception):
    """The port we picked was taken before the child bound it; try another."""
