"""Finding the server a client talks to, in the order the package's docstring gives: an
argument, ``JUPYTER_LLAMA_URL``, a running Jupyter server of this user, the background
manager (started on first use where a client asks for it)."""

from __future__ import annotations

import os
from typing import Mapping

import httpx

from .address import TOKEN_ENV, URL_ENV, ServerInfo, api_url
from .errors import HOW_TO_START, ServerNotFound, SettingsDiffer
from .runtime import running_server, token_from_runtime


def find_server(url: str | None = None, token: str | None = None,
                environ: Mapping[str, str] | None = None, *, start: bool = False) -> ServerInfo:
    """Where the API is and which token to send (first match wins): ``url``; then
    ``JUPYTER_LLAMA_URL``; then a running Jupyter server of this user that serves the
    extension (this kernel's own first, from ``JPY_PARENT_PID``); then the user's background
    manager; then, with ``start``, a background manager started now. Else ServerNotFound."""
    environ = os.environ if environ is None else environ
    if url:
        api = api_url(url)
        tok = token if token is not None else (environ.get(TOKEN_ENV) or token_from_runtime(api, environ))
        return ServerInfo(api, tok, "argument")
    env_url = environ.get(URL_ENV)
    if env_url:
        api = api_url(env_url)
        tok = token if token is not None else (environ.get(TOKEN_ENV) or token_from_runtime(api, environ))
        return ServerInfo(api, tok, URL_ENV)
    from .. import background  # below this package: it knows nothing of clients

    bg = background.find()
    found = running_server(environ, skip_pid=bg.pid if bg is not None else None)
    if found is not None:
        return found
    if bg is None and start:
        try:
            bg = background.ensure()
        except background.ManagerStartFailed as e:
            raise ServerNotFound(str(e)) from None
    if bg is not None and bg.unlike and start:
        return _with_these_settings(bg)
    if bg is not None:
        return ServerInfo(bg.url, bg.token, bg.source, bg.pid, bg.unlike and (
            f"{bg.unlike}: the next command that uses it restarts it with these settings when it holds no model"))
    raise ServerNotFound(f"no jupyter-llama server found ({URL_ENV} is not set, no Jupyter server of yours serves "
                         f"the extension, no background manager runs): {HOW_TO_START}")


def _with_these_settings(bg) -> ServerInfo:
    """A command about to use a background manager started with other settings than its
    own: the settings apply where they are given. When the manager holds no model it is
    restarted with this process's settings (the note says so); else SettingsDiffer."""
    from .. import background

    try:
        r = httpx.get(bg.url + "api/ps", headers={"Authorization": f"token {bg.token}"}, timeout=10, trust_env=False)
        loaded = [m.get("name") for m in r.json().get("models") or []] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        loaded = None
    if loaded is None:
        raise ServerNotFound(f"{bg.unlike}; the background manager (pid {bg.pid}) did not say what it holds, "
                             "so it was not restarted")
    if loaded:
        raise SettingsDiffer(f"{bg.unlike}. It holds {', '.join(loaded)}, so it was not restarted: this command "
                             "would act on its store and budgets, not on yours. Stop it (`jupyter-llama status "
                             "--stop`, which unloads them) and run the command again, or run it without these "
                             "settings to use the manager as it is")
    background.stop()
    try:
        new = background.ensure()
    except background.ManagerStartFailed as e:
        raise ServerNotFound(str(e)) from None
    return ServerInfo(new.url, new.token, new.source, new.pid,
                      "the background manager ran with other settings and held no model: restarted it with these")


def _found_again(server: ServerInfo) -> ServerInfo | None:
    """Where to go now that ``server`` stopped answering: a new background manager if it was
    the background one (found, or started); None otherwise, or when nothing moved."""
    from .. import background

    if not server.source.startswith(background.SOURCE):
        return None
    info = find_server(start=True)
    return info if info.url != server.url else None
