"""What the scheduler knows: the models with a runner, the requests holding them, and the
event log of its decisions.

:class:`Loaded` is the loop's own record of a model (its runner, timers, futures);
:class:`LoadedSnapshot` is the plain, frozen copy of it that the policy (:mod:`.policy`)
decides over, so that a rule can be tried on a table of snapshots without a process.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ..load_options import LoadOptions
from ..memory.report import ACTUAL, MemoryReport
from ..models.names import same_model
from ..models.ref import ModelRef

if TYPE_CHECKING:  # (types only: the state is not the engine's)
    from ..engine.runner import Runner
    from .loop import Scheduler

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

    def matches(self, requested: LoadOptions) -> list[str]:
        """Options that differ from what the request asks; automatic (None) values match anything."""
        diffs = []
        for f in dataclasses.fields(LoadOptions):
            if f.name in PLACEMENT_FIELDS:  # set by the scheduler, not the caller
                continue
            want = getattr(requested, f.name)
            if want is None:
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

    def info(self) -> dict:
        actual = self.actual
        charge = self.charge
        return {
            "name": self.name, "also_as": sorted(self.also_as), "path": self.ref.path, "digest": self.ref.digest,
            "state": self.state,
            "options": self.options.to_dict(), "keep_alive": None if self.pinned else self.keep_alive,
            "pinned": self.pinned, "refcount": self.refcount, "expires_at": self.expires_at,
            "pid": self.runner.pid if self.runner else None,
            "load_duration": self.load_duration,
            "context_length": (actual.n_ctx if actual and actual.n_ctx else self.options.total_ctx),
            "layers_offloaded": actual.layers_offloaded if actual else None,
            "layers_total": actual.layers_total if actual else None,
            "size": charge.total(), "size_vram": charge.gpu_total,
            "by_device": charge.by_device(), "workers": list(self.options.rpc or ()),
            "memory": {k: v.to_dict() for k, v in self.predictions.items()} | (
                {ACTUAL: actual.to_dict()} if actual else {}),
        }


class Lease:
    """A request's hold on a ready runner. Release it (or use ``async with``) when done."""

    def __init__(self, scheduler: "Scheduler", loaded: Loaded, load_duration: float):
        self._scheduler = scheduler
        self.loaded = loaded
        self.runner: Runner = loaded.runner  # type: ignore[assignment]
        self.load_duration = load_duration
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._scheduler._release(self.loaded)

    async def __aenter__(self) -> "Lease":
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()
