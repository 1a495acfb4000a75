"""What the scheduler plans with: the devices and RPC workers as they are now, what its
runners hold, what this user's other managers hold, and where a load would go.

:class:`Devices` is the lowest part of :class:`~.loop.Scheduler`. It takes the inventory
(the free RPC workers probed now, the ones its runners hold as they last answered), sums
what the loaded runners are charged, plans a load's placement and predictions, and runs
the fit as a dry run over a snapshot (:func:`.policy.fit_plan`). It also writes what this
manager holds to the peer board (:mod:`..memory.peers`), on a thread of its own. It decides
nothing and stops nothing: the parts above it (:mod:`.unloading`, :mod:`.room`,
:mod:`.loading`, :mod:`.loop`) act on what it reports.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from typing import Callable

from ..load_options import LoadOptions
from ..memory import devices as devmod
from ..memory import peers as peermod
from ..memory import rpc
from ..memory.report import MemoryReport
from ..models.ref import ModelRef
from . import policy
from .policy import FitPlan
from .settings import SchedulerSettings
from .state import Loaded, LoadedSnapshot, ModelState

# How long a worker's answer after our runner let it go stands for it (see Devices.inventory):
# long enough for the load that evicted the runner to be planned, not for a later one.
FREED_FRESH_S = 1.0

# Predicts a load's memory per source: ``(ref, options, gpus, split)`` -> {source: report}
# (the default is ``loop.default_predictor``).
Predictor = Callable[..., dict[str, MemoryReport]]


class Devices:
    """The devices, the workers and the peers as the scheduler plans with them."""

    # (all made by Scheduler.__init__)
    settings: SchedulerSettings
    predictor: Predictor
    loaded: dict[str, Loaded]  # model key -> its runner's record, while it has one
    _inventory_fn: Callable[[], devmod.Inventory]  # reads the host's devices (workers are probed here)
    _worker_status: dict[str, rpc.WorkerStatus]  # last good probe per worker
    _freed_at: dict[str, float]  # a worker's answer once our runner let it go (see _wait_workers)
    _retiring: list[Loaded]  # evicted runners stopping while the next one starts, until they are gone
    peers: peermod.PeerBoard | None  # this user's other managers (None without peers_dir)
    _board: concurrent.futures.ThreadPoolExecutor | None  # writes self.peers' file (_board_write)

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

    # -------------------------------------------------------------- the peer board

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
