"""``jupyter-llama serve``'s identity provider: jupyter_server's own, with a fast path for API clients.

For a request that carries the server's token in its ``Authorization`` header and no login
cookie (what ollama, openai, curl and every other API client send), jupyter_server makes a
new anonymous user and signs a login cookie for it, every time: about a third of a
millisecond of the server's time before a stream's first token, for a cookie the client
throws away. Here such a request is the server's one API user, made once. Everything else
(a browser's cookie, ``?token=`` in a URL, a wrong or missing token) goes the way
jupyter_server decides, so the 401 for a wrong token and XSRF for cookies are unchanged.

Only ``serve`` installs it (``ServerApp.identity_provider_class``): inside a user's Jupyter
server, authentication is that server's.
"""

from __future__ import annotations

import hmac

from jupyter_server.auth.identity import PasswordIdentityProvider, User

__all__ = ["ApiTokenIdentityProvider"]


class ApiTokenIdentityProvider(PasswordIdentityProvider):
    _api_user: User | None = None

    async def get_user(self, handler):
        header = handler.request.headers.get("Authorization")
        if header and self.token and not handler.request.query_arguments.get("token"):
            m = self.auth_header_pat.match(header)
            if (m and hmac.compare_digest(m.group(2).strip().encode(), self.token.encode())
                    and self.get_cookie_name(handler) not in handler.request.cookies):
                if self._api_user is None:
                    self._api_user = User(username="api", name="API client", display_name="API client")
                handler._token_authenticated = True  # what jupyter_server's XSRF and origin checks read
                return self._api_user
        return await super().get_user(handler)
