"""``GET llama/metrics``: what the manager holds and does, in Prometheus's text format.

Written by hand (the text exposition format, version 0.0.4), from one snapshot of the
scheduler taken on the event loop: per model (the bytes it holds on each device, requests
running and waiting, the tokens a second of its latest answer, evictions) and, on a manager
shared through a JupyterHub, per user (requests, generated tokens and the time they took,
refusals by quota, the bytes their models hold, requests running and waiting).
:func:`render` is pure: a snapshot in, the text out.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

__all__ = ["snapshot", "render", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help)
METRICS = {
    "jupyter_llama_model_loaded_bytes": ("gauge", "Bytes a loaded model holds on a device (llama.cpp's figures once "
                                                  "it has loaded, the prediction before)."),
    "jupyter_llama_model_requests_in_flight": ("gauge", "Requests holding a loaded model now."),
    "jupyter_llama_model_queue_depth": ("gauge", "Requests waiting for a slot of a loaded model (a shared manager's "
                                                 "fair queue)."),
    "jupyter_llama_model_tokens_per_second": ("gauge", "Generated tokens a second of the latest answer of a model "
                                                       "that reported its counts."),
    "jupyter_llama_model_evictions_total": ("counter", "Times a model was evicted to make room for another."),
    "jupyter_llama_requests_waiting_for_load": ("gauge", "Requests waiting for a model to load."),
    "jupyter_llama_requests_total": ("counter", "Requests per model and user (a shared manager's)."),
    "jupyter_llama_generated_tokens_total": ("counter", "Generated tokens per model and user, of answers that "
                                                        "reported their counts."),
    "jupyter_llama_generation_seconds_total": ("counter", "Seconds spent generating those tokens."),
    "jupyter_llama_refusals_total": ("counter", "Requests refused per user and quota (429 or 507)."),
    "jupyter_llama_user_loaded_bytes": ("gauge", "Bytes the models a user's requests loaded hold on a device."),
    "jupyter_llama_user_requests_in_flight": ("gauge", "A user's requests running or waiting now."),
    "jupyter_llama_user_queue_depth": ("gauge", "A user's requests waiting for a slot now."),
}


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        return repr(v)
    return str(int(v))


def snapshot(scheduler) -> dict:
    """The numbers :func:`render` shows, read from ``scheduler`` now (on its event loop)."""
    models = []
    for lo in scheduler.live():
        models.append({"name": lo.name, "by_device": lo.charge.by_device(), "in_flight": lo.refcount})
    snap = {"models": models, "pending": scheduler.pending, "evictions": dict(scheduler.evictions),
            "users": None}
    book = getattr(scheduler, "users", None)
    if book is not None:
        held: dict[tuple[str, str], int] = {}
        for lo in scheduler.live():
            if lo.loaded_by is not None:
                for d, n in lo.charge.by_device().items():
                    held[(lo.loaded_by, d)] = held.get((lo.loaded_by, d), 0) + n
        snap["users"] = {
            "requests": dict(book.requests), "tokens": dict(book.tokens), "token_seconds": dict(book.token_seconds),
            "refusals": dict(book.refusals), "held": held, "in_flight": dict(book.in_flight),
            "waiting": book.waiting_by_user(), "queue": book.queue_depth(), "rate": dict(book.last_rate),
        }
    return snap


def _lines(name: str, samples: Iterable[tuple[Mapping[str, str], float]]) -> list[str]:
    kind, text = METRICS[name]
    out = [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        spelled = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{spelled}}} {_number(value)}" if spelled else f"{name} {_number(value)}")
    return out


def render(snap: dict) -> str:
    """The text Prometheus scrapes, from a :func:`snapshot`."""
    users = snap.get("users")
    names = [m["name"] for m in snap["models"]]
    queue = (users or {}).get("queue", {})
    rate = (users or {}).get("rate", {})
    out: list[str] = []
    out += _lines("jupyter_llama_model_loaded_bytes",
                  (({"model": m["name"], "device": d}, n)
                   for m in snap["models"] for d, n in sorted(m["by_device"].items())))
    out += _lines("jupyter_llama_model_requests_in_flight",
                  (({"model": m["name"]}, m["in_flight"]) for m in snap["models"]))
    out += _lines("jupyter_llama_model_queue_depth", (({"model": n}, queue.get(n, 0)) for n in names))
    out += _lines("jupyter_llama_model_tokens_per_second", (({"model": n}, float(r)) for n, r in sorted(rate.items())))
    out += _lines("jupyter_llama_model_evictions_total",
                  (({"model": n}, c) for n, c in sorted(snap["evictions"].items())))
    out += _lines("jupyter_llama_requests_waiting_for_load", [({}, snap["pending"])])
    if users is not None:
        out += _lines("jupyter_llama_requests_total",
                      (({"model": m, "user": u}, c) for (m, u), c in sorted(users["requests"].items())))
        out += _lines("jupyter_llama_generated_tokens_total",
                      (({"model": m, "user": u}, c) for (m, u), c in sorted(users["tokens"].items())))
        out += _lines("jupyter_llama_generation_seconds_total",
                      (({"model": m, "user": u}, float(c)) for (m, u), c in sorted(users["token_seconds"].items())))
        out += _lines("jupyter_llama_refusals_total",
                      (({"user": u, "quota": q}, c) for (u, q), c in sorted(users["refusals"].items())))
        out += _lines("jupyter_llama_user_loaded_bytes",
                      (({"user": u, "device": d}, n) for (u, d), n in sorted(users["held"].items())))
        out += _lines("jupyter_llama_user_requests_in_flight",
                      (({"user": u}, c) for u, c in sorted(users["in_flight"].items())))
        out += _lines("jupyter_llama_user_queue_depth", (({"user": u}, c) for u, c in sorted(users["waiting"].items())))
    return "\n".join(out) + "\n"
