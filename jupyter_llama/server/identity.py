"""``jupyter-llama serve``'s identity provider: jupyter_server's own, without a login cookie per API request.

For a request that carries the token in its ``Authorization`` header and no login cookie
(what ollama, openai, curl and every other API client send), jupyter_server makes a new
anonymous user and signs a login cookie for it, every time: about a third of a millisecond
of the server's time before a stream's first token, for a cookie the client throws away.
Here such a request is the server's one API user, made once, and gets no cookie. Who is
authenticated is still jupyter_server's decision (the token check, the 401 for a wrong one,
XSRF for cookies, ``?token=`` logins are all its own).

Only ``serve`` installs it (``ServerApp.identity_provider_class``): inside a user's Jupyter
server, authentication is that server's.
"""

from __future__ import annotations

from jupyter_server.auth.identity import PasswordIdentityProvider

__all__ = ["ApiTokenIdentityProvider"]

class ApiTokenIdentityProvider(PasswordIdentityProvider):
    _api_user = None

    def _api_client(self, handler) -> bool:
        """An API client's request: a token in the header, none in the URL, no login cookie."""
        req = handler.request
        return (bool(req.headers.get("Authorization")) and not req.query_arguments.get("token")
                and self.get_cookie_name(handler) not in req.cookies)

    def generate_anonymous_user(self, handler):
        if not self._api_client(handler):
            return super().generate_anonymous_user(handler)
        if self._api_user is None:
            self._api_user = super().generate_anonymous_user(handler)
        return self._api_user

    def set_login_cookie(self, handler, user) -> None:
        if not self._api_client(handler):
            super().set_login_cookie(handler, user)
