"""The scheduler: one place that decides what is loaded, whether it fits, what to evict.

It follows Ollama's rules (REFERENCE section 5) and goes past them where its users asked:

* Load and evict decisions are serialised (one lock held for the whole decision and load:
  no two loads race for the same memory). A request for a loaded model whose load options
  match goes straight to its runner without touching the lock; concurrent requests for a
  model that is loading wait for that one load.
* Memory-aware everywhere, on GPUs and on CPU-only machines alike: before a load a runner
  is charged at its prediction, after it at the figures parsed from its log. The charges
  on a device never exceed its budget.
* Pinned models (negative keep_alive) are evicted only when nothing else can make room,
  and then only when ``evict_pinned`` is set; otherwise the load fails naming them.
* Every decision is an :class:`Event` with its numbers, kept in a bounded history that
  callers can subscribe to (``%llama explain`` and the lab panel read it).

No HTTP and no Jupyter here: the server, the magics and the tests drive it directly.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import enum
import math
import os
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence

from .. import config
from ..config import ConfigError, format_duration, parse_duration, shown
from ..errors import BadRequest, DoesNotFit, LoadFailed, ModelNotFound, PinnedInTheWay, SchedulerError, ServerBusy
from ..load_options import LoadOptions
from ..engine.runner import EngineError, LoadError, Runner
from ..memory import devices as devmod
from ..memory import peers as peermod
from ..memory import rpc
from ..memory.estimate import estimate_coarse, estimate_detailed, estimate_layer_counts, fit_layers, within_training
from ..memory.report import (ACTUAL, COARSE, COMPUTE, DETAILED, HOST, KV, OTHER, WEIGHTS, MemoryReport, MiB,
                            format_bytes, format_pct, is_gpu)
from ..models.gguf_info import GGUFError, read_gguf_info
from ..models.names import same_model
from ..models.ref import ModelRef
from ..procs import exit_words

Resolver = Callable[[str], Awaitable[ModelRef]]


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


class FileResolver:
    """Resolves a name that is a path to a GGUF file (the registry plugs in a richer one).

    Metadata is read in a worker thread and cached by (path, size, mtime).
    """

    def __init__(self):
        self._cache: dict[str, tuple[tuple[int, int], ModelRef]] = {}

    async def __call__(self, name: str) -> ModelRef:
        path = os.path.abspath(os.path.expanduser(name))
        try:
            st = os.stat(path)
        except OSError:
            raise ModelNotFound(name, missing_file=path) from None
        stamp = (st.st_size, st.st_mtime_ns)
        hit = self._cache.get(path)
        if hit and hit[0] == stamp:
            return hit[1]
        try:
            info = await asyncio.to_thread(read_gguf_info, path)
        except GGUFError as e:
            raise BadRequest(str(e)) from None
        ref = ModelRef(name=name, path=path, info=info)
        self._cache[path] = (stamp, ref)
        return ref


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


# ----------------------------------------------------------------------------- settings


@dataclass
class SchedulerSettings:
    binary: str = ""
    keep_alive: float = 300.0  # seconds; inf = forever
    max_loaded_models: int = 0  # 0 = 3 x max(GPUs, 1)
    max_queue: int = 512
    load_timeout: float = 300.0
    fit_estimator: str = "detailed"  # or "coarse"
    safety_margin: float = 0.10  # added to the detailed estimate when fitting
    evict_pinned: bool = False
    num_parallel: int | None = None  # default slots per runner (None: llama-server's auto)
    budgets: devmod.Budgets = field(default_factory=devmod.Budgets)
    recovery_timeout: float = 5.0  # after an unload, wait up to this for GPU memory to come back
    recovery_poll: float = 0.25
    rpc_workers: tuple[str, ...] = ()  # llama.cpp RPC workers (HOST:PORT), each a device
    worker_timeout: float = 2.0  # a probe of a worker gives up after this (never a hang)
    peers_dir: str = ""  # where this user's managers publish what they hold (memory.peers); "" = alone
    manager_url: str = ""  # this manager's API root, for the others' messages

    # The settings a person sets (an environment variable each, or a LlamaExtension trait).
    SETTABLE = ("keep_alive", "max_loaded_models", "max_queue", "load_timeout", "fit_estimator", "evict_pinned",
                "num_parallel", "memory_limit", "gpu_overhead", "rpc_workers")

    @classmethod
    def from_values(cls, values: Mapping[str, object], label: Callable[[str], str], **overrides) -> "SchedulerSettings":
        """Settings from ``values`` (keys from :attr:`SETTABLE`; strings are parsed, typed values
        taken as they are, None or "" leave the default). ``label(key)`` names the setting in
        error messages (``JUPYTER_LLAMA_KEEP_ALIVE``, ``LlamaExtension.keep_alive``)."""
        unknown = set(values) - set(cls.SETTABLE)
        if unknown:
            raise ConfigError(f"unknown scheduler settings: {', '.join(sorted(unknown))}")
        given = {k: v for k, v in values.items() if v is not None and v != ""}
        s = cls()
        if "keep_alive" in given:
            s.keep_alive = parse_duration(given["keep_alive"], label("keep_alive"))
        if "load_timeout" in given:
            s.load_timeout = parse_duration(given["load_timeout"], label("load_timeout"))
        for key in ("max_loaded_models", "max_queue"):
            if key in given:
                setattr(s, key, config.parse_int(given[key], label(key)))
        if "num_parallel" in given:  # 0 means automatic, as unset does
            s.num_parallel = config.parse_int(given["num_parallel"], label("num_parallel")) or None
        if "fit_estimator" in given:
            s.fit_estimator = str(given["fit_estimator"]).strip()
        if "evict_pinned" in given:
            s.evict_pinned = config.parse_bool(given["evict_pinned"], label("evict_pinned"))
        s.budgets = devmod.budgets_from(given.get("memory_limit"), given.get("gpu_overhead"),
                                        label("memory_limit"), label("gpu_overhead"))
        s.rpc_workers = rpc.parse_workers(given.get("rpc_workers"), label("rpc_workers"))
        for k, v in overrides.items():
            setattr(s, k, v)
        s.validate(label)
        return s

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "SchedulerSettings":
        environ = os.environ if environ is None else environ
        values = {k: environ.get(config.ENV_PREFIX + k.upper()) for k in cls.SETTABLE}  # JUPYTER_LLAMA_KEEP_ALIVE, ...
        return cls.from_values(values, lambda k: config.ENV_PREFIX + k.upper(), **overrides)

    def validate(self, label: Callable[[str], str] = lambda k: config.ENV_PREFIX + k.upper()) -> None:
        if self.fit_estimator not in (COARSE, DETAILED):
            raise ConfigError(f"{label('fit_estimator')} must be 'coarse' or 'detailed', got {self.fit_estimator!r}")
        if self.max_queue < 1:
            raise ConfigError(f"{label('max_queue')} must be at least 1, got {self.max_queue}")
        if self.max_loaded_models < 0:
            raise ConfigError(f"{label('max_loaded_models')} must be 0 (automatic) or more, "
                              f"got {self.max_loaded_models}")
        # (each of these was taken, and every load or request then failed in words that blamed it)
        if self.num_parallel is not None and not 0 <= self.num_parallel <= 256:  # (0: automatic, as None)
            raise ConfigError(f"{label('num_parallel')} must be 0 (automatic) or 1 to 256 request slots per model, "
                              f"got {self.num_parallel}")
        if not self.load_timeout > 0:
            raise ConfigError(f"{label('load_timeout')} must be a duration above 0 (how long a loading model may "
                              f"stay silent; -1 for never), got {self.load_timeout:g}s")


# ----------------------------------------------------------------------------- loaded runners

# Load options the scheduler fills in from the devices it places a model on; a request never
# asks for them, so they never force a reload.
PLACEMENT_FIELDS = ("fit_target_mib", "rpc")

# How long a worker's answer after our runner let it go stands for it (see Scheduler.inventory):
# long enough for the load that evicted the runner to be planned, not for a later one.
FREED_FRESH_S = 1.0


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


# ----------------------------------------------------------------------------- the scheduler


Predictor = Callable[..., dict[str, MemoryReport]]


def default_predictor(ref: ModelRef, options: LoadOptions, gpus: list[str],
                      split: Sequence[float] | None = None) -> dict[str, MemoryReport]:
    """Both predictions for this load: both are recorded; the settings pick the one that fits.
    ``split`` is the share of offloaded layers per accelerator (see ``layer_devices``)."""
    return {COARSE: estimate_coarse(ref.info, options, gpus),
            DETAILED: estimate_detailed(ref.info, options, gpus, split)}


def budget_room(device: devmod.DeviceState, used: dict[str, int], held: dict[str, int] | None) -> int | None:
    """Bytes of ``device``'s budget still open to this manager (None: the device has no
    budget; below 0: it is over by that much): the budget is the user's, so what the user's
    other managers hold there (``held``) comes off it, as well as what this manager's runners
    use (``used``). The planner leaves the rest of the device free, the fit check measures
    the need against it, and once a load's real size is known the budget is enforced by it."""
    if device.budget is None:
        return None
    return device.budget - (held or {}).get(device.id, 0) - used.get(device.id, 0)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _what_to_shrink(report: MemoryReport | None, device: str, estimator: str, offload: bool = True) -> str:
    """Advice for a load over its budget, from the largest part of what it needs there;
    ``offload``: there are devices (GPUs, RPC workers) that layers could go to instead of the host."""
    parts = {c: report.total(device=device, component=c) for c in (WEIGHTS, KV, COMPUTE, OTHER)} if report else {}
    if not parts or not any(parts.values()):
        return "load it with a smaller context (num_ctx) or a smaller quantisation"
    part, size = max(parts.items(), key=lambda kv: kv[1])
    share = f"{format_bytes(size)} of it is"
    if part == OTHER and estimator == COARSE:
        return (f"{share} the coarse estimate's allowance for large batches (Ollama's, for a batch of 1024 tokens or "
                "more; llama-server's default is 2048): load it with num_batch 512, which drops the allowance, or "
                "let the detailed estimate decide (JUPYTER_LLAMA_FIT_ESTIMATOR=detailed)")
    if part == COMPUTE:
        return f"{share} the compute buffer: load it with a smaller batch (num_batch, num_ubatch)"
    if part == KV:
        return (f"{share} the K/V cache: load it with a smaller context (num_ctx), fewer parallel requests "
                "(num_parallel) or a quantised cache (cache_type_k/cache_type_v q8_0)")
    if device == HOST:
        return f"{share} the weights: use a smaller quantisation of the model" + (
            ", or put more layers on devices (num_gpu)" if offload else ", or a smaller model")
    return f"{share} the weights: use a smaller quantisation of the model, or put fewer layers here (num_gpu)"


@dataclass
class FitPlan:
    """Whether a model fits now, the one computation behind every verdict (the scheduler's
    own decision, ``/api/estimate``, the picker, the panel and ``%llama estimate``).

    ``devices`` maps each device the prediction uses to ``need`` (the deciding estimate, with
    its margin), ``available`` (what may still be planned with there: free memory less GPU
    overhead, capped by the budget less what loaded models use), ``in_use``, ``budget``,
    ``checked`` (whether the verdict looks at it: with automatic placement llama.cpp's --fit
    keeps each accelerator within the room it was given, so only the host is checked) and
    ``fits``. ``verdict`` is ``fits``, ``evict`` (``evict`` names the models a load now would
    unload, in order), ``first`` (it may not fit but nothing else is loaded, so it gets to
    try), ``over_budget`` (alone it needs more than a budget: refused), ``peers`` (it fits the
    budget alone, but this user's other managers hold the rest of it: refused, naming them;
    ``peers`` lists them) or ``refuse`` (nothing that may be evicted would make room).
    """

    model: str
    fit_source: str  # the prediction that decides (the configured estimator, else coarse)
    estimator: str  # what it is called with its margin: "detailed+10%"
    devices: dict[str, dict]
    cap: int
    others: int
    verdict: str
    evict: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)  # other managers of this user holding budgeted memory

    @property
    def fits(self) -> bool:
        return self.verdict == "fits"

    @property
    def short(self) -> dict[str, int]:
        """Bytes missing per checked device."""
        return {d: n["need"] - n["available"] for d, n in self.devices.items() if n["checked"] and not n["fits"]}

    @property
    def over_cap(self) -> bool:
        return self.others >= self.cap

    @property
    def verdict_words(self) -> str:
        """The verdict as every front end says it."""
        return {"fits": "fits", "evict": "fits after evicting " + ", ".join(self.evict),
                "first": "may not fit, but nothing else is loaded, so it gets to try",
                "over_budget": "does not fit: over the budget",
                "peers": "does not fit: your other jupyter-llama managers hold the rest of the budget",
                "refuse": "does not fit, and evicting would not make room"}[self.verdict]

    def words(self, only: Iterable[str] | None = None) -> str:
        keep = set(only) if only is not None else None
        return _fit_words({d: n for d, n in self.devices.items() if keep is None or d in keep}, self.estimator)

    def to_dict(self) -> dict:
        return {"model": self.model, "estimator": self.estimator, "verdict": self.verdict, "fits": self.fits,
                "verdict_words": self.verdict_words,
                "devices": self.devices, "cap": self.cap, "loaded": self.others, "over_cap": self.over_cap,
                "evict": list(self.evict), "workers": list(self.workers), "peers": list(self.peers),
                "text": self.words()}


class Scheduler:
    """Loads, fits, evicts and unloads llama-server runners. See the module docstring."""

    def __init__(self, settings: SchedulerSettings, *, resolver: Resolver | None = None,
                 predictor: Predictor = default_predictor,
                 inventory: Callable[[], devmod.Inventory] | None = None):
        if not settings.binary:
            raise ConfigError("scheduler needs the path of a llama-server binary (settings.binary)")
        self.settings = settings
        self.resolver = resolver or FileResolver()
        self.predictor = predictor
        # Workers are probed by the scheduler itself (it knows which ones its runners hold).
        self._inventory_fn = inventory or (lambda: devmod.inventory(workers=()))
        self._worker_status: dict[str, rpc.WorkerStatus] = {}  # last good probe per worker
        # a worker's answer once our runner let it go (see _wait_workers), for the plan that follows
        self._freed_at: dict[str, float] = {}
        self.loaded: dict[str, Loaded] = {}
        self.events = EventLog()
        self._lock = asyncio.Lock()
        self._pending = 0
        self._in_flight = 0
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        self._stopping: set[asyncio.Task] = set()  # evicted runners stopping while the next one starts
        self._retiring: list[Loaded] = []  # those runners, until they are gone
        # the last failed load of each model (by file), for `log` to show what its child said
        self.failed: dict[str, Loaded] = {}
        self.peers = (peermod.PeerBoard(settings.peers_dir, settings.manager_url) if settings.peers_dir
                      else None)
        self._board: concurrent.futures.ThreadPoolExecutor | None = None  # writes self.peers' file (_board_write)

    # -------------------------------------------------------------- public API

    @property
    def in_flight(self) -> int:
        """Requests holding a runner right now (the idle culler's notion of activity)."""
        return self._in_flight

    @property
    def pending(self) -> int:
        return self._pending

    def max_loaded(self, n_gpus: int) -> int:
        """The loaded-model cap: the setting, else 3 per accelerator (GPUs and RPC worker
        devices alike), at least 3."""
        return self.settings.max_loaded_models or 3 * max(n_gpus, 1)

    async def acquire(self, name: str, options: LoadOptions | None = None, keep_alive=None) -> Lease:
        """Get a ready runner for ``name`` under ``options``, loading (and evicting) as needed."""
        if self._closed:
            raise SchedulerError("the scheduler is shutting down")
        ka = None if keep_alive is None else parse_duration(keep_alive)
        ref = await self.resolver(name)
        options = within_training(options or LoadOptions(), ref.info)  # (what a load of it would have)
        lo = self.loaded.get(ref.key)
        if lo is not None and lo.state == ModelState.READY and not lo.unload_when_idle and not lo.matches(options) \
                and lo.runner is not None and lo.runner.serving:
            return self._lease(lo, ka, 0.0, ref)  # fast path: no queue, no lock
        if self._pending >= self.settings.max_queue:
            self.events.emit(EventKind.BUSY, ref.name, f"queue full ({self._pending} waiting, limit "
                             f"{self.settings.max_queue}): request refused", pending=self._pending,
                             max_queue=self.settings.max_queue)
            raise ServerBusy(f"server busy, please try again later (queue limit {self.settings.max_queue} reached; "
                             "raise JUPYTER_LLAMA_MAX_QUEUE to allow more waiting requests)")
        self._pending += 1
        t0 = time.monotonic()
        try:
            while True:
                lo = self.loaded.get(ref.key)
                if lo is not None and lo.state == ModelState.LOADING:
                    await asyncio.shield(lo.ready)  # one load, however many wait for it
                    continue
                if lo is not None and lo.state == ModelState.READY and not lo.unload_when_idle and not lo.matches(options):
                    if await self._healthy(lo) and lo.state == ModelState.READY and not lo.unload_when_idle:
                        return self._lease(lo, ka, time.monotonic() - t0, ref)  # still: the check awaited
                async with self._lock:
                    if self._closed:
                        raise SchedulerError("the scheduler is shutting down")
                    lo = self.loaded.get(ref.key)
                    if lo is not None and lo.state == ModelState.READY and not lo.unload_when_idle \
                            and not lo.matches(options) and await self._healthy(lo):
                        continue  # someone loaded it while we waited for the lock
                    if lo is not None:
                        await self._retire_for_reload(lo, options)
                    lo = await self._load(ref, options, ka)
                return self._lease(lo, ka, time.monotonic() - t0, ref)
        finally:
            self._pending -= 1

    @contextlib.asynccontextmanager
    async def use(self, name: str, options: LoadOptions | None = None, keep_alive=None) -> AsyncIterator[Lease]:
        """``async with scheduler.use(name) as lease:`` — acquire and always release."""
        lease = await self.acquire(name, options, keep_alive)
        try:
            yield lease
        finally:
            lease.release()

    async def load(self, name: str, options: LoadOptions | None = None, keep_alive=None) -> Loaded:
        """Load without a request (Ollama's empty prompt); keep_alive 0 unloads instead."""
        if keep_alive is not None and parse_duration(keep_alive) == 0:
            await self.unload(name)
            return None  # type: ignore[return-value]
        lease = await self.acquire(name, options, keep_alive)
        lease.release()
        return lease.loaded

    async def unload(self, name: str, reason: str = "unloaded on request") -> bool:
        """Unload ``name`` now (after its running requests finish). False if it was not loaded."""
        lo = await self.find_loaded(name)
        if lo is None:
            return False
        if lo.state == ModelState.LOADING:
            try:
                await asyncio.shield(lo.ready)
            except Exception:
                return False
        await self._unload(lo, reason, rule="explicit")
        return True

    def live(self) -> list[Loaded]:
        """The models that have a runner now (loading, ready or unloading), as a list the
        caller may hold across awaits."""
        return [lo for lo in self.loaded.values() if lo.state != ModelState.GONE]

    def ps(self) -> list[dict]:
        return [lo.info() for lo in self.live()]

    def kill_now(self) -> None:
        """SIGKILL every child at once, without waiting (a last resort when the loop is gone)."""
        for lo in list(self.loaded.values()):
            if lo.runner is not None:
                lo.runner.kill_now()

    async def unload_file(self, path: str, reason: str) -> None:
        """Unload every model loaded from the file ``path`` (a model being deleted)."""
        for lo in self.live():
            if lo.ref.path == path:
                await self._unload(lo, reason, rule="explicit")

    async def name_changed(self, name: str) -> list[str]:
        """``name`` was created, copied over or deleted: retire the runners loaded under it
        whose name (the one they were loaded under) no longer points at their file (another
        file, or nothing), so that ``stop``, ``rm``, the cap and the next request all see what
        the name means now. One whose name still points at its file stays, shown by the name
        that file is shown by now (a pulled model loaded by its full name is ``tiny:latest``
        once no model made here has that name, and its full name again beside one). Names
        it has also served (``also_as``) that no longer point at it are dropped. Returns the
        names retired."""
        try:
            named = (await self.resolver(name)).key
        except SchedulerError:
            named = None
        except (OSError, ValueError):
            return []  # the store cannot say now: every runner is left as it is
        retired = []
        for lo in self.live():
            loaded_as = lo.runner.name if lo.runner is not None else lo.name
            if named != lo.ref.key:
                lo.also_as = {n for n in lo.also_as if not same_model(n, name)}
            if not same_model(loaded_as, name):  # (its shown name is a spelling of the same)
                continue
            try:
                ref = await self.resolver(loaded_as)
            except SchedulerError:
                ref = None  # deleted
            except (OSError, ValueError):
                continue
            if ref is None or ref.key != lo.ref.key:
                what = "now names another file" if ref is not None else "was deleted"
                await self._unload(lo, f"{name} {what}", rule="replaced")
                retired.append(lo.name)
            elif ref.name != lo.ref.name:  # ps shows it as tags does
                lo.ref = dataclasses.replace(lo.ref, name=ref.name)
        return retired

    async def find_loaded(self, name: str) -> Loaded | None:
        """The loaded model ``name`` names, resolved as a load would resolve it (``m`` is
        ``m:latest``); a name the store no longer knows still finds what is loaded under it."""
        try:
            key = (await self.resolver(name)).key
        except SchedulerError:
            key = None
        lo = self.loaded.get(key) if key else None
        if lo is None or lo.state == ModelState.GONE:  # loaded under this name from what it named before
            lo = next((x for x in self.live() if same_model(x.name, name)), None)
        return lo if lo is not None and lo.state != ModelState.GONE else None

    async def find_failed(self, name: str) -> Loaded | None:
        """The last load of ``name`` that failed, when it has not loaded since (its runner
        keeps what the child logged)."""
        try:
            key = (await self.resolver(name)).key
        except SchedulerError:
            return None
        return None if key in self.loaded else self.failed.get(key)

    async def predict(self, name: str, options: LoadOptions | None = None) -> tuple[ModelRef, dict[str, MemoryReport]]:
        """Predictions for loading ``name`` now: on the devices a load would get, with the
        placement the scheduler would ask llama.cpp for."""
        ref = await self.resolver(name)
        inv = await self.inventory()
        held = peermod.usage(await asyncio.to_thread(self.peer_holdings))
        _, preds = await asyncio.to_thread(self.plan, ref, self.effective_options(options or LoadOptions(), ref), inv,
                                           self.usage(), held)
        return ref, preds

    async def estimate(self, name: str, options: LoadOptions | None = None, *, engine=None) -> dict:
        """What loading ``name`` with ``options`` takes, per source, and what it took if it is loaded.

        A model loaded with matching options answers with the predictions made for its own
        placement (the workers it holds are not free for a new plan) and its actual figures;
        otherwise the predictions are for the placement a load would get now, and ``actual``
        is None: a load with other options allocated something else. ``loaded`` names the
        loaded model either way, with its options.
        """
        from ..memory import estimate as est

        ref = await self.resolver(name)
        opts = self.effective_options(options or LoadOptions(), ref)
        lo = next((x for x in self.loaded.values() if x.ref.key == ref.key and x.state != ModelState.GONE), None)
        same = lo is not None and lo.state in (ModelState.READY, ModelState.UNLOADING) and not lo.matches(opts)
        inv = await self.inventory()
        used = self.usage()
        if lo is not None:  # would it fit if it were loaded afresh: its own runner not counted
            for d, n in lo.charge.by_device().items():
                used[d] = max(0, used.get(d, 0) - n)
            if not same:  # ... nor the workers it holds, which a reload lets go first (as they last answered)
                inv.held = {ep: who for ep, who in inv.held.items() if ep not in (lo.options.rpc or ())}
        peers = await asyncio.to_thread(self.peer_holdings)
        if same:
            opts, estimates, actual = lo.options, dict(lo.predictions), lo.actual
        else:
            opts, planned = await asyncio.to_thread(self.plan, ref, opts, inv, used, peermod.usage(peers))
            estimates = await est.with_projection_async(planned, engine, ref.path, opts)
            actual = None
        estimates = est.with_cap_note(estimates, (options or LoadOptions()).num_ctx, ref.info)
        return {"ref": ref, "options": opts, "estimates": estimates, "actual": actual, "loaded": lo,
                "same_options": same, "fit": self.fit(ref, opts, estimates, inv, used, peers)}

    async def shutdown(self) -> None:
        """Stop every child and wait for them."""
        self._closed = True
        los = list(self.loaded.values()) + [lo for lo in self._retiring if lo.state != ModelState.GONE]
        for lo in los:
            if lo.timer:
                lo.timer.cancel()
        await asyncio.gather(*(self._stop_runner(lo, "manager shutting down", rule="shutdown") for lo in los),
                             *list(self._stopping), return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.peers is not None:
            await asyncio.wrap_future(self._board_write(self.peers.close))  # after the writes before it
            self._board.shutdown(wait=False)
            self._board, self.peers = None, None  # off the board: nothing is published after this

    # -------------------------------------------------------------- internals: leasing

    def _lease(self, lo: Loaded, keep_alive: float | None, waited: float, ref: ModelRef | None = None) -> Lease:
        if ref is not None and ref.name != lo.ref.name:  # the same file under another name: ps says so
            lo.also_as.add(ref.name)
        if keep_alive is not None:
            lo.keep_alive = keep_alive  # a request's own value overrides the runner's
        if lo.timer:
            lo.timer.cancel()
            lo.timer = None
        lo.expires_at = None
        lo.refcount += 1
        lo.idle.clear()
        lo.last_used = time.monotonic()
        self._in_flight += 1
        return Lease(self, lo, waited)

    def _release(self, lo: Loaded) -> None:
        lo.refcount -= 1
        self._in_flight -= 1
        lo.last_used = time.monotonic()
        if lo.refcount > 0:
            return
        lo.idle.set()
        if lo.state != ModelState.READY:
            return
        if lo.runner is None or not lo.runner.alive:
            self._spawn(self._crashed(lo))
        elif lo.unload_when_idle:
            self._stop_soon(lo, lo.unload_when_idle, rule="deferred")
        elif lo.keep_alive == 0:
            self._stop_soon(lo, "keep_alive is 0: unloaded as soon as idle", rule="keep_alive")
        elif not lo.pinned:
            self._arm_timer(lo)

    def _arm_timer(self, lo: Loaded) -> None:
        loop = asyncio.get_running_loop()
        lo.expires_at = time.time() + lo.keep_alive
        lo.timer = loop.call_later(lo.keep_alive, self._expire, lo)

    def _expire(self, lo: Loaded) -> None:
        lo.timer = None
        if lo.state != ModelState.READY:
            return
        self.events.emit(EventKind.EXPIRE, lo.name, f"keep_alive of {format_duration(lo.keep_alive)} ran out"
                         + (f"; unloading after {lo.refcount} running request(s)" if lo.refcount else ""),
                         keep_alive=lo.keep_alive, refcount=lo.refcount)
        if lo.refcount:
            lo.unload_when_idle = "keep_alive ran out while busy"
        else:
            self._stop_soon(lo, "keep_alive ran out", rule="keep_alive")

    def _stop_soon(self, lo: Loaded, reason: str, rule: str, tasks: set | None = None) -> None:
        """Stop an idle runner in a task of its own. From now on it takes no new request (the
        fast path skips a runner with ``unload_when_idle``); one that got it in the meantime
        (a request that was checking its health) keeps it, and its release stops it."""
        lo.unload_when_idle = reason

        async def stop() -> None:
            if lo.refcount == 0:
                await self._stop_runner(lo, reason, rule=rule)

        t = asyncio.get_running_loop().create_task(stop())
        bucket = self._tasks if tasks is None else tasks
        bucket.add(t)
        t.add_done_callback(bucket.discard)

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _healthy(self, lo: Loaded) -> bool:
        """Alive, and (after a quiet spell) answering /health; a failure forces a reload."""
        r = lo.runner
        if r is None or not r.serving:
            return False
        if time.monotonic() - lo.last_used < 10 or await r.health():
            return True
        self.events.emit(EventKind.CRASH, lo.name, "health check failed: the runner will be reloaded", pid=r.pid)
        return False

    # -------------------------------------------------------------- internals: loading

    def effective_options(self, options: LoadOptions, ref: ModelRef | None = None) -> LoadOptions:
        """The options a load would really use: the configured default slots filled in, the
        model's registered projector (``--mmproj``) unless the request names one, and a
        ``num_ctx`` above the model's training context brought down to it, as Ollama does
        (llama-server would cap each slot there anyway, with the KV cache of the larger
        context allocated and the prompt's truncation aiming past what a slot takes)."""
        if options.num_parallel is None and self.settings.num_parallel:
            options = options.replace(num_parallel=self.settings.num_parallel)
        if ref is not None:
            options = within_training(options, ref.info)
        if ref is not None and ref.mmproj and options.mmproj is None:
            options = options.replace(mmproj=ref.mmproj)
        if ref is not None and options.embedding and options.num_ubatch is None:
            # An embedding takes its whole input in one micro-batch (llama-server refuses an
            # input longer than -ub: "increase the physical batch size"), so an embedding load
            # gets a batch as large as a request's context, as Ollama gives it.
            ctx = options.num_ctx or ref.info.context_length
            options = options.replace(num_ubatch=ctx, num_batch=max(ctx, options.num_batch or 0))
        return options

    async def _retire_for_reload(self, lo: Loaded, options: LoadOptions) -> None:
        changed = lo.matches(options)
        if lo.runner is None or not lo.runner.alive:
            reason, rule = "its runner is no longer running", "crash"
        elif lo.unload_when_idle and not changed:
            reason, rule = f"it was being unloaded ({lo.unload_when_idle})", "reload"
        elif changed:
            def spelled(v) -> str:  # (None: the option left to llama.cpp's or the scheduler's choice)
                return "automatic" if v is None else shown(v)

            reason = "load options changed: " + ", ".join(
                f"{n} {spelled(getattr(lo.options, n))} -> {spelled(getattr(options, n))}" for n in changed)
            rule = "reload"
        else:
            reason, rule = "health check failed", "reload"
        self.events.emit(EventKind.RELOAD, lo.name, f"reloading: {reason}", changed=changed)
        await self._unload(lo, reason, rule=rule)

    async def inventory(self, planning: bool = False) -> devmod.Inventory:
        """Devices as they are now, under the scheduler's own budgets, with the RPC workers:
        the free ones probed now, the ones our runners hold as last seen (a worker serves one
        client, so a held worker would answer only once its runner is gone).

        Two kinds of worker are not asked either, but taken as they last answered: those of an
        evicted runner still exiting while its successor starts (see :meth:`_make_room`: asked
        now, they would answer only once it is gone), and, for the plan of a load
        (``planning``), those that answered a moment ago after our runner let them go (asking
        again would cost a second round of probes before the load)."""
        endpoints = self.settings.rpc_workers
        held: dict[str, str] = {}
        skip: set[str] = set()
        if endpoints:
            held = self.held_workers()
            skip = set(held) | {ep for lo in self._retiring for ep in lo.options.rpc or ()}
            if planning:
                now = time.monotonic()
                skip |= {ep for ep, at in self._freed_at.items() if now - at < FREED_FRESH_S}
                self._freed_at.clear()
        known = dict(self._worker_status)  # (a copy: the thread reads it while the loop may change it)

        def take() -> devmod.Inventory:  # in one thread: the host's devices, then the workers' probes
            inv = self._inventory_fn()
            if endpoints:
                inv.workers = devmod.probe_workers(endpoints, skip, known, self.settings.worker_timeout)
            return inv

        inv = await asyncio.to_thread(take)
        inv.budgets = self.settings.budgets
        if endpoints:
            inv.held = held
            for w in inv.workers:
                if w.reachable and w.devices and w.endpoint not in skip:
                    self._worker_status[w.endpoint] = w
        return inv

    def held_workers(self) -> dict[str, str]:
        """Worker endpoint -> the model whose runner is connected to it (loading or loaded)."""
        out: dict[str, str] = {}
        for lo in self.loaded.values():
            if lo.state != ModelState.GONE and lo.options.rpc:
                for ep in lo.options.rpc:
                    out[ep] = lo.name
        return out

    def plan(self, ref: ModelRef, options: LoadOptions, inv: devmod.Inventory,
             used: dict[str, int], held: dict[str, int] | None = None) -> tuple[LoadOptions, dict[str, MemoryReport]]:
        """Where a load of ``ref`` would go now, as options and predictions (``used``: bytes per
        device our runners hold, :meth:`usage` taken on the event loop; ``held``: what the
        user's other managers hold, :func:`.memory.peers.usage`; this runs in a thread).

        The accelerators are the local GPUs and the RPC workers no runner holds. With
        automatic placement (``num_gpu`` unset) the room under each device's budget becomes
        llama.cpp's ``--fit-target`` for it, and the predictions describe the layers
        :func:`fit_layers` expects llama.cpp to put there; a worker expected to get no layer
        is left out of ``--rpc``, free for another model. With ``num_gpu N`` llama.cpp splits
        the N layers by free memory, and so do the predictions. ``num_gpu 0`` uses no device.
        """
        accel = [] if options.num_gpu == 0 else inv.accelerators()
        split: list[float] | None = None
        margins: tuple[int, ...] | None = None
        if accel and options.gpu_automatic:
            keeps = []
            for d in accel:
                keep = max(1024 * MiB, d.overhead)
                room = budget_room(d, used, held)
                if room is not None:  # leave free everything beyond what is left of the budget here
                    keep = max(keep, d.free - max(0, room))
                keeps.append(keep)
            weights = fit_layers(ref.info, options, [(d.id, max(0, d.free - k)) for d, k in zip(accel, keeps)],
                                 free=[d.free for d in accel])
            layers = estimate_layer_counts(ref.info, options, [d.id for d in accel], weights)
            kept = [i for i, d in enumerate(accel) if d.kind != "rpc" or layers[i] > 0]
            accel = [accel[i] for i in kept]
            split = [weights[i] for i in kept]
            margins = tuple(int(keeps[i] // MiB) for i in kept)
        elif accel:
            split = [float(max(d.free, 1)) for d in accel]
        workers = tuple(dict.fromkeys(rpc.split_id(d.id)[0] for d in accel if d.kind == "rpc"))
        options = options.replace(rpc=workers or None, fit_target_mib=margins if accel else None)
        preds = self.predictor(ref, options, [d.id for d in accel], split if accel else None)
        return options, preds

    def usage(self) -> dict[str, int]:
        """Bytes per device charged to the loaded runners (actual when known, else predicted)."""
        used: dict[str, int] = collections.defaultdict(int)
        for lo in self.loaded.values():
            if lo.state == ModelState.GONE:
                continue
            for dev, n in lo.charge.by_device().items():
                used[dev] += n
        return dict(used)

    def available(self, inv: devmod.Inventory, used: dict[str, int],
                  peers: dict[str, int] | None = None,
                  returned: dict[str, int] | None = None) -> dict[str, tuple[int, int | None]]:
        """Per device: (bytes we may still plan with, the budget if one is set). A budget is
        the user's: what their other managers hold (``peers``) counts against it too; free
        memory, read live, already has their models taken out. ``returned``: bytes that runners
        a dry run of evictions stops would give back to each device's free memory."""
        out = {}
        for d in inv.devices():
            free = d.free + (returned or {}).get(d.id, 0) - (d.overhead if is_gpu(d.id) else 0)
            room = budget_room(d, used, peers)
            out[d.id] = (max(0, min(free, d.total - used.get(d.id, 0) if room is None else room)), d.budget)
        return out

    def peer_holdings(self) -> list[peermod.Peer]:
        """This user's other live managers and what their models hold (none without peers_dir)."""
        return self.peers.others() if self.peers is not None else []

    def announce(self, url: str) -> None:
        """This manager's API root, known once the server listens: the other managers' messages
        about the memory it holds name it."""
        self.settings.manager_url = url
        if self.peers is not None:
            self.peers.url = url
            self._board_write(self.peers.publish, self._holdings())

    async def _publish(self) -> None:
        """Tell this user's other managers what our models hold now (written when this returns)."""
        if self.peers is not None:
            await asyncio.wrap_future(self._board_write(self.peers.publish, self._holdings()))

    def _holdings(self) -> list[dict]:
        return [{"name": lo.name, "by_device": lo.charge.by_device()} for lo in self.loaded.values()
                if lo.state in (ModelState.READY, ModelState.LOADING)]

    def _board_write(self, fn, *args) -> concurrent.futures.Future:
        """``fn(*args)`` on the peer board's own thread: its file is in Jupyter's runtime folder,
        which may be on a network file system (a JupyterHub's home directories), so it is never
        written on the event loop; one thread keeps the writes in the order they were asked for,
        so the newest holdings are the ones left in the file."""
        if self._board is None:
            self._board = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jupyter-llama-peers")
        return self._board.submit(fn, *args)

    def _need(self, preds: dict[str, MemoryReport], fit_source: str) -> MemoryReport:
        rep = preds[fit_source]
        if fit_source == DETAILED and self.settings.safety_margin:
            return rep.scaled(1 + self.settings.safety_margin, source=f"{DETAILED}+{self.settings.safety_margin:.0%}")
        return rep

    async def _load(self, ref: ModelRef, options: LoadOptions, keep_alive: float | None) -> Loaded:
        """Called with the lock held: make room, start the runner, retry on OOM as Ollama does."""
        if not os.path.isfile(ref.path):  # deleted while this request waited: as if it never was
            raise ModelNotFound(ref.name, "it was deleted while this request waited")
        options = self.effective_options(options, ref)
        options, preds, fit_source = await self._make_room(ref, options)
        ka = self.settings.keep_alive if keep_alive is None else keep_alive
        lo = Loaded(ref=ref, options=options, keep_alive=ka, predictions=preds, fit_source=fit_source)
        self.loaded[ref.key] = lo
        retried: set[str] = set()
        try:
            while True:
                try:
                    await self._start_runner(lo)
                    break
                except LoadError as e:
                    retry = await self._oom_retry(lo, e, retried) if e.oom else None
                    if retry is None:
                        raise
        except BaseException as e:
            lo.state = ModelState.GONE
            lo.gone.set()
            self.loaded.pop(ref.key, None)
            if isinstance(e, Exception) and lo.runner is not None and lo.runner.parser.n_lines:  # (not a cancel)
                self.failed[ref.key] = lo
                while len(self.failed) > 8:  # (the newest few: a log is up to 2,000 lines)
                    self.failed.pop(next(iter(self.failed)))
            err = e if isinstance(e, SchedulerError) else LoadFailed(
                f"failed to load {ref.name}: {e}") if isinstance(e, EngineError) else e
            if isinstance(e, Exception):
                self.events.emit(EventKind.ERROR, ref.name, f"load failed: {str(e).splitlines()[0]}")
            if not lo.ready.done():
                lo.ready.set_exception(err if isinstance(err, BaseException) else e)
                lo.ready.exception()  # mark retrieved: waiters re-raise it themselves
            if err is e:
                raise
            raise err from None
        lo.state = ModelState.READY
        lo.loaded_at = time.time()
        self.failed.pop(ref.key, None)  # (a load that failed before is no longer what `log` should show)
        actual = lo.actual
        self.events.emit(EventKind.LOADED, ref.name, _loaded_message(lo, actual), load_seconds=round(lo.load_duration, 3),
                         pid=lo.runner.pid, predicted={k: v.total() for k, v in preds.items()},
                         actual=actual.to_dict() if actual else None)
        published = asyncio.ensure_future(self._publish())  # (on the board's thread, while the budgets are checked)
        try:
            await self._enforce_budgets(lo)
        except DoesNotFit as e:
            lo.ready.set_exception(e)
            lo.ready.exception()
            raise
        finally:
            await published
        lo.ready.set_result(lo)
        self._spawn(self._watch(lo))
        return lo

    async def _enforce_budgets(self, new: Loaded) -> None:
        """Predictions can be wrong: once the actual figures are known, the budget still holds.

        If the new runner's real allocation pushes a device over its budget, evict others
        (the usual victim order); if it alone is over, unload it and say by how much. The
        budget is the user's: what their other managers hold counts, as it did in the fit.
        """
        while self.settings.budgets.limits:  # (none set: nothing to check, and no inventory to take)
            inv = await self.inventory()
            used = self.usage()
            held = peermod.usage(await asyncio.to_thread(self.peer_holdings))
            over = {d.id: -room for d in inv.devices() if (room := budget_room(d, used, held)) is not None
                    and room < 0}
            if not over:
                return
            dev, excess = next(iter(over.items()))
            words = (f"llama.cpp allocated {format_bytes(new.charge.total(device=dev))} for {new.name} on {dev} "
                     f"({new.fit_source} predicted "
                     f"{format_bytes(new.predictions[new.fit_source].total(device=dev))}), "
                     f"{format_bytes(excess)} over the budget there"
                     + (f" (your other jupyter-llama managers hold {format_bytes(held[dev])} of it)"
                        if held.get(dev) else ""))
            try:
                victim, rule = self._choose_victim(new.ref, words)
            except DoesNotFit:
                await self._stop_runner(new, "over budget once its actual size was known", rule="budget")
                msg = (f"{words}, and no other model can make room. Raise JUPYTER_LLAMA_MEMORY_LIMIT or load it "
                       "with a smaller context")
                self.events.emit(EventKind.FIT, new.name, "does not fit after all: " + msg, fits=False)
                raise DoesNotFit(msg) from None
            self.events.emit(EventKind.EVICT, victim.name, f"evicting {victim.name}: {words}; chosen because {rule}",
                             victim=victim.name, for_model=new.name, rule=rule, over_budget=over)
            await self._unload(victim, f"evicted for {new.name} (budget)", rule="evict")

    async def _start_runner(self, lo: Loaded) -> None:
        r = Runner(lo.ref.path, lo.options, binary=self.settings.binary, name=lo.ref.name,
                   load_timeout=self.settings.load_timeout)
        lo.runner = r
        self.events.emit(EventKind.LOAD, lo.name, f"starting llama-server for {lo.name}"
                         f" (context {lo.options.total_ctx or 'automatic'}, "
                         f"num_gpu {'automatic' if lo.options.num_gpu is None else lo.options.num_gpu})",
                         options=lo.options.to_dict())
        t0 = time.monotonic()
        await r.start()
        lo.load_duration = time.monotonic() - t0

    async def _oom_retry(self, lo: Loaded, err: LoadError, retried: set[str]) -> str | None:
        """Ollama's out-of-memory recoveries, each at most once. Returns what was done, or None."""
        train_ctx = lo.ref.info.context_length
        current = lo.options.num_ctx or train_ctx
        if "ctx" not in retried and lo.options.num_ctx is None and current > 4096:
            retried.add("ctx")
            step = 32768 if current > 32768 else 4096
            lo.options = lo.options.replace(num_ctx=step)
            self.events.emit(EventKind.OOM_RETRY, lo.name, f"out of memory with automatic context {current}: "
                             f"retrying once with context {step}", ctx_from=current, ctx_to=step)
            return "ctx"
        others = [o for o in self.loaded.values() if o is not lo and o.state == ModelState.READY]
        if "evict" not in retried and others:
            retried.add("evict")
            self.events.emit(EventKind.OOM_RETRY, lo.name, f"out of memory with {len(others)} other model(s) loaded: "
                             "evicting them all and retrying once", victims=[o.name for o in others])
            for o in others:
                await self._unload(o, f"evicted to retry {lo.name} after an out-of-memory failure", rule="oom")
            return "evict"
        if "mmproj" not in retried and lo.options.mmproj and lo.options.mmproj_offload:
            retried.add("mmproj")
            lo.options = lo.options.replace(mmproj_offload=False)
            self.events.emit(EventKind.OOM_RETRY, lo.name, "out of memory: retrying once with the projector on the CPU")
            return "mmproj"
        return None

    def fit(self, ref: ModelRef, placed: LoadOptions, preds: dict[str, MemoryReport], inv: devmod.Inventory,
            used: dict[str, int], peers: list[peermod.Peer] | None = None) -> FitPlan:
        """The :class:`FitPlan` for loading ``ref`` as ``placed`` with ``preds``, given the
        devices and what loaded models use (this model's own runner not counted). Pure: it
        decides nothing and unloads nothing; the eviction it names is a dry run of the rule."""
        fit_source = self.settings.fit_estimator if self.settings.fit_estimator in preds else COARSE
        need = self._need(preds, fit_source)
        cap = self.max_loaded(len(inv.accelerators(include_unusable=True)))
        others = [lo for lo in self.loaded.values() if lo.state in (ModelState.READY, ModelState.LOADING) and lo.ref.key != ref.key]
        checked = {HOST} if placed.fit_target_mib is not None else set(need.devices)

        held = peermod.usage(peers or [])

        def numbers(usage: dict[str, int], returned: dict[str, int] | None = None) -> dict[str, dict]:
            avail = self.available(inv, usage, held, returned)
            out = {}
            for d in need.devices:
                n, a = need.total(device=d), avail.get(d, (0, None))
                out[d] = {"need": n, "available": a[0], "in_use": usage.get(d, 0), "budget": a[1],
                          "checked": d in checked, "fits": d not in checked or n <= a[0]}
            return out

        devices = numbers(used)
        plan = FitPlan(ref.name, fit_source, need.source, devices, cap, len(others), "fits",
                       workers=list(placed.rpc or ()))
        if not plan.short and not plan.over_cap:
            return plan
        if not others:
            over = any(n["checked"] and n["budget"] is not None and n["need"] > n["budget"] for n in devices.values())
            taken = [d for d in plan.short if devices[d]["budget"] is not None and held.get(d)]
            plan.verdict = "over_budget" if over else "peers" if taken else "first"
            plan.peers = [p.describe(taken[0]) for p in peers or [] if taken and p.by_device().get(taken[0])]
            return plan
        # A dry run of the eviction rule: who would go, in order, until the model fits.
        # Each victim's bytes leave what loaded models use and come back to free memory.
        usage, returned, count = dict(used), collections.Counter(), len(others)
        for victim in self._eviction_order(ref):
            plan.evict.append(victim.name)
            for d, n in victim.charge.by_device().items():
                usage[d] = max(0, usage.get(d, 0) - n)
                if not rpc.is_rpc(d):  # (a held worker is already counted as it was before it was taken)
                    returned[d] += n
            count -= 1
            trial = numbers(usage, returned)
            if all(n["fits"] for n in trial.values()) and count < cap:
                plan.verdict = "evict"
                return plan
        plan.verdict = "refuse"
        return plan

    def _eviction_order(self, ref: ModelRef) -> list[Loaded]:
        """Who an eviction for ``ref`` takes, in order: shortest keep_alive first (ties by model
        path), idle before busy; pinned ones last, and only with ``evict_pinned``."""
        candidates = [lo for lo in self.loaded.values() if lo.state == ModelState.READY and lo.ref.key != ref.key]
        unpinned = sorted((lo for lo in candidates if not lo.pinned), key=lambda lo: (lo.keep_alive, lo.ref.path))
        pinned = sorted((lo for lo in candidates if lo.pinned), key=lambda lo: lo.ref.path)
        order: list[Loaded] = []
        for group in (unpinned, pinned if self.settings.evict_pinned else []):
            order += [lo for lo in group if lo.refcount == 0] + [lo for lo in group if lo.refcount > 0]
        return order

    async def _make_room(self, ref: ModelRef, options: LoadOptions) -> tuple[LoadOptions, dict[str, MemoryReport], str]:
        """Evict until the load fits (or refuse); returns the placed options, the predictions
        and the estimator that decided. The placement is planned again after each eviction:
        an evicted model may free an RPC worker the new one can use."""
        again: tuple[devmod.Inventory, list[peermod.Peer]] | None = None
        while True:
            if again is None:
                inv, peers = await asyncio.gather(self.inventory(planning=True), asyncio.to_thread(self.peer_holdings))
            else:  # as read a moment ago, but for the workers the evicted runner held: see below
                (inv, peers), again = again, None
                inv.held = self.held_workers()
            used = self.usage()
            placed, preds = await asyncio.to_thread(self.plan, ref, options, inv, used, peermod.usage(peers))
            plan = self.fit(ref, placed, preds, inv, used, peers)
            fit_source = plan.fit_source
            numbers = {d: {k: n[k] for k in ("need", "available", "in_use", "budget")} for d, n in plan.devices.items()}
            if plan.fits:
                self.events.emit(EventKind.FIT, ref.name, "fits: " + plan.words(), fits=True, estimator=plan.estimator,
                                 devices=numbers, workers=plan.workers,
                                 predicted={k: v.total() for k, v in preds.items()})
                return placed, preds, fit_source
            if plan.verdict == "over_budget":
                d, n = next((d, n) for d, n in plan.devices.items()
                            if n["checked"] and n["budget"] is not None and n["need"] > n["budget"])
                msg = (f"{ref.name} needs {format_bytes(n['need'])} on {d} ({plan.estimator} estimate) but the budget "
                       f"there is {format_bytes(n['budget'])}; "
                       f"{_what_to_shrink(preds.get(fit_source), d, plan.estimator, bool(inv.accelerators()))}"
                       ", or raise JUPYTER_LLAMA_MEMORY_LIMIT")
                self.events.emit(EventKind.FIT, ref.name, "does not fit: " + msg, fits=False, devices=numbers)
                raise DoesNotFit(msg)
            if plan.verdict == "peers":
                d, n = next(iter(plan.short.items()))
                msg = (f"{ref.name} needs {format_bytes(plan.devices[d]['need'])} on {d} ({plan.estimator} estimate); "
                       f"the budget there is {format_bytes(plan.devices[d]['budget'])}, and your other jupyter-llama "
                       f"managers hold {format_bytes(peermod.usage(peers).get(d, 0))} of it ("
                       + "; ".join(plan.peers) + "). Unload models there (their `stop`, or keep_alive 0), "
                       "or raise JUPYTER_LLAMA_MEMORY_LIMIT")
                self.events.emit(EventKind.FIT, ref.name, "does not fit: " + msg, fits=False, devices=numbers,
                                 peers=plan.peers)
                raise DoesNotFit(msg)
            if plan.verdict == "first":
                self.events.emit(EventKind.FIT, ref.name, "may not fit (" + plan.words() + "), but no other model is "
                                 "loaded: the first model always gets to try", fits=False, devices=numbers,
                                 workers=plan.workers)
                return placed, preds, fit_source
            short = plan.short
            reason = (f"the loaded-model cap ({plan.cap}) is reached" if plan.over_cap and not short else
                      "not enough memory: " + plan.words(short))
            self._refuse_if_only_pinned_help(ref, short, reason)
            if plan.verdict == "refuse" and short and not any(
                    lo.state == ModelState.LOADING and lo.ref.key != ref.key for lo in self.loaded.values()):
                # Even with every model that may go unloaded it would not fit: unloading them
                # would only lose their work. (Alone, a model still gets to try: see "first".)
                msg = (f"cannot load {ref.name}: {reason}; unloading every other model would not make room "
                       f"({plan.estimator} estimate), so none was unloaded. "
                       + _sentence(_what_to_shrink(preds.get(fit_source), next(iter(short)), plan.estimator,
                                                 bool(inv.accelerators())))
                       + ", or unload the others yourself to let it try alone")
                self.events.emit(EventKind.FIT, ref.name, msg, fits=False, devices=numbers)
                raise DoesNotFit(msg)
            victim, rule = self._choose_victim(ref, reason)
            self.events.emit(EventKind.EVICT, victim.name, f"evicting {victim.name} to make room for {ref.name}: {reason}; "
                             f"chosen because {rule}", victim=victim.name, for_model=ref.name, rule=rule,
                             devices=numbers, over_cap=plan.over_cap)
            if plan.over_cap and not short and victim.refcount == 0 and all(
                    d == HOST or rpc.is_rpc(d) for d in victim.charge.by_device()):
                # Only the count cap is in the way, and the memory fit counted the victim as
                # loaded: its process can exit while the new one starts (a swap pays one start,
                # not a stop and a start). Host memory and RPC workers only (a local GPU's
                # memory must be back before a fit): a worker serves one client at a time and
                # frees a client's buffers before it takes the next, so the new child's
                # connection waits for the old one's to close, and the plans made while it
                # exits count each of its workers as it answered before the victim took it
                # (see inventory; llama.cpp's own fit reads their memory live as it loads).
                # So the next plan takes this one's inventory as it is: the host's memory is
                # what it was (the victim still runs), and its workers were counted as they
                # answered before it took them, as a fresh inventory would count them now.
                self._stop_behind(victim, f"evicted for {ref.name}")
                again = (inv, peers)
            else:
                await self._unload(victim, f"evicted for {ref.name}", rule="evict")

    def _refuse_if_only_pinned_help(self, ref: ModelRef, short: dict[str, int], reason: str) -> None:
        """Don't evict unpinned models for nothing: if freeing all of them still leaves a
        device short and only pinned models hold the rest, refuse now, naming them."""
        if self.settings.evict_pinned or not short:
            return
        pinned = [lo for lo in self.loaded.values() if lo.state == ModelState.READY and lo.pinned and lo.ref.key != ref.key]
        if not pinned:
            return
        freeable: dict[str, int] = collections.defaultdict(int)
        for lo in self.loaded.values():
            if lo.state == ModelState.READY and not lo.pinned and lo.ref.key != ref.key:
                for dev, n in lo.charge.by_device().items():
                    freeable[dev] += n
        if all(missing <= freeable.get(dev, 0) for dev, missing in short.items()):
            return
        names = ", ".join(lo.name for lo in sorted(pinned, key=lambda lo: lo.ref.path))
        msg = (f"cannot load {ref.name}: {reason}; evicting every unpinned model would not be enough, and only "
               f"pinned models ({names}) could make room. Unload one of them (keep_alive 0 or `stop`), or set "
               "JUPYTER_LLAMA_EVICT_PINNED=1")
        self.events.emit(EventKind.FIT, ref.name, msg, fits=False, pinned=[lo.name for lo in pinned])
        raise PinnedInTheWay(msg)

    def _choose_victim(self, ref: ModelRef, reason: str) -> tuple[Loaded, str]:
        """The first of :meth:`_eviction_order`, with the rule that chose it in words."""
        order = self._eviction_order(ref)
        if order:
            lo = order[0]
            label = "pinned, " if lo.pinned else ""
            if lo.refcount == 0:
                return lo, f"{label}idle, shortest keep_alive ({format_duration(lo.keep_alive)})"
            return lo, f"{label}shortest keep_alive ({format_duration(lo.keep_alive)}); busy, so it unloads " \
                       f"when its {lo.refcount} request(s) finish"
        pinned = sorted((lo for lo in self.loaded.values() if lo.state == ModelState.READY and lo.pinned
                         and lo.ref.key != ref.key), key=lambda lo: lo.ref.path)
        if pinned:
            names = ", ".join(lo.name for lo in pinned)
            msg = (f"cannot load {ref.name}: {reason}, and only pinned models ({names}) could make room. "
                   f"Unload one of them (keep_alive 0 or `stop`), or set JUPYTER_LLAMA_EVICT_PINNED=1")
            self.events.emit(EventKind.FIT, ref.name, msg, fits=False, pinned=[lo.name for lo in pinned])
            raise PinnedInTheWay(msg)
        raise DoesNotFit(f"cannot load {ref.name}: {reason}, and no loaded model can be evicted "
                         "(they are all still loading)")

    # -------------------------------------------------------------- internals: unloading

    async def _unload(self, lo: Loaded, reason: str, rule: str) -> None:
        """Unload, waiting for running requests first; then wait for GPU memory to come back."""
        if lo.state == ModelState.GONE:
            return
        if lo.refcount > 0:
            lo.unload_when_idle = reason
            await lo.gone.wait()
            return
        await self._stop_runner(lo, reason, rule)

    def _stop_behind(self, lo: Loaded, reason: str) -> None:
        """Take an idle runner off the loaded models now and stop it in the background;
        :meth:`shutdown` waits for it."""
        if self.loaded.get(lo.ref.key) is lo:
            self.loaded.pop(lo.ref.key)
        self._retiring.append(lo)
        self._stop_soon(lo, reason, rule="evict", tasks=self._stopping)

    async def _stop_runner(self, lo: Loaded, reason: str, rule: str) -> None:
        if lo.state in (ModelState.UNLOADING, ModelState.GONE):
            await lo.gone.wait()
            return
        lo.state = ModelState.UNLOADING
        if lo.timer:
            lo.timer.cancel()
            lo.timer = None
        charged = lo.charge.by_device()
        gpu_used = {d: n for d, n in charged.items() if is_gpu(d) and not rpc.is_rpc(d)}
        workers = list(lo.options.rpc or ())
        before = None
        if gpu_used:
            before = {g.id: g.free for g in (await asyncio.to_thread(self._inventory_fn)).gpus}
        if lo.runner is not None:
            await lo.runner.stop()
        self.loaded.pop(lo.ref.key, None) if self.loaded.get(lo.ref.key) is lo else None
        lo.state = ModelState.GONE
        lo.expires_at = None
        behind = any(x is lo for x in self._retiring)  # stopped behind the load that evicted it
        self._retiring = [x for x in self._retiring if x is not lo]  # by identity
        self.events.emit(EventKind.UNLOAD, lo.name, f"unloaded {lo.name}: {reason}", rule=rule,
                         freed=lo.charge.to_dict(), workers=workers, behind=behind)
        lo.gone.set()
        await self._publish()
        if self._closed:
            return
        if gpu_used and before is not None:
            await self._wait_recovery(lo.name, gpu_used, before)
        if workers and not behind:  # (stopped behind a load: the next child is connecting to them by now)
            await self._wait_workers(lo.name, workers)

    async def _wait_recovery(self, name: str, used: dict[str, int], before: dict[str, int]) -> None:
        """Poll until each GPU's free memory has grown by 75% of what the runner used (or time
        out), as Ollama does: a driver returns an exited process's memory a moment later."""
        t0 = time.monotonic()
        deadline = t0 + self.settings.recovery_timeout
        now: dict[str, int] = {}
        while True:
            now = {g.id: g.free for g in (await asyncio.to_thread(self._inventory_fn)).gpus}
            back = all(now.get(d, 0) - before.get(d, 0) >= 0.75 * n for d, n in used.items())
            if back or time.monotonic() >= deadline:
                break
            await asyncio.sleep(self.settings.recovery_poll)
        waited = time.monotonic() - t0
        gained = {d: now.get(d, 0) - before.get(d, 0) for d in used}
        words = ", ".join(f"{d} {format_bytes(max(g, 0))} of {format_bytes(used[d])}" for d, g in gained.items())
        self.events.emit(EventKind.RECOVER, name,
                         (f"GPU memory came back {waited * 1000:.0f} ms after {name} stopped ({words})" if back else
                          f"GPU memory had not come back {self.settings.recovery_timeout:g}s after {name} stopped "
                          f"({words}); placement goes on with what the driver reports"),
                         devices=sorted(used), free={d: now.get(d) for d in used}, gained=gained, recovered=back,
                         waited=waited)

    async def _wait_workers(self, name: str, endpoints: list[str]) -> None:
        """After a runner on RPC workers stops, wait (up to the recovery timeout) until each
        worker answers again: it takes its next client only once the old connection is closed
        and the runner's buffers are freed, so an answer means its memory is back."""
        t0 = time.monotonic()
        deadline = t0 + self.settings.recovery_timeout
        pending = list(endpoints)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            found = await asyncio.to_thread(devmod.probe_workers, pending, (), None,
                                            min(self.settings.worker_timeout, max(0.1, left)))
            for st in found:
                if st.reachable:
                    self._worker_status[st.endpoint] = st
                    self._freed_at[st.endpoint] = time.monotonic()
                    pending.remove(st.endpoint)
                    free = sum(d.free for d in st.devices)
                    self.events.emit(EventKind.RECOVER, name, f"RPC worker {st.endpoint} answers again "
                                     f"{(time.monotonic() - t0) * 1000:.0f} ms after {name} stopped "
                                     f"({format_bytes(free)} free)", worker=st.endpoint, free=free,
                                     waited=time.monotonic() - t0)
            if pending:
                await asyncio.sleep(self.settings.recovery_poll)
        for ep in pending:
            self.events.emit(EventKind.RECOVER, name, f"RPC worker {ep} did not answer within "
                             f"{self.settings.recovery_timeout:g}s after {name} stopped; it is left out of "
                             "placement until it does", worker=ep, free=None, waited=time.monotonic() - t0)

    async def _crashed(self, lo: Loaded) -> None:
        if lo.state != ModelState.READY:
            return
        code = lo.runner.returncode if lo.runner else None
        lost = await lo.runner.lost_workers() if lo.runner else []
        cause = f" because RPC worker {', '.join(lost)} went away" if lost else ""
        self.events.emit(EventKind.CRASH, lo.name, f"llama-server for {lo.name} stopped unexpectedly "
                         f"({exit_words(code)}){cause}; the next request reloads it"
                         + (" on the devices that are left" if lost else ""),
                         exit_code=code, lost_workers=lost,
                         last_lines=lo.runner.parser.last_error_lines(5) if lo.runner else [])
        await self._stop_runner(lo, "its runner crashed", rule="crash")

    async def _watch(self, lo: Loaded) -> None:
        """Notice a child that dies while idle, so ps never shows a dead model."""
        r = lo.runner
        if r is None:
            return
        await r._exited.wait()
        if lo.state == ModelState.READY and lo.refcount == 0:
            await self._crashed(lo)


def _fit_words(numbers: dict, source: str) -> str:
    parts = []
    for d, n in numbers.items():
        budget = f", budget {format_bytes(n['budget'])}" if n.get("budget") is not None else ""
        left = ("; not checked: llama.cpp's --fit places layers within that room by its own projection, which can "
                "be lower than this one (a budget is checked again once llama.cpp has allocated)"
                if n.get("checked") is False and n["need"] > n["available"] else "")
        parts.append(f"{d} needs {format_bytes(n['need'])} ({source}), {format_bytes(n['available'])} available "
                     f"({format_bytes(n['in_use'])} in use by loaded models{budget}){left}")
    return "; ".join(parts)


def _loaded_message(lo: Loaded, actual: MemoryReport | None) -> str:
    msg = f"loaded {lo.name} in {lo.load_duration:.2f}s"
    if actual:
        pred = lo.predictions[lo.fit_source].total()
        err = (pred - actual.total()) / actual.total() * 100 if actual.total() else 0.0
        msg += (f": llama.cpp allocated {format_bytes(actual.total())} "
                f"({', '.join(f'{d} {format_bytes(n)}' for d, n in actual.by_device().items())}); "
                f"{lo.fit_source} predicted {format_bytes(pred)} ({format_pct(err)})")
        if actual.layers_total:
            msg += f"; {actual.layers_offloaded}/{actual.layers_total} layers on devices"
    return msg
