"""jupyter-llama as a JupyterHub service: one manager for every user of a Hub.

``jupyter-llama serve`` run by a Hub (a managed service), or beside it (an external one),
finds the Hub's service environment (:func:`service_environment`) and then:

* authenticates every request with the Hub (:mod:`.identity`): a browser through OAuth
  (``<service prefix>login``), a kernel or a script through its user's API token; each
  request knows who asked (name, groups) and whether they are the service's admin;
* holds each person to the admin's quotas and serves them round-robin when a model is busy
  (``Scheduler.share``, :mod:`jupyter_llama.scheduler.fairness`), from the settings of
  :class:`.settings.LlamaHub` (``c.LlamaHub.*`` in the service's config file);
* shows each person the shared library and their own models (``<their namespace>/...``),
  and who holds and uses each loaded model (everyone's to an admin, their own to the rest).

Users' servers find it through :mod:`.spawner` (``c.Spawner.environment`` and
``c.Spawner.server_token_scopes`` for the Hub's config). docs/hub.md is the admin's page.

Only this package imports JupyterHub, and only when a Hub is there (it is not a dependency
of the rest: ``pip install jupyterhub`` on the service's machine).
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from tornado import web

__all__ = ["service_environment", "SERVICE_VARIABLES", "hub_missing", "refuse", "refusal"]

# What the Hub sets for a service it manages (and what an external service is given by hand).
SERVICE_VARIABLES = ("JUPYTERHUB_API_TOKEN", "JUPYTERHUB_API_URL", "JUPYTERHUB_SERVICE_PREFIX")


def service_environment(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs as a JupyterHub service: the Hub's service variables are set,
    and it is not a user's server (whose environment has them too, with ``JUPYTERHUB_USER``:
    a `jupyter-llama serve` started inside a user's server is that user's own manager)."""
    environ = os.environ if environ is None else environ
    return all(environ.get(k) for k in SERVICE_VARIABLES) and not environ.get("JUPYTERHUB_USER")


def hub_missing() -> str | None:
    """None when JupyterHub's service library can be imported, else what to do about it."""
    try:
        import jupyterhub.services.auth  # noqa: F401
    except ImportError as e:
        return (f"running as a JupyterHub service needs JupyterHub's Python package on this machine ({e}): "
                "pip install jupyterhub (the Hub's own version)")
    return None


# Why an identity provider turned a request away, in a sentence for its error page: a user the
# Hub knows but does not give this service (jupyter_server makes any failure of ``get_user``
# a bare 403 before the handler could say why).
_refusals: weakref.WeakKeyDictionary[web.RequestHandler, str] = weakref.WeakKeyDictionary()


def refuse(handler: web.RequestHandler, sentence: str) -> None:
    """Say why ``handler``'s request is refused (see :func:`refusal`)."""
    _refusals[handler] = sentence


def refusal(handler: web.RequestHandler) -> str | None:
    """The sentence :func:`refuse` gave for ``handler``'s request, if any."""
    return _refusals.get(handler)
