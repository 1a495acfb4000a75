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

The client is a package, one seam a module: ``errors`` (the error classes, tied to the
manager's own), ``address`` (:class:`ServerInfo`, API URLs, :func:`client_environment`),
``runtime`` (Jupyter servers found by their runtime files), ``discovery``
(:func:`find_server`, the background manager), ``routes`` (every call of the API, once),
``local_key`` (proving a client runs as the server's user), ``sync_client`` and
``async_client``. Each name below is importable from this package as it was from the one
module.
"""

from __future__ import annotations

from .address import TOKEN_ENV as TOKEN_ENV
from .address import URL_ENV as URL_ENV
from .address import ServerInfo, api_url, client_environment
from .async_client import AsyncLlamaClient
from .discovery import find_server
from .errors import HOW_TO_START as HOW_TO_START
from .errors import (
    BadRequestError,
    ConflictError,
    DoesNotFitError,
    ForbiddenError,
    LlamaError,
    ModelNotFoundError,
    QuotaExceededError,
    ServerBusyError,
    ServerNotFound,
    SettingsDiffer,
    TooLargeError,
)
from .errors import _error as _error
from .errors import _message_of as _message_of
from .routes import TIMEOUT as TIMEOUT
from .runtime import running_server, token_from_runtime
from .sync_client import LlamaClient

# Besides __all__, the names imported ``as`` themselves above are imported from here by the
# magics, the CLI and the tests.
__all__ = [
    "LlamaError",
    "BadRequestError",
    "ForbiddenError",
    "ModelNotFoundError",
    "ConflictError",
    "QuotaExceededError",
    "TooLargeError",
    "ServerBusyError",
    "DoesNotFitError",
    "ServerNotFound",
    "ServerInfo",
    "client_environment",
    "SettingsDiffer",
    "find_server",
    "LlamaClient",
    "AsyncLlamaClient",
    "api_url",
    "running_server",
    "token_from_runtime",
]
