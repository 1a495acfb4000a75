"""A request whose Host header jupyter_server refuses (issue 58 item 7).

jupyter_server answers only to local names unless ``ServerApp.allow_remote_access`` is set
(against DNS rebinding): a request with ``Host: example.com`` is refused before its token is
read. It was answered 401 "not authenticated: send the token", while the server's log said the
Host was blocked, so a user behind a reverse proxy that keeps the Host went after a token they
already sent. It is now a 403 that says which setting lets the name in, and names no token.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.engine


@pytest.fixture
async def raw(llama_url):
    """A client at <server>/llama/ that sends no token unless asked."""
    async with httpx.AsyncClient(base_url=llama_url + "/", timeout=httpx.Timeout(60.0), trust_env=False) as c:
        yield c


async def test_a_refused_host_is_a_403_that_says_so(raw, token):
    auth = {"Authorization": f"Bearer {token}"}
    for method, path, body in (("GET", "api/tags", None), ("POST", "api/show", {"model": "tiny"}),
                               ("POST", "v1/chat/completions", {"model": "tiny", "messages": []}),
                               ("POST", "v1/messages", {"model": "tiny", "max_tokens": 1, "messages": []})):
        for headers in (auth, {"x-api-key": token}, {}):  # the right token (two ways), and none
            r = await raw.request(method, path, json=body, headers={**headers, "Host": "example.com"})
            where = (method, path, list(headers), r.status_code, r.text)
            assert r.status_code == 403, where
            err = r.json()["error"]
            message = err["message"] if isinstance(err, dict) else err
            assert 'the Host header named "example.com", a host this Jupyter server does not allow' in message, where
            assert "ServerApp.allow_remote_access=True" in message and "local_hostnames" in message, where
            assert "not authenticated" not in message and "WWW-Authenticate" not in r.headers, where
            assert token not in r.text, where
        # the same request by a local name is answered: the token was right
        r = await raw.request(method, path, json=body, headers={**auth, "Host": "localhost"})
        assert r.status_code != 403 and r.status_code != 401, (path, r.status_code, r.text)


async def test_no_token_by_a_local_name_is_still_a_401(raw, token):
    for host in (None, "localhost", "127.0.0.1"):
        headers = {"Host": host} if host else {}
        r = await raw.get("api/tags", headers=headers)
        assert r.status_code == 401, (host, r.text)
        assert r.json()["error"].startswith("not authenticated: send the Jupyter server's token")
        assert r.headers["WWW-Authenticate"] == 'Bearer realm="jupyter-llama"'
    r = await raw.get("api/tags", headers={"Authorization": "Bearer wrong", "Host": "localhost"})
    assert r.status_code == 401 and "Host" not in r.json()["error"]
