"""Jupyter servers of this user, found by their runtime files (``jpserver-<pid>.json`` in
Jupyter's runtime directory): the token of the one serving an API URL, and a running one that
serves this extension (this kernel's own first, from ``JPY_PARENT_PID``)."""

from __future__ import annotations

import glob
import json
import os
import urllib.parse
from typing import Mapping

from .address import ServerInfo, api_url


def _runtime_files() -> list[str]:
    try:
        from jupyter_core.paths import jupyter_runtime_dir

        rdir = jupyter_runtime_dir()
    except Exception:  # noqa: BLE001 - no jupyter_core config: no runtime files
        return []
    def mtime(path: str) -> float:
        try:
            return os.path.getmtime(path)
        except OSError:  # a server exiting now removes its file
            return 0.0

    return sorted(glob.glob(os.path.join(rdir, "jpserver-*.json")), key=mtime, reverse=True)


def _read_runtime(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _same_server(server_url: str, api: str) -> bool:
    a, b = urllib.parse.urlsplit(server_url), urllib.parse.urlsplit(api)
    hosts = {"localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0", ""}
    same_host = a.hostname == b.hostname or (a.hostname in hosts and b.hostname in hosts)
    return same_host and a.port == b.port and b.path.startswith(a.path or "/")


def token_from_runtime(api: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The token of the server serving ``api``: its ``jpserver-<JPY_PARENT_PID>.json`` first."""
    environ = os.environ if environ is None else environ
    candidates = []
    pid = environ.get("JPY_PARENT_PID")
    files = _runtime_files()
    if pid:
        candidates += [f for f in files if os.path.basename(f) == f"jpserver-{pid}.json"]
    candidates += [f for f in files if f not in candidates]
    for f in candidates:
        data = _read_runtime(f)
        if not data:
            continue
        server_url = data.get("url", "")
        if server_url and data.get("base_url"):
            server_url = urllib.parse.urljoin(server_url, data["base_url"])
        if server_url and _same_server(server_url, api):
            return data.get("token") or None
    return None


def running_server(environ: Mapping[str, str] | None = None, skip_pid: int | None = None) -> ServerInfo | None:
    """A running Jupyter server of this user (its runtime file) that serves this extension:
    the one this kernel belongs to (``JPY_PARENT_PID``) first, then the newest."""
    from .. import background  # below this package: it knows nothing of clients
    from ..procs import process_alive

    environ = os.environ if environ is None else environ
    files = _runtime_files()
    pid = environ.get("JPY_PARENT_PID")
    if pid:
        files = sorted(files, key=lambda f: os.path.basename(f) != f"jpserver-{pid}.json")
    for f in files:
        data = _read_runtime(f)
        if not data or not isinstance(data.get("pid"), int) or data["pid"] == skip_pid:
            continue
        server_url = data.get("url", "")
        if not server_url or not process_alive(data["pid"]):
            continue
        api = api_url(urllib.parse.urljoin(server_url, data.get("base_url") or "/"))
        tok = data.get("token") or None
        if background.answers(api, tok):
            return ServerInfo(api, tok, f"Jupyter server (pid {data['pid']}, {os.path.basename(f)})", data["pid"])
    return None
