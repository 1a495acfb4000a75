"""Notebook widgets over the REST API: a model picker, a live panel of loaded models, pull progress.

* :class:`ModelPicker` (``%llama picker``): the registry's models, load options, the memory
  they are predicted to need (and whether that fits) before anything loads, Load / Unload,
  and a prompt whose answer streams in chunk by chunk.
* :class:`RunningPanel` (``%llama panel``): one row per loaded model (memory per device,
  actual against predicted, GPU layers, context, requests in flight, keep-alive countdown,
  an Unload button), device totals and budgets on top, the latest scheduler decisions
  below. It follows the manager live.
* :func:`pull_progress`: a progress bar for ``client.pull``.

The logic lives in pure functions that turn API answers into view rows
(:func:`model_rows`, :func:`fit_summary`, :func:`panel_rows`, :func:`device_rows`,
:func:`event_rows`) and render them to HTML (``render_*``); the widget classes only fetch,
call those and set trait values.

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
loop (scripts, tests) they run synchronously.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as _dt
import functools
import html
import math
import time
import weakref
from typing import Any, Awaitable, Callable, Iterable, Mapping

import ipywidgets as W

from .client import AsyncLlamaClient, LlamaClient, LlamaError
from .memory.report import COARSE, DETAILED, LLAMA_CPP, format_bytes
from .models.names import same_model

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
]

ACTUAL = "actual"
FOREVER_S = 50 * 365 * 86400  # expires_at further away than this: kept loaded for good

# colours (colour-blind safe pairs from the Tableau palette)
C_ACTUAL = "#4e79a7"
C_DETAILED = "#e15759"
C_COARSE = "#f28e2b"
C_LLAMA = "#59a14f"
C_OK = "#2e7d32"
C_BAD = "#c62828"
C_MUTED = "#666"


# ============================================================================ small helpers


def error_text(exc: BaseException) -> str:
    """A short, traceback-free line for an exception."""
    if isinstance(exc, LlamaError):
        return exc.message if exc.status is None else f"{exc.message} (HTTP {exc.status})"
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def duration_text(seconds: float) -> str:
    """``75`` -> ``1m 15s``; ``3700`` -> ``1h 01m``; ``9`` -> ``9s``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def parse_time(value: Any) -> float | None:
    """RFC 3339 text (or epoch seconds) -> epoch seconds; None when absent or unreadable."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    text = str(value).strip()
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    try:
        dt = _dt.datetime.fromisoformat(text)
    except ValueError:
        # fractional seconds longer than Python < 3.11 accepts
        head, dot, rest = text.partition(".")
        if not dot:
            return None
        frac = "".join(ch for ch in rest if ch.isdigit())
        tz = rest[len(frac):]
        try:
            dt = _dt.datetime.fromisoformat(f"{head}.{frac[:6]}{tz}")
        except ValueError:
            return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=_dt.timezone.utc)
    return dt.timestamp()


def _report_by_device(report: Mapping | None) -> dict[str, int]:
    """``MemoryReport.to_dict()`` -> {device: total bytes}."""
    if not report:
        return {}
    return {d: int(sum(comps.values())) for d, comps in (report.get("devices") or {}).items()}


def _device_order(devs: Iterable[str]) -> list[str]:
    return sorted(set(devs), key=lambda d: (d != "cpu", d))


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _async_client(client: LlamaClient) -> AsyncLlamaClient:
    """An async client for the same server and token as ``client``."""
    return AsyncLlamaClient(client.server.url, client.server.token)


# ============================================================================ view models: picker


def model_rows(tags: Mapping | None, ps: Mapping | None = None) -> list[dict]:
    """One row per registry model: name, size, quantisation, parameters, family, loaded or not."""
    loaded = {m.get("name"): m for m in (ps or {}).get("models") or []}
    rows = []
    for m in (tags or {}).get("models") or []:
        name = m.get("name") or m.get("model") or ""
        det = m.get("details") or {}
        row = {
            "name": name,
            "size": int(m.get("size") or 0),
            "quantization": det.get("quantization_level") or "",
            "parameters": det.get("parameter_size") or "",
            "family": det.get("family") or "",
            "loaded": name in loaded,
            "state": (loaded.get(name) or {}).get("state"),
        }
        bits = [name, format_bytes(row["size"])]
        if row["quantization"]:
            bits.append(row["quantization"])
        if row["parameters"]:
            bits.append(f"{row['parameters']} params")
        if row["loaded"]:
            bits.append("loaded" if row["state"] in (None, "ready") else str(row["state"]))
        row["label"] = " · ".join(bits)
        rows.append(row)
    return rows


GPU_AUTO, GPU_NONE, GPU_N = "auto", "cpu", "n"


def load_options(num_ctx: int | None = None, gpu_mode: str = GPU_AUTO, gpu_layers: int | None = None,
                 **extra) -> dict:
    """Ollama ``options`` for the picker's fields: context (0/None = default) and GPU layers.

    ``gpu_mode``: ``"auto"`` (num_gpu unset, or -1), ``"cpu"`` (0) or ``"n"`` (``gpu_layers``).
    """
    opts: dict[str, Any] = {}
    if num_ctx:
        opts["num_ctx"] = int(num_ctx)
    if gpu_mode == GPU_NONE:
        opts["num_gpu"] = 0
    elif gpu_mode == GPU_N and gpu_layers is not None and gpu_layers >= 0:
        opts["num_gpu"] = int(gpu_layers)
    opts.update({k: v for k, v in extra.items() if v is not None})
    return opts


def _device_room(devices: Mapping) -> dict[str, dict]:
    """Per device of ``/api/devices``: its figures, what loaded models use (the server's
    ``usage``) and what a new model may still use there (the scheduler's ``available``,
    absent when no scheduler runs). Nothing is computed here."""
    usage = devices.get("usage") or {}
    out = {}
    for d in devices.get("devices") or []:
        dev = d.get("id")
        out[dev] = {"name": d.get("name") or dev, "total": int(d.get("total") or 0), "free": int(d.get("free") or 0),
                    "budget": d.get("budget"), "overhead": int(d.get("overhead") or 0) if dev != "cpu" else 0,
                    "used": int(usage.get(dev, 0)), "available": d.get("available"),
                    "state": ("unreachable" if d.get("reachable") is False else "held" if d.get("held_by")
                              else "ready"), "held_by": d.get("held_by"), "error": d.get("error")}
    return out


def fit_summary(estimate: Mapping, devices: Mapping | None = None) -> dict:
    """``/api/estimate``'s answer in rows and words: per device the predictions of each source
    and the scheduler's fit plan for it (what it needs with the estimator and margin the
    scheduler really uses, what is available, the verdict, what a load would evict).

    The verdict is the scheduler's (``estimate["fit"]``); without a scheduler (no engine yet)
    there is none, and ``fits`` is None. ``devices`` (``/api/devices``) only says which
    devices this machine has. Returns ``{"model", "fits", "verdict", "estimator", "n_ctx",
    "layers", "devices": [rows], "evict", "text", "warnings"}``; each row has ``device, coarse,
    detailed, llama_cpp, need, available, budget, used, known, checked, fits``.
    """
    ests = estimate.get("estimates") or {}
    fit = estimate.get("fit") or {}
    plan = fit.get("devices") or {}
    known = {d.get("id") for d in (devices or {}).get("devices") or []}
    per = {src: _report_by_device(rep) for src, rep in ests.items()}
    rows = []
    for dev in _device_order(list(plan) + [d for src in per.values() for d in src]):
        n = plan.get(dev) or {}
        rows.append({
            "device": dev,
            "coarse": per.get(COARSE, {}).get(dev),
            "detailed": per.get(DETAILED, {}).get(dev),
            "llama_cpp": per.get(LLAMA_CPP, {}).get(dev),
            "need": n.get("need"),
            "available": n.get("available"),
            "budget": n.get("budget"),
            "used": n.get("in_use", 0),
            "known": dev in known if known else n.get("available") is not None,
            "checked": n.get("checked", False),
            "fits": n.get("fits"),
        })
    source = fit.get("estimator") or (DETAILED if DETAILED in ests else next(iter(ests), None))
    main = ests.get(DETAILED) or ests.get(COARSE) or {}
    n_ctx = main.get("n_ctx") or (estimate.get("options") or {}).get("num_ctx")
    lo, lt = main.get("layers_offloaded"), main.get("layers_total")
    warnings = [w for rep in ests.values() for w in (rep.get("warnings") or [])]
    loaded = estimate.get("loaded") or {}
    summary = {"model": estimate.get("model"), "fits": fit.get("fits") if fit else None,
               "verdict": fit.get("verdict"), "estimator": source or "none", "n_ctx": n_ctx,
               "layers": f"{lo}/{lt}" if lo is not None and lt else None, "evict": list(fit.get("evict") or []),
               "already_loaded": loaded.get("name"), "devices": rows, "warnings": warnings,
               "totals": {src: sum(v.values()) for src, v in per.items()}}
    summary["text"] = _fit_words(summary)
    return summary


def _fit_words(s: dict) -> str:
    if not s["devices"]:
        return f"No memory prediction for {s['model']}."
    ctx = f" with context {s['n_ctx']}" if s.get("n_ctx") else ""
    totals = s["totals"]
    pred = [f"{src} {format_bytes(totals[src])}" for src in (DETAILED, COARSE, LLAMA_CPP) if src in totals]
    head = f"{s['model']}{ctx} is predicted to need " + ", ".join(pred) + "."
    if s.get("layers"):
        head += f" GPU layers {s['layers']}."
    if s.get("verdict") is None:
        return head + " (No scheduler is running here, so there is no fit verdict.)"
    parts = []
    for r in s["devices"]:
        if r["need"] is None or not r["checked"]:
            continue
        budget = f", budget {format_bytes(r['budget'])}" if r["budget"] is not None else ""
        where = r["device"] if r["known"] else f"{r['device']} (not on this machine)"
        parts.append(f"{where} needs {format_bytes(r['need'])} ({s['estimator']}) of "
                     f"{format_bytes(r['available'] or 0)} available{budget}")
    verdict = {"fits": "Fits", "evict": "Fits after evicting " + ", ".join(s["evict"]),
               "first": "May not fit, but nothing else is loaded: it gets to try",
               "over_budget": "Does not fit (over the budget)",
               "refuse": "Does not fit, and evicting would not make room"}.get(s["verdict"], s["verdict"])
    tail = f"{verdict}: " + "; ".join(parts) + "." if parts else f"{verdict}."
    if s.get("already_loaded"):
        tail += f" ({s['already_loaded']} is loaded now.)"
    return f"{head} {tail}"


# ============================================================================ view models: panel


def keep_alive_text(model: Mapping, now: float) -> tuple[str, float | None]:
    """(words, seconds left or None) for one ``/api/ps`` entry's keep-alive."""
    if model.get("pinned"):
        return "kept loaded (keep_alive < 0)", None
    exp = parse_time(model.get("expires_at"))
    if exp is None:
        return "no expiry", None
    left = exp - now
    if left > FOREVER_S:
        return "kept loaded (keep_alive < 0)", None
    if int(model.get("refcount") or 0) > 0:
        return f"busy; unloads {duration_text(max(0.0, left))} after its last request", None
    if left <= 0:
        return "unloading now", 0.0
    return f"unloads in {duration_text(left)}", left


def panel_rows(ps: Mapping | None, devices: Mapping | None, now: float) -> list[dict]:
    """One row per loaded model: memory per device (actual and predictions), layers, context,
    requests in flight, keep-alive countdown."""
    room = _device_room(devices or {})
    rows = []
    for m in (ps or {}).get("models") or []:
        mem = m.get("memory") or {}
        actual = _report_by_device(mem.get(ACTUAL))
        preds = {src: _report_by_device(mem.get(src)) for src in (DETAILED, COARSE, LLAMA_CPP) if mem.get(src)}
        devs = _device_order(list(actual) + [d for p in preds.values() for d in p])
        per_dev = []
        for dev in devs:
            a = actual.get(dev) if mem.get(ACTUAL) else None
            p = {src: v.get(dev, 0) for src, v in preds.items()}
            scale = max([a or 0, *p.values(), 1]) * 1.15
            main_pred = p.get(DETAILED, p.get(COARSE))
            r = room.get(dev)
            cap = (r["budget"] if r and r["budget"] is not None else (r["total"] if r else None))
            per_dev.append({
                "device": dev, "actual": a, "predicted": p, "scale": scale,
                "actual_pct": 100.0 * (a or 0) / scale,
                "predicted_pct": {src: 100.0 * v / scale for src, v in p.items()},
                "error_pct": (100.0 * (main_pred - a) / a) if a and main_pred is not None else None,
                "share_pct": (100.0 * (a if a is not None else (main_pred or 0)) / cap) if cap else None,
                "capacity": cap, "capacity_kind": ("budget" if r and r["budget"] is not None else "total"),
            })
        lo_, lt = m.get("layers_offloaded"), m.get("layers_total")
        opts = m.get("options") or {}
        if lo_ is not None and lt:
            layers = f"{lo_}/{lt}"
        elif int(m.get("size_vram") or 0) == 0:
            layers = "0 (CPU only)" if lt is None else f"0/{lt}"
        else:
            layers = "?"
        ka, left = keep_alive_text(m, now)
        rows.append({
            "name": m.get("name") or m.get("model"),
            "state": m.get("state") or "ready",
            "pid": m.get("pid"),
            "size": int(m.get("size") or 0),
            "size_vram": int(m.get("size_vram") or 0),
            "context": m.get("context_length") or opts.get("num_ctx"),
            "num_gpu": opts.get("num_gpu"),
            "layers": layers,
            "refcount": int(m.get("refcount") or 0),
            "pinned": bool(m.get("pinned")),
            "keep_alive": ka,
            "expires_in": left,
            "devices": per_dev,
            "has_actual": bool(mem.get(ACTUAL)),
        })
    return rows


def device_rows(devices: Mapping | None) -> list[dict]:
    """One row per device: total, free, budget, used by loaded models, what is left to plan with."""
    room = _device_room(devices or {})
    rows = []
    for dev, r in room.items():
        cap = r["budget"] if r["budget"] is not None else r["total"]
        rows.append({"device": dev, "name": r["name"], "total": r["total"], "free": r["free"],
                     "budget": r["budget"], "used": r["used"], "available": r["available"],
                     "state": r["state"], "held_by": r["held_by"], "error": r["error"],
                     "capacity": cap, "used_pct": (100.0 * r["used"] / cap) if cap else 0.0})
    return rows


def event_rows(events: Iterable[Mapping], limit: int = 8) -> list[dict]:
    """The latest ``limit`` events, newest first."""
    evs = sorted(events, key=lambda e: e.get("seq", 0))[-limit:] if limit else []
    out = []
    for e in reversed(evs):
        t = e.get("time")
        out.append({"seq": e.get("seq"), "time": time.strftime("%H:%M:%S", time.localtime(t)) if t else "",
                    "kind": e.get("kind") or "", "model": e.get("model") or "", "message": e.get("message") or ""})
    return out


# ============================================================================ HTML


_TABLE = "border-collapse:collapse;font-size:12px;margin:4px 0"
_TD = "padding:1px 8px;text-align:right"
_TH = "padding:1px 8px;text-align:right;border-bottom:1px solid #ccc"


def _fmt(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def render_fit(summary: Mapping) -> str:
    """Plain words and a small table for :func:`fit_summary`'s result."""
    ok = summary.get("fits")
    v = summary.get("verdict")
    colour = C_OK if ok or v == "evict" else C_MUTED if v in (None, "first") else C_BAD
    verdict = {"fits": "fits", "evict": "fits after evicting", "first": "may not fit", None: "no verdict"}.get(
        v, "does not fit")

    def cell(r):
        if r["fits"] is None or not r.get("checked"):
            return f"<td style='{_TD};color:{C_MUTED}'>{'' if r['fits'] is None else 'not checked'}</td>"
        return f"<td style='{_TD};color:{C_OK if r['fits'] else C_BAD}'>{'fits' if r['fits'] else 'does not fit'}</td>"

    rows = "".join(
        f"<tr><td style='{_TD};text-align:left'>{_e(r['device'])}</td><td style='{_TD}'>{_fmt(r['coarse'])}</td>"
        f"<td style='{_TD}'>{_fmt(r['detailed'])}</td><td style='{_TD}'>{_fmt(r['llama_cpp'])}</td>"
        f"<td style='{_TD}'><b>{_fmt(r['need'])}</b></td><td style='{_TD}'>{_fmt(r['available'])}</td>"
        f"<td style='{_TD}'>{_fmt(r['budget'])}</td>{cell(r)}</tr>"
        for r in summary.get("devices") or [])
    table = (f"<table style='{_TABLE}'><tr><th style='{_TH};text-align:left'>device</th><th style='{_TH}'>coarse</th>"
             f"<th style='{_TH}'>detailed</th><th style='{_TH}'>llama.cpp</th>"
             f"<th style='{_TH}'>needs ({_e(summary.get('estimator'))})</th><th style='{_TH}'>available</th>"
             f"<th style='{_TH}'>budget</th><th style='{_TH}'></th></tr>{rows}</table>")
    warn = "".join(f"<div style='color:{C_MUTED};font-size:11px'>note: {_e(w)}</div>"
                   for w in dict.fromkeys(summary.get("warnings") or []))
    return (f"<div><span style='font-weight:bold;color:{colour}'>{verdict}</span> "
            f"<span>{_e(summary.get('text'))}</span>{table}{warn}</div>")


def _bar(fill_pct: float, markers: Iterable[tuple[float, str, str]] = (), colour: str = C_ACTUAL,
         title: str = "") -> str:
    fill = min(100.0, max(0.0, fill_pct))
    marks = "".join(
        f"<div title='{_e(t)}' style='position:absolute;left:calc({min(100.0, max(0.0, p)):.2f}% - 1px);top:-3px;"
        f"bottom:-3px;width:3px;background:{c}'></div>" for p, c, t in markers)
    return (f"<div title='{_e(title)}' style='position:relative;height:10px;background:#e8e8e8;border-radius:3px;"
            f"width:100%;min-width:120px;margin:4px 0'><div style='position:absolute;left:0;top:0;bottom:0;"
            f"width:{fill:.2f}%;background:{colour};border-radius:3px'></div>{marks}</div>")


def render_panel_row(row: Mapping) -> str:
    """One loaded model: a line of facts and one memory bar per device."""
    state = "" if row.get("state") == "ready" else f" <i>({_e(row.get('state'))})</i>"
    ka = row.get("keep_alive") or ""
    busy = row.get("refcount") or 0
    facts = [f"context {_e(row.get('context') or '-')}", f"GPU layers {_e(row.get('layers'))}",
             f"{busy} request{'s' if busy != 1 else ''} in flight", _e(ka)]
    if row.get("pid"):
        facts.append(f"pid {_e(row['pid'])}")
    bars = []
    for d in row.get("devices") or []:
        a = d["actual"]
        preds = d["predicted"]
        markers = []
        if DETAILED in preds:
            markers.append((d["predicted_pct"][DETAILED], C_DETAILED, f"detailed prediction {_fmt(preds[DETAILED])}"))
        if COARSE in preds:
            markers.append((d["predicted_pct"][COARSE], C_COARSE, f"coarse prediction {_fmt(preds[COARSE])}"))
        words = [f"actual {_fmt(a)}" if a is not None else "actual: not yet known"]
        words += [f"{src} {_fmt(v)}" for src, v in preds.items()]
        if d.get("error_pct") is not None:
            words.append(f"prediction error {d['error_pct']:+.0f}%")
        if d.get("share_pct") is not None:
            words.append(f"{d['share_pct']:.1f}% of the {d['capacity_kind']} {_fmt(d['capacity'])}")
        bars.append(
            f"<div style='display:flex;gap:8px;align-items:center;font-size:12px'>"
            f"<div style='width:60px'>{_e(d['device'])}</div><div style='flex:1'>"
            f"{_bar(d['actual_pct'], markers, title='actual (bar) and predictions (markers)')}</div>"
            f"<div style='flex:2'>{' · '.join(_e(w) for w in words)}</div></div>")
    return (f"<div style='margin:2px 0'><b>{_e(row.get('name'))}</b>{state} "
            f"<span style='color:{C_MUTED};font-size:12px'>{' · '.join(facts)}</span>{''.join(bars)}</div>")


def render_devices(rows: Iterable[Mapping], n_models: int = 0) -> str:
    out = []
    for r in rows:
        budget = f"budget {_fmt(r['budget'])}" if r["budget"] is not None else "no budget"
        if r.get("state") == "unreachable":
            words = f"unreachable: {r.get('error') or 'the worker did not answer'}; left out of placement"
        else:
            room = (f"in use by {r.get('held_by')} (a worker serves one model at a time)" if r.get("state") == "held"
                    else f"{_fmt(r['available'])} left to plan with")
            words = (f"{_fmt(r['used'])} used by loaded models of {_fmt(r['capacity'])} "
                     f"({'budget' if r['budget'] is not None else 'total'}); {_fmt(r['free'])} free; {budget}; {room}")
        out.append(f"<div style='display:flex;gap:8px;align-items:center;font-size:12px'>"
                   f"<div style='width:60px'><b>{_e(r['device'])}</b></div>"
                   f"<div style='flex:1'>{_bar(r['used_pct'], colour='#76b7b2')}</div>"
                   f"<div style='flex:2'>{_e(r['name'])}: {_e(words)}</div></div>")
    legend = (f"<div style='font-size:11px;color:{C_MUTED}'>{n_models} model{'s' if n_models != 1 else ''} loaded · "
              f"bars: <span style='color:{C_ACTUAL}'>■</span> actual, markers: "
              f"<span style='color:{C_DETAILED}'>▮</span> detailed, <span style='color:{C_COARSE}'>▮</span> coarse "
              f"prediction</div>")
    return "<div>" + "".join(out) + legend + "</div>"


def render_events(rows: Iterable[Mapping]) -> str:
    rows = list(rows)
    if not rows:
        return f"<div style='font-size:12px;color:{C_MUTED}'>no scheduler decisions yet</div>"
    body = "".join(f"<tr><td style='padding:0 6px;color:{C_MUTED}'>{_e(r['time'])}</td>"
                   f"<td style='padding:0 6px'><b>{_e(r['kind'])}</b></td>"
                   f"<td style='padding:0 6px'>{_e(r['model'])}</td>"
                   f"<td style='padding:0 6px;text-align:left'>{_e(r['message'])}</td></tr>" for r in rows)
    return (f"<div style='font-size:12px'><div style='color:{C_MUTED}'>latest scheduler decisions</div>"
            f"<table style='{_TABLE}'>{body}</table></div>")


def _status(text: str, error: bool = False) -> str:
    if not text:
        return ""
    colour = C_BAD if error else C_MUTED
    return f"<span style='color:{colour};font-size:12px'>{_e(text)}</span>"


# ============================================================================ widgets: base


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


# ============================================================================ ModelPicker


class ModelPicker(W.VBox, _Actions):
    """Pick a registry model, see its predicted memory and fit, load/unload it, run a prompt.

    ``client``: a :class:`~jupyter_llama.client.LlamaClient` (default: found from the
    environment). ``background``: run actions as tasks on the running event loop (the
    default when there is one, as in a Jupyter kernel) or synchronously (``False``).
    """

    def __init__(self, client: LlamaClient | None = None, *, background: bool | None = None,
                 num_predict: int = 256, **kwargs):
        self.client = client if client is not None else LlamaClient()
        self._init_actions(background)
        self._estimate_seq = 0
        self._devices: dict | None = None
        self.updates = 0  # answer updates in the latest run (tests read it)
        self.last_summary: dict | None = None
        self.last_response: dict | None = None
        self._run_task: asyncio.Task | None = None

        self.model_select = W.Dropdown(description="model", options=[], layout=W.Layout(width="auto", flex="1"))
        self.refresh_button = W.Button(icon="refresh", tooltip="reload the model list", layout=W.Layout(width="36px"))
        self.ctx_input = W.BoundedIntText(value=0, min=0, max=1 << 22, step=512, description="context",
                                          continuous_update=False, tooltip="num_ctx; 0 = the default",
                                          layout=W.Layout(width="190px"))
        self.gpu_select = W.Dropdown(description="GPU layers",
                                     options=[("automatic", GPU_AUTO), ("0 (CPU only)", GPU_NONE), ("N", GPU_N)],
                                     value=GPU_AUTO, layout=W.Layout(width="230px"))
        self.gpu_layers_input = W.BoundedIntText(value=0, min=0, max=100000, description="N",
                                                 continuous_update=False, disabled=True,
                                                 layout=W.Layout(width="140px"))
        self.keep_alive_input = W.Text(value="", description="keep alive", placeholder="default (e.g. 5m, -1, 0)",
                                       continuous_update=False, layout=W.Layout(width="240px"))
        self.load_button = W.Button(description="Load", icon="upload", button_style="primary")
        self.unload_button = W.Button(description="Unload", icon="eject")
        self.status_html = W.HTML()
        self.estimate_html = W.HTML()
        self.prompt_input = W.Textarea(placeholder="prompt", layout=W.Layout(width="100%", height="80px"))
        self.num_predict_input = W.BoundedIntText(value=num_predict, min=-1, max=1 << 20, description="max tokens",
                                                  tooltip="num_predict; -1 = until the model stops",
                                                  layout=W.Layout(width="190px"))
        self.run_button = W.Button(description="Run", icon="play", button_style="success")
        self.stop_button = W.Button(description="Stop", icon="stop", disabled=True)
        self.answer_html = W.HTML()

        self.refresh_button.on_click(lambda _b: self.refresh_models())
        self.load_button.on_click(lambda _b: self.load())
        self.unload_button.on_click(lambda _b: self.unload())
        self.run_button.on_click(lambda _b: self.run())
        self.stop_button.on_click(lambda _b: self.stop())
        self.model_select.observe(self._on_change, names="value")
        self.ctx_input.observe(self._on_change, names="value")
        self.gpu_select.observe(self._on_gpu_mode, names="value")
        self.gpu_layers_input.observe(self._on_change, names="value")

        children = [
            W.HBox([self.model_select, self.refresh_button]),
            W.HBox([self.ctx_input, self.gpu_select, self.gpu_layers_input, self.keep_alive_input],
                   layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.load_button, self.unload_button, self.status_html], layout=W.Layout(align_items="center")),
            self.estimate_html,
            self.prompt_input,
            W.HBox([self.run_button, self.stop_button, self.num_predict_input]),
            self.answer_html,
        ]
        super().__init__(children=children, **kwargs)
        _on_frontend_close(self, self._cancel_tasks)
        self.refresh_models()

    # ------------------------------------------------------------------ state

    @property
    def selected(self) -> str | None:
        return self.model_select.value or None

    @property
    def options(self) -> dict:
        """The load options the fields describe (Ollama ``options``)."""
        return load_options(self.ctx_input.value, self.gpu_select.value, self.gpu_layers_input.value)

    @property
    def keep_alive(self) -> str | None:
        text = self.keep_alive_input.value.strip()
        return text or None

    @property
    def answer(self) -> str:
        """The text of the latest answer."""
        return self._answer_text

    _answer_text = ""

    def _show_error(self, exc: BaseException) -> None:
        self.status_html.value = _status(error_text(exc), error=True)

    def _set_status(self, text: str) -> None:
        self.status_html.value = _status(text)

    # ------------------------------------------------------------------ models

    @_safe
    def refresh_models(self):
        """Reload the model list (tags, and ps for which are loaded)."""
        async def act(ac):
            self._apply_models(await ac.tags(), await ac.ps())

        return self._dispatch(act)

    def _apply_models(self, tags: dict, ps: dict, reestimate: bool = False) -> None:
        rows = model_rows(tags, ps)
        before = self.model_select.value
        names = [r["name"] for r in rows]
        self._quiet = True  # setting options resets the value: no estimate for that
        try:
            self.model_select.options = [(r["label"], r["name"]) for r in rows]
            if before in names:
                self.model_select.value = before
            elif names:
                self.model_select.value = names[0]
        finally:
            self._quiet = False
        if not rows:
            self.estimate_html.value = _status("No models in the registry yet: pull one "
                                               "(%llama pull <url or hf.co/owner/repo>).")
        elif reestimate or self.model_select.value != before or self.last_summary is None:
            self.update_estimate()

    # ------------------------------------------------------------------ estimate

    _quiet = False

    def _on_change(self, change) -> None:
        if not self._quiet:
            self.update_estimate()

    def _on_gpu_mode(self, change) -> None:
        self.gpu_layers_input.disabled = change["new"] != GPU_N
        self.update_estimate()

    @_safe
    def update_estimate(self):
        """Predict the memory of the selected model with the chosen options, before loading."""
        name = self.selected
        if not name:
            return None
        self._estimate_seq += 1
        seq, opts = self._estimate_seq, self.options
        self.estimate_html.value = _status(f"estimating {name} …")

        async def act(ac):
            self._apply_estimate(seq, await ac.estimate(name, opts), await ac.devices())

        return self._dispatch(act)

    def _apply_estimate(self, seq: int, estimate: dict, devices: dict) -> None:
        if seq != self._estimate_seq:  # a newer selection superseded this one
            return
        self._devices = devices
        summary = fit_summary(estimate, devices)
        self.last_summary = summary
        self.estimate_html.value = render_fit(summary)

    # ------------------------------------------------------------------ load / unload

    @_safe
    def load(self):
        """Load the selected model with the chosen options and keep-alive."""
        name = self.selected
        if not name:
            raise LlamaError("choose a model first")
        opts, ka = self.options, self.keep_alive
        self._set_status(f"loading {name} …")
        self.load_button.disabled = True

        def done(res: dict) -> None:
            secs = (res or {}).get("load_duration")
            self._set_status(f"{name} loaded" + (f" in {secs / 1e9:.2f}s" if secs else ""))

        async def act(ac):
            try:
                done(await ac.load(name, options=opts, keep_alive=ka))
            finally:
                self.load_button.disabled = False
            self._apply_models(await ac.tags(), await ac.ps(), reestimate=True)

        return self._dispatch(act)

    @_safe
    def unload(self):
        """Unload the selected model."""
        name = self.selected
        if not name:
            raise LlamaError("choose a model first")
        self._set_status(f"unloading {name} …")

        async def act(ac):
            await ac.unload(name)
            self._set_status(f"{name} unloaded")
            self._apply_models(await ac.tags(), await ac.ps(), reestimate=True)

        return self._dispatch(act)

    # ------------------------------------------------------------------ run

    def _render_answer(self, final: dict | None = None) -> None:
        text = f"<pre style='white-space:pre-wrap;margin:4px 0;font-size:13px'>{_e(self._answer_text)}</pre>"
        if final:
            n = final.get("eval_count")
            dur = final.get("eval_duration")
            stats = [f"done ({final.get('done_reason') or 'stop'})"]
            if n:
                stats.append(f"{n} tokens")
                if dur:
                    stats.append(f"{n / (dur / 1e9):.1f} tokens/s")
            if final.get("load_duration"):
                stats.append(f"load {final['load_duration'] / 1e9:.2f}s")
            text += _status(" · ".join(stats))
        self.answer_html.value = text

    def _on_chunk(self, chunk: dict) -> None:
        piece = chunk.get("response") or ""
        if piece:
            self._answer_text += piece
            self.updates += 1
        if chunk.get("done"):
            self.last_response = chunk
            self._render_answer(chunk)
        elif piece:
            self._render_answer()

    def _run_started(self, name: str) -> None:
        self._answer_text = ""
        self.updates = 0
        self.last_response = None
        self.answer_html.value = _status(f"{name} is thinking …")
        self.run_button.disabled = True
        self.stop_button.disabled = False

    def _run_ended(self) -> None:
        if not self._answer_text and self.last_response is None:
            self.answer_html.value = ""  # failed before any text: the status line says why
        self.run_button.disabled = False
        self.stop_button.disabled = True
        self._run_task = None

    @_safe
    def run(self, prompt: str | None = None):
        """Stream the answer to the prompt (the text area's, or ``prompt``) into the widget."""
        name = self.selected
        if not name:
            raise LlamaError("choose a model first")
        if prompt is not None:
            self.prompt_input.value = prompt
        text = self.prompt_input.value
        opts = dict(self.options)
        if self.num_predict_input.value:
            opts["num_predict"] = int(self.num_predict_input.value)
        ka = self.keep_alive
        self._run_started(name)

        async def act(ac):
            try:
                stream = ac.generate(name, text, stream=True, options=opts, keep_alive=ka)
                try:
                    async for chunk in stream:
                        self._on_chunk(chunk)
                finally:
                    await stream.aclose()
                self._apply_models(await ac.tags(), await ac.ps())
            except asyncio.CancelledError:
                self._render_answer()
                self._set_status("stopped")
                raise
            finally:
                self._run_ended()

        task = self._dispatch(act)
        if isinstance(task, asyncio.Task):
            self._run_task = task
        return task

    def stop(self) -> None:
        """Stop a generation running in the background (closing the stream stops it on the server)."""
        if self._run_task is not None and not self._run_task.done():
            self._run_task.get_loop().call_soon_threadsafe(self._run_task.cancel)

    _run_task = None

    def close(self) -> None:
        self._cancel_tasks()
        for w in _descendants(self):
            w.close()
        super().close()


def _descendants(widget: W.Widget) -> list[W.Widget]:
    out, todo = [], list(getattr(widget, "children", ()) or ())
    while todo:
        w = todo.pop()
        out.append(w)
        todo.extend(getattr(w, "children", ()) or ())
    return out


# ============================================================================ RunningPanel


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
        self._task: asyncio.Task | None = None
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
        self.devices_html.value = render_devices(devs, len(rows))
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
        if self.running:
            return self._task  # type: ignore[return-value]
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

    _task = None
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


# ============================================================================ pull


class PullProgress(W.VBox):
    """A progress bar and a label for a pull; :meth:`run` drives it from ``client.pull``."""

    def __init__(self, **kwargs):
        self.bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="pull",
                                   layout=W.Layout(width="60%"))
        self.label = W.HTML()
        self.statuses: list[dict] = []
        super().__init__(children=[W.HBox([self.bar, self.label])], **kwargs)

    def update(self, st: Mapping) -> None:
        """Show one Ollama pull status dict."""
        self.statuses.append(dict(st))
        status = str(st.get("status") or "")
        total, completed = st.get("total"), st.get("completed")
        if total:
            frac = min(1.0, max(0.0, float(completed or 0) / float(total)))
            self.bar.value = frac
            self.label.value = _status(f"{status}: {format_bytes(completed or 0)} / {format_bytes(total)} "
                                       f"({frac:.0%})")
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
        self.bar.bar_style = "danger"
        self.label.value = _status(message, error=True)

    def run(self, client: LlamaClient, source: str, name: str | None = None, *, raise_errors: bool = False) -> dict:
        """Pull and show progress; returns the final status (``{"status": "error", "error": ...}`` on failure
        unless ``raise_errors``)."""
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
