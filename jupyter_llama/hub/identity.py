"""Who asked, as the Hub says: the identity provider of ``jupyter-llama serve`` as a JupyterHub service.

jupyter_server asks its identity provider (``ServerApp.identity_provider_class``) for the
user behind each request; this one asks the Hub, through JupyterHub's own service library
(:class:`jupyterhub.services.auth.HubOAuth`):

* a request with a token (``Authorization: token|Bearer ...``, or ``x-api-key``, which the
  handlers turn into one) is its owner's: a user's API token, the token the Hub gives each
  user's server, or the OAuth token a browser got; the Hub answers who owns it (cached for
  a few minutes by HubAuth, keyed by a hash of the token: never kept, never sent on);
* a browser without one goes through the Hub's OAuth once: ``<service prefix>login``
  redirects to the Hub, which sends it back to ``<service prefix>oauth_callback`` with a
  code; the token the code is exchanged for is kept in a signed cookie for this service's
  path alone (and a cookie-authenticated request that changes something needs the XSRF
  token, as the Hub requires of its services).

A user is let in only with the service's access scope (``access:services!service=NAME``,
which the Hub's roles grant; docs/hub.md), else a 403. The user is a :class:`HubUser`: the
jupyter_server ``User`` with the Hub's groups and admin flag beside it; the handlers make the
:class:`~jupyter_llama.scheduler.fairness.Who` of each request from it.

Only public APIs of jupyter_server (``IdentityProvider``) and of JupyterHub's service library.
"""

from __future__ import annotations

import urllib.parse
import weakref
from typing import Any, Callable, TypeVar

from jupyter_server.auth.identity import IdentityProvider, User
from jupyter_server.base.handlers import JupyterHandler
from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler
from tornado import web
from tornado.httputil import url_concat
from traitlets import Instance, default

from . import refuse

_F = TypeVar("_F", bound=Callable[..., Any])

try:
    from jupyter_server.auth.decorator import allow_unauthenticated
except ImportError:  # jupyter_server before 2.13
    def allow_unauthenticated(method: _F) -> _F:
        return method

__all__ = ["HubIdentityProvider", "HubUser"]


class HubUser(User):
    """A jupyter_server user with what the Hub says of them (not dataclass fields, so the
    identity model jupyter_server reports stays its own)."""

    hub_user: dict

    def __init__(self, hub_user: dict):
        self.hub_user = hub_user
        super().__init__(username=hub_user["name"])

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(self.hub_user.get("groups") or ())

    @property
    def hub_admin(self) -> bool:
        return bool(self.hub_user.get("admin"))


class HubLoginHandler(JupyterHandler):
    """``GET <prefix>login?next=PATH``: a browser's way in, through the Hub's OAuth."""

    @allow_unauthenticated
    def get(self):
        hub_auth: HubOAuth = self.identity_provider.hub_auth
        next_url = self.get_argument("next", "") or hub_auth.base_url
        # only a path of this service: never a redirect to somewhere else
        parts = urllib.parse.urlsplit(next_url)
        if parts.scheme or parts.netloc or not next_url.startswith(hub_auth.base_url):
            next_url = hub_auth.base_url
        params = {}
        verifier = None
        if hub_auth.pkce_enabled:
            verifier, challenge, method = hub_auth.generate_pkce_code_challenge()
            params |= {"code_challenge": challenge, "code_challenge_method": method}
        params["state"] = hub_auth.set_state_cookie(self, next_url=next_url, code_verifier=verifier)
        self.redirect(url_concat(hub_auth.login_url, params))


class HubLogoutHandler(JupyterHandler):
    """``GET <prefix>logout``: forget this service's cookie, then log out of the Hub."""

    @allow_unauthenticated
    def get(self):
        hub_auth: HubOAuth = self.identity_provider.hub_auth
        hub_auth.clear_cookie(self)
        self.redirect(hub_auth.hub_host + hub_auth.hub_prefix + "logout")


class OAuthCallbackHandler(HubOAuthCallbackHandler):
    """The Hub's OAuth sends the browser back here (JupyterHub's own handler)."""

    def initialize(self, hub_auth: HubOAuth) -> None:
        self.hub_auth = hub_auth

    @allow_unauthenticated
    async def get(self):
        return await super().get()


class HubIdentityProvider(IdentityProvider):
    """The identity provider of jupyter-llama as a JupyterHub service (see the module's docstring)."""

    hub_service = True  # (what the extension checks to run as a shared manager)
    hub_auth = Instance(HubOAuth)
    token_generated = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # Who each request in progress is (None: nobody), asked of the Hub once a request.
        self._asked: weakref.WeakKeyDictionary[web.RequestHandler, HubUser | None] = weakref.WeakKeyDictionary()

    @default("hub_auth")
    def _default_hub_auth(self) -> HubOAuth:
        return HubOAuth(parent=self)  # (the Hub's service variables configure it)

    @default("token")
    def _no_token(self) -> str:
        # No token of this server's own: users send theirs. (jupyter_server would make one,
        # print it and write it to its runtime file, where it would open nothing here.)
        return ""

    async def get_user(self, handler: web.RequestHandler) -> HubUser | None:
        if handler in self._asked:  # (jupyter_server may ask more than once a request)
            return self._asked[handler]
        self._asked[handler] = None
        model = await self.hub_auth.get_user(handler, sync=False)
        if model is None:
            return None
        if model.get("kind", "user") != "user":  # a service's own token: no person to serve
            return None
        if not self.hub_auth.check_scopes(self.hub_auth.access_scopes, model):
            # Known to the Hub, but not given this service: a 403 that says so (not the 401 of
            # a request without credentials, nor a redirect to a login that would come back here).
            sentence = (f"user {model.get('name')} may not use this service: the Hub gives them none of "
                        f"{', '.join(sorted(self.hub_auth.access_scopes))}; ask the Hub's admin to grant it "
                        "(docs/hub.md says how)")
            self.log.warning("jupyter-llama: %s", sentence)
            refuse(handler, sentence)
            raise web.HTTPError(403, sentence)
        user = self._asked[handler] = HubUser(model)
        return user

    def get_handlers(self) -> list[tuple]:
        return [("/login", HubLoginHandler), ("/logout", HubLogoutHandler),
                ("/oauth_callback", OAuthCallbackHandler, {"hub_auth": self.hub_auth})]

    def validate_security(self, app, ssl_options=None) -> None:
        """The Hub authenticates every request: jupyter_server's warnings about a server
        without a token of its own do not apply."""
        return

    def identity_model(self, user: User) -> dict:
        model = super().identity_model(user)
        if isinstance(user, HubUser):
            model["groups"] = list(user.groups)
        return model
