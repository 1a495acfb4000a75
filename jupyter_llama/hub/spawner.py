"""For the Hub's config: users' servers and kernels find the shared manager with no setup.

In ``jupyterhub_config.py``::

    from jupyter_llama.hub.spawner import configure
    configure(c, url="http://127.0.0.1:8000/services/llama/")

does what these two lines would (either way is fine; docs/hub.md shows both):

* ``c.Spawner.environment``: ``JUPYTER_LLAMA_URL``, ``OLLAMA_HOST``, ``OPENAI_BASE_URL`` and
  ``ANTHROPIC_BASE_URL`` point at the service, and ``JUPYTER_LLAMA_TOKEN``,
  ``OLLAMA_API_KEY``, ``OPENAI_API_KEY`` and ``ANTHROPIC_API_KEY`` hold the token the Hub
  gives the user's server (its own ``JUPYTERHUB_API_TOKEN``, which the Hub makes when the
  server starts and revokes when it stops). Each server gets its own user's token: it
  reaches no one else, and the manager passes no token to its model runners.
* ``c.Spawner.server_token_scopes``: that token may use the service
  (``access:services!service=NAME``) besides what a server's token may do by default.
  The user must hold that scope too (the Hub's ``user`` role, :func:`user_role`).

So ``%llama``, the widgets, ``ollama``, ``openai`` and langchain in a user's kernel talk to
the shared manager as they would to a laptop's, and the user's Jupyter server, seeing
``JUPYTER_LLAMA_URL`` in its environment, runs no manager of its own: its ``llama/`` routes
(the JupyterLab panel's) relay to the shared one (``LlamaExtension.shared_url``).
"""

from __future__ import annotations

from typing import Any, Callable

from ..client import api_url, client_environment

__all__ = ["configure", "environment", "server_token_scopes", "user_role", "SERVER_SCOPES"]

# What the Hub gives a server's token when nothing is configured (its ``server`` role).
SERVER_SCOPES = ("users:activity!user", "access:servers!server")


def _token(spawner) -> str:
    return spawner.api_token or ""


def environment(url: str) -> dict[str, Any]:
    """``c.Spawner.environment`` entries that point a user's server and kernels at the
    service at ``url`` (the service's address as the users' servers reach it, through the
    Hub's proxy, ``http://HUB/services/NAME/``, or directly) with the server's own token: strings, and for the token
    callables the Hub calls with the spawner when the server starts."""
    # (the API's root is the service's URL + llama/, also for a service named llama, whose
    # URL ends in llama/ already)
    api = api_url(url.rstrip("/") + "/llama/")
    env: dict[str, Any] = client_environment(api, None)
    token: Callable = _token
    for key in ("JUPYTER_LLAMA_TOKEN", "OLLAMA_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        env[key] = token
    return env


def server_token_scopes(service: str = "llama", base=SERVER_SCOPES) -> list[str]:
    """``c.Spawner.server_token_scopes``: what a server's token may do by default (``base``),
    and use the service ``service``."""
    return [*base, f"access:services!service={service}"]


def user_role(service: str = "llama") -> dict:
    """A ``c.JupyterHub.load_roles`` entry that gives every user the service (the Hub's own
    ``user`` role, with the service's access scope added)."""
    return {"name": "user", "scopes": ["self", f"access:services!service={service}"]}


def configure(c, url: str, service: str = "llama") -> None:
    """Set ``c.Spawner.environment`` (added to what is there) and ``c.Spawner.server_token_scopes``
    (the default server scopes, or those set before, with the service's) for the service
    ``service`` at ``url``. The users' role must give them the service (:func:`user_role`)."""
    c.Spawner.environment.update(environment(url))
    scopes = c.Spawner.server_token_scopes
    base = list(scopes) if isinstance(scopes, (list, tuple)) and scopes else list(SERVER_SCOPES)
    wanted = f"access:services!service={service}"
    c.Spawner.server_token_scopes = base + ([wanted] if wanted not in base else [])
