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

:class:`Scheduler` is this module's: its public API, the acquire path (the fast path, the
queue, the load lock, a name changed meanwhile) and the leases. It is built on parts, each
in a module of its own and each on top of the one before:

* :mod:`.inventory` (:class:`~.inventory.Devices`): the devices and RPC workers, what the
  runners hold, the peer board, a load's plan and its fit as a dry run;
* :mod:`.unloading` (:class:`~.unloading.Unloading`): keep-alive timers, unloads, stops,
  crashes, and the wait for memory to come back;
* :mod:`.room` (:class:`~.room.MakingRoom`): the fit before a load, the quotas, the
  eviction and its victims, and the budgets after a load;
* :mod:`.loading` (:class:`~.loading.Loading`): the options a load uses, the runner's
  start, and the out-of-memory retries.
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

from ..config import ConfigError, context_length, parse_duration
from ..engine.runner import Runner
from ..errors import (
    BadRequest,
    JupyterLlamaError,
    LoadCancelled,
    ModelNotFound,
    SchedulerError,
    ServerBusy,
)
from ..load_options import LoadOptions
from ..memory import devices as devmod
from ..memory import peers as peermod
from ..memory import rpc
from ..memory.estimate import estimate_coarse, estimate_detailed
from ..memory.report import COARSE, DETAILED, MemoryReport
from ..models.gguf_info import GGUFError, read_gguf_info
from ..models.names import same_model
from ..models.ref import ModelRef
from . import policy
from .fairness import QuotaTable, Who
from .inventory import FREED_FRESH_S as FREED_FRESH_S
from .inventory import Predictor
from .loading import Loading, RunnerFactory
from .settings import SchedulerSettings
from .state import EventKind, EventLog, Lease, Loaded, ModelState
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


def default_predictor(ref: ModelRef, options: LoadOptions, gpus: list[str],
                      split: Sequence[float] | None = None) -> dict[str, MemoryReport]:
    """Both predictions for this load: both are recorded; the settings pick the one that fits.
    ``split`` is the share of offloaded layers per accelerator (see ``layer_devices``)."""
    return {COARSE: estimate_coarse(ref.info, options, gpus),
            DETAILED: estimate_detailed(ref.info, options, gpus, split)}


class Scheduler(Loading):
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

    async def _healthy(self, lo: Loaded) -> bool:
        """Alive, and (after a quiet spell) answering /health; a failure forces a reload."""
        r = lo.runner
        if r is None or not r.serving:
            return False
        if time.monotonic() - lo.last_used < 10 or await r.health():
            return True
        self.events.emit(EventKind.CRASH, lo.name, "health check failed: the runner will be reloaded", pid=r.pid)
        return False
