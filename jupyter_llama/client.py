"""A client for the jupyter-llama REST API, used by the magics, the widgets and the CLI.

Finding the server (first match wins):

1. explicit ``url`` (and ``token``) arguments;
2. ``JUPYTER_LLAMA_URL``, which the server extension exports into the environment its
   kernels inherit; the token then comes from ``token``, else ``JUPYTER_LLAMA_TOKEN``,
   else the server's runtime file ``jpserver-<pid>.json`` (``pid`` from
   ``JPY_PARENT_PID``, which Jupyter sets in every kernel) in Jupyter's runtime directory,
   else any runtime file whose server URL the API URL lies under;
3. a running Jupyter server of this user that serves the extension, found by its runtime
   file (this kernel's own first) and asked for ``llama/api/version``: JupyterLab's, or a
   ``jupyter-llama serve``;
4. this user's background manager (:mod:`.background`), which ``LlamaClient()``, the
   magics, the widgets and the CLI start on first use where none of the above exists;
5. else :class:`ServerNotFound` (``start=False``), whose message says how to start a server.

:class:`LlamaClient` is synchronous (``httpx.Client``), :class:`AsyncLlamaClient` the
same over ``httpx.AsyncClient``. Streaming calls return iterators of Ollama's chunk dicts;
closing one early (or breaking out of the loop) closes the connection, which stops the
generation on the server. HTTP errors and mid-stream ``{"error": ...}`` lines raise
:class:`LlamaError` (a subclass per status) carrying ``status`` and ``message``.
"""

from __future__ import annotations

import glob
import json
import os
import stat
import urllib.parse
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Mapping

import httpx

from . import errors

__all__ = [
    "LlamaError",
    "BadRequestError",
    "ForbiddenError",
    "ModelNotFoundError",
    "ConflictError",
    "QuotaExceededError",
    "ServerBusyError",
    "DoesNotFitError",
    "ServerNotFound",
    "ServerInfo",
    "client_environment",
    "SettingsDiffer",
    "find_server",
    "LlamaClient",
    "AsyncLlamaClient",
]

URL_ENV = "JUPYTER_LLAMA_URL"
TOKEN_ENV = "JUPYTER_LLAMA_TOKEN"

HOW_TO_START = ("start one with `jupyter-llama serve` (then set JUPYTER_LLAMA_URL and JUPYTER_LLAMA_TOKEN, "
                "or give them as --url and --token, url= and token= in Python), or run inside JupyterLab / "
                "Jupyter Server with the jupyter_llama extension enabled, which exports JUPYTER_LLAMA_URL to its "
                "kernels")


# ----------------------------------------------------------------------------- errors


class LlamaError(Exception):
    """An error answer from the server: ``status`` (HTTP, or None) and ``message``."""

    status: int | None = None

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def __str__(self) -> str:
        return self.message if self.status is None else f"{self.message} (HTTP {self.status})"


# One class per status the manager answers with, its status taken from the error the manager
# raises for it (jupyter_llama.errors), so that the two cannot disagree.


class BadRequestError(LlamaError):
    status = errors.BadRequest.status


class ForbiddenError(LlamaError):
    """The server knows who asked and does not allow it (on a Hub: another user's model)."""

    status = errors.Forbidden.status


class ModelNotFoundError(LlamaError):
    status = errors.ModelNotFound.status


class ConflictError(LlamaError):
    """The name changed or was deleted while the request waited; asking again may work."""

    status = errors.LoadCancelled.status


class QuotaExceededError(LlamaError):
    """Over one of the Hub admin's quotas (requests at once or a minute); the message names it."""

    status = errors.QuotaExceeded.status


class ServerBusyError(LlamaError):
    status = errors.ServerBusy.status


class DoesNotFitError(LlamaError):
    status = errors.DoesNotFit.status


class ServerNotFound(LlamaError):
    """No jupyter-llama server could be found; the message says how to start one."""


_BY_STATUS: dict[int, type[LlamaError]] = {
    c.status: c for c in (BadRequestError, ForbiddenError, ModelNotFoundError, ConflictError, QuotaExceededError,
                          ServerBusyError, DoesNotFitError) if c.status is not None}


def _error(status: int | None, message: str) -> LlamaError:
    return _BY_STATUS.get(status or 0, LlamaError)(message, status)


def _message_of(body: bytes | str, status: int) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:500] or f"HTTP {status}"
    if isinstance(data, dict):
        err = data.get("error", data.get("message", data))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)
    return str(data)


# ----------------------------------------------------------------------------- discovery


@dataclass
class ServerInfo:
    url: str  # the API root, ending in "llama/"
    token: str | None
    source: str  # how it was found
    pid: int | None = None  # the server's process, when it was found by its runtime or state file
    warning: str | None = None  # what a person should know of it (a background manager's other settings)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"} if self.token else {}


def client_environment(url: str, token: str | None) -> dict[str, str]:
    """The variables that point clients at the jupyter-llama API at ``url`` (its root, ending
    in ``llama/``): ``JUPYTER_LLAMA_URL``/``_TOKEN`` for ours, and those Ollama's, OpenAI's
    and Anthropic's clients read (``OLLAMA_HOST``, ``OPENAI_BASE_URL``, ... and their keys), so
    ``ollama.chat(...)``, ``openai.OpenAI()``, langchain and ``%%ai`` work unconfigured."""
    env = {URL_ENV: url, "OLLAMA_HOST": url.rstrip("/"), "OPENAI_BASE_URL": url.rstrip("/") + "/v1",
           "ANTHROPIC_BASE_URL": url.rstrip("/")}
    if token:
        env |= {TOKEN_ENV: token, "OLLAMA_API_KEY": token, "OPENAI_API_KEY": token, "ANTHROPIC_API_KEY": token}
    return env


def api_url(url: str) -> str:
    """The API root for a server URL: ``http://h:p/base/`` -> ``http://h:p/base/llama/``;
    ``h:p`` is read as ``http://h:p/`` (as curl and Ollama's OLLAMA_HOST read it)."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ServerNotFound(f"{url} is not a jupyter-llama server's address: give it as http://HOST:PORT/ (with "
                             "the Jupyter server's base URL, if it has one), as the server prints it when it starts")
    if not url.endswith("/"):
        url += "/"
    if not url.endswith("/llama/"):
        url += "llama/"
    return url


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
    from . import background  # below this module: it knows nothing of clients

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


class SettingsDiffer(ServerNotFound):
    """The background manager runs with other settings than this process's and is in use,
    so it is neither used (the command would act on its store, with its budgets) nor
    restarted (its models would go); the message says how to proceed."""


def _with_these_settings(bg) -> ServerInfo:
    """A command about to use a background manager started with other settings than its
    own: the settings apply where they are given. When the manager holds no model it is
    restarted with this process's settings (the note says so); else SettingsDiffer."""
    from . import background

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


def running_server(environ: Mapping[str, str] | None = None, skip_pid: int | None = None) -> ServerInfo | None:
    """A running Jupyter server of this user (its runtime file) that serves this extension:
    the one this kernel belongs to (``JPY_PARENT_PID``) first, then the newest."""
    from . import background  # below this module: it knows nothing of clients
    from .procs import process_alive

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


def _found_again(server: ServerInfo) -> ServerInfo | None:
    """Where to go now that ``server`` stopped answering: a new background manager if it was
    the background one (found, or started); None otherwise, or when nothing moved."""
    from . import background

    if not server.source.startswith(background.SOURCE):
        return None
    info = find_server(start=True)
    return info if info.url != server.url else None


def _is_loopback(url: str) -> bool:
    return (urllib.parse.urlsplit(url).hostname or "") in ("localhost", "127.0.0.1", "::1")


TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)


def _clean(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


# ----------------------------------------------------------------------------- request bodies


def _generate_body(model, prompt, stream, options, keep_alive, system, raw, format, defaults=None):
    return _clean({"model": model, "prompt": prompt, "stream": stream, "options": options,
                   "keep_alive": keep_alive, "system": system, "raw": raw, "format": format,
                   "default_options": defaults})


def _chat_body(model, messages, stream, options, keep_alive, tools, format, defaults=None):
    return _clean({"model": model, "messages": list(messages or []), "stream": stream, "options": options,
                   "keep_alive": keep_alive, "tools": tools, "format": format, "default_options": defaults})


def _check_line(line: str) -> dict | None:
    if not line.strip():
        return None
    data = json.loads(line)
    if isinstance(data, dict) and "error" in data and len(data) == 1:
        err = data["error"]
        raise _error(500, err.get("message", str(err)) if isinstance(err, dict) else str(err))
    return data


# ----------------------------------------------------------------------------- sync


@dataclass(frozen=True)
class _Call:
    """One request, as every client sends it: the route, what goes in it, how to read the answer."""

    method: str
    path: str
    body: Any = None
    params: dict | None = None
    stream: bool = False  # NDJSON lines, one dict each
    pick: str | None = None  # the key of the answer to return


class _Routes:
    """Every route of the API, once. :class:`LlamaClient` and :class:`AsyncLlamaClient` only
    carry the calls (``_do``): the same words, answers and errors, blocking or awaited."""

    def _do(self, call: _Call):  # pragma: no cover - each client defines it
        raise NotImplementedError

    # -- Ollama API

    def generate(self, model: str, prompt: str = "", *, stream: bool = True, options: dict | None = None,
                 keep_alive=None, system: str | None = None, raw: bool | None = None, format=None,
                 default_options: dict | None = None):
        """Chunks (``stream=True``: an iterator, ``async for`` on the async client) or the whole
        answer (one dict; awaited on the async client). ``default_options`` apply where neither
        ``options`` nor the model's preset set a value (ours: how the CLI's length limit yields
        to a Modelfile's)."""
        return self._do(_Call("POST", "api/generate", _generate_body(model, prompt, stream, options, keep_alive,
                                                                     system, raw, format, default_options),
                              stream=stream))

    def chat(self, model: str, messages: list[dict], *, stream: bool = True, options: dict | None = None,
             keep_alive=None, tools: list | None = None, format=None, default_options: dict | None = None):
        return self._do(_Call("POST", "api/chat", _chat_body(model, messages, stream, options, keep_alive, tools,
                                                             format, default_options), stream=stream))

    def embed(self, model: str, input: str | list[str], *, options: dict | None = None, keep_alive=None):
        return self._do(_Call("POST", "api/embed", _clean({"model": model, "input": input, "options": options,
                                                           "keep_alive": keep_alive})))

    def load(self, model: str, *, options: dict | None = None, keep_alive=None):
        """Load without generating (Ollama's empty prompt)."""
        return self.generate(model, "", stream=False, options=options, keep_alive=keep_alive)

    def unload(self, model: str):
        return self.generate(model, "", stream=False, keep_alive=0)

    def ps(self):
        return self._do(_Call("GET", "api/ps"))

    def tags(self):
        return self._do(_Call("GET", "api/tags"))

    def show(self, model: str, verbose: bool = False):
        return self._do(_Call("POST", "api/show", {"model": model, "verbose": verbose}))

    def pull(self, source: str, name: str | None = None, *, stream: bool = True):
        return self._do(_Call("POST", "api/pull", _clean({"model": source, "destination": name, "stream": stream}),
                              stream=stream))

    def copy(self, source: str, destination: str):
        return self._do(_Call("POST", "api/copy", {"source": source, "destination": destination}))

    def delete(self, model: str):
        return self._do(_Call("DELETE", "api/delete", {"model": model}))

    def prune(self):
        """Drop partial downloads that no pull is working on: ``{"removed": [...], "freed": bytes}``."""
        return self._do(_Call("POST", "api/prune", {}))

    def create(self, model: str, *, files: dict[str, str] | None = None, from_: str | None = None,
               stream: bool = False, system: str | None = None, template: str | None = None,
               parameters: dict | None = None, messages: list[dict] | None = None,
               license: str | list[str] | None = None):
        """Ollama's create: from uploaded ``files`` or a model (``from_``), with an optional preset."""
        return self._do(_Call("POST", "api/create", _clean({
            "model": model, "files": files, "from": from_, "stream": stream, "system": system or None,
            "template": template or None, "parameters": parameters or None, "messages": messages or None,
            "license": license or None}), stream=stream))

    def version(self):
        return self._do(_Call("GET", "api/version"))

    # -- ours

    def devices(self):
        return self._do(_Call("GET", "api/devices"))

    def estimate(self, model: str, options: dict | None = None):
        return self._do(_Call("POST", "api/estimate", _clean({"model": model, "options": options})))

    def log(self, model: str, lines: int = 200, match: str | None = None):
        """A loaded model's llama-server log (its last ``lines`` lines, or those containing ``match``)."""
        params = {"model": model, "lines": lines} | ({"match": match} if match else {})
        return self._do(_Call("GET", "api/log", params=params))

    def events(self, model: str | None = None, since: int = 0, limit: int | None = None, *, stream: bool = False):
        """The event history (a list), or with ``stream=True`` an endless iterator of new events."""
        params = _clean({"model": model, "since": since or None, "limit": limit, "stream": "1" if stream else None})
        return self._do(_Call("GET", "api/events", params=params, stream=stream, pick=None if stream else "events"))


def _local_key(r: httpx.Response) -> str | None:
    """The key a server asks this user's own clients to prove themselves with (it answers a
    file path with a 400 naming its key file). Read only from a file that is plainly such a key:
    the right name, a regular file of this user's, readable by nobody else, a few bytes."""
    from .models.store import LOCAL_KEY_FILE_HEADER

    path = r.headers.get(LOCAL_KEY_FILE_HEADER)
    if r.status_code != 400 or not path or not _is_loopback(str(r.url)):
        return None
    name = os.path.basename(path)
    if not (name.startswith("jupyter-llama-local-") and name.endswith(".key")):
        return None
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size > 128:
            return None
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _prove_local(headers: httpx.Headers, r: httpx.Response) -> bool:
    """Asked to prove this client runs as the server's user: send the key from now on (in
    ``headers``, its HTTP client's)."""
    from .models.store import LOCAL_KEY_HEADER

    key = None if LOCAL_KEY_HEADER in headers else _local_key(r)
    if key:
        headers[LOCAL_KEY_HEADER] = key
    return key is not None


def _unreachable(url: str, e: Exception) -> ServerNotFound:
    return ServerNotFound(f"cannot reach the jupyter-llama server at {url}: {e}; {HOW_TO_START}")


def _answer(r: httpx.Response, call: _Call):
    data = r.json() if r.content else {}
    return data[call.pick] if call.pick else data


class LlamaClient(_Routes):
    """Synchronous client. ``LlamaClient()`` finds the server as the module docstring says."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: httpx.Timeout = TIMEOUT,
                 environ: Mapping[str, str] | None = None, start: bool = True):
        self.server = find_server(url, token, environ, start=start)
        self._timeout = timeout
        self._http = self._connect()

    def _connect(self) -> httpx.Client:
        return httpx.Client(base_url=self.server.url, headers=self.server.headers(), timeout=self._timeout,
                            trust_env=not _is_loopback(self.server.url))

    def _found_again(self) -> bool:
        """The background manager this client used has exited (it does when idle): find or
        start it again. True when there is a new address to retry at."""
        info = _found_again(self.server)
        if info is None:
            return False
        self._http.close()
        self.server = info
        self._http = self._connect()
        return True

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "LlamaClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _do(self, call: _Call):
        return self._stream(call) if call.stream else self._json(call)

    def _json(self, call: _Call, again: bool = True):
        try:
            r = self._http.request(call.method, call.path, json=call.body, params=call.params)
        except httpx.ConnectError as e:
            if again and self._found_again():
                return self._json(call, again=False)
            raise _unreachable(self.url, e) from None
        if r.status_code == 400 and _prove_local(self._http.headers, r):
            return self._json(call, again)
        if r.status_code >= 400:
            raise _error(r.status_code, _message_of(r.content, r.status_code))
        return _answer(r, call)

    def _stream(self, call: _Call, again: bool = True) -> Iterator[dict]:
        try:
            with self._http.stream(call.method, call.path, json=call.body, params=call.params) as r:
                proven = r.status_code == 400 and _prove_local(self._http.headers, r)
                if not proven and r.status_code >= 400:
                    raise _error(r.status_code, _message_of(r.read(), r.status_code))
                if not proven:
                    for line in r.iter_lines():
                        data = _check_line(line)
                        if data is not None:
                            yield data
            if proven:  # nothing was yielded: ask again, with the key
                yield from self._stream(call, again)
        except httpx.ConnectError as e:  # raised before anything was yielded: safe to retry
            if again and self._found_again():
                yield from self._stream(call, again=False)
                return
            raise _unreachable(self.url, e) from None

    list = _Routes.tags

    def create_blob(self, path: str | os.PathLike) -> str:
        """Upload a file as a blob (unless the server has it); returns its ``sha256:<hex>`` digest."""
        import hashlib

        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        digest = f"sha256:{h.hexdigest()}"
        try:
            if self._http.head(f"api/blobs/{digest}").status_code == 200:
                return digest
            with open(path, "rb") as fh:
                r = self._http.post(f"api/blobs/{digest}", content=fh)
        except httpx.ConnectError as e:
            raise _unreachable(self.url, e) from None
        if r.status_code >= 400:
            raise _error(r.status_code, _message_of(r.content, r.status_code))
        return digest


# ----------------------------------------------------------------------------- async


class AsyncLlamaClient(_Routes):
    """The same routes over ``httpx.AsyncClient``: ``await`` an answer, ``async for`` a stream."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: httpx.Timeout = TIMEOUT,
                 environ: Mapping[str, str] | None = None, start: bool = True):
        self.server = find_server(url, token, environ, start=start)
        self._timeout = timeout
        self._http = self._connect()

    def _connect(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server.url, headers=self.server.headers(), timeout=self._timeout,
                                 trust_env=not _is_loopback(self.server.url))

    async def _found_again(self) -> bool:
        """:meth:`LlamaClient._found_again`, without blocking the event loop."""
        import asyncio

        info = await asyncio.to_thread(_found_again, self.server)
        if info is None:
            return False
        await self._http.aclose()
        self.server = info
        self._http = self._connect()
        return True

    @property
    def url(self) -> str:
        return self.server.url

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncLlamaClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _do(self, call: _Call):
        return self._stream(call) if call.stream else self._json(call)

    async def _json(self, call: _Call, again: bool = True):
        try:
            r = await self._http.request(call.method, call.path, json=call.body, params=call.params)
        except httpx.ConnectError as e:
            if again and await self._found_again():
                return await self._json(call, again=False)
            raise _unreachable(self.url, e) from None
        if r.status_code == 400 and _prove_local(self._http.headers, r):
            return await self._json(call, again)
        if r.status_code >= 400:
            raise _error(r.status_code, _message_of(r.content, r.status_code))
        return _answer(r, call)

    async def _stream(self, call: _Call, again: bool = True) -> AsyncIterator[dict]:
        try:
            async with self._http.stream(call.method, call.path, json=call.body, params=call.params) as r:
                proven = r.status_code == 400 and _prove_local(self._http.headers, r)
                if not proven and r.status_code >= 400:
                    raise _error(r.status_code, _message_of(await r.aread(), r.status_code))
                if not proven:
                    async for line in r.aiter_lines():
                        data = _check_line(line)
                        if data is not None:
                            yield data
            if proven:  # nothing was yielded: ask again, with the key
                async for data in self._stream(call, again):
                    yield data
        except httpx.ConnectError as e:  # raised before anything was yielded: safe to retry
            if again and await self._found_again():
                async for data in self._stream(call, again=False):
                    yield data
                return
            raise _unreachable(self.url, e) from None
