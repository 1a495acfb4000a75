"""``RunningPanel`` (``%llama panel``), the live view of loaded models, and pull progress."""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any, Callable, Mapping

import ipywidgets as W

from ..client import AsyncLlamaClient, LlamaClient, LlamaError
from ..memory.report import format_bytes
from ..models.names import same_model
from .base import _Actions, _async_client, _descendants, _on_frontend_close, _running_loop
from .model import (
    TransferRate,
    device_rows,
    error_text,
    event_rows,
    memory_scale_text,
    panel_rows,
    pull_error_text,
    rate_text,
)
from .render import _status, render_devices, render_events, render_panel_row


class _ModelRow(W.HBox):
    def __init__(self, name: str, on_unload: Callable[[str], Any]):
        self.name = name
        self.html = W.HTML(layout=W.Layout(flex="1"))
        self.unload_button = W.Button(description="Unload", icon="eject", tooltip=f"unload {name}",
                                      layout=W.Layout(width="96px"))
        self.unload_button.on_click(lambda _b: on_unload(name))
        super().__init__(children=[self.html, self.unload_button],
                         layout=W.Layout(align_items="flex-start", border_bottom="1px solid #eee"))

    def close(self) -> None:
        self.html.close()
        self.unload_button.close()
        super().close()


class RunningPanel(W.VBox, _Actions):
    """Loaded models with their memory, layers, context, requests and keep-alive, live.

    ``refresh()`` does one synchronous update. ``start()`` (automatic when created on a
    running event loop, e.g. in a Jupyter kernel; ``autostart=False`` to prevent it) runs the
    live loop as an asyncio task on that loop; ``stop()`` ends it, as do ``close()`` and the
    frontend closing the widget. With ``exclusive`` (the default) starting one panel's loop
    stops the others' in this kernel, so re-running a ``%llama panel`` cell does not pile up
    pollers (the older panel says it stopped; its ``start()`` resumes it).
    :meth:`stop_all` stops every panel's loop.
    """

    _live_panels: "weakref.WeakSet[RunningPanel]" = weakref.WeakSet()

    def __init__(self, client: LlamaClient | None = None, interval: float = 2.0, *, autostart: bool = True,
                 max_events: int = 8, exclusive: bool = True, background: bool | None = None, **kwargs):
        self.client = client if client is not None else LlamaClient()
        self.exclusive = exclusive
        self._init_actions(background)
        self.interval = float(interval)
        self.max_events = int(max_events)
        self._events: list[dict] = []  # the latest decisions, as the last poll saw them
        self._last_seq = 0
        self._rows: dict[str, _ModelRow] = {}
        self._task = None
        self._wake: asyncio.Event | None = None
        self.updates = 0  # completed refreshes (tests read it)
        self.last_rows: list[dict] = []
        self.last_devices: list[dict] = []

        self.title_html = W.HTML(value="<b>jupyter-llama</b>")
        self.devices_html = W.HTML()
        self.rows_box = W.VBox()
        self.events_html = W.HTML()
        self.status_html = W.HTML()
        super().__init__(children=[self.title_html, self.devices_html, self.rows_box, self.events_html,
                                   self.status_html], **kwargs)
        _on_frontend_close(self, self.stop)
        self.refresh()
        if autostart and _running_loop() is not None:
            self.start()

    # ------------------------------------------------------------------ updates

    def _show_error(self, exc: BaseException) -> None:
        self.status_html.value = _status(error_text(exc), error=True)

    def refresh(self) -> None:
        """One update (ps, devices, new events), finished when this returns."""
        self._dispatch(self.arefresh, block=True)

    async def arefresh(self, aclient: AsyncLlamaClient | None = None) -> None:
        """One update without blocking the event loop."""
        if aclient is None:
            async with _async_client(self.client) as ac:
                return await self.arefresh(ac)
        ps = await aclient.ps()
        dev = await aclient.devices()
        try:
            evs = await aclient.events(limit=self.max_events)
        except LlamaError:  # the panel works without the decisions
            evs = self._events
        self._apply(ps, dev, evs, time.time())

    def _apply(self, ps: dict, devices: dict, events: list[dict], now: float) -> None:
        # the latest events replace the previous ones (a restarted server numbers from 1 again)
        self._events = sorted(events, key=lambda e: e.get("seq", 0))[-self.max_events:]
        self._last_seq = max((int(e.get("seq") or 0) for e in self._events), default=0)
        rows = panel_rows(ps, devices, now)
        devs = device_rows(devices)
        self.last_rows, self.last_devices = rows, devs
        self.devices_html.value = render_devices(devs, len(rows), memory_scale_text(rows))
        names = [r["name"] for r in rows]
        for name in [n for n in self._rows if n not in names]:
            self._rows.pop(name).close()
        for r in rows:
            w = self._rows.get(r["name"])
            if w is None:
                w = self._rows[r["name"]] = _ModelRow(r["name"], self.unload)
            w.html.value = render_panel_row(r)
            w.unload_button.disabled = r["state"] in ("unloading", "gone")
        order = tuple(self._rows[n] for n in names)
        if tuple(self.rows_box.children) != order:
            self.rows_box.children = order
        if not rows:
            self.rows_box.children = ()
        self.events_html.value = render_events(event_rows(self._events, self.max_events))
        live = "live" if self.running else "not live (call refresh() or start())"
        self.status_html.value = _status(f"updated {time.strftime('%H:%M:%S', time.localtime(now))} · {live}")
        self.updates += 1
        if not rows:
            self.title_html.value = "<b>jupyter-llama</b> · no models loaded"
        else:
            self.title_html.value = f"<b>jupyter-llama</b> · {len(rows)} model{'s' if len(rows) != 1 else ''} loaded"

    def row(self, name: str) -> _ModelRow | None:
        """The row widget of a loaded model (by ps name, or a name without ``:latest``)."""
        return next((row for listed, row in self._rows.items() if same_model(listed, name)), None)

    # ------------------------------------------------------------------ unload

    def unload(self, name: str):
        """Unload ``name`` (the rows' Unload buttons call this), then update."""
        w = self.row(name)
        if w is not None:
            w.unload_button.disabled = True
        self.status_html.value = _status(f"unloading {name} …")

        async def act(ac):
            await ac.unload(name)
            if not self.running:
                await self.arefresh(ac)
            self.poke()

        return self._dispatch(act)

    # ------------------------------------------------------------------ live loop

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task:
        """Start the live loop as a task on ``loop`` (default: the running one)."""
        if self._task is not None and not self._task.done():  # (running)
            return self._task
        loop = loop or _running_loop()
        if loop is None:
            raise RuntimeError("RunningPanel.start() needs a running asyncio event loop (a Jupyter kernel has one); "
                               "call refresh() for a single update instead")
        if self.exclusive:
            for other in list(RunningPanel._live_panels):
                if other is not self:
                    other.stop()
        self._task = loop.create_task(self._live())
        RunningPanel._live_panels.add(self)
        return self._task

    @classmethod
    def stop_all(cls) -> None:
        """Stop the live loop of every panel in this process."""
        for p in list(cls._live_panels):
            p.stop()

    def stop(self) -> None:
        """Stop the live loop (safe from any thread; returns at once)."""
        task = self._task
        if task is not None and not task.done():
            loop = task.get_loop()
            if _running_loop() is loop:
                task.cancel()
            else:
                loop.call_soon_threadsafe(task.cancel)

    def poke(self) -> None:
        """Ask the live loop for an update now (from the loop's thread)."""
        if self._wake is not None:
            self._wake.set()

    async def _live(self) -> None:
        self._wake = asyncio.Event()
        ac = _async_client(self.client)
        follower = asyncio.ensure_future(self._follow_events(ac))
        failures = 0
        try:
            while self.comm is not None:
                self._wake.clear()
                try:
                    await self.arefresh(ac)
                    failures = 0
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - shown; the loop keeps going (server restarts)
                    failures += 1
                    self._show_error(e)
                delay = self.interval * min(8, 2 ** failures) if failures else self.interval
                try:
                    await asyncio.wait_for(self._wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
        except asyncio.CancelledError:
            pass
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            try:
                await ac.aclose()
            except Exception:  # noqa: BLE001
                pass
            self._wake = None
            RunningPanel._live_panels.discard(self)
            if self.comm is not None:
                self.status_html.value = _status("stopped (call start() to follow the manager again)")

    async def _follow_events(self, ac: AsyncLlamaClient) -> None:
        """Follow ``api/events`` as a stream: each new decision triggers an update at once
        (the update itself reads ps, devices and the latest events)."""
        backoff = self.interval
        while True:
            try:
                async for _ev in ac.events(since=self._last_seq, stream=True):
                    backoff = self.interval
                    if self._wake is not None:
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - polling still runs; try the stream again later
                pass
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 60.0)

    _task: asyncio.Task | None = None
    _rows: dict = {}

    def close(self) -> None:
        self.stop()
        self._cancel_tasks()
        for w in list(self._rows.values()):
            w.close()
        self._rows = {}
        for attr in ("title_html", "devices_html", "rows_box", "events_html", "status_html"):
            w = getattr(self, attr, None)
            if w is not None:
                w.close()
        super().close()



# ---------------------------------------------------------------------------- pull


class PullProgress(W.VBox):
    """A progress bar and a label for a pull; :meth:`run` drives it from ``client.pull``.
    While a file downloads the label says its speed and the time left, measured from the
    bytes completed over time (:class:`~.model.TransferRate`)."""

    def __init__(self, **kwargs: Any) -> None:
        self.bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="pull",
                                   layout=W.Layout(width="60%"))
        self.label = W.HTML()
        self.statuses: list[dict] = []
        self.source: str | None = None  # what is pulled, once run() knows it
        self._rate = TransferRate()
        super().__init__(children=[W.HBox([self.bar, self.label])], **kwargs)

    def update(self, st: Mapping, now: float | None = None) -> None:
        """Show one Ollama pull status dict (``now``: its time in seconds, monotonic; the
        time it arrives when not given)."""
        self.statuses.append(dict(st))
        status = str(st.get("status") or "")
        total, completed = st.get("total"), st.get("completed")
        if total:
            frac = min(1.0, max(0.0, float(completed or 0) / float(total)))
            self.bar.value = frac
            speed, left = self._rate.add(time.monotonic() if now is None else now,
                                         str(st.get("digest") or status), int(completed or 0), int(total))
            rate = rate_text(speed, left)
            self.label.value = _status(f"{status}: {format_bytes(completed or 0)} / {format_bytes(total)} "
                                       f"({frac:.0%})" + (f" · {rate}" if rate else ""))
        else:
            self.label.value = _status(status)
        if status == "success":
            self.bar.value = 1.0
            self.bar.bar_style = "success"
            self.label.value = _status("success" + (f": {st['model']}" if st.get("model") else ""))

    def close(self) -> None:
        for w in _descendants(self):
            w.close()
        super().close()

    def fail(self, message: str) -> None:
        """Show a failure: the source once, then what went wrong (:func:`~.model.pull_error_text`)."""
        self.bar.bar_style = "danger"
        text = pull_error_text(self.source or "", message)
        self.label.value = _status(f"{self.source}: {text}" if self.source else text, error=True)

    def run(self, client: LlamaClient, source: str, name: str | None = None, *, raise_errors: bool = False) -> dict:
        """Pull and show progress; returns the final status (``{"status": "error", "error": ...}`` on failure
        unless ``raise_errors``)."""
        self.source = source
        last: dict = {}
        try:
            stream = client.pull(source, name, stream=True)
            try:
                for st in stream:
                    self.update(st)
                    last = st
            finally:
                stream.close()
        except Exception as e:  # noqa: BLE001 - shown in the widget
            self.fail(error_text(e))
            if raise_errors:
                raise
            return {"status": "error", "error": error_text(e)}
        return last


def pull_progress(client: LlamaClient | None, source: str, name: str | None = None, *, display: bool = True,
                  widget: PullProgress | None = None, raise_errors: bool = False) -> dict:
    """Pull ``source`` (as ``name``) with a progress bar shown in the cell; returns the final status."""
    client = client if client is not None else LlamaClient()
    widget = widget if widget is not None else PullProgress()
    if display:
        try:
            from IPython.display import display as _display

            _display(widget)
        except ImportError:  # pragma: no cover - IPython is a dependency of ipywidgets
            pass
    return widget.run(client, source, name, raise_errors=raise_errors)
