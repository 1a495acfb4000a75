"""View models: API answers (``/api/tags``, ``/api/ps``, ``/api/devices``, ``/api/estimate``,
``/api/events``) turned into rows and words, with nothing computed that the server decides
(the fit verdict and the room per device are the scheduler's). Pure functions; no widgets."""

from __future__ import annotations

import datetime as _dt
import math
import re
import time
from typing import Any, Iterable, Mapping

from ..client import LlamaError
from ..memory.report import COARSE, DETAILED, LLAMA_CPP, format_bytes
from ..models.names import same_model

ACTUAL = "actual"
FOREVER_S = 50 * 365 * 86400  # expires_at further away than this: kept loaded for good


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


# ---------------------------------------------------------------------------- the picker


def model_rows(tags: Mapping | None, ps: Mapping | None = None) -> list[dict]:
    """One row per registry model: name, size, quantisation, parameters, family, loaded or not."""
    loaded = {m.get("name"): m for m in (ps or {}).get("models") or []}
    rows = []
    for m in (tags or {}).get("models") or []:
        name = m.get("name") or m.get("model") or ""
        det = m.get("details") or {}
        size = int(m.get("size") or 0)
        row = {
            "name": name,
            "size": size,
            "quantization": det.get("quantization_level") or "",
            "parameters": det.get("parameter_size") or "",
            "family": det.get("family") or "",
            "loaded": name in loaded,
            "state": (loaded.get(name) or {}).get("state"),
        }
        bits = [name, format_bytes(size)]
        if row["quantization"]:
            bits.append(row["quantization"])
        if row["parameters"]:
            bits.append(f"{row['parameters']} params")
        if row["loaded"]:
            bits.append("loaded" if row["state"] in (None, "ready") else str(row["state"]))
        row["label"] = " · ".join(bits)
        rows.append(row)
    return rows


def _used_at(m: Mapping) -> float | None:
    """When a ``/api/ps`` entry was last used, as far as the answer tells: its ``last_used``
    where the server gives one, else its expiry (a request's end plus the keep-alive, so the
    later expiry is the later use while keep-alives are alike). None for a model kept
    loaded for good, whose expiry says nothing of its use."""
    used = parse_time(m.get("last_used"))
    if used is not None:
        return used
    if m.get("pinned"):
        return None
    exp = parse_time(m.get("expires_at"))
    if exp is None or exp - time.time() > FOREVER_S:
        return None
    return exp


def initial_model(tags: Mapping | None, ps: Mapping | None = None) -> str | None:
    """The model a picker opens on: the loaded one, or of several the most recently used (one
    answering a request now first); with none loaded, the first registered model."""
    names = [r["name"] for r in model_rows(tags, ps)]
    loaded = [m for m in (ps or {}).get("models") or [] if m.get("state") not in ("unloading", "gone")]

    def recency(m: Mapping) -> tuple:
        used = _used_at(m)
        return (int(m.get("refcount") or 0) > 0, used is not None, used or 0.0)

    for m in sorted(loaded, key=recency, reverse=True):
        hit = next((n for n in names if same_model(n, m.get("name") or m.get("model") or "")), None)
        if hit is not None:
            return hit
    return names[0] if names else None


GPU_AUTO, GPU_NONE, GPU_N = "auto", "cpu", "n"
CTX_AUTO, CTX_SET = "auto", "set"


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
               "verdict": fit.get("verdict"), "verdict_words": fit.get("verdict_words"),
               "estimator": source or "none", "n_ctx": n_ctx,
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
    words = s.get("verdict_words") or s["verdict"]  # the scheduler's words for its verdict
    verdict = words[:1].upper() + words[1:]
    tail = f"{verdict}: " + "; ".join(parts) + "." if parts else f"{verdict}."
    if s.get("already_loaded"):
        tail += f" ({s['already_loaded']} is loaded now.)"
    return f"{head} {tail}"



# ---------------------------------------------------------------------------- the panel


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
    largest = 0
    for m in (ps or {}).get("models") or []:
        mem = m.get("memory") or {}
        actual = _report_by_device(mem.get(ACTUAL))
        preds = {src: _report_by_device(mem.get(src)) for src in (DETAILED, COARSE, LLAMA_CPP) if mem.get(src)}
        devs = _device_order(list(actual) + [d for p in preds.values() for d in p])
        per_dev = []
        for dev in devs:
            a = actual.get(dev) if mem.get(ACTUAL) else None
            p = {src: v.get(dev, 0) for src, v in preds.items()}
            main_pred = p.get(DETAILED, p.get(COARSE, p.get(LLAMA_CPP)))
            largest = max(largest, a or 0, main_pred or 0)  # what the shared scale must hold
            r = room.get(dev)
            cap = (r["budget"] if r and r["budget"] is not None else (r["total"] if r else None))
            per_dev.append({
                "device": dev, "actual": a, "predicted": p, "main_predicted": main_pred,
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
    # One scale for every bar (see memory_scale): a bar's length is bytes, across models and devices.
    scale = nice_bytes(largest)
    for d in (d for row in rows for d in row["devices"]):
        held = d["actual"] if d["actual"] is not None else (d["main_predicted"] or 0)
        d["scale"] = scale
        d["actual_pct"] = min(100.0, 100.0 * held / scale)
        d["predicted_pct"] = {src: min(100.0, 100.0 * v / scale) for src, v in d["predicted"].items()}
        d["off_scale"] = {src: v > scale for src, v in d["predicted"].items()}
    return rows


_NICE_STEPS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10)
_KiB, _MiB, _GiB = 1 << 10, 1 << 20, 1 << 30


def nice_bytes(n: float) -> int:
    """The smallest round figure of bytes above ``n`` (13.2 MiB -> 15 MiB, 4 GiB -> 5 GiB), so
    a scale's end reads as a plain number and the longest bar never looks like a full one;
    at least 1 KiB. (labextension/src/model.ts ``niceBytes`` is the same rule.)"""
    b = max(float(_KiB), float(n or 0))
    unit = _GiB if b >= _GiB else _MiB if b >= _MiB else _KiB
    v = b / unit
    decade = 10.0 ** math.floor(math.log10(v))
    step = next((k for k in _NICE_STEPS if k * decade > v * (1 + 1e-9)), 10)
    return int(round(step * decade * unit))


def round_bytes_text(n: float) -> str:
    """A round figure of bytes without trailing zeros: ``15 MiB``, ``1.5 GiB``, ``512 KiB``."""
    unit, name = (_GiB, "GiB") if n >= _GiB else (_MiB, "MiB") if n >= _MiB else (_KiB, "KiB")
    return f"{round(n / unit, 2):g} {name}"


def memory_scale(rows: Iterable[Mapping]) -> int | None:
    """The one scale every loaded model's memory bars share: the largest figure a bar shows
    (a model's actual bytes on one device, or its main prediction where that is larger or the
    actual figure is not known yet), rounded up. On one scale a bar's length is bytes: a small
    model's bar is short beside a large one's, and no bar reads as "nearly full" of itself.
    A prediction far past it (the coarse one's batch surcharge) is marked at the end as off
    the scale rather than stretching every bar. None when no model is loaded."""
    for row in rows:
        for d in row.get("devices") or ():
            return d["scale"]
    return None


def memory_scale_text(rows: Iterable[Mapping]) -> str | None:
    """The words that say what the bars' scale is, for the line above them."""
    scale = memory_scale(rows)
    if scale is None:
        return None
    return f"Memory bars share one scale, 0 to {round_bytes_text(scale)}: a bar's length is bytes."


# ---------------------------------------------------------------------------- pull progress


class TransferRate:
    """The speed and time left of a pull, from its ``completed`` bytes over time: the bytes
    gained over the latest ``window`` seconds divided by the time they took. A new file
    (another ``digest`` or status text) or a count that goes back (a download started again)
    starts the measure afresh. Nothing is said before ``min_span`` seconds of samples, so a
    first burst does not read as the speed. (labextension/src/model.ts ``TransferRate``.)"""

    def __init__(self, window: float = 8.0, min_span: float = 1.0):
        self.window = float(window)
        self.min_span = float(min_span)
        self._key: str | None = None
        self._samples: list[tuple[float, int]] = []

    def add(self, now: float, key: str, completed: int, total: int) -> tuple[float | None, float | None]:
        """Record ``completed`` of ``total`` bytes of file ``key`` at ``now`` (seconds);
        returns (bytes per second, seconds left), each None while unknown."""
        if key != self._key or (self._samples and completed < self._samples[-1][1]):
            self._key, self._samples = key, []
        self._samples.append((now, completed))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.pop(0)
        t0, c0 = self._samples[0]
        span = now - t0
        if span < self.min_span:
            return None, None
        speed = max(0, completed - c0) / span
        left = (total - completed) / speed if total > completed and speed > 0 else None
        return speed, left


def rate_text(speed: float | None, left: float | None) -> str:
    """``12.3 MiB/s · about 1m 05s left`` (what is known of it), or ''."""
    if speed is None:
        return ""
    parts = [f"{format_bytes(speed)}/s"]
    if left is not None:
        parts.append(f"about {duration_text(left)} left")
    elif speed == 0:
        parts.append("stalled")
    return " · ".join(parts)


_STATUS_TAIL = re.compile(r"\s*\(HTTP \d{3}\)$")
_HTTP_STATUS = re.compile(r"\bHTTP \d{3}\b")
_NOT_FOUND = re.compile(r"^(\S+): not found \(HTTP (404|410)\b[^)]*\)\.?$")


def pull_error_text(source: str, message: str) -> str:
    """A failed pull's message for a line that already names ``source``: the source is not
    said again, nor a second HTTP status after the remote server's, and a file the remote
    server does not have is said in one sentence (``nothing is at this address (HTTP 404 not
    found).``; a file other than the source, as one a Hugging Face repository lists, is
    named). (labextension/src/model.ts ``pullErrorText``.)"""
    msg = str(message or "").strip()
    src = str(source or "").strip()
    tail = _STATUS_TAIL.search(msg)
    if tail and _HTTP_STATUS.search(msg[:tail.start()]):
        msg = msg[:tail.start()]
    nf = _NOT_FOUND.match(msg)
    if nf:
        where, status = nf.groups()
        if where == src:
            return f"nothing is at this address (HTTP {status} not found)."
        return f"the server has no file {where} (HTTP {status} not found)."
    if src and msg.startswith(f"{src}: "):
        msg = msg[len(src) + 2:]
    return msg


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
