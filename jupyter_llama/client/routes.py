"""Every route of the API, once: :class:`_Routes` says what each call sends and how its answer
is read (:class:`_Call`); the sync and async clients carry the calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

# A client waits at most this long to connect and to send a body; an answer (a generation,
# a pull) may take as long as it takes.
TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)


def _clean(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _generate_body(model, prompt, stream, options, keep_alive, system, raw, format, defaults=None):
    return _clean({"model": model, "prompt": prompt, "stream": stream, "options": options,
                   "keep_alive": keep_alive, "system": system, "raw": raw, "format": format,
                   "default_options": defaults})


def _chat_body(model, messages, stream, options, keep_alive, tools, format, defaults=None):
    return _clean({"model": model, "messages": list(messages or []), "stream": stream, "options": options,
                   "keep_alive": keep_alive, "tools": tools, "format": format, "default_options": defaults})


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


def _answer(r: httpx.Response, call: _Call):
    """A whole (not streamed) answer's JSON, or its ``call.pick`` key."""
    data = r.json() if r.content else {}
    return data[call.pick] if call.pick else data
