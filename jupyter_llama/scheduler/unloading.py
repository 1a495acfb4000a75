"""How a runner leaves: keep-alive timers, unloads that wait for running requests, stops,
crashes, and the wait for the memory to come back.

:class:`Unloading` is the part of :class:`~.loop.Scheduler` that stops runners. An idle
runner's keep-alive timer stops it when it runs out; a busy one is marked
(``Loaded.unload_when_idle``) and stopped by its last release. A stop takes the runner off
the loaded models, fails its load if it had not finished (with the reason it was stopped,
not as a crash), tells the peer board, and then waits until the GPUs' memory and the RPC
workers it held are back, so that the next plan counts them free. A child that dies on its
own is noticed (:meth:`Unloading._watch`) and stopped the same way.
"""

from __future__ import annotations

import asyncio
import collections
import time

from ..config import format_duration
from ..errors import JupyterLlamaError, LoadCancelled
from ..memory import devices as devmod
from ..memory import rpc
from ..memory.report import format_bytes, is_gpu
from ..procs import exit_words
from .inventory import Devices
from .state import EventKind, EventLog, Loaded, ModelState


class Unloading(Devices):
    """Keep-alive timers, unloads and stops; the waits for memory to come back."""

    # (all made by Scheduler.__init__)
    events: EventLog
    evictions: collections.Counter[str]  # per model name, for /metrics
    _closed: bool  # shutting down: a stop waits for no memory to come back
    _tasks: set[asyncio.Task]  # the stops and watches running on their own
    _stopping: set[asyncio.Task]  # evicted runners stopping while the next one starts (see _stop_behind)

    # -------------------------------------------------------------- keep-alive timers

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

    # -------------------------------------------------------------- unloading

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
