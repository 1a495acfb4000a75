"""HTML for the view rows (``render_*``): what the widgets show, escaped, in plain words."""

from __future__ import annotations

import html
from typing import Any, Iterable, Mapping

from ..memory.report import COARSE, DETAILED, format_bytes, format_pct
from .model import round_bytes_text

# colours (colour-blind safe pairs from the Tableau palette)
C_ACTUAL = "#4e79a7"
C_DETAILED = "#e15759"
C_COARSE = "#f28e2b"
C_LLAMA = "#59a14f"
C_OK = "#2e7d32"
C_BAD = "#c62828"
C_MUTED = "#666"


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))



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


def _marker(pct: float, colour: str, title: str, off_scale: bool = False) -> str:
    """A prediction's mark on a bar: a line, or at the end an arrow in its colour when the
    prediction is off the bar's scale (as the sidebar draws it)."""
    if off_scale:
        return (f"<div title='{_e(title)} (off the scale)' style='position:absolute;left:calc(100% - 3px);top:-3px;"
                f"width:0;height:0;border-top:8px solid transparent;border-bottom:8px solid transparent;"
                f"border-left:6px solid {colour}'></div>")
    return (f"<div title='{_e(title)}' style='position:absolute;left:calc({min(100.0, max(0.0, pct)):.2f}% - 1px);"
            f"top:-3px;bottom:-3px;width:3px;background:{colour}'></div>")


def _bar(fill_pct: float, markers: Iterable[tuple] = (), colour: str = C_ACTUAL, title: str = "") -> str:
    fill = min(100.0, max(0.0, fill_pct))
    marks = "".join(_marker(*m) for m in markers)
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
        scale_title = (f"actual (bar) and predictions (markers), on the scale every bar shares: "
                       f"0 to {round_bytes_text(d['scale'])}")
        a = d["actual"]
        preds = d["predicted"]
        markers = []
        off = d.get("off_scale") or {}
        if DETAILED in preds:
            markers.append((d["predicted_pct"][DETAILED], C_DETAILED, f"detailed prediction {_fmt(preds[DETAILED])}",
                            off.get(DETAILED, False)))
        if COARSE in preds:
            markers.append((d["predicted_pct"][COARSE], C_COARSE, f"coarse prediction {_fmt(preds[COARSE])}",
                            off.get(COARSE, False)))
        words = [f"actual {_fmt(a)}" if a is not None else "actual: not yet known"]
        words += [f"{src} {_fmt(v)}" for src, v in preds.items()]
        if d.get("error_pct") is not None:
            words.append(f"prediction error {format_pct(d['error_pct'])}")
        if d.get("share_pct") is not None:
            words.append(f"{d['share_pct']:.1f}% of the {d['capacity_kind']} {_fmt(d['capacity'])}")
        bars.append(
            f"<div style='display:flex;gap:8px;align-items:center;font-size:12px'>"
            f"<div style='width:60px'>{_e(d['device'])}</div><div style='flex:1'>"
            f"{_bar(d['actual_pct'], markers, title=scale_title)}</div>"
            f"<div style='flex:2'>{' · '.join(_e(w) for w in words)}</div></div>")
    return (f"<div style='margin:2px 0'><b>{_e(row.get('name'))}</b>{state} "
            f"<span style='color:{C_MUTED};font-size:12px'>{' · '.join(facts)}</span>{''.join(bars)}</div>")


def render_devices(rows: Iterable[Mapping], n_models: int = 0, scale_text: str | None = None) -> str:
    """The devices with their use against the budget (or total), and the legend; ``scale_text``
    (:func:`~.model.memory_scale_text`) says the scale the loaded models' bars share."""
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
              f"prediction · device bars: share of each device's budget (or total)</div>")
    if scale_text:
        legend += f"<div class='jl-scale' style='font-size:11px;color:{C_MUTED}'>{_e(scale_text)}</div>"
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


_CODE = ("font-family:var(--jp-code-font-family,monospace);background:rgba(127,127,127,.15);"
         "padding:0 3px;border-radius:3px")


def _with_code(text: str) -> str:
    """Help text as HTML, its ``code`` spans (between backticks) set as code: a person reads
    ``%llama pull`` as a command, never the backticks themselves (an odd backtick stays)."""
    parts = str(text or "").split("`")
    if len(parts) % 2 == 0:  # an unmatched backtick: the last one is literal
        parts[-2:] = [parts[-2] + "`" + parts[-1]]
    return "".join(f"<code style='{_CODE}'>{_e(p)}</code>" if i % 2 else _e(p) for i, p in enumerate(parts) if p)


def _help(text: str) -> str:
    """A muted line of help text with its code spans rendered."""
    return f"<span style='color:{C_MUTED};font-size:12px'>{_with_code(text)}</span>" if text else ""
