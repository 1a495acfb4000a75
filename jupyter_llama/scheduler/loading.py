"""Loading a model: the options a load really uses, the runner's start, and Ollama's
out-of-memory retries.

:class:`Loading` is the part of :class:`~.loop.Scheduler` that, with the load lock held,
makes room (:class:`~.room.MakingRoom`), starts the runner through the runner factory,
retries a load that ran out of memory as Ollama does (a smaller automatic context, then
without the other models, then with the projector on the CPU), and on success records the
runner, holds it to the budgets and watches it. A load that fails, or that the scheduler
stops meanwhile, ends with the error its requests should hear, once its child has exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Callable

from ..engine.launch import BARE_PROMPT_CHAT_TEMPLATE
from ..engine.runner import EngineError, LoadError, LoadStopped, Runner
from ..errors import JupyterLlamaError, LoadCancelled, LoadFailed, ModelNotFound
from ..load_options import LoadOptions
from ..memory.estimate import within_training
from ..memory.report import MemoryReport, format_bytes, format_pct
from ..models.ref import ModelRef
from .fairness import Who
from .room import MakingRoom
from .state import EventKind, Loaded, ModelState

# Makes a load's runner: called as Runner is, ``(path, options, binary=, name=, load_timeout=)``,
# and returns an object with Runner's interface (start, stop, memory, health, ...).
RunnerFactory = Callable[..., Runner]


class Loading(MakingRoom):
    """Starting a model's runner, with room made for it, and retrying it out of memory."""

    # (all made by Scheduler.__init__)
    runner_factory: RunnerFactory
    failed: dict[str, Loaded]  # the last failed load of each model (by file), for `log` to show what its child said

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

    async def _load(self, ref: ModelRef, options: LoadOptions, keep_alive: float | None,
                    user: Who | None = None, replacing: Loaded | None = None) -> Loaded:
        """Called with the lock held: make room, start the runner, retry on OOM as Ollama does.
        ``options``: as :meth:`effective_options` made them (the acquire path compares those
        with what is loaded). ``replacing``: the model's runner now (other options, unhealthy, or being unloaded),
        stopped once the load is allowed (see :meth:`_make_room`).

        A load the scheduler stops meanwhile (:meth:`_stop_runner`: its name changed, a
        delete, shutdown) fails with the error the stop gave it (``Loaded.cancelled``), once its
        child has exited: no child of it outlives it, and none is started after the stop."""
        if not os.path.isfile(ref.path):  # deleted while this request waited: as if it never was
            raise ModelNotFound(ref.name, "it was deleted while this request waited")
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
