"""What every widget shares: actions written once as coroutines (run as tasks on a running
loop, to the end without one), errors shown in the widget, the frontend closing it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from typing import Any, Awaitable, Callable

import ipywidgets as W

from ..client import AsyncLlamaClient, LlamaClient


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _async_client(client: LlamaClient) -> AsyncLlamaClient:
    """An async client for the same server and token as ``client``."""
    return AsyncLlamaClient(client.server.url, client.server.token)



class _Actions:
    """Run an action synchronously, or as a task on the running loop (``background``)."""

    background: bool | None = None

    def _init_actions(self, background: bool | None) -> None:
        self.background = background
        self._tasks: set[asyncio.Task] = set()

    def _show_error(self, exc: BaseException) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _dispatch(self, action: Callable[[AsyncLlamaClient], Awaitable[Any]], *, block: bool = False):
        """Run ``action(async_client)``: each action is written once, as a coroutine.

        On a running event loop (a Jupyter kernel) it becomes a task there, so the kernel keeps
        answering while it runs; the task is returned. With no loop in this thread (a script,
        IPython in a terminal) it runs to the end before this returns, and so it does when
        ``block`` is set or ``background`` is False while a loop runs here (then on a helper
        thread with its own loop). Errors end up in the widget, never as a traceback."""
        async def with_client():
            async with _async_client(self.client) as ac:
                return await action(ac)

        async def to_the_end():
            result = await self._guard(with_client())
            here = asyncio.get_running_loop()  # and what it started (a load re-estimates), before this loop closes
            while mine := [t for t in self._tasks if t.get_loop() is here and not t.done()]:
                await asyncio.wait(mine)
            return result

        loop = _running_loop()
        if loop is None:
            return asyncio.run(to_the_end())
        if block or self.background is False:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                return pool.submit(asyncio.run, to_the_end()).result()
        task = loop.create_task(self._guard(with_client()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guard(self, coro):
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - shown in the widget
            self._show_error(e)
            return None

    async def wait_tasks(self, timeout: float | None = None) -> None:
        """Wait for the actions started in the background, and those they start (tests, scripts)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._tasks:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait(list(self._tasks), timeout=left)
            if deadline is not None and time.monotonic() >= deadline:
                return

    def _cancel_tasks(self) -> None:
        for t in list(getattr(self, "_tasks", ())):
            if not t.done():
                t.get_loop().call_soon_threadsafe(t.cancel)


def _safe(method):
    """Widget callbacks: show any error in the widget instead of raising into the kernel."""

    @functools.wraps(method)
    def inner(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001
            self._show_error(e)
            return None

    return inner


def _on_frontend_close(widget: W.Widget, callback: Callable[[], None]) -> None:
    """Call ``callback`` when the frontend closes the widget's comm."""
    comm = getattr(widget, "comm", None)
    if comm is not None and hasattr(comm, "on_close"):
        try:
            comm.on_close(lambda msg=None: callback())
        except Exception:  # noqa: BLE001 - a comm without close callbacks: close() still stops it
            pass


def _descendants(widget: W.Widget) -> list[W.Widget]:
    out, todo = [], list(getattr(widget, "children", ()) or ())
    while todo:
        w = todo.pop()
        out.append(w)
        todo.extend(getattr(w, "children", ()) or ())
    return out
