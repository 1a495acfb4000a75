"""Notebook widgets over the REST API: a model picker, a live panel of loaded models, pull progress.

* :class:`ModelPicker` (``%llama picker``): the registry's models, load options, the memory
  they are predicted to need (and whether that fits) before anything loads, Load / Unload,
  and a prompt whose answer streams in chunk by chunk.
* :class:`RunningPanel` (``%llama panel``): one row per loaded model (memory per device,
  actual against predicted, GPU layers, context, requests in flight, keep-alive countdown,
  an Unload button), device totals and budgets on top, the latest scheduler decisions
  below. It follows the manager live.
* :func:`pull_progress`: a progress bar for ``client.pull``.

The package mirrors the lab extension's TypeScript: ``model`` turns API answers into view
rows (:func:`model_rows`, :func:`fit_summary`, :func:`panel_rows`, :func:`device_rows`,
:func:`event_rows`), ``render`` turns rows into HTML (``render_*``), ``base`` carries the
actions, ``picker`` and ``panel`` are the widgets, which only fetch, call those and set
trait values. Nothing here decides a fit: the verdict and the room per device come from
the scheduler.

Live updates and the kernel
---------------------------
Jupyter kernels (ipykernel 6 and 7) run an asyncio event loop in the main thread and run
cells and comm messages on it. The panel's live loop is an asyncio task on that loop: it
talks to the server through :class:`~jupyter_llama.client.AsyncLlamaClient` (never a
blocking call), follows ``api/events`` as a stream to react at once, polls ``api/ps`` every
``interval`` seconds, and changes widget trait values only. Trait changes travel as comm
messages addressed to the widget's model, so they land in the widget wherever it is
displayed, never in whichever cell happens to be running; nothing is printed and no Output
widget captures anything. Every error is caught and shown as a short line in the widget
(an exception escaping a task or a callback would otherwise print a traceback into some
other cell). The loop stops on :meth:`RunningPanel.stop`, on ``close()``, and when the
frontend closes the widget. Picker actions (estimate, load, run) also run as tasks on that
loop when there is one, so a long answer streams while other cells run; without a running
loop (scripts, tests) they run to the end before the call returns. Each action is written
once, as a coroutine on the async client.
"""

# the public API (``__all__`` below), from the modules that define it
from .model import (  # noqa: F401
    device_rows,
    duration_text,
    error_text,
    event_rows,
    fit_summary,
    keep_alive_text,
    load_options,
    model_rows,
    panel_rows,
    parse_time,
)
from .panel import PullProgress, RunningPanel, pull_progress  # noqa: F401
from .picker import ModelPicker  # noqa: F401
from .render import render_devices, render_events, render_fit, render_panel_row  # noqa: F401

__all__ = [
    "ModelPicker",
    "RunningPanel",
    "PullProgress",
    "pull_progress",
    "model_rows",
    "load_options",
    "fit_summary",
    "panel_rows",
    "device_rows",
    "event_rows",
    "keep_alive_text",
    "render_fit",
    "render_panel_row",
    "render_devices",
    "render_events",
    "error_text",
    "duration_text",
    "parse_time",
]
