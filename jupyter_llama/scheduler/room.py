"""Making room for a load: the fit, the quotas, the eviction and its victims.

:class:`MakingRoom` is the part of :class:`~.loop.Scheduler` that decides, with the load
lock held, whether a load may go ahead and what must go for it. It plans the load on the
devices as they are (:class:`~.inventory.Devices`), asks the policy whether it fits
(:func:`.policy.fit_plan`) and, while it does not, evicts one victim at a time and plans
again: an evicted model may free memory or an RPC worker the new one can use. It refuses
with words (:class:`DoesNotFit`, :class:`PinnedInTheWay`, a quota's 507) before it stops
anything for nothing. Once a runner is loaded, :meth:`MakingRoom._enforce_budgets` holds
its actual allocation to the budgets the same way.

On a shared manager (:meth:`.Scheduler.share`) the quota is checked before anything is
evicted or the model's own runner is stopped, and the victim is chosen by sharing's rule
on top of the policy's (:func:`.fairness.fair_eviction_order`).
"""

from __future__ import annotations

import asyncio
import collections

from ..config import shown
from ..errors import DoesNotFit, PinnedInTheWay
from ..load_options import LoadOptions
from ..memory import devices as devmod
from ..memory import peers as peermod
from ..memory import rpc
from ..memory.report import HOST, MemoryReport, format_bytes
from ..models.ref import ModelRef
from . import policy
from .fairness import Holding, Who, fair_eviction_order, over_share
from .policy import budget_room
from .state import EventKind, Loaded, LoadedSnapshot, ModelState
from .unloading import Unloading
from .users import UserBook


class MakingRoom(Unloading):
    """The fit, the quotas and the evictions before a load, and the budgets after it."""

    # (made by Scheduler.__init__; set by Scheduler.share)
    users: UserBook | None  # a shared manager's books; None in a single-user manager

    def _need(self, preds: dict[str, MemoryReport], fit_source: str) -> MemoryReport:
        return policy.need(preds, fit_source, self.settings.safety_margin)

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

    async def _retire_for_reload(self, lo: Loaded, options: LoadOptions, name: str | None = None) -> None:
        """Unload the model's own runner ``lo`` so that its reload under ``options`` is planned
        without it (called by :meth:`_make_room` once the load is allowed), with a ``reload``
        event saying why: its child is gone, it was being unloaded, its options changed, or
        its health check failed."""
        changed = lo.differences(options, name)
        dead = lo.runner is None or not lo.runner.alive
        if lo.unload_when_idle and (dead or not changed):
            # (its stop, decided before this request came, may have ended its child meanwhile:
            # that is the unload, not a crash)
            reason, rule = f"it was being unloaded ({lo.unload_when_idle})", "reload"
        elif dead:
            reason, rule = "its runner is no longer running", "crash"
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

    def _eviction_order(self, ref: ModelRef) -> list[Loaded]:
        """Who an eviction for ``ref`` takes, in order (:func:`.policy.eviction_order`:
        shortest keep_alive first, ties by model path, idle before busy; pinned ones last,
        and only with ``evict_pinned``)."""
        order = policy.eviction_order(self.snapshot(), ref.key, self.settings.evict_pinned)
        return [self.loaded[s.key] for s in order]

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
