"""What the scheduler knows: the models with a runner, the requests holding them, and the
event log of its decisions.

:class:`Loaded` is the loop's own record of a model (its runner, timers, futures);
:class:`LoadedSnapshot` is the plain, frozen copy of it that the policy (:mod:`.policy`)
decides over, so that a rule can be tried on a table of snapshots without a process.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from ..load_options import LoadOptions
from ..memory.report import ACTUAL, MemoryReport
from ..models.names import same_model
from ..models.ref import ModelRef
from ..procs import process_alive

if TYPE_CHECKING:  # (types only: the state is not the engine's)
    from ..engine.runner import Runner
    from ..errors import JupyterLlamaError
    from .loop import Scheduler
    from .users import Gate

class ModelState(enum.StrEnum):
    """Where a loaded model is in its life (``Loaded.state``; ``ps`` shows it)."""

    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    GONE = "gone"  # its runner is stopped; about to leave ``Scheduler.loaded``


class EventKind(enum.StrEnum):
    """What a scheduler decision was about (``Event.kind``, ``GET /llama/api/events``)."""

    FIT = "fit"
    LOAD = "load"
    LOADED = "loaded"
    RELOAD = "reload"
    EVICT = "evict"
    UNLOAD = "unload"
    EXPIRE = "expire"
    OOM_RETRY = "oom_retry"
    CRASH = "crash"
    ERROR = "error"
    BUSY = "busy"
    RECOVER = "recover"
    RETRY = "retry"  # a request that found its child dead was sent again, to a fresh one
    # a shared manager's (see scheduler.users): a request waits for a slot, gets its turn, or
    # is refused by its user's quota
    QUEUE = "queue"
    TURN = "turn"
    REFUSE = "refuse"


# ----------------------------------------------------------------------------- events


@dataclass
class Event:
    """One scheduling decision, with the numbers behind it."""

    seq: int
    time: float  # epoch seconds
    kind: EventKind
    model: str | None
    message: str
    data: dict = field(default_factory=dict)

    def concerns(self, model: str | None) -> bool:
        """Whether this event is about ``model`` (any name for it: ``m`` is ``m:latest``); None: any."""
        return model is None or same_model(self.model, model)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class EventLog:
    """A bounded history of events with live subscribers."""

    def __init__(self, maxlen: int = 1000):
        self.history: collections.deque[Event] = collections.deque(maxlen=maxlen)
        self._seq = 0
        self._subscribers: set[asyncio.Queue] = set()

    def emit(self, kind: EventKind, model: str | None, message: str, **data) -> Event:
        self._seq += 1
        ev = Event(self._seq, time.time(), kind, model, message, data)
        self.history.append(ev)
        for q in list(self._subscribers):
            if q.full():  # a slow subscriber loses its oldest events, never blocks us
                q.get_nowait()
            q.put_nowait(ev)
        return ev

    def recent(self, model: str | None = None, limit: int = 50, since: int = 0) -> list[Event]:
        out = [e for e in self.history if e.seq > since and e.concerns(model)]
        return out[-limit:]

    def listen(self, maxsize: int = 1000) -> "Subscription":
        """Start receiving events now (registered before this returns, so nothing is missed)."""
        return Subscription(self, maxsize)

class Subscription:
    """A live feed of events; use as a context manager, ``await get()`` each one."""

    def __init__(self, log: EventLog, maxsize: int):
        self._log = log
        self.queue: asyncio.Queue[Event] = asyncio.Queue(maxsize)
        log._subscribers.add(self.queue)

    async def get(self) -> Event:
        return await self.queue.get()

    def close(self) -> None:
        self._log._subscribers.discard(self.queue)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- loaded runners

# Load options the scheduler fills in from the devices it places a model on; a request never
# asks for them, so they never force a reload.
PLACEMENT_FIELDS = ("fit_target_mib", "rpc")


@dataclass(frozen=True)
class LoadedSnapshot:
    """A loaded model as the policy sees it: plain values copied at one moment
    (:meth:`Loaded.snapshot`), never a runner. ``by_device`` is what it counts against the
    budgets there (its actual figures once known, else its prediction)."""

    name: str
    key: str  # the runner's identity (``ModelRef.key``: the file, and its projector)
    path: str
    keep_alive: float  # seconds; inf: pinned
    refcount: int  # requests holding it now
    state: ModelState
    by_device: Mapping[str, int] = field(default_factory=dict)

    @property
    def pinned(self) -> bool:
        return math.isinf(self.keep_alive)


@dataclass
class Loaded:
    """A model with a runner (loading, ready or unloading), as ``ps`` shows it."""

    ref: ModelRef
    options: LoadOptions
    keep_alive: float
    predictions: dict[str, MemoryReport]
    fit_source: str
    runner: Runner | None = None
    state: ModelState = ModelState.LOADING  # loading -> ready -> unloading -> gone
    refcount: int = 0
    loaded_at: float | None = None
    expires_at: float | None = None  # epoch seconds; None while busy or pinned
    unload_when_idle: str | None = None  # a reason, when an unload waits for requests to finish
    ready: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None
    last_used: float = field(default_factory=time.monotonic)
    load_duration: float = 0.0
    also_as: set[str] = field(default_factory=set)  # other names of the same file it has served
    # Set when the manager stops it before its load has finished (its name now means another
    # file, it was deleted, the manager shuts down): what the requests waiting for that load
    # are answered with, instead of the child's exit worded as a crash.
    cancelled: JupyterLlamaError | None = None
    # A shared manager's (see scheduler.users): whose request loaded it (its memory counts
    # against that person's quota), who holds it now (requests in flight per person), and
    # who has used it since it loaded. Empty in a single-user manager.
    loaded_by: str | None = None
    users: collections.Counter = field(default_factory=collections.Counter)
    used_by: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def pinned(self) -> bool:
        return math.isinf(self.keep_alive)

    @property
    def actual(self) -> MemoryReport | None:
        if self.runner is None or self.state not in (ModelState.READY, ModelState.UNLOADING):
            return None
        rep = self.runner.memory()
        return rep if rep.total() > 0 else None

    @property
    def charge(self) -> MemoryReport:
        """What this runner counts against budgets: actual once known, else the prediction."""
        return self.actual or self.predictions[self.fit_source]

    def snapshot(self) -> LoadedSnapshot:
        """This model as the policy decides over it, now."""
        return LoadedSnapshot(self.name, self.ref.key, self.ref.path, self.keep_alive, self.refcount, self.state,
                              self.charge.by_device())

    def differences(self, requested: LoadOptions, name: str | None = None) -> list[str]:
        """The load options in which this model differs from what a request for ``name`` asks
        (empty when it serves the request as it is).

        Asked under the name it was loaded under (or with no name), an automatic (None) value
        matches anything: a client that sets nothing, as OpenAI's cannot, takes the model as
        it is loaded. Another name of the same file (a preset and the model it is made from)
        has load options of its own, as Ollama gives each name: there a None asks for the
        default, so it matches only a runner loaded without that option, and the context
        compares as the context each request gets."""
        other = name is not None and not same_model(name, self.name)
        diffs = []
        for f in dataclasses.fields(LoadOptions):
            if f.name in PLACEMENT_FIELDS:  # set by the scheduler, not the caller
                continue
            want = getattr(requested, f.name)
            if other and f.name in ("num_ctx", "default_ctx"):
                if f.name == "num_ctx" and requested.request_ctx != self.options.request_ctx:
                    diffs.append(f.name)
                continue
            if want is None:
                if other and getattr(self.options, f.name) is not None:
                    diffs.append(f.name)
                continue
            if f.name == "embedding" and not want and self.options.embedding:
                # A child started with --embeddings also completes (b11434 turns embeddings on
                # per batch), so generate after embed needs no reload: no ping-pong between them.
                continue
            if want != getattr(self.options, f.name):
                diffs.append(f.name)
        return diffs

    def log(self, lines: int = 200, match: str | None = None) -> dict:
        """The child's last ``lines`` log lines (those containing ``match``, if given)."""
        runner = self.runner
        kept = list(runner.parser.lines) if runner else []
        if match:
            kept = [ln for ln in kept if match in ln]
        return {"model": self.name, "pid": runner.pid if runner else None, "state": self.state,
                "argv": list(runner.argv) if runner and runner.argv else [],
                "lines": kept[-lines:] if lines > 0 else [],
                "lines_seen": runner.parser.n_lines if runner else 0}

    @property
    def shown_state(self) -> ModelState:
        """Its state as ``ps`` tells it: a ready model whose child has died is unloading (the
        scheduler is about to stop it), from the moment the child's death can be seen, not
        from when the loop has acted on it. Seen as anyone sees it: a child killed is a
        zombie in /proc while its threads are still being torn down, before its exit can be
        reaped (``Runner.alive``) or its pidfd wakes the loop."""
        r = self.runner
        if self.state == ModelState.READY and r is not None and (
                not r.alive or (r.pid is not None and not process_alive(r.pid))):
            return ModelState.UNLOADING
        return self.state

    def info(self) -> dict:
        actual = self.actual
        charge = self.charge
        return {
            "name": self.name, "also_as": sorted(self.also_as), "path": self.ref.path, "digest": self.ref.digest,
            "state": self.shown_state,
            "options": self.options.to_dict(), "keep_alive": None if self.pinned else self.keep_alive,
            "pinned": self.pinned, "refcount": self.refcount, "expires_at": self.expires_at,
            "last_used": time.time() - (time.monotonic() - self.last_used),  # epoch seconds
            "pid": self.runner.pid if self.runner else None,
            "load_duration": self.load_duration,
            "context_length": (actual.n_ctx if actual and actual.n_ctx else self.options.total_ctx),
            "layers_offloaded": actual.layers_offloaded if actual else None,
            "layers_total": actual.layers_total if actual else None,
            "size": charge.total(), "size_vram": charge.gpu_total,
            "by_device": charge.by_device(), "workers": list(self.options.rpc or ()),
            "memory": {k: v.to_dict() for k, v in self.predictions.items()} | (
                {ACTUAL: actual.to_dict()} if actual else {}),
        } | ({"loaded_by": self.loaded_by, "users": dict(self.users), "used_by": sorted(self.used_by)}
             if self.loaded_by is not None or self.used_by else {})


class Lease:
    """A request's hold on a ready runner. Release it (or use ``async with``) when done.

    ``runner`` is the runner to send the request to, as a :class:`LeasedRunner`: a request
    that finds its child dead before any of its answer went to the caller is sent once more,
    to a fresh runner of the same model (loaded as ``acquire(*again)`` would load it), and
    this lease holds that runner from then on. ``loaded`` is the model it holds now."""

    def __init__(self, scheduler: "Scheduler", loaded: Loaded, load_duration: float,
                 again: tuple | None = None, who=None):
        self._scheduler = scheduler
        self.who = who  # the person whose request holds it (a shared manager's), else None
        self._gate: Gate | None = None  # the slot it holds on a shared manager's fair queue (scheduler.users)
        self._finished = False  # its request has counted out of the shared manager's books
        self.loaded = loaded
        self._runner: Runner = loaded.runner  # type: ignore[assignment]
        self.runner = LeasedRunner(self)
        self.load_duration = load_duration
        self._released = False
        self._again = again  # (name, options, keep_alive) of the acquire that made it: for the retry
        self._retried = False
        self._swap: asyncio.Lock | None = None

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._scheduler._release(self.loaded, self.who)
        if not self._finished:  # (its request counts out once, whichever runner it ended on)
            self._finished = True
            if self.who is not None and self._scheduler.users is not None:
                self._scheduler.users.finish(self)

    async def _fresh_runner(self, dead: "Runner", error: Exception) -> "Runner | None":
        """A fresh runner for a request that failed on ``dead``'s dead child, or None when it
        may not be retried (retried once already, released, or the name now means another
        file). Calls of one request that failed together share the one retry."""
        if self._swap is None:
            self._swap = asyncio.Lock()
        async with self._swap:
            if self._runner is not dead:  # another call of this request has found a fresh one
                return self._runner
            if self._retried or self._released or self._again is None:
                return None
            self._retried = True
            old = self.loaded
            self._scheduler.events.emit(
                EventKind.RETRY, old.name,
                f"a request to {old.name} found its llama-server (pid {dead.pid}) dead before any of its answer was "
                f"sent ({error}); sending it once more, to a fresh runner",
                pid=dead.pid, exit_code=dead.returncode)
            self._released = True  # (the dead one's hold goes: its release lets the scheduler retire it)
            self._scheduler._release(old, self.who)
            # (the request keeps its turn on a shared manager's queue: same model, same slot)
            fresh = await self._scheduler._acquire(*self._again)
            if fresh.loaded.ref.key != old.ref.key:  # the name moved meanwhile: not the same model
                fresh._released = fresh._finished = True  # (its hold only: the turn and count are this lease's)
                self._scheduler._release(fresh.loaded, fresh.who)
                return None
            fresh._released = fresh._finished = True  # (its hold is this lease's now)
            self.loaded, self._runner, self._released = fresh.loaded, fresh._runner, False
            return self._runner

    async def __aenter__(self) -> "Lease":
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


def _retryable(e: BaseException) -> bool:
    return getattr(e, "retryable", False) is True


class LeasedRunner:
    """The runner a :class:`Lease` holds, with its interface: attributes are the runner's;
    a call that fails because the child was dead before any of its answer went to the
    caller (``RunnerCrashed.retryable``) is made once more on a fresh runner (see
    :meth:`Lease._fresh_runner`), with a ``retry`` event. Awaitables and async iterators
    alike; anything else is the runner's call as it is."""

    __slots__ = ("_lease",)

    def __init__(self, lease: Lease):
        self._lease = lease

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._lease._runner, name)
        if name.startswith("_") or not inspect.ismethod(value):
            return value

        def call(*args, **kwargs):
            runner = self._lease._runner
            first = getattr(runner, name)(*args, **kwargs)
            if inspect.isawaitable(first):
                return self._awaited(runner, name, first, args, kwargs)
            if hasattr(first, "__aiter__"):
                return self._iterated(runner, name, first, args, kwargs)
            return first

        return call

    async def _awaited(self, runner, name, first, args, kwargs):
        try:
            return await first
        except Exception as e:
            if not _retryable(e):
                raise
            fresh = await self._lease._fresh_runner(runner, e)
            if fresh is None:
                raise
        return await getattr(fresh, name)(*args, **kwargs)

    async def _iterated(self, runner, name, first, args, kwargs):
        answered = False
        try:
            async with contextlib.aclosing(first) as events:
                async for event in events:
                    answered = True
                    yield event
            return
        except Exception as e:
            if answered or not _retryable(e):
                raise
            fresh = await self._lease._fresh_runner(runner, e)
            if fresh is None:
                raise
        async with contextlib.aclosing(getattr(fresh, name)(*args, **kwargs)) as events:
            async for event in events:
                yield event

    def __repr__(self) -> str:
        return f"<leased {self._lease._runner!r}>"

    async def __aenter__(self) -> "LeasedRunner":
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()
