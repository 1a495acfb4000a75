"""The loop's side of sharing one manager between many users: the counters, the clocks and
the queues behind the rules of :mod:`.fairness`.

A :class:`UserBook` is made by :meth:`.Scheduler.share` (a JupyterHub service does it; a
single-user manager has none, and none of this runs). For each request that says who asked:

* :meth:`UserBook.admit` checks the person's requests at once and requests a minute
  (a 429 naming the quota when over) and counts the request in;
* the scheduler loads the model (a load checks their memory and loaded-model quotas: a 507)
  and leases it;
* :meth:`UserBook.take_turn` waits for one of the model's slots: while every slot of the
  model's runner is taken, requests wait in one queue per person and are let in
  round-robin (:func:`.fairness.round_robin`), so one person's fifty queued requests do not
  delay another's first; a request that waited gives a ``queue`` event when it starts to
  wait and a ``turn`` event when it is let in;
* the lease's release gives the slot to the next in turn, and counts the request out.

It also keeps what ``/metrics`` tells per model and per person: requests, refusals,
generated tokens and the time they took.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, Callable

from ..errors import OverMemoryQuota, QuotaExceeded
from .fairness import (
    QuotaTable,
    Who,
    concurrent_refusal,
    load_refusal,
    quota_for,
    rate_refusal,
    round_robin,
)
from .state import EventKind, EventLog

if TYPE_CHECKING:
    from .state import Lease

__all__ = ["UserBook", "Gate"]


class Gate:
    """The slots of one model's runner, and the requests waiting for one, a queue per person."""

    def __init__(self, capacity: int, name: str = ""):
        self.name = name  # the model's, as ps shows it
        self.capacity = max(1, capacity)
        self.active = 0
        self.waiting: dict[str, collections.deque[asyncio.Future]] = {}
        self.ring: tuple[str, ...] = ()

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def queued_by(self, user: str) -> int:
        return len(self.waiting.get(user, ()))

    def enter(self, user: str) -> asyncio.Future | None:
        """None: a slot is taken now. Else a future that is done when the slot is this request's."""
        if self.active < self.capacity and not self.queued:
            self.active += 1
            return None
        fut = asyncio.get_running_loop().create_future()
        q = self.waiting.setdefault(user, collections.deque())
        if not q and user not in self.ring:
            self.ring = self.ring + (user,)
        q.append(fut)
        self._wake()  # (a slot may be free with others waiting: a cancelled request freed it)
        return fut

    def leave(self) -> None:
        """A request holding a slot is done with it: the next in turn gets it."""
        self.active -= 1
        self._wake()

    def withdraw(self, user: str, fut: asyncio.Future) -> None:
        """A waiting request gave up (its client left): out of the queue, or, if the slot was
        given to it meanwhile, the slot goes on to the next."""
        q = self.waiting.get(user)
        if q is not None and fut in q:
            q.remove(fut)
            if not q:
                del self.waiting[user]
            return
        if fut.done() and not fut.cancelled():
            self.leave()

    def _wake(self) -> None:
        while self.active < self.capacity:
            counts = {u: len(q) for u, q in self.waiting.items()}
            user, self.ring = round_robin(self.ring, counts)
            if user is None:
                return
            fut = self.waiting[user].popleft()
            if not self.waiting[user]:
                del self.waiting[user]
            if fut.done():  # (cancelled meanwhile)
                continue
            self.active += 1
            fut.set_result(user)


class UserBook:
    """Per-person state of a shared manager (see the module's docstring)."""

    def __init__(self, table: QuotaTable, events: EventLog, clock: Callable[[], float] = time.monotonic):
        self.table = table
        self.events = events
        self.clock = clock
        self.in_flight: collections.Counter[str] = collections.Counter()  # running or waiting, per person
        self.recent: dict[str, collections.deque[float]] = {}  # request times in the last minute, per person
        self.gates: dict[str, Gate] = {}  # per model key
        self.people: dict[str, Who] = {}  # the last identity seen of each person
        # for /metrics
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()  # (model, person)
        self.refusals: collections.Counter[tuple[str, str]] = collections.Counter()  # (person, quota)
        self.tokens: collections.Counter[tuple[str, str]] = collections.Counter()  # (model, person)
        self.token_seconds: collections.defaultdict[tuple[str, str], float] = collections.defaultdict(float)
        self.last_rate: dict[str, float] = {}  # model -> tokens/s of its latest answer

    def quota(self, who: Who):
        return quota_for(who, self.table)

    # ------------------------------------------------------------ admission

    def admit(self, who: Who, model: str) -> None:
        """Count a request of ``who`` in, or refuse it with a 429 naming the quota."""
        self.people[who.name] = who
        quota = self.quota(who)
        now = self.clock()
        recent = self.recent.setdefault(who.name, collections.deque())
        while recent and now - recent[0] >= 60.0:
            recent.popleft()
        refusal = concurrent_refusal(who, self.in_flight[who.name], quota)
        kind = "concurrent"
        if refusal is None:
            refusal, kind = rate_refusal(who, recent, now, quota), "per_minute"
        if refusal is not None:
            self.refused(who, kind, model, refusal)
            raise QuotaExceeded(refusal)
        recent.append(now)
        self.in_flight[who.name] += 1
        self.requests[(model, who.name)] += 1

    def leave(self, who: Who) -> None:
        """A request counted in by :meth:`admit` is over."""
        self.in_flight[who.name] -= 1
        if self.in_flight[who.name] <= 0:
            del self.in_flight[who.name]

    def refused(self, who: Who, kind: str, model: str | None, sentence: str) -> None:
        self.refusals[(who.name, kind)] += 1
        self.events.emit(EventKind.REFUSE, model, sentence, user=who.name, quota=kind)

    def check_load(self, who: Who, model: str, need: dict[str, int], held: dict[str, int], held_models: int) -> None:
        refusal = load_refusal(who, model, need, held, held_models, self.quota(who))
        if refusal is not None:
            self.refused(who, "models" if "'models'" in refusal else "memory", model, refusal)
            raise OverMemoryQuota(refusal)

    # ------------------------------------------------------------ turns

    def gate(self, key: str, capacity: int) -> Gate:
        g = self.gates.get(key)
        if g is None:
            g = self.gates[key] = Gate(capacity)
        elif capacity != g.capacity:
            g.capacity = max(1, capacity)
            g._wake()
        return g

    async def take_turn(self, lease: "Lease") -> None:
        """Wait until one of the leased model's slots is this request's (fair across people)."""
        who = lease.who
        lo = lease.loaded
        slots = lo.runner.slots if lo.runner is not None else 1
        gate = self.gate(lo.ref.key, slots)
        gate.name = lo.name
        fut = gate.enter(who.name)
        lease._gate = gate
        if fut is None:
            return
        ahead = gate.queued - 1
        self.events.emit(EventKind.QUEUE, lo.name, f"a request waits for a slot of {lo.name} ({gate.active} of "
                         f"{gate.capacity} busy, {ahead} request(s) waiting before it)",
                         user=who.name, waiting=gate.queued, slots=gate.capacity)
        try:
            await fut
        except BaseException:
            gate.withdraw(who.name, fut)
            lease._gate = None
            raise
        self.events.emit(EventKind.TURN, lo.name, f"a waiting request's turn on {lo.name}", user=who.name,
                         waiting=gate.queued)

    def finish(self, lease: "Lease") -> None:
        """The lease is released: its slot goes to the next in turn, its request counts out."""
        gate, lease._gate = lease._gate, None
        if gate is not None:
            gate.leave()
        if lease.who is not None:
            self.leave(lease.who)

    # ------------------------------------------------------------ metrics

    def record_tokens(self, model: str, who: Who | None, tokens: int, seconds: float) -> None:
        """An answer of ``tokens`` generated tokens that took ``seconds`` to generate."""
        if tokens <= 0:
            return
        name = who.name if who is not None else ""
        self.tokens[(model, name)] += tokens
        self.token_seconds[(model, name)] += max(seconds, 0.0)
        if seconds > 0:
            self.last_rate[model] = tokens / seconds

    def requests_last_minute(self, user: str) -> int:
        now = self.clock()
        return sum(1 for t in self.recent.get(user, ()) if now - t < 60.0)

    def queue_depth(self) -> dict[str, int]:
        """Requests waiting per model (by name)."""
        out: collections.Counter[str] = collections.Counter()
        for g in self.gates.values():
            out[g.name] += g.queued
        return dict(out)

    def waiting_by_user(self) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter()
        for g in self.gates.values():
            for u, q in g.waiting.items():
                out[u] += len(q)
        return dict(out)
