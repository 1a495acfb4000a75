"""Where a server is: :class:`ServerInfo` (its API root, token and how it was found), the API
root of a server's URL, and the environment variables that point clients at it."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from .errors import ServerNotFound

URL_ENV = "JUPYTER_LLAMA_URL"
TOKEN_ENV = "JUPYTER_LLAMA_TOKEN"


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


def _is_loopback(url: str) -> bool:
    return (urllib.parse.urlsplit(url).hostname or "") in ("localhost", "127.0.0.1", "::1")
