"""The commands about the manager and what it has loaded: ``status``, ``ps``, ``stop``,
``log``, ``explain`` (its decisions), and ``serve`` where it cannot run (in a kernel)."""

from __future__ import annotations

import re
import time
from typing import Any

from ..models.names import same_model
from .frontend import EXIT_OK, EXIT_USAGE, CommandError, Frontend
from .helpers import _call, _loaded, _mib


def cmd_stop(args, fe: Frontend):
    from ..client import ModelNotFoundError

    client = fe.client()
    loaded = _loaded(client.ps(), args.model) is not None
    try:
        client.unload(args.model)  # (a model known but not loaded: nothing happens, as with Ollama's)
    except ModelNotFoundError as e:  # (no advice to pull a model in order to stop it)
        close = re.search(r"\(did you mean [^)]*\)", e.message)
        raise CommandError(f'no model is named "{args.model}"{f" {close.group(0)}" if close else ""}: nothing to '
                           "stop. `ps` shows the loaded models, `list` the ones there are") from None
    fe.note(f"{args.model} unloaded" if loaded
            else f"{args.model} was not loaded: nothing to stop (`ps` shows what is)")
    return EXIT_OK


def cmd_status(args, fe: Frontend):
    if args.stop:
        from .. import background

        pid = background.stop()
        fe.out(f"stopped the background manager (pid {pid})" if pid else "no background manager runs")
        return EXIT_OK
    from ..client import api_url

    client = fe.running_client()  # (a look: it starts no manager)
    info = client.server if client is not None else None
    version = _call(fe, client.version) if client is not None else {}
    others = [p for p in _other_managers() if info is None or (p.pid != info.pid and api_url(p.url) != info.url)]
    data: dict[str, Any] = {"url": info and info.url, "source": info and info.source, "pid": info and info.pid,
            "version": version.get("version"), "jupyter_llama": version.get("jupyter_llama"),
            "engine": version.get("engine"), "engine_error": version.get("engine_error"),
            "loaded": [m.get("name") for m in _call(fe, client.ps).get("models", [])] if client is not None else [],
            "others": [{"pid": p.pid, "url": p.url, "models": p.models} for p in others]}
    if args.json:
        fe.json(data)
        return EXIT_OK
    if info is None:
        fe.out("manager: none runs (JUPYTER_LLAMA_URL is not set, no Jupyter server of yours serves the extension, "
               "no background manager runs)\nA command that needs one (run, load, ps, ...) starts the background "
               "manager; `jupyter-llama serve` runs one in the foreground.")
    else:
        engine = data["engine"] or f"unavailable ({data['engine_error'] or 'not found'})"
        fe.out(f"manager: {info.url}\nfound:   {info.source}\nversion: jupyter-llama {data['jupyter_llama']} (Ollama's "
               f"API {data['version']}), engine {engine}\nloaded:  {', '.join(data['loaded']) or 'nothing'}")
    for p in others:  # they share this machine's memory and this user's budgets with it
        fe.out(f"also:    another manager of yours, {p.describe()}")
    return EXIT_OK


def _other_managers():
    """This user's managers on this machine, from what each publishes (memory.peers)."""
    from jupyter_core.paths import jupyter_runtime_dir

    from ..memory.peers import PeerBoard

    return PeerBoard(jupyter_runtime_dir(), pid=-1).others()


def cmd_ps(args, fe: Frontend):
    from ..memory.report import render_table

    data = _call(fe, fe.client().ps)
    if args.json:
        fe.json(data)
        return EXIT_OK
    rows = []
    for m in data.get("models", []):
        size, vram = m.get("size") or 0, m.get("size_vram") or 0
        where = "CPU" if not vram else "GPU" if vram >= size else f"{vram / size:.0%} GPU"
        layers = f"{m['layers_offloaded']}/{m['layers_total']}" if m.get("layers_total") else ""
        devices = ", ".join(f"{d} {_mib(n)}" for d, n in (m.get("by_device") or {}).items())
        name = m.get("name") + (f" (also {', '.join(m['also_as'])})" if m.get("also_as") else "")
        rows.append([name, _mib(size), where, layers, devices, m.get("context_length") or "",
                     _until(m.get("expires_at"))])
    if not rows:
        fe.out("no models loaded")
    else:
        fe.out(render_table(["NAME", "SIZE", "PROCESSOR", "LAYERS", "DEVICES", "CONTEXT", "UNTIL"], rows))
    return EXIT_OK


def cmd_log(args, fe: Frontend):
    from ..client import ModelNotFoundError

    def fetch():
        try:
            return fe.client().log(args.model, args.lines, args.match)
        except ModelNotFoundError as e:  # not loaded: the server's sentence says what to do
            raise CommandError(e.message) from None

    data = _call(fe, fetch)
    if args.json:
        fe.json(data)
        return EXIT_OK
    lines = data.get("lines") or []
    shown = f"{len(lines)} line(s)" + (f" containing {args.match!r}" if args.match else "")
    fe.out(f"{data.get('model')} (pid {data.get('pid')}, {data.get('state')}): {shown} "
           f"of {data.get('lines_seen', 0)} its llama-server printed")
    if lines:
        fe.out("\n".join(lines))
    return EXIT_OK


def _until(stamp: str | None, now: float | None = None) -> str:
    """When a loaded model is unloaded (an RFC 3339 time from /api/ps), as ``ollama ps`` says
    it: "4 minutes from now", "About a minute from now", "Forever" (pinned: more than 20 years
    ahead), "Stopping..." (its time is past)."""
    if not stamp:
        return "Never"
    from datetime import datetime

    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError, OSError):
        return stamp
    ahead = when - (time.time() if now is None else now)
    if ahead < 0:
        return "Stopping..."
    if ahead > 20 * 365 * 86400:
        return "Forever"
    return f"{human_duration(ahead)} from now"


def human_duration(seconds: float) -> str:
    """A duration as Ollama words one (its format.humanDuration): "Less than a second",
    "1 second", "42 seconds", "About a minute", "4 minutes", "About an hour", "5 hours",
    "3 days", "2 weeks", "4 months", "3 years"."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = s // 60
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = int(seconds / 3600 + 0.5)  # (Go's math.Round: halves away from zero)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{hours // 24 // 365} years"


def describe_event(e: dict) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
    return f"{t}  {e.get('kind', ''):<9} {e.get('message', '')}"


def cmd_explain(args, fe: Frontend):
    events = _call(fe, fe.client().events, None, limit=max(args.limit, 1000) if args.model else args.limit)
    if args.model:  # `tiny` and `tiny:latest` are one model
        events = [e for e in events if same_model(e.get("model"), args.model)]
    if args.json:
        fe.json(events)
        return EXIT_OK
    if not events:
        fe.out(f"no decisions recorded{' about ' + args.model if args.model else ''} yet")
        return EXIT_OK
    fe.out("\n".join(describe_event(e) for e in events[-args.limit:]))
    return EXIT_OK


def _serve_elsewhere(args, fe: Frontend):
    raise CommandError("serve runs a server in the foreground: start it from a shell with `jupyter-llama serve`",
                       EXIT_USAGE)
