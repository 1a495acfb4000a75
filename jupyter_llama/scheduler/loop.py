"""The scheduler's loop: one place that acts on what is loaded, what fits and what to evict.

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

The decisions themselves (the fit plan, the room under budgets, placement, the eviction
order and the words of each verdict) are :mod:`.policy`'s pure functions over a snapshot
of this loop's state; the loop owns the leases, the load lock, keep-alive timers, OOM
retries and the runners, which a factory makes (``runner_factory``, :class:`Runner` by
default). No HTTP and no Jupyter here: the server, the magics and the tests drive it directly.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import os
import time
from typing import AsyncIterator, Awaitable, Callable, Sequence

from ..config import ConfigError, context_length, format_duration, parse_duration, shown
from ..engine.launch import BARE_PROMPT_CHAT_TEMPLATE
from ..engine.runner import EngineError, LoadError, LoadStopped, Runner
from ..errors import (
    BadRequest,
    DoesNotFit,
    JupyterLlamaError,
    LoadCancelled,
    LoadFailed,
    ModelNotFound,
    PinnedInTheWay,
    SchedulerError,
    ServerBusy,
)
from ..load_options import LoadOptions
from ..memory import devices as devmod
from ..memory import peers as peermod
from ..memory import rpc
from ..memory.estimate import estimate_coarse, estimate_detailed, within_training
from ..memory.report import COARSE, DETAILED, HOST, MemoryReport, format_bytes, format_pct, is_gpu
from ..models.gguf_info import GGUFError, read_gguf_info
from ..models.names import same_model
from ..models.ref import ModelRef
from ..procs import exit_words
from . import policy
from .fairness import Holding, QuotaTable, Who, fair_eviction_order, over_share
from .policy import FitPlan, budget_room
from .settings import SchedulerSettings
from .state import EventKind, EventLog, Lease, Loaded, LoadedSnapshot, ModelState
from .users import UserBook

Resolver = Callable[[str], Awaitable[ModelRef]]


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


# How long a worker's answer after our runner let it go stands for it (see Scheduler.inventory):
# long enough for the load that evicted the runner to be planned, not for a later one.
FREED_FRESH_S = 1.0

Predictor = Callable[..., dict[str, MemoryReport]]
# Makes a load's runner: called as Runner is, ``(path, options, binary=, name=, load_timeout=)``,
# and returns an object with Runner's interface (start, stop, memory, health, ...).
RunnerFactory = Callable[..., Runner]


def default_predictor(ref: ModelRef, options: LoadOptions, gpus: list[str],
                      split: Sequence[float] | None = None) -> dict[str, MemoryReport]:
    """Both predictions for this load: both are recorded; the settings pick the one that fits.
    ``split`` is the share of offloaded layers per accelerator (see ``layer_devices``)."""
    return {COARSE: estimate_coarse(ref.info, options, gpus),
            DETAILED: estimate_detailed(ref.info, options, gpus, split)}


class Scheduler:
    """Loads, fits, evicts and unloads llama-server runners. See the module docstring."""

    def __init__(self, settings: SchedulerSettings, *, resolver: Resolver | None = None,
                 predictor: Predictor = default_predictor,
                 inventory: Callable[[], devmod.Inventory] | None = None,
                 runner_factory: RunnerFactory = Runner):
        """``resolver`` turns a name into a ModelRef (:class:`FileResolver`: a path);
        ``predictor`` predicts a load's memory per source (:func:`default_predictor`);
        ``inventory`` reads the host's devices; ``runner_factory`` makes each load's runner
        (:class:`Runner`, a llama-server child), so that the loop can be driven without one."""
        if not settings.binary:
            raise ConfigError("scheduler needs the path of a llama-server binary (settings.binary)")
        context_length()  # (a default context it cannot read stops the manager here, not every load)
        self.settings = settings
        self.resolver = resolver or FileResolver()
        self.predictor = predictor
        self.runner_factory = runner_factory
        # Workers are probed by the scheduler itself (it knows which ones its runners hold).
        self._inventory_fn = inventory or (lambda: devmod.inventory(workers=()))
        self._worker_status: dict[str, rpc.WorkerStatus] = {}  # last good probe per worker
        # a worker's answer once our runner let it go (see _wait_workers), for the plan that follows
        self._freed_at: dict[str, float] = {}
        self.loaded: dict[str, Loaded] = {}
        self.events = EventLog()
        self._lock = asyncio.Lock()
        self._name_changes = 0  # name_changed and unload_file calls so far (see acquire)
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
        # A shared manager's books (share()): quotas, fair queues, per-person counters. None in
        # a single-user manager, where none of it runs.
        self.users: UserBook | None = None
        self.evictions: collections.Counter[str] = collections.Counter()  # per model name, for /metrics
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
        devices alike), at least 3 (:func:`.policy.max_loaded`)."""
        return policy.max_loaded(self.settings, n_gpus)

    def share(self, quotas: QuotaTable | None = None) -> UserBook:
        """Make this a manager shared by many people (a JupyterHub service): requests that say
        who asked (``acquire(..., user=)``) are held to ``quotas`` and served round-robin
        across people when a model's slots are all taken (see :mod:`.users`)."""
        self.users = UserBook(quotas or QuotaTable(), self.events)
        return self.users

    async def acquire(self, name: str, options: LoadOptions | None = None, keep_alive=None,
                      user: Who | None = None) -> Lease:
        """Get a ready runner for ``name`` under ``options``, loading (and evicting) as needed.

        ``user``: who asked, on a shared manager (:meth:`share`): the request counts against
        their quotas (a 429 or a 507 naming the quota when over) and, when every slot of the
        model's runner is taken, waits for its turn, round-robin across people."""
        book = self.users
        if user is None or book is None:
            return await self._acquire(name, options, keep_alive)
        book.admit(user, name)
        try:
            lease = await self._acquire(name, options, keep_alive, user)
        except BaseException:
            book.leave(user)
            raise
        try:
            await book.take_turn(lease)
        except BaseException:
            lease.release()
            raise
        return lease

    async def _acquire(self, name: str, options: LoadOptions | None = None, keep_alive=None,
                       user: Who | None = None) -> Lease:
        if self._closed:
            raise SchedulerError("the scheduler is shutting down")
        ka = None if keep_alive is None else parse_duration(keep_alive)
        asked = options or LoadOptions()
        names_seen = self._name_changes
        ref = await self.resolver(name)
        # What a load of it would have: the configured slots too, so that another name of a
        # loaded file, asking for nothing, matches a runner that got them from the settings.
        options = self.effective_options(asked, ref)
        # (a lease whose child is found dead asks again, once: Lease)
        again = (name, options, keep_alive) if user is None else (name, options, keep_alive, user)
        lo = self.loaded.get(ref.key)
        if lo is not None and lo.state == ModelState.READY and not lo.unload_when_idle \
                and not lo.differences(options, ref.name) and lo.runner is not None and lo.runner.serving:
            return self._lease(lo, ka, 0.0, ref, again, user)  # fast path: no queue, no lock
        if self._pending >= self.settings.max_queue:
            self.events.emit(EventKind.BUSY, ref.name, f"queue full ({self._pending} waiting, limit "
                             f"{self.settings.max_queue}): request refused", pending=self._pending,
                             max_queue=self.settings.max_queue)
            raise ServerBusy(f"server busy, please try again later (queue limit {self.settings.max_queue} reached; "
                             "raise JUPYTER_LLAMA_MAX_QUEUE to allow more waiting requests)")
        self._pending += 1
        t0 = time.monotonic()
        loading = False  # this request waited for a load (its own or another's): its load_duration says how long
        try:
            while True:
                lo = self.loaded.get(ref.key)
                if lo is not None and lo.state == ModelState.LOADING:
                    loading = True
                    await asyncio.shield(lo.ready)  # one load, however many wait for it
                    continue
                if lo is not None and lo.state == ModelState.READY and not lo.unload_when_idle \
                        and not lo.differences(options, ref.name):
                    if await self._healthy(lo) and lo.state == ModelState.READY and not lo.unload_when_idle:
                        # (a health check is no load: 0 unless it waited for one)
                        return self._lease(lo, ka, time.monotonic() - t0 if loading else 0.0, ref, again, user)
                async with self._lock:
                    if self._closed:
                        raise SchedulerError("the scheduler is shutting down")
                    if self._name_changes != names_seen:
                        # A name was created, copied over or deleted since this request resolved
                        # its own: it loads what the name means now (or is a 404), never the
                        # file the name meant before under it.
                        names_seen = self._name_changes
                        ref = await self.resolver(name)
                        options = self.effective_options(asked, ref)
                        continue
                    lo = self.loaded.get(ref.key)
                    if lo is not None and lo.state == ModelState.READY and not lo.unload_when_idle \
                            and not lo.differences(options, ref.name) and await self._healthy(lo):
                        continue  # someone loaded it while we waited for the lock
                    lo = await self._load(ref, options, ka, user, replacing=lo)
                return self._lease(lo, ka, time.monotonic() - t0, ref, again, user)
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
        """Unload every model loaded from the file ``path`` (a model being deleted); one still
        loading is stopped, and the requests waiting for it are told it was deleted (404)."""
        self._name_changes += 1
        for lo in self.live():
            if lo.ref.path == path:
                await self._unload(lo, reason, rule="explicit",
                                   cancel=ModelNotFound(lo.name, "it was deleted while it was loading"))

    async def name_changed(self, name: str) -> list[str]:
        """``name`` was created, copied over or deleted: retire the runners loaded under it
        whose name (the one they were loaded under) no longer points at their file (another
        file, or nothing), so that ``stop``, ``rm``, the cap and the next request all see what
        the name means now. One whose name still points at its file stays, shown by the name
        that file is shown by now (a pulled model loaded by its full name is ``tiny:latest``
        once no model made here has that name, and its full name again beside one). Names
        it has also served (``also_as``) that no longer point at it are dropped. Returns the
        names retired."""
        self._name_changes += 1
        try:
            named = (await self.resolver(name)).key
        except JupyterLlamaError:
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
            except JupyterLlamaError:
                ref = None  # deleted
            except (OSError, ValueError):
                continue
            if ref is None or ref.key != lo.ref.key:
                what = "now names another file" if ref is not None else "was deleted"
                # (a load of it under way is stopped: its requests hear why, 404 or 409)
                cancel = (ModelNotFound(loaded_as, "it was deleted while it was loading") if ref is None else
                          LoadCancelled(f"{loaded_as} was pointed at another model file while it was loading, so "
                                        "that load was stopped; send the request again to load what it names now"))
                await self._unload(lo, f"{name} {what}", rule="replaced", cancel=cancel)
                retired.append(lo.name)
            elif ref.name != lo.ref.name:  # ps shows it as tags does
                lo.ref = dataclasses.replace(lo.ref, name=ref.name)
        return retired

    async def find_loaded(self, name: str) -> Loaded | None:
        """The loaded model ``name`` names, resolved as a load would resolve it (``m`` is
        ``m:latest``); a name the store no longer knows still finds what is loaded under it."""
        try:
            key = (await self.resolver(name)).key
        except JupyterLlamaError:
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
        except JupyterLlamaError:
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
        from ..memory.sources import with_projection_async

        ref = await self.resolver(name)
        opts = self.effective_options(options or LoadOptions(), ref)
        lo = next((x for x in self.loaded.values() if x.ref.key == ref.key and x.state != ModelState.GONE), None)
        same = lo is not None and lo.state in (ModelState.READY, ModelState.UNLOADING) \
            and not lo.differences(opts, ref.name)
        inv = await self.inventory()
        used = self.usage()
        if lo is not None:  # would it fit if it were loaded afresh: its own runner not counted
            for d, n in lo.charge.by_device().items():
                used[d] = max(0, used.get(d, 0) - n)
            if not same:  # ... nor the workers it holds, which a reload lets go first (as they last answered)
                inv.held = {ep: who for ep, who in inv.held.items() if ep not in (lo.options.rpc or ())}
        peers = await asyncio.to_thread(self.peer_holdings)
        if same:
            assert lo is not None  # (same is said of a loaded model only)
            opts, estimates, actual = lo.options, dict(lo.predictions), lo.actual
        else:
            opts, planned = await asyncio.to_thread(self.plan, ref, opts, inv, used, peermod.usage(peers))
            estimates = await with_projection_async(planned, engine, ref.path, opts)
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
        await asyncio.gather(*(self._stop_runner(lo, "manager shutting down", rule="shutdown",
                                                 cancel=ServerBusy(f"the manager is shutting down: the load of "
                                                                   f"{lo.name} was stopped"))
                               for lo in los),
                             *list(self._stopping), return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.peers is not None:
            await asyncio.wrap_future(self._board_write(self.peers.close))  # after the writes before it
            assert self._board is not None  # (made with the peers' board)
            self._board.shutdown(wait=False)
            self._board, self.peers = None, None  # off the board: nothing is published after this

    # -------------------------------------------------------------- internals: leasing

    def _lease(self, lo: Loaded, keep_alive: float | None, waited: float, ref: ModelRef | None = None,
               again: tuple | None = None, user: Who | None = None) -> Lease:
        if ref is not None and ref.name != lo.ref.name:  # the same file under another name: ps says so
            lo.also_as.add(ref.name)
        if keep_alive is not None and (user is None or self.users is None or user.admin
                                       or lo.loaded_by in (None, user.name)):
            # A request's own value overrides the runner's; on a shared manager, only its
            # loader's (or an admin's): another person's keep_alive 0 does not unload it.
            lo.keep_alive = keep_alive
        if lo.timer:
            lo.timer.cancel()
            lo.timer = None
        lo.expires_at = None
        lo.refcount += 1
        lo.idle.clear()
        lo.last_used = time.monotonic()
        self._in_flight += 1
        if user is not None:
            lo.users[user.name] += 1
            lo.used_by.add(user.name)
        return Lease(self, lo, waited, again, user)

    def _release(self, lo: Loaded, user: Who | None = None) -> None:
        if user is not None:
            lo.users[user.name] -= 1
            if lo.users[user.name] <= 0:
                del lo.users[user.name]
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
        return options  # (an embedding load's batch is within_training's: embed_batch)

    async def _retire_for_reload(self, lo: Loaded, options: LoadOptions, name: str | None = None) -> None:
        changed = lo.differences(options, name)
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
        self.events.emit(EventKind.RELOAD, lo.name, f"reloading: {reason}", changed=changed,
                         pid=lo.runner.pid if lo.runner is not None else None)
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

        The placement is :func:`.policy.placement` (the accelerators, llama.cpp's
        ``--fit-target`` from the room under each budget, the split of the layers); the
        predictions are the predictor's for it.
        """
        where = policy.placement(ref.info, options, inv, used, held)
        preds = self.predictor(ref, where.options, list(where.devices),
                               list(where.split) if where.split is not None else None)
        return where.options, preds

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
        """Per device: (bytes we may still plan with, the budget if one is set); see
        :func:`.policy.available`."""
        return policy.available(inv, used, peers, returned)

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
        return policy.need(preds, fit_source, self.settings.safety_margin)

    async def _load(self, ref: ModelRef, options: LoadOptions, keep_alive: float | None,
                    user: Who | None = None, replacing: Loaded | None = None) -> Loaded:
        """Called with the lock held: make room, start the runner, retry on OOM as Ollama does.
        ``replacing``: the model's runner now (other options, unhealthy, or being unloaded),
        stopped once the load is allowed (see :meth:`_make_room`).

        A load the scheduler stops meanwhile (:meth:`_stop_runner`: its name changed, a
        delete, shutdown) fails with the error the stop gave it (``Loaded.cancelled``), once its
        child has exited: no child of it outlives it, and none is started after the stop."""
        if not os.path.isfile(ref.path):  # deleted while this request waited: as if it never was
            raise ModelNotFound(ref.name, "it was deleted while this request waited")
        options = self.effective_options(options, ref)
        options, preds, fit_source = await self._make_room(ref, options, user, replacing)
        ka = self.settings.keep_alive if keep_alive is None else keep_alive
        lo = Loaded(ref=ref, options=options, keep_alive=ka, predictions=preds, fit_source=fit_source,
                    loaded_by=user.name if user is not None and self.users is not None else None)
        self.loaded[ref.key] = lo
        retried: set[str] = set()
        try:
            while True:
                try:
                    await self._start_runner(lo)
                    break
                except LoadError as e:
                    retry = await self._oom_retry(lo, e, retried) if e.oom else None
                    if retry is None or lo.cancelled is not None:
                        raise
            if lo.cancelled is not None:  # stopped as its start ended: its stop has the child
                raise lo.cancelled
        except BaseException as exc:
            cancelled = lo.cancelled
            if cancelled is not None and lo.runner is not None:
                # The stop that cancelled it may still be waiting for the child to exit: the
                # load ends once it has (every child is known here until it has exited).
                with contextlib.suppress(Exception):
                    await lo.runner.stop()
            lo.state = ModelState.GONE
            lo.gone.set()
            if self.loaded.get(ref.key) is lo:
                self.loaded.pop(ref.key)
            # a stopped load fails with the reason it was stopped, not with how its child ended
            error = cancelled if cancelled is not None and isinstance(exc, Exception) else exc
            if isinstance(error, LoadStopped):  # (stopped by someone other than this loop: still no crash)
                error = cancelled = LoadCancelled(f"the load of {ref.name} was stopped before it was ready; send the "
                                              "request again")
            if isinstance(error, Exception) and cancelled is None and lo.runner is not None \
                    and lo.runner.parser.n_lines:  # (not a cancel)
                self.failed[ref.key] = lo
                while len(self.failed) > 8:  # (the newest few: a log is up to 2,000 lines)
                    self.failed.pop(next(iter(self.failed)))
            err = error if isinstance(error, JupyterLlamaError) else LoadFailed(
                f"failed to load {ref.name}: {error}") if isinstance(error, EngineError) else error
            if isinstance(error, Exception):
                self.events.emit(EventKind.ERROR, ref.name, ("load stopped: " if cancelled is not None else
                                                             "load failed: ") + str(error).splitlines()[0])
            if not lo.ready.done():
                lo.ready.set_exception(err)
                lo.ready.exception()  # mark retrieved: waiters re-raise it themselves
            if err is exc:
                raise
            raise err from None
        lo.state = ModelState.READY
        lo.loaded_at = time.time()
        self.failed.pop(ref.key, None)  # (a load that failed before is no longer what `log` should show)
        actual = lo.actual
        assert lo.runner is not None  # (ready: its runner started)
        self.events.emit(EventKind.LOADED, ref.name, _loaded_message(lo, actual),
                         load_seconds=round(lo.load_duration, 3), pid=lo.runner.pid,
                         predicted={k: v.total() for k, v in preds.items()},
                         actual=actual.to_dict() if actual else None,
                         **({"user": lo.loaded_by} if lo.loaded_by else {}))
        published = asyncio.ensure_future(self._publish())  # (on the board's thread, while the budgets are checked)
        try:
            try:
                await self._enforce_budgets(lo)
            finally:
                await published
            if lo.cancelled is not None:  # stopped while its budgets were checked or published: see _stop_runner
                raise lo.cancelled
        except JupyterLlamaError as e:
            lo.ready.set_exception(e)
            lo.ready.exception()
            raise
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
        if lo.cancelled is not None:  # stopped between two tries (an OOM retry): no new child
            raise lo.cancelled
        # a model with no chat template of its own chats through Ollama's default one (launch.py)
        bare = {} if lo.ref.has_chat_template else {"extra_args": ["--chat-template", BARE_PROMPT_CHAT_TEMPLATE]}
        r = self.runner_factory(lo.ref.path, lo.options, binary=self.settings.binary, name=lo.ref.name,
                                load_timeout=self.settings.load_timeout, **bare)
        lo.runner = r
        self.events.emit(EventKind.LOAD, lo.name, f"starting llama-server for {lo.name}"
                         f" (context {lo.options.total_ctx or 'automatic'}, "
                         f"num_gpu {'automatic' if lo.options.num_gpu is None else lo.options.num_gpu})",
                         options=lo.options.to_dict(), **({"user": lo.loaded_by} if lo.loaded_by else {}))
        t0 = time.monotonic()
        await r.start()
        lo.load_duration = time.monotonic() - t0

    async def _oom_retry(self, lo: Loaded, err: LoadError, retried: set[str]) -> str | None:
        """Ollama's out-of-memory recoveries, each at most once. Returns what was done, or None."""
        train_ctx = lo.ref.info.context_length
        current = lo.options.request_ctx or train_ctx  # (an automatic context is its default, when set)
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

    def snapshot(self) -> list[LoadedSnapshot]:
        """The loaded models as the policy decides over them, now."""
        return [lo.snapshot() for lo in self.loaded.values()]

    def fit(self, ref: ModelRef, placed: LoadOptions, preds: dict[str, MemoryReport], inv: devmod.Inventory,
            used: dict[str, int], peers: list[peermod.Peer] | None = None) -> FitPlan:
        """The :class:`FitPlan` for loading ``ref`` as ``placed`` with ``preds``, given the
        devices and what loaded models use (this model's own runner not counted): the pure
        :func:`.policy.fit_plan` over a snapshot of the loaded models. It decides nothing and
        unloads nothing; the eviction it names is a dry run of the rule."""
        return policy.fit_plan(ref.name, ref.key, placed, preds, inv, used, self.snapshot(), self.settings, peers)

    def _eviction_order(self, ref: ModelRef) -> list[Loaded]:
        """Who an eviction for ``ref`` takes, in order (:func:`.policy.eviction_order`:
        shortest keep_alive first, ties by model path, idle before busy; pinned ones last,
        and only with ``evict_pinned``)."""
        order = policy.eviction_order(self.snapshot(), ref.key, self.settings.evict_pinned)
        return [self.loaded[s.key] for s in order]

    async def _make_room(self, ref: ModelRef, options: LoadOptions, user: Who | None = None,
                         replacing: Loaded | None = None) -> tuple[LoadOptions, dict[str, MemoryReport], str]:
        """Evict until the load fits (or refuse); returns the placed options, the predictions
        and the estimator that decided. The placement is planned again after each eviction:
        an evicted model may free an RPC worker the new one can use. On a shared manager, a
        load that would take ``user`` past their memory or loaded-model quota is refused
        first (a 507), before anything is evicted or ``replacing`` (the model's own runner,
        which may be another user's) is stopped for it."""
        again: tuple[devmod.Inventory, list[peermod.Peer]] | None = None
        quota_checked = user is None or self.users is None
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
            if not quota_checked:
                quota_checked = True
                assert user is not None  # (checked above: a person on a shared manager)
                self._check_quota(user, ref, self._need(preds, fit_source).by_device())
            if replacing is not None:  # (planned again without it: what it held is free)
                await self._retire_for_reload(replacing, options, ref.name)
                replacing = None
                continue
            numbers = {d: {k: n[k] for k in ("need", "estimate", "available", "in_use", "budget")}
                       for d, n in plan.devices.items()}
            if plan.fits:
                self.events.emit(EventKind.FIT, ref.name, "fits: " + plan.words(), fits=True, estimator=plan.estimator,
                                 devices=numbers, workers=plan.workers,
                                 predicted={k: v.total() for k, v in preds.items()})
                return placed, preds, fit_source
            if plan.verdict in ("over_budget", "peers"):
                msg = policy.refusal(plan, preds.get(fit_source), bool(inv.accelerators()), peermod.usage(peers))
                self.events.emit(EventKind.FIT, ref.name, "does not fit: " + msg, fits=False, devices=numbers,
                                 **({"peers": plan.peers} if plan.verdict == "peers" else {}))
                raise DoesNotFit(msg)
            if plan.verdict == "first":
                self.events.emit(EventKind.FIT, ref.name, "may not fit (" + plan.words() + "), but no other model is "
                                 "loaded: the first model always gets to try", fits=False, devices=numbers,
                                 workers=plan.workers)
                return placed, preds, fit_source
            short = plan.short
            reason = policy.eviction_reason(plan)
            self._refuse_if_only_pinned_help(ref, short, reason)
            if plan.verdict == "refuse" and short and not any(
                    lo.state == ModelState.LOADING and lo.ref.key != ref.key for lo in self.loaded.values()):
                # Even with every model that may go unloaded it would not fit: unloading them
                # would only lose their work. (Alone, a model still gets to try: see "first".)
                msg = policy.refusal(plan, preds.get(fit_source), bool(inv.accelerators()))
                self.events.emit(EventKind.FIT, ref.name, msg, fits=False, devices=numbers)
                raise DoesNotFit(msg)
            victim, rule = self._choose_victim(ref, reason)
            self.events.emit(EventKind.EVICT, victim.name,
                             f"evicting {victim.name} to make room for {ref.name}: {reason}; chosen because {rule}",
                             victim=victim.name, for_model=ref.name, rule=rule,
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
        device short and only pinned models hold the rest, refuse now, naming them
        (:func:`.policy.only_pinned_would_help`)."""
        if self.settings.evict_pinned or not short:
            return
        pinned = policy.only_pinned_would_help(self.snapshot(), ref.key, short, self.settings.evict_pinned)
        if pinned:
            msg = policy.pinned_refusal(ref.name, reason, pinned, unpinned_first=True)
            self.events.emit(EventKind.FIT, ref.name, msg, fits=False, pinned=[s.name for s in pinned])
            raise PinnedInTheWay(msg)

    def _check_quota(self, user: Who, ref: ModelRef, need: dict[str, int]) -> None:
        """A 507 naming the quota when loading ``ref`` (``need``: bytes per device) takes
        ``user`` past their memory or loaded-model quota: what the models their requests
        loaded hold counts (a reload of ``ref`` itself does not count its old runner)."""
        held: dict[str, int] = collections.defaultdict(int)
        count = 0
        for lo in self.loaded.values():
            if lo.state == ModelState.GONE or lo.loaded_by != user.name or lo.ref.key == ref.key:
                continue
            count += 1
            for d, n in lo.charge.by_device().items():
                held[d] += n
        assert self.users is not None  # (quotas are a shared manager's)
        self.users.check_load(user, ref.name, need, dict(held), count)

    def _fair_choice(self, snaps: list[LoadedSnapshot], key: str) -> tuple[LoadedSnapshot, str] | None:
        """On a shared manager: the eviction order with sharing's rule on top
        (:func:`.fairness.fair_eviction_order`: idle before busy, then the models of people
        over their share first)."""
        order = policy.eviction_order(snaps, key, self.settings.evict_pinned)
        if not order:
            return None
        holdings = {k: Holding(k, lo.loaded_by, bool(lo.users)) for k, lo in self.loaded.items()}
        held: dict[str, int] = collections.defaultdict(int)
        for lo in self.loaded.values():
            if lo.loaded_by is not None and lo.state != ModelState.GONE:
                held[lo.loaded_by] += lo.charge.total()
        over = over_share(held)
        first = fair_eviction_order(order, holdings, over)[0]
        rule = policy.victim_rule(first)
        owner = holdings.get(first.key)
        if owner is not None and owner.owner in over:
            rule += "; loaded by a user who holds more than an equal share of what is loaded"
        return first, rule

    def _choose_victim(self, ref: ModelRef, reason: str) -> tuple[Loaded, str]:
        """The first of :meth:`_eviction_order`, with the rule that chose it in words
        (:func:`.policy.choose_victim`); raises, naming the pinned models, when none may go."""
        snaps = self.snapshot()
        chosen = (self._fair_choice(snaps, ref.key) if self.users is not None else
                  policy.choose_victim(snaps, ref.key, self.settings.evict_pinned))
        if chosen is not None:
            return self.loaded[chosen[0].key], chosen[1]
        pinned = policy.pinned_in_the_way(snaps, ref.key)
        if pinned:
            msg = policy.pinned_refusal(ref.name, reason, pinned, unpinned_first=False)
            self.events.emit(EventKind.FIT, ref.name, msg, fits=False, pinned=[s.name for s in pinned])
            raise PinnedInTheWay(msg)
        raise DoesNotFit(f"cannot load {ref.name}: {reason}, and no loaded model can be evicted "
                         "(they are all still loading)")

    # -------------------------------------------------------------- internals: unloading

    async def _unload(self, lo: Loaded, reason: str, rule: str, cancel: JupyterLlamaError | None = None) -> None:
        """Unload, waiting for running requests first; then wait for GPU memory to come back.
        ``cancel``: what the requests waiting for its load hear, if it is still loading (see
        :meth:`_stop_runner`)."""
        if lo.state == ModelState.GONE:
            return
        if lo.refcount > 0:
            lo.unload_when_idle = reason
            await lo.gone.wait()
            return
        await self._stop_runner(lo, reason, rule, cancel)

    def _stop_behind(self, lo: Loaded, reason: str) -> None:
        """Take an idle runner off the loaded models now and stop it in the background;
        :meth:`shutdown` waits for it."""
        if self.loaded.get(lo.ref.key) is lo:
            self.loaded.pop(lo.ref.key)
        self._retiring.append(lo)
        self._stop_soon(lo, reason, rule="evict", tasks=self._stopping)

    async def _stop_runner(self, lo: Loaded, reason: str, rule: str, cancel: JupyterLlamaError | None = None) -> None:
        """Stop its runner and take it off the loaded models. One whose load has not finished
        is stopped too (a child being started included: :meth:`Runner.stop` waits for it), and
        its load fails with ``cancel`` (by default a 409 that gives ``reason``), not with the
        child's exit worded as a crash."""
        if lo.state in (ModelState.UNLOADING, ModelState.GONE):
            await lo.gone.wait()
            return
        if not lo.ready.done() and lo.cancelled is None:
            lo.cancelled = cancel or LoadCancelled(f"the load of {lo.name} was stopped before it was ready ({reason}); "
                                                   "send the request again")
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
        if rule in ("evict", "oom"):
            self.evictions[lo.name] += 1
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
                         exit_code=code, lost_workers=lost, pid=lo.runner.pid if lo.runner else None,
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
